"""The backend protocol: every kernel a model room builds comes from here.

``model/`` composes layers; the kernels inside them (the local GEMM of a TP layer, a norm fused in
front of a GEMM, the norms, core attention, rotary embedding, a fused MLP) are built through a
``Backend``. Three implement it:

- ``Backend`` itself ("none"): plain torch in the parameters' dtype (bf16 or fp32), no FP8.
- ``torch_backend.TorchBackend`` ("torch"): our FP8 recipe, ``torch._scaled_mm`` on CUDA and an
  exact emulation of the same GEMM on the CPU.
- ``te_backend.TEBackend`` ("te"): Transformer Engine modules and recipes. It is the only module
  outside the tests that imports Transformer Engine.

A backend also wraps the model's forward in its autocast (``autocast``), is told each micro-batch's
index before its forward (``microbatch``), steps its scaling state after its backward
(``update``), and checkpoints a region for activation recompute (``checkpoint``: its FP8 state
replayed, never updated twice). Process groups are always passed in; a layer with no
parallelism passes ``mappings.SOLO``, never ``None``.
"""

from __future__ import annotations

import contextlib
import importlib.util
import logging
import math
import re

import torch
import torch.distributed as dist
import torch.nn.functional as F
import torch.utils.checkpoint
from torch import nn

from megafp8.parallel.mappings import world
from megafp8.parallel.random import TP_STREAM

log = logging.getLogger(__name__)


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


class Backend:
    """The protocol, implemented with plain torch ("none").

    ``fp8``: whether this backend's GEMMs are FP8 at all. ``fuses_norm``: whether
    ``make_norm_linear`` exists (a norm fused into the GEMM that follows it). ``fuses_mlp``: whether
    ``make_fused_mlp`` exists (norm + fc1 + activation + fc2 in one module).
    """

    name = "none"
    fp8 = False
    fuses_norm = False
    fuses_mlp = False

    def make_linear(
        self, in_features, out_features, bias, *, name, group, fp8=True, dtype, device=None
    ) -> nn.Module:
        """The local GEMM of a TP layer (``group``: the ranks holding shards of it, whose FP8
        scales must agree). The module has ``weight`` [out, in], ``bias`` and ``plain``."""
        world(group)  # a group is required even where nothing is reduced
        return PlainLinear(in_features, out_features, bias, dtype=dtype, device=device)

    def make_norm_linear(
        self,
        in_features,
        out_features,
        bias,
        *,
        normalization,
        eps,
        zero_centered_gamma=False,
        fp8=True,
        dtype,
        device,
    ) -> nn.Module:
        """norm(x) w^T in one module, with ``norm_parameters()``; only where ``fuses_norm``."""
        raise NotImplementedError(f"backend {self.name!r} does not fuse norms into GEMMs")

    grouped_gemm = False  # whether ``make_grouped_linear`` exists (--moe-grouped-gemm)

    def make_grouped_linear(
        self, num, in_features, out_features, bias, *, fp8, dtype, device
    ) -> nn.Module:
        """``num`` GEMMs in one call: ``forward(x, m_splits)`` on rows grouped by m_splits, weights
        ``weights[i]`` [out, in] (and ``biases``); only where ``grouped_gemm``."""
        raise NotImplementedError(f"backend {self.name!r} has no grouped GEMM")

    def make_fused_mlp(self, cfg, *, groups, layer, seed, fp8, dtype, device) -> nn.Module:
        """norm + fc1 + activation + fc2 of one layer's MLP shard; only where ``fuses_mlp``."""
        raise NotImplementedError(f"backend {self.name!r} has no fused MLP")

    def make_norm(
        self,
        normalization: str,
        hidden: int,
        eps: float,
        *,
        zero_centered_gamma: bool = False,
        dtype,
        device,
    ) -> nn.Module:
        """LayerNorm or RMSNorm over the last dim (weight stored as ``w - 1`` when
        ``zero_centered_gamma``)."""
        if zero_centered_gamma:
            return ZeroCenteredNorm(normalization, hidden, eps, dtype=dtype, device=device)
        if normalization == "LayerNorm":
            return nn.LayerNorm(hidden, eps=eps, dtype=dtype, device=device)
        return nn.RMSNorm(hidden, eps=eps, dtype=dtype, device=device)

    def make_core_attention(
        self,
        heads: int,
        head_dim: int,
        kv_heads: int,
        *,
        dropout: float,
        rng=None,
        document_mask: bool = False,
    ) -> nn.Module:
        """Causal attention of this rank's heads: (q [s,b,np,hd], k, v [s,b,kvp,hd]) ->
        [s, b, np*hd]; with ``document_mask`` it also takes ``mask`` [b, 1, s, s]."""
        return SdpaAttention(heads, head_dim, kv_heads, dropout, rng)

    def rope_tables(self, seq: int, dim: int, base: float, device, scaling=None) -> tuple:
        """What ``rope`` and ``split_qkv`` take for positions 0..seq-1 (here cos and sin), each
        [seq, 1, 1, dim]; ``rope`` and ``split_qkv`` also take them gathered per sample
        [s, b, 1, dim] (model/documents.py: ``gather_tables``). ``scaling``: Llama 3.1's
        frequency scaling factor, or None."""
        return rope_tables(seq, dim, base, device, scaling)

    def rope(self, x: torch.Tensor, *tables) -> torch.Tensor:
        """Rotary position embedding of q or k [s, b, n, d] (``tables`` from ``rope_tables``)."""
        return apply_rope(x, *tables)

    def split_qkv(self, qkv: torch.Tensor, heads_per_group: int, rope=None):
        """The grouped QKV GEMM's output [s, b, g, (hpg + 2) * hd] -> q [s, b, g * hpg, hd],
        k and v [s, b, g, hd], RoPE applied to q and k when ``rope`` (tables) is given.

        Views where the layout allows: split's backward writes the three gradients into one qkv
        gradient in a single pass (indexing would zero-fill and add three full tensors), and TE's
        attention reads the interleaved views in place. Grouped-query q is a copy (the heads of a
        group are not adjacent to the next group's)."""
        s, b, g = qkv.shape[:3]
        hpg = heads_per_group
        hd = qkv.shape[3] // (hpg + 2)
        qkv = qkv.view(s, b, g, hpg + 2, hd)  # per group: hpg q heads, k, v
        if hpg == 1:
            q, k, v = qkv.unbind(3)  # each [s, b, g, hd]
        else:
            q, k, v = torch.split(qkv, [hpg, 1, 1], dim=3)  # [s, b, g, hpg|1|1, hd]
            q = q.reshape(s, b, g * hpg, hd)
            k, v = k.squeeze(3), v.squeeze(3)  # [s, b, g, hd]
        if rope:
            q, k = self.rope(q, *rope), self.rope(k, *rope)
        return q, k, v

    def autocast(self):
        return contextlib.nullcontext()

    def checkpoint(self, fn, *args, contexts=()):
        """``fn(*args)`` keeping only ``args`` for the backward, in which ``fn`` runs again
        (activation recompute). ``contexts``: callables that return a (forward, recompute) pair
        of context managers for the region, e.g. ``RngTracker.recompute_contexts``; torch's
        checkpoint replays the default RNG streams itself."""
        return torch.utils.checkpoint.checkpoint(
            fn, *args, use_reentrant=False, context_fn=self._context_fn(contexts)
        )

    def start_fp8_stats(self) -> None:
        """Before an iteration whose FP8 health statistics are logged."""

    def fp8_stats(self, model) -> dict[str, float]:
        """After it: ``{"<gemm>.<role>/<stat>": value}`` (amax, scale, and where the backend
        sees the tensors, the saturated and flushed shares) of this rank."""
        return {}

    def recompute_contexts(self):
        """This backend's own (forward, recompute) pair for a checkpointed region."""
        return contextlib.nullcontext(), contextlib.nullcontext()

    def _context_fn(self, contexts):
        def context_fn():  # once per checkpointed call
            pairs = [make() for make in contexts] + [self.recompute_contexts()]
            return _all_of([f for f, _ in pairs]), _all_of([r for _, r in pairs])

        return context_fn

    def microbatch(self, index: int | None) -> None:
        """Before each micro-batch's forward: its index within the iteration (``None`` outside
        training, e.g. evaluation)."""

    def release_main_grads(self) -> None:
        """At the accumulation boundary, before the optimizer step: the backward is over."""

    def update(self, roles: tuple[str, ...] | None = None) -> None:
        """After each micro-batch's forward + backward; under pipelining, after each forward
        (``roles=("x", "w")``) and after each backward (``roles=("g",)``)."""

    def fp8_overflows(self, model) -> dict[str, torch.Tensor]:
        """Per layer ("layers.3") whose FP8 casts were watched: 1.0 (a 0-dim tensor) where one
        overflowed since the last call, else 0.0; the flags start again (``Fp8OverflowGuard``)."""
        return {}

    def fall_back_to_bf16(self, model, layer: str) -> int:
        """From now on run every GEMM of ``layer`` ("layers.3") in this rank's ``model`` without
        FP8 (the parameters' dtype: BF16 under --bf16); returns how many modules changed."""
        return 0

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass


_LAYER = re.compile(r"(?:^|\.)(layers\.\d+)(?:\.|$)")


def layer_name(name: str) -> str | None:
    """The transformer layer of a GEMM or module name: "chunks.0.layers.3.mlp.fc1" -> "layers.3"
    (layer indices are global, one process's); None outside the layers."""
    m = _LAYER.search(name)
    return m.group(1) if m else None


class Fp8OverflowGuard:
    """``--fp8-overflow-fallback-steps K``: a layer whose FP8 casts overflow (the backend's
    ``fp8_overflows``) in K iterations in a row leaves FP8 for good: ``fall_back_to_bf16``.

    After each iteration one MAX all-reduce over every rank of a per-layer flag vector (a
    superset of the TP x DP ranks that hold shards and replicas of a layer, so those agree, and
    every pipeline stage learns of every layer, rank 0 included, which logs the fallback once).
    The fallen-back layers and the current runs are checkpointed (``state_dict``) and applied
    again on load."""

    def __init__(self, backend, model, num_layers: int, steps: int | None, rank0: bool, device):
        self.backend, self.model, self.steps, self.rank0 = backend, model, steps, rank0
        self.device = device
        self.runs = [0] * num_layers  # iterations in a row with an overflow, per layer
        self.fallen: list[str] = []

    def after_iteration(self, iteration: int) -> list[str]:
        """Returns the layers that fell back now."""
        if self.steps is None:
            return []
        flags = torch.zeros(len(self.runs), dtype=torch.float32, device=self.device)
        for lay, flag in self.backend.fp8_overflows(self.model).items():
            i = int(lay.split(".")[1])
            flags[i] = torch.maximum(flags[i], flag.to(flags))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        new = []
        for i, f in enumerate(flags.tolist()):
            name = f"layers.{i}"
            self.runs[i] = self.runs[i] + 1 if f > 0 and name not in self.fallen else 0
            if self.runs[i] >= self.steps:
                new.append(name)
                self.runs[i] = 0
        for name in new:
            self.fall_back(name)
            if self.rank0:
                log.warning(
                    "FP8 overflow in %s for %d iterations in a row (to iteration %d): its GEMMs "
                    "run without FP8 from iteration %d on",
                    name, self.steps, iteration, iteration + 1,
                )  # fmt: skip
        return new

    def fall_back(self, name: str) -> None:
        self.backend.fall_back_to_bf16(self.model, name)
        if name not in self.fallen:
            self.fallen.append(name)

    def state_dict(self) -> dict:
        return {"layers": list(self.fallen), "runs": list(self.runs)}

    def load_state_dict(self, sd: dict) -> None:
        for name in sd.get("layers", []):
            self.fall_back(name)
        if len(sd.get("runs", [])) == len(self.runs):
            self.runs = list(sd["runs"])
        if self.fallen and self.rank0:
            log.info("FP8 off (fallen back after overflows) in: %s", ", ".join(self.fallen))


@contextlib.contextmanager
def _all_of(managers):
    with contextlib.ExitStack() as stack:
        for m in managers:
            stack.enter_context(m)
        yield


def resolve_backend_name(f) -> str:
    """``auto``: te where TE and a GPU are present, FP8 or not (its fused norm, MLP and RoPE
    kernels serve BF16 too); else torch with FP8 and ``none`` (plain PyTorch) without."""
    if f.fp8_backend == "te":
        return "te"
    if f.fp8_backend == "auto":
        if importlib.util.find_spec("transformer_engine") is not None:
            from megafp8.fp8.te_backend import te_available

            if te_available():
                return "te"
        return "torch" if f.enabled else "none"
    return f.fp8_backend if f.enabled else "none"


def build_backend(
    f,
    *,
    amax_group,
    tp_group,
    attention_backend: str = "auto",
    expert_amax_group=None,
    wgrad_fusion: bool = False,
) -> Backend:
    """From an ``Fp8Config``. ``amax_group``: every rank holding a shard or replica of the same
    tensors (TP x DP), over which FP8 amaxes are reduced; ``expert_amax_group``: the same for the
    routed experts (TP x expert-DP; default ``amax_group``); ``tp_group``: this rank's TP group.
    ``attention_backend`` (Megatron's flag) picks the te backend's attention kernels;
    ``wgrad_fusion`` (``optim.zero.wgrad_fusion``): the te backend's weight gradients accumulate
    inside their wgrad GEMM."""
    from megafp8.fp8.recipe import Fp8Recipe

    name = resolve_backend_name(f)
    recipe = Fp8Recipe.from_config(f) if f.enabled else None
    world(amax_group), world(tp_group)  # both required, even when of size 1
    if name == "te":
        if not importlib.util.find_spec("transformer_engine"):
            raise ValueError("fp8_backend='te' needs Transformer Engine: pip install -e .[te]")
        from megafp8.fp8.te_backend import TEBackend

        return TEBackend(
            recipe,
            amax_group=amax_group,
            fused_norm=f.te_fused_norm,
            fused_mlp=f.te_fused_mlp,
            attention_backend=attention_backend,
            weight_cache=f.te_weight_cache,
            wgrad_fusion=wgrad_fusion,
        )
    if name == "torch" and recipe is not None:
        from megafp8.fp8.torch_backend import TorchBackend

        backend = TorchBackend(
            recipe, amax_group=amax_group, gemm=f.fp8_gemm, expert_amax_group=expert_amax_group
        )
        if f.fp8_overflow_fallback_steps is not None:
            backend.state.watch_overflow(f.fp8_overflow_saturated_share)
        return backend
    return Backend()
