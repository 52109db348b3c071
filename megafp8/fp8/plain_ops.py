"""The plain-torch kernels of the ``none`` backend, which the FP8 backends reuse where they
have nothing better: the GEMM of a linear layer, the zero-centered norm, SDPA attention (causal,
grouped-query, or under the documents' mask) and rotary embedding (its tables, Llama 3.1's
frequency scaling, and the rotation itself in fp32)."""

from __future__ import annotations

import contextlib
import math

import torch
import torch.nn.functional as F
from torch import nn

from megafp8.parallel.random import TP_STREAM


class PlainLinear(nn.Module):
    """y = x w^T (+ b) on this rank's shard with torch's GEMM. ``plain`` tells a TP layer that it
    may run this GEMM itself (the sequence-parallel gather that saves only the shard)."""

    plain = True

    def __init__(self, in_features, out_features, bias, *, dtype, device=None):
        super().__init__()
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device)
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        )

    def forward(self, x):  # [..., in] -> [..., out]
        return F.linear(x, self.weight, self.bias)


class ZeroCenteredNorm(nn.Module):
    """LayerNorm or RMSNorm whose weight is stored centered on zero: it multiplies by
    ``1 + weight`` (Megatron's ``--apply-layernorm-1p``), so weight decay pulls it towards 1."""

    def __init__(self, normalization: str, hidden: int, eps: float, *, dtype, device):
        super().__init__()
        self.layer = normalization == "LayerNorm"
        self.shape, self.eps = (hidden,), eps
        self.weight = nn.Parameter(torch.zeros(hidden, dtype=dtype, device=device))
        self.bias = (
            nn.Parameter(torch.zeros(hidden, dtype=dtype, device=device)) if self.layer else None
        )

    def forward(self, x):  # [..., h] -> [..., h]
        if self.layer:
            return F.layer_norm(x, self.shape, 1.0 + self.weight, self.bias, self.eps)
        return F.rms_norm(x, self.shape, 1.0 + self.weight, self.eps)


def torch_norm(
    normalization: str, hidden: int, eps: float, *, zero_centered_gamma=False, dtype, device
) -> nn.Module:
    """LayerNorm or RMSNorm over the last dim in torch ops (weight stored as ``w - 1`` when
    ``zero_centered_gamma``)."""
    if zero_centered_gamma:
        return ZeroCenteredNorm(normalization, hidden, eps, dtype=dtype, device=device)
    if normalization == "LayerNorm":
        return nn.LayerNorm(hidden, eps=eps, dtype=dtype, device=device)
    return nn.RMSNorm(hidden, eps=eps, dtype=dtype, device=device)


class SdpaAttention(nn.Module):
    """Causal softmax(q k^T / sqrt(d)) v of this rank's heads with torch's SDPA. Grouped-query:
    ``kv_heads`` < ``heads``, each kv head serving ``heads / kv_heads`` query heads. Dropout on the
    attention probabilities runs on the TP RNG stream (each rank's heads differ, as one process's
    heads do). ``mask`` [b, 1, s, s] (True: attend) replaces the causal mask (the documents of
    ``--reset-attention-mask``); grouped-query k and v are then repeated per query head, since
    SDPA's memory-efficient kernel, the one that takes a mask, does not group heads itself."""

    def __init__(self, heads: int, head_dim: int, kv_heads: int, dropout: float, rng=None):
        super().__init__()
        self.heads, self.head_dim, self.kv_heads = heads, head_dim, kv_heads
        self.dropout, self.rng = dropout, rng

    def forward(self, q, k, v, mask=None):  # q [s, b, np, hd], k/v [s, b, kvp, hd]
        s, b = q.shape[:2]
        q, k, v = (t.permute(1, 2, 0, 3) for t in (q, k, v))  # [b, n, s, hd]
        p = self.dropout if self.training else 0.0
        gqa = self.kv_heads != self.heads
        if mask is not None and gqa:
            rep = self.heads // self.kv_heads
            k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
            gqa = False
        fork = self.rng.fork(TP_STREAM) if p > 0 and self.rng is not None else None
        with fork or contextlib.nullcontext():
            o = F.scaled_dot_product_attention(
                q, k, v, attn_mask=mask, dropout_p=p, is_causal=mask is None, enable_gqa=gqa
            )  # [b, np, s, hd]
        return o.permute(2, 0, 1, 3).reshape(s, b, self.heads * self.head_dim)  # [s, b, np*hd]


# Llama 3.1's RoPE scaling (Megatron's --use-rope-scaling): its fixed frequency bands
ROPE_SCALING_BANDS = dict(low_freq_factor=1.0, high_freq_factor=4.0, original_context=8192)


def scale_rope_frequencies(inv: torch.Tensor, factor: float) -> torch.Tensor:
    """Llama 3.1's RoPE scaling of the frequencies ``inv``: with L the original context (8192),
    a frequency whose wavelength 2 pi / f is below L / 4 stays, above L / 1 it is divided by
    ``factor``, and in between it moves smoothly from one to the other:
    (1 - t) f / factor + t f with t = (L / wavelength - 1) / (4 - 1)."""
    b = ROPE_SCALING_BANDS
    lo, hi, ctx = b["low_freq_factor"], b["high_freq_factor"], b["original_context"]
    wavelength = 2 * math.pi / inv
    t = (ctx / wavelength - lo) / (hi - lo)
    mid = (1 - t) * inv / factor + t * inv
    out = torch.where(wavelength > ctx / lo, inv / factor, mid)
    return torch.where(wavelength < ctx / hi, inv, out)


def rope_angles(
    seq: int, dim: int, base: float, device, scaling: float | None = None
) -> torch.Tensor:
    """position * base^(-2i/dim), fp32 [s, 1, 1, dim] (both halves alike); ``scaling``: the
    factor of Llama 3.1's frequency scaling (None: none)."""
    inv = 1.0 / (base ** (torch.arange(0, dim, 2, device=device, dtype=torch.float32) / dim))
    if scaling is not None:
        inv = scale_rope_frequencies(inv, scaling)
    ang = torch.outer(torch.arange(seq, device=device, dtype=torch.float32), inv)  # [s, d/2]
    return torch.cat([ang, ang], dim=-1)[:, None, None, :]  # [s, 1, 1, d]


def rope_tables(
    seq: int, dim: int, base: float, device, scaling: float | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin of the RoPE angles, each [s, 1, 1, dim]."""
    ang = rope_angles(seq, dim, base, device, scaling)
    return ang.cos(), ang.sin()


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [s, b, n, d]; rotate-half RoPE (Megatron's non-interleaved layout), in fp32."""
    d = x.shape[-1] // 2
    rot = torch.cat([-x[..., d:], x[..., :d]], dim=-1)  # [s, b, n, d]: (-x2, x1)
    return (x.float() * cos + rot.float() * sin).to(x.dtype)
