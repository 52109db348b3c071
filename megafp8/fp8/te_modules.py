"""The modules of the te backend: Transformer Engine's linears, fused MLP and grouped linear
holding this rank's shard (``te`` is handed in by te_backend.py, the one module that imports
Transformer Engine)."""

from __future__ import annotations

import torch
from torch import nn

from megafp8.parallel import mappings as M
from megafp8.parallel.layers import allreduce_grad_hook, full_normal, mark_full, mark_tp, param_seed


class WeightCache:
    """Shared by a TE backend's modules: ``first`` is TE's ``is_first_microbatch`` (True: cast
    the weights to FP8 and keep them; False: reuse the kept cast; None: no cache).

    ``fused``: the weights whose gradients accumulate inside their wgrad GEMM (``wgrad_fusion``
    in optim/zero.py). TE writes the GEMM's output into ``weight.main_grad`` (overwriting on the
    first micro-batch, adding on the others) and hands autograd no gradient for the weight; here
    ``main_grad`` is the parameter's ``.grad`` itself, made (zeros) at the forward when there is
    none, so DeepSpeed finds the sum where it looks. ``release()`` drops the second reference
    once the backward is over, so the buffer is freed when DeepSpeed lets go of ``.grad``."""

    def __init__(self):
        self.first: bool | None = None
        self.fused: list[nn.Parameter] = []

    def main_grads(self, params) -> None:
        if torch.is_grad_enabled():
            for p in params:
                if p.grad is None:
                    p.grad = torch.zeros_like(p)
                p.main_grad = p.grad

    def release(self) -> None:
        for p in self.fused:
            if hasattr(p, "main_grad"):
                del p.main_grad


def _fuse_wgrad(cache: WeightCache, inner, params) -> bool:
    """At the first forward: keep the fusion only for weights that no gradient hook of ours
    watches (``allreduce_grad_hook`` marks them ``sequence_parallel``: a hook needs autograd's
    gradient, which a fused weight never gets)."""
    if any(getattr(p, "sequence_parallel", False) for p in params):
        inner.fuse_wgrad_accumulation = False
        return False
    cache.fused.extend(params)
    return True


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
        fuse_wgrad=False,
    ):
        super().__init__()
        self.fp8, self.te, self.cache = fp8, te, cache or WeightCache()
        self.fuse_wgrad: bool | None = None if fuse_wgrad else False  # None: decided at forward
        kw = dict(
            bias=bias,
            params_dtype=dtype,
            device=device or "cuda",
            init_method=lambda w: None,
            fuse_wgrad_accumulation=fuse_wgrad,
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
        if self.fuse_wgrad is None:
            self.fuse_wgrad = _fuse_wgrad(self.cache, self.inner, [self.weight])
        if self.fuse_wgrad:
            self.cache.main_grads([self.weight])
        if self.fp8:
            return self.inner(x, is_first_microbatch=self.cache.first)
        with self.te.autocast(enabled=False):
            return self.inner(x)


class TEFusedMLP(nn.Module):
    """SP off: norm + fc1 + activation + fc2 in one te.LayerNormMLP (the activation's output is
    cast to FP8 inside its kernel). Holds the same shards as ``model.mlp.MLP`` (fc1 rows, fc2
    columns of this rank), initialized from the same seeds. Under TP fc2's bias is added after
    the TP reduction; without TP there is no reduction before it, so fc2's GEMM adds it in its
    epilogue (and its backward sums the bias gradient in its cast) instead of a broadcast add
    and a sum over the tokens of their own. Forward: copy into the TP region, fused MLP,
    all-reduce, + bias."""

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
            activation="swiglu" if m.swiglu else "srelu" if m.squared_relu else "gelu",
            return_bias=tp > 1,  # tp 1: fc2's bias in its GEMM's epilogue
            params_dtype=dtype,
            device=device or "cuda",
            init_method=lambda w: None,
            output_layer_init_method=lambda w: None,
            fuse_wgrad_accumulation=backend.wgrad_fusion,
        )
        self.fuse_wgrad: bool | None = None if backend.wgrad_fusion else False
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
                # the unfused MLP's name for it (fc1's LayerNormLinear), so checkpoints carry
                # one name whichever way the MLP runs
                mark_full(p, f"{name}.fc1.linear.inner.{pname}")

    def forward(self, x):  # x: [s, b, h] -> [s, b, h]
        weights = [self.inner.fc1_weight, self.inner.fc2_weight]
        if self.fuse_wgrad is None:
            self.fuse_wgrad = _fuse_wgrad(self.cache, self.inner, weights)
        if self.fuse_wgrad:
            self.cache.main_grads(weights)
        x = M.copy_to_tensor_parallel_region(x, self.tp_group)
        if self.fp8:
            out = self.inner(x, is_first_microbatch=self.cache.first)
        else:
            with self.te.autocast(enabled=False):
                out = self.inner(x)
        if not self.inner.return_bias:  # fc2's bias is in the output already
            return out
        y, bias = out
        y = M.reduce_from_tensor_parallel_region(y, self.tp_group)
        return y if bias is None or bias.numel() == 0 else y + bias


class TEGroupedLinear(nn.Module):
    """A te.GroupedLinear: ``num`` GEMMs ([out, in] weights ``weights[i]``) in one call on rows
    grouped by ``m_splits`` (each a multiple of 16 under FP8); outside FP8 for BF16 layers."""

    plain = False

    def __init__(self, te, num, in_features, out_features, bias, *, fp8, dtype, device, cache):
        super().__init__()
        self.fp8, self.te, self.cache = fp8, te, cache
        self.inner = te.GroupedLinear(
            num, in_features, out_features, bias=bias, params_dtype=dtype,
            device=device or "cuda", init_method=lambda w: None,
        )  # fmt: skip
        self.weights = [getattr(self.inner, f"weight{i}") for i in range(num)]
        self.biases = [getattr(self.inner, f"bias{i}") for i in range(num)] if bias else []

    def forward(self, x, m_splits: list[int]):  # [sum(m_splits), in] -> [.., out]
        if self.fp8:
            return self.inner(x, m_splits, is_first_microbatch=self.cache.first)
        with self.te.autocast(enabled=False):
            return self.inner(x, m_splits)
