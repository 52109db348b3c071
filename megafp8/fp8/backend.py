"""The backend protocol: every kernel a model room builds comes from here.

``model/`` composes layers; the kernels inside them (the local GEMM of a TP layer, a norm fused in
front of a GEMM, the norms, core attention, rotary embedding, a fused MLP) are built through a
``Backend``. Three implement it:

- ``Backend`` itself ("none"): plain torch in the parameters' dtype (bf16 or fp32), no FP8;
  its kernels are ``plain_ops.py``'s.
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

import torch
import torch.utils.checkpoint
from torch import nn

from megafp8.fp8.plain_ops import (
    PlainLinear,
    SdpaAttention,
    apply_rope,
    rope_tables,
    torch_norm,
)
from megafp8.parallel.mappings import world

log = logging.getLogger(__name__)


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
    norm_residual_add = False  # fp8/norm_residual.py: the block's add in the norm's backward

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
        return torch_norm(
            normalization, hidden, eps, zero_centered_gamma=zero_centered_gamma, dtype=dtype,
            device=device,
        )  # fmt: skip

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
            fused_dswiglu=f.te_fused_dswiglu,
            fused_swiglu=f.te_fused_swiglu,
            norm_residual_add=f.te_norm_residual_add,
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
