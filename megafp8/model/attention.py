"""Causal self-attention split by heads over TP (multi-head or grouped-query).

Under TP, rank r holds heads [r*np, (r+1)*np) with np = heads / tp. Grouped-query: when tp <= kv
heads, each rank holds kv/tp whole groups and one fused QKV column-parallel GEMM suffices (the full
QKV weight is laid out group by group: the group's query heads, then its k, then its v). When tp
exceeds the kv heads, each kv head is replicated on the tp/kv ranks whose query heads use it: a
separate KV projection holds that group's rows, and their gradient is summed over those ranks.

``--qk-layernorm`` normalizes every query head and every key head over the head dim (one weight
for all query heads, one for all key heads; the model's norm type), after the split and before
RoPE. Those weights are replicated: each TP rank's gradient covers its own heads, and the sum
over TP is the whole. They run as PyTorch norms on either backend.
"""

from __future__ import annotations

import functools

import torch
from torch import nn

from megafp8.fp8.plain_ops import torch_norm
from megafp8.parallel import mappings as M
from megafp8.parallel.layers import ColumnParallelLinear, RowParallelLinear, allreduce_grad_hook


def qkv_rows(heads: int, kv: int, hd: int, tp: int, rank: int) -> torch.Tensor:
    """Rows of the grouped QKV weight that rank ``rank`` holds when tp divides kv."""
    per_group = (heads // kv + 2) * hd
    groups = kv // tp
    start = rank * groups * per_group
    return torch.arange(start, start + groups * per_group)


class SelfAttention(nn.Module):
    """softmax(q k^T / sqrt(d) + causal mask) v, then the output projection.

    Shards: this TP rank holds np = heads / tp query heads and kvp = max(1, kv / tp) kv heads: the
    rows of the fused QKV weight [(heads + 2 kv) hd, h] that produce them (column-parallel), and
    the matching columns of the output projection [h, heads hd] (row-parallel, summed over TP).
    Under SP the input is a sequence shard [s/tp, b, h], all-gathered by the QKV GEMM, and the
    output is reduce-scattered back to [s/tp, b, h]. ``kv_group``: the TP ranks sharing this
    rank's kv head (``SOLO`` when tp <= kv), over which the k/v rows' gradients are summed.
    """

    def __init__(
        self,
        cfg,
        *,
        backend,
        groups,
        layer: int,
        seed: int,
        fp8: bool,
        dtype,
        device,
        kv_group,
        rng=None,
        norm=None,
        recompute=None,
    ):
        super().__init__()
        self.recompute = recompute if recompute and recompute.selective("core_attn") else None
        m, sp = cfg.model, cfg.parallel.sequence_parallel
        tp_group = groups.tp_group
        tp, r = M.world(tp_group), M.rank_in(tp_group)
        self.heads, self.kv, self.hd = m.num_attention_heads, m.kv_heads, m.head_dim
        self.np, self.rng, self.dropout = self.heads // tp, rng, m.attention_dropout
        self.kvp = max(1, self.kv // tp)
        name = f"layers.{layer}.attn"
        kw = dict(
            backend=backend,
            tp_group=tp_group,
            std=m.init_method_std,
            seed=seed,
            bias=m.add_bias_linear,
            sequence_parallel=sp,
            dtype=dtype,
            device=device,
            fp8=fp8,
        )
        qkv_out = (self.heads + 2 * self.kv) * self.hd
        qkv_kw = dict(kw, bias=m.add_bias_linear or m.add_qkv_bias)  # --add-qkv-bias: QKV's alone
        self.fused = self.kv % tp == 0
        self.backend = backend
        if self.fused:
            self.qkv = ColumnParallelLinear(
                m.hidden_size,
                qkv_out,
                name=f"{name}.qkv",
                rows=qkv_rows(self.heads, self.kv, self.hd, tp, r),
                norm=norm,
                weight_grad_group=M.SOLO,
                **qkv_kw,
            )
        else:  # tp > kv: q split by heads, k/v of this rank's group replicated
            if norm is not None:
                raise ValueError("a fused norm needs the fused QKV projection (tp <= kv heads)")
            g = r * self.kv // tp
            hpg = self.heads // self.kv
            base = g * (hpg + 2) * self.hd
            q_rows = torch.cat(
                [
                    torch.arange(gg * (hpg + 2) * self.hd, gg * (hpg + 2) * self.hd + hpg * self.hd)
                    for gg in range(self.kv)
                ]
            )
            q_rows = q_rows.view(tp, -1)[r]  # [tp, heads*hd/tp] -> this rank's rows
            kv_rows = torch.arange(base + hpg * self.hd, base + (hpg + 2) * self.hd)
            self.q = ColumnParallelLinear(
                m.hidden_size,
                qkv_out,
                name=f"{name}.qkv",
                rows=q_rows,
                weight_grad_group=M.SOLO,
                **qkv_kw,
            )
            self.kv_proj = ColumnParallelLinear(
                m.hidden_size,
                qkv_out,
                name=f"{name}.qkv",
                rows=kv_rows,
                weight_grad_group=kv_group,
                **qkv_kw,
            )
        self.proj = RowParallelLinear(
            self.heads * self.hd,
            m.hidden_size,
            name=f"{name}.proj",
            **{**kw, "std": m.init_method_std / (2.0 * m.num_layers) ** 0.5},
        )
        self.q_norm = self.k_norm = None
        if m.qk_layernorm:
            nkw = dict(zero_centered_gamma=m.apply_layernorm_1p, dtype=dtype, device=device)
            self.q_norm = torch_norm(m.normalization, self.hd, m.norm_epsilon, **nkw)
            self.k_norm = torch_norm(m.normalization, self.hd, m.norm_epsilon, **nkw)
            for p in (*self.q_norm.parameters(), *self.k_norm.parameters()):
                allreduce_grad_hook(p, tp_group)
        self.core = backend.make_core_attention(
            self.np, self.hd, self.kvp, dropout=self.dropout, rng=rng,
            document_mask=cfg.data.reset_attention_mask,
        )  # fmt: skip

    def forward(self, x, rope=None, mask=None):  # x: [s(/tp), b, h] -> [s(/tp), b, h]
        """``rope``: the backend's tables, [s, 1, 1, d] or per sample [s, b, 1, d]; ``mask``: the
        documents' attention mask [b, 1, s, s] (model/documents.py), None: causal."""
        if self.fused:
            qkv = self.qkv(x)  # [s, b, kvp * (hpg + 2) * hd]
            s, b = qkv.shape[:2]
            qkv = qkv.view(s, b, self.kvp, -1)  # [s, b, kvp, (hpg + 2) * hd]: one group each
            # q [s, b, np, hd], k and v [s, b, kvp, hd], RoPE applied (fused on the te backend)
            # unless the heads are normed first
            split_rope = None if self.q_norm is not None else rope
            q, k, v = self.backend.split_qkv(qkv, self.heads // self.kv, split_rope)
        else:
            q = self.q(x)
            s, b = q.shape[:2]
            q = q.view(s, b, self.np, self.hd)  # [s, b, np, hd]
            kv = self.kv_proj(x).view(s, b, 2, self.hd)  # [s, b, k|v, hd]
            k, v = kv[:, :, 0:1], kv[:, :, 1:2]  # [s, b, 1, hd]
        if self.q_norm is not None:  # v a buffer of its own like q and k (one layout for all)
            q, k, v = self.q_norm(q), self.k_norm(k), v.contiguous()
        if rope is not None and (self.q_norm is not None or not self.fused):
            q, k = self.backend.rope(q, *rope), self.backend.rope(k, *rope)
        core = self.core if mask is None else functools.partial(self.core, mask=mask)
        if self.recompute is not None:  # keep q, k, v; the attention runs again in backward
            ctx = self.recompute(core, q, k, v)  # [s, b, np*hd]
        else:
            ctx = core(q, k, v)
        return self.proj(ctx)
