"""The "te" backend: Transformer Engine modules and recipes (imported only when selected).

This is the only module outside the tests that imports Transformer Engine. It provides the local
GEMMs (``te.Linear``), norms fused into the next GEMM (``te.LayerNormLinear``), the norms, core
attention (``te.DotProductAttention``) and optionally the whole MLP (``te.LayerNormMLP``), each
holding this rank's shard; the TP collectives stay ours, around them.
"""

from __future__ import annotations

import contextlib
import os
import warnings

import torch

from megafp8.fp8 import dswiglu, norm_residual, qkv_rope, swiglu_fwd
from megafp8.fp8.backend import Backend
from megafp8.fp8.overflow_guard import layer_name
from megafp8.fp8.plain_ops import SdpaAttention, apply_rope, rope_angles
from megafp8.fp8.recipe import Fp8Recipe
from megafp8.fp8.te_modules import TEFusedMLP, TEGroupedLinear, TELinear, WeightCache
from megafp8.parallel import mappings as M

__all__ = ["TEBackend", "TEFusedMLP", "TEGroupedLinear", "TELinear", "te_available"]

# Megatron's --attention-backend -> TE's kernel switches ("auto": TE chooses; "local": ours)
ATTENTION_ENV = {
    "flash": {"NVTE_FLASH_ATTN": "1", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "0"},
    "fused": {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "1", "NVTE_UNFUSED_ATTN": "0"},
    "unfused": {"NVTE_FLASH_ATTN": "0", "NVTE_FUSED_ATTN": "0", "NVTE_UNFUSED_ATTN": "1"},
}


def te_available() -> bool:
    """Transformer Engine imports, a GPU is present and it can run FP8."""
    if not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch as te

        ok = te.is_fp8_available()
        return bool(ok[0] if isinstance(ok, tuple) else ok)
    except Exception:  # a broken TE install: fall back to the torch backend
        return False


class TEBackend(Backend):
    name = "te"

    def __init__(
        self,
        recipe: Fp8Recipe | None,
        *,
        amax_group,
        fused_norm: bool = True,
        fused_mlp: bool = False,
        fused_dswiglu: bool = True,
        fused_swiglu: bool = False,
        norm_residual_add: bool = True,
        attention_backend: str = "auto",
        weight_cache: bool = True,
        wgrad_fusion: bool = False,
    ):
        import transformer_engine.common.recipe as ter
        import transformer_engine.pytorch as te

        # TE recognizes the attention's interleaved q/k/v views by their pointers and warns that
        # it prefers the packed tensor; that path selects the views inside TE, whose backward
        # zero-fills and sums three full qkv gradients. Keep the views, drop the warning.
        warnings.filterwarnings("ignore", "Relying on pointer-based detection", DeprecationWarning)
        self.te = te
        self.attention_backend = attention_backend
        if attention_backend in ATTENTION_ENV:  # TE reads these when it picks a kernel
            os.environ.update(ATTENTION_ENV[attention_backend])
        self.fp8 = recipe is not None
        self.amax_group = amax_group
        self.te_recipe = None
        self.fuses_norm = fused_norm
        self.fuses_mlp = fused_norm and fused_mlp
        # te.LayerNormMLP's SwiGLU backward with its FP8 cast and transpose in one kernel
        # (fp8/dswiglu.py: TE's bytes; delayed scaling only, elsewhere TE's own kernels)
        delayed = recipe is not None and recipe.recipe == "delayed"
        self.fuses_dswiglu = dswiglu.install(self.fuses_mlp and fused_dswiglu and delayed)
        # and its forward with the FP8 cast and transpose in one kernel (fp8/swiglu_fwd.py)
        self.fuses_swiglu = swiglu_fwd.install(self.fuses_mlp and fused_swiglu and delayed)
        # the residual's gradient added inside TE's RMSNorm backward (fp8/norm_residual.py); the
        # block asks for it only where the norm is fused and there is no TP
        self.norm_residual_add = norm_residual.install(fused_norm and norm_residual_add)
        # FP8 weight cache over micro-batches: the weights change only at the optimizer step, so
        # the first micro-batch of an iteration casts them (and their transposes) to FP8 and
        # the others reuse the cast (TE's ``is_first_microbatch``); None (eval) casts every time.
        self.cache = WeightCache()
        self.weight_cache = weight_cache
        self.wgrad_fusion = wgrad_fusion  # optim/zero.py: wgrad_fusion
        if recipe is not None:
            fmt = ter.Format.HYBRID if recipe.fp8_format == "hybrid" else ter.Format.E4M3
            if recipe.recipe == "delayed":
                # TE reduces amaxes over the autocast's group, and a group of None means the
                # whole world to it: an amax group of one rank (e.g. TP 1 x DP 1 under PP) must
                # switch the reduction off, or the stages' different layers would share amaxes
                self.te_recipe = ter.DelayedScaling(
                    fp8_format=fmt,
                    margin=recipe.margin,
                    amax_history_len=recipe.amax_history_len,
                    amax_compute_algo=recipe.amax_compute_algo,
                    reduce_amax=M.world(amax_group) > 1,
                )
            elif recipe.recipe == "tensorwise":
                self.te_recipe = ter.Float8CurrentScaling(fp8_format=fmt)
            else:
                self.te_recipe = ter.MXFP8BlockScaling(fp8_format=fmt)

    def _linear(self, in_features, out_features, bias, fp8, dtype, device, norm=None, zc=False):
        return TELinear(
            self.te,
            in_features,
            out_features,
            bias,
            fp8=fp8 and self.fp8,
            dtype=dtype,
            device=device,
            norm=norm,
            zero_centered_gamma=zc,
            cache=self.cache,
            fuse_wgrad=self.wgrad_fusion,
        )

    def make_linear(
        self, in_features, out_features, bias, *, name, group, fp8=True, dtype, device=None
    ):
        M.world(group)
        return self._linear(in_features, out_features, bias, fp8, dtype, device)

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
    ):
        norm = (normalization, eps)
        return self._linear(
            in_features, out_features, bias, fp8, dtype, device, norm, zero_centered_gamma
        )

    grouped_gemm = True

    def make_grouped_linear(self, num, in_features, out_features, bias, *, fp8, dtype, device):
        return TEGroupedLinear(self.te, num, in_features, out_features, bias,
                               fp8=fp8 and self.fp8, dtype=dtype, device=device,
                               cache=self.cache)  # fmt: skip

    def make_fused_mlp(self, cfg, *, groups, layer, seed, fp8, dtype, device):
        dswiglu.biased_mlp(cfg.model.add_bias_linear)  # no fc1 bias: no bias gradient to write
        return TEFusedMLP(
            cfg, backend=self, groups=groups, layer=layer, seed=seed, fp8=fp8, dtype=dtype,
            device=device,
        )  # fmt: skip

    def make_norm(self, normalization, hidden, eps, *, zero_centered_gamma=False, dtype, device):
        cls = self.te.LayerNorm if normalization == "LayerNorm" else self.te.RMSNorm
        return cls(
            hidden,
            eps=eps,
            zero_centered_gamma=zero_centered_gamma,
            params_dtype=dtype,
            device=device or "cuda",
        )

    def make_core_attention(
        self, heads, head_dim, kv_heads, *, dropout, rng=None, document_mask=False
    ):
        # Megatron's "local": the framework's own attention; the documents' mask goes to torch's
        # SDPA as well (validate.py refuses it with a TE kernel named)
        if self.attention_backend == "local" or document_mask:
            return SdpaAttention(heads, head_dim, kv_heads, dropout, rng)
        # [s, b, np, hd] in, [s, b, np*hd] out; TE copies a layout it cannot read
        return self.te.DotProductAttention(
            heads,
            head_dim,
            num_gqa_groups=kv_heads,
            attention_dropout=dropout,
            attn_mask_type="causal",
            qkv_format="sbhd",
        )

    def rope_tables(self, seq, dim, base, device, scaling=None):
        # TE's kernels take the angles
        return (rope_angles(seq, dim, base, device, scaling).contiguous(),)

    def rope(self, x, freqs):
        if freqs.shape[1] > 1:  # per-sample positions: TE's kernel takes one row per position
            return apply_rope(x, freqs.cos(), freqs.sin())
        from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

        return apply_rotary_pos_emb(x, freqs, tensor_format="sbhd", fused=True)

    def split_qkv(self, qkv, heads_per_group, rope=None):
        """With RoPE: one Triton kernel splits the grouped QKV output and rotates q and k
        (``fp8/qkv_rope.py``; TE's fused QKV-split RoPE where Triton is missing), writing q with
        its heads adjacent (no separate copy, no fp32 intermediates). Without: TE's
        SplitAlongDim, whose backward finds the three gradients already side by side in one
        buffer (TE's attention writes dq, dk, dv into one dqkv for the interleaved layout) and
        returns that buffer, where torch's split / unbind would copy them into a new one."""
        if not rope:
            from transformer_engine.pytorch.utils import SplitAlongDim

            s, b, g = qkv.shape[:3]
            hd = qkv.shape[3] // (heads_per_group + 2)
            parts = qkv.view(s, b, g, heads_per_group + 2, hd)  # per group: hpg q heads, k, v
            q, k, v = SplitAlongDim.apply(parts, 3, [heads_per_group, 1, 1])
            # q a view when hpg == 1; grouped-query q is a copy (see Backend.split_qkv)
            return q.reshape(s, b, g * heads_per_group, hd), k.squeeze(3), v.squeeze(3)
        (freqs,) = rope
        if qkv_rope.available(qkv):  # shared or per-sample (documents) angle rows
            return qkv_rope.split_qkv_rope(qkv, freqs, heads_per_group)
        if freqs.shape[1] > 1:  # per-sample positions: torch's split and RoPE
            return Backend.split_qkv(self, qkv, heads_per_group, rope)
        from transformer_engine.pytorch.attention.rope import apply_fused_qkv_rotary_pos_emb

        s, b = qkv.shape[:2]
        hd = qkv.shape[3] // (heads_per_group + 2)
        split = [heads_per_group * hd, hd, hd]
        q, k, v = apply_fused_qkv_rotary_pos_emb(qkv, freqs, freqs, split, tensor_format="sbhd")
        return tuple(t.reshape(s, b, -1, hd) for t in (q, k, v))

    def fp8_stats(self, model):
        """TE's delayed-scaling state of every FP8 module, read, not recomputed: per GEMM and
        role (x, w: forward; g: backward) the most recent reduced amax and the scale. TE does not
        expose the cast tensors, so the saturated / flushed shares are the torch backend's only.
        One device-to-host copy."""
        names, rows = [], []
        for name, mod in model.named_modules():
            meta = getattr(mod, "fp8_meta", None)
            if not meta or "scaling_fwd" not in meta:
                continue
            base = name.removesuffix(".inner").removesuffix(".linear")
            fwd, bwd = meta["scaling_fwd"], meta["scaling_bwd"]
            gemms = fwd.scale.numel() // 3  # forward: input, weight, output per GEMM
            for i in range(gemms):
                gemm = base if gemms == 1 else f"{base}.fc{i + 1}"
                for role, st, j in (("x", fwd, 3 * i), ("w", fwd, 3 * i + 1), ("g", bwd, 2 * i)):
                    h = st.amax_history  # [len, tensors]; TE rolls the newest to the last row
                    names.append(f"{gemm}.{role}")
                    rows.append(torch.stack([h[-1 if h.shape[0] > 1 else 0, j], st.scale[j]]))
        if not rows:
            return {}
        vals = torch.stack(rows).float().cpu().tolist()
        out = {}
        for n, (amax, scale) in zip(names, vals, strict=True):
            out[f"{n}/amax"], out[f"{n}/scale"] = amax, scale
        return out

    def fp8_overflows(self, model):
        """Per layer: 1.0 where the newest reduced amax of one of its TE modules' FP8 tensors
        (forward and backward) is not finite. TE hands out neither the cast tensors nor the
        saturated share, and its amax kernels may pass over a NaN: an inf is what shows here."""
        out: dict = {}
        for path, mod in model.named_modules():
            meta, lay = getattr(mod, "fp8_meta", None), layer_name(path)
            if not meta or "scaling_fwd" not in meta or lay is None:
                continue
            for key in ("scaling_fwd", "scaling_bwd"):
                h = meta[key].amax_history  # [len, tensors]; the newest in the last row
                bad = (~torch.isfinite(h[-1])).any().float()
                out[lay] = bad if lay not in out else torch.maximum(out[lay], bad)
        return out

    def fall_back_to_bf16(self, model, layer):
        n = 0
        for path, mod in model.named_modules():
            te_mods = (TELinear, TEFusedMLP, TEGroupedLinear)
            if isinstance(mod, te_mods) and mod.fp8 and layer_name(path) == layer:
                mod.fp8 = False  # runs under te.autocast(enabled=False) from now on
                n += 1
        return n

    def checkpoint(self, fn, *args, contexts=()):
        # TE's checkpoint runs the recomputation in its recompute phase: the forward's FP8
        # scaling state is reused and no amax is recorded again
        return self.te.checkpoint(
            fn, *args, use_reentrant=False, context_fn=self._context_fn(contexts)
        )

    def release_main_grads(self) -> None:
        self.cache.release()

    def microbatch(self, index: int | None) -> None:
        self.cache.first = None if index is None or not self.weight_cache else index == 0

    def autocast(self):
        if not self.fp8:
            return contextlib.nullcontext()
        # a group of one rank is no torch.distributed group: None, with reduce_amax off above
        group = self.amax_group if M.world(self.amax_group) > 1 else None
        return self.te.autocast(enabled=True, recipe=self.te_recipe, amax_reduction_group=group)
