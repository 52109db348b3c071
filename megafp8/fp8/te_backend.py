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
from torch import nn

from megafp8.fp8.backend import Backend, SdpaAttention, layer_name, rope_angles
from megafp8.fp8.recipe import Fp8Recipe
from megafp8.parallel import mappings as M
from megafp8.parallel.layers import allreduce_grad_hook, full_normal, mark_full, mark_tp, param_seed

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


class WeightCache:
    """Shared by a TE backend's modules: ``first`` is TE's ``is_first_microbatch`` (True: cast
    the weights to FP8 and keep them; False: reuse the kept cast; None: no cache)."""

    def __init__(self):
        self.first: bool | None = None


class TEBackend(Backend):
    name = "te"

    def __init__(
        self,
        recipe: Fp8Recipe | None,
        *,
        amax_group,
        fused_norm: bool = True,
        fused_mlp: bool = False,
        attention_backend: str = "auto",
        weight_cache: bool = True,
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
        # FP8 weight cache over micro-batches: the weights change only at the optimizer step, so
        # the first micro-batch of an iteration casts them (and their transposes) to FP8 and
        # the others reuse the cast (TE's ``is_first_microbatch``); None (eval) casts every time.
        self.cache = WeightCache()
        self.weight_cache = weight_cache
        if recipe is not None:
            fmt = ter.Format.HYBRID if recipe.fp8_format == "hybrid" else ter.Format.E4M3
            if recipe.recipe == "delayed":
                self.te_recipe = ter.DelayedScaling(
                    fp8_format=fmt,
                    margin=recipe.margin,
                    amax_history_len=recipe.amax_history_len,
                    amax_compute_algo=recipe.amax_compute_algo,
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

    def make_fused_mlp(self, cfg, *, groups, layer, seed, fp8, dtype, device):
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

    def make_core_attention(self, heads, head_dim, kv_heads, *, dropout, rng=None):
        if self.attention_backend == "local":  # Megatron's "local": the framework's own attention
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

    def rope_tables(self, seq, dim, base, device):
        return (rope_angles(seq, dim, base, device).contiguous(),)  # TE's kernels take angles

    def rope(self, x, freqs):
        from transformer_engine.pytorch.attention.rope import apply_rotary_pos_emb

        return apply_rotary_pos_emb(x, freqs, tensor_format="sbhd", fused=True)

    def split_qkv(self, qkv, heads_per_group, rope=None):
        """With RoPE: one TE kernel splits the grouped QKV output and rotates q and k, writing q
        with its heads adjacent (no separate copy, no fp32 intermediates)."""
        if not rope:
            return super().split_qkv(qkv, heads_per_group)
        from transformer_engine.pytorch.attention.rope import apply_fused_qkv_rotary_pos_emb

        s, b = qkv.shape[:2]
        hd = qkv.shape[3] // (heads_per_group + 2)
        (freqs,) = rope
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
            if isinstance(mod, (TELinear, TEFusedMLP)) and mod.fp8 and layer_name(path) == layer:
                mod.fp8 = False  # runs under te.autocast(enabled=False) from now on
                n += 1
        return n

    def checkpoint(self, fn, *args, contexts=()):
        # TE's checkpoint runs the recomputation in its recompute phase: the forward's FP8
        # scaling state is reused and no amax is recorded again
        return self.te.checkpoint(
            fn, *args, use_reentrant=False, context_fn=self._context_fn(contexts)
        )

    def microbatch(self, index: int | None) -> None:
        self.cache.first = None if index is None or not self.weight_cache else index == 0

    def autocast(self):
        if not self.fp8:
            return contextlib.nullcontext()
        # TE takes None for "this process alone" and calls torch.distributed on any other value
        group = self.amax_group if M.world(self.amax_group) > 1 else None
        return self.te.autocast(enabled=True, recipe=self.te_recipe, amax_reduction_group=group)


class TELinear(nn.Module):
    """A te.Linear (or, with ``norm``, a te.LayerNormLinear: the norm and the FP8 cast of its output
    in one kernel) whose ``weight``/``bias`` are the local shard; outside FP8 for BF16 layers."""

    plain = False

    def __init__(
        self,
        te,
        in_features,
        out_features,
        bias,
        *,
        fp8,
        dtype,
        device,
        norm=None,
        zero_centered_gamma=False,
        cache=None,
    ):
        super().__init__()
        self.fp8, self.te, self.cache = fp8, te, cache or WeightCache()
        kw = dict(
            bias=bias, params_dtype=dtype, device=device or "cuda", init_method=lambda w: None
        )
        if norm is None:
            self.inner = te.Linear(in_features, out_features, **kw)
        else:
            self.inner = te.LayerNormLinear(
                in_features,
                out_features,
                eps=norm[1],
                normalization=norm[0],
                zero_centered_gamma=zero_centered_gamma,
                **kw,
            )
        self.weight = self.inner.weight
        self.bias = self.inner.bias if bias else None

    def norm_parameters(self) -> list[nn.Parameter]:
        """The fused norm's weights (empty for a plain linear)."""
        names = ("layer_norm_weight", "layer_norm_bias")
        return [p for n in names if isinstance(p := getattr(self.inner, n, None), nn.Parameter)]

    def forward(self, x):  # [..., in] -> [..., out]
        if self.fp8:
            return self.inner(x, is_first_microbatch=self.cache.first)
        with self.te.autocast(enabled=False):
            return self.inner(x)


class TEFusedMLP(nn.Module):
    """SP off: norm + fc1 + activation + fc2 in one te.LayerNormMLP (the activation's output is
    cast to FP8 inside its kernel). Holds the same shards as ``model.mlp.MLP`` (fc1 rows, fc2
    columns of this rank), initialized from the same seeds; fc2's bias is added after the TP
    reduction. Forward: copy into the TP region, fused MLP, all-reduce, + bias."""

    def __init__(self, cfg, *, backend, groups, layer: int, seed: int, fp8: bool, dtype, device):
        super().__init__()
        m, tg = cfg.model, groups.tp_group
        tp, r = M.world(tg), M.rank_in(tg)
        n = m.ffn // tp
        self.tp_group, self.fp8, self.te = tg, fp8 and backend.fp8, backend.te
        self.cache = backend.cache
        self.inner = backend.te.LayerNormMLP(
            m.hidden_size,
            n,
            eps=m.norm_epsilon,
            bias=m.add_bias_linear,
            normalization=m.normalization,
            zero_centered_gamma=m.apply_layernorm_1p,
            activation="swiglu" if m.swiglu else "gelu",
            return_bias=True,
            params_dtype=dtype,
            device=device or "cuda",
            init_method=lambda w: None,
            output_layer_init_method=lambda w: None,
        )
        name = f"layers.{layer}.mlp"
        rows = torch.arange(r * n, (r + 1) * n)
        if m.swiglu:  # [gate; up]: this rank's chunk of both
            rows = torch.cat([rows, m.ffn + rows])
        cols = torch.arange(r * n, (r + 1) * n)
        inn, dev = self.inner, self.inner.fc1_weight.device
        out1 = 2 * m.ffn if m.swiglu else m.ffn
        std2 = m.init_method_std / (2.0 * m.num_layers) ** 0.5
        with torch.no_grad():
            w1 = full_normal(
                (out1, m.hidden_size),
                m.init_method_std,
                param_seed(seed, f"{name}.fc1"),
                dev,
                dtype,
            )  # [ffn (x2), h]
            inn.fc1_weight.copy_(w1[rows.to(dev)])
            w2 = full_normal(
                (m.hidden_size, m.ffn), std2, param_seed(seed, f"{name}.fc2"), dev, dtype
            )  # [h, ffn]
            inn.fc2_weight.copy_(w2[:, cols.to(dev)])
            for b in (getattr(inn, "fc1_bias", None), getattr(inn, "fc2_bias", None)):
                if isinstance(b, nn.Parameter):
                    b.zero_()
        mark_tp(inn.fc1_weight, 0, f"{name}.fc1.linear.weight", rows)
        mark_tp(inn.fc2_weight, 1, f"{name}.fc2.linear.weight", cols)
        if isinstance(getattr(inn, "fc1_bias", None), nn.Parameter):
            mark_tp(inn.fc1_bias, 0, f"{name}.fc1.linear.bias", rows)
        if isinstance(getattr(inn, "fc2_bias", None), nn.Parameter):
            mark_full(inn.fc2_bias, f"{name}.fc2.bias")
        for pname in ("layer_norm_weight", "layer_norm_bias"):
            p = getattr(inn, pname, None)
            if isinstance(p, nn.Parameter):  # sees only this rank's share of its output grad
                allreduce_grad_hook(p, tg)

    def forward(self, x):  # x: [s, b, h] -> [s, b, h]
        x = M.copy_to_tensor_parallel_region(x, self.tp_group)
        if self.fp8:
            y, bias = self.inner(x, is_first_microbatch=self.cache.first)
        else:
            with self.te.autocast(enabled=False):
                y, bias = self.inner(x)
        y = M.reduce_from_tensor_parallel_region(y, self.tp_group)
        return y if bias is None or bias.numel() == 0 else y + bias
