"""MLP split by the ffn dim over TP: column-parallel fc1 (GELU or SwiGLU), row-parallel fc2."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megafp8.parallel import mappings as M
from megafp8.parallel.layers import (
    ColumnParallelLinear,
    RowParallelLinear,
    allreduce_grad_hook,
    full_normal,
    mark_full,
    mark_tp,
    param_seed,
)


class MLP(nn.Module):
    def __init__(
        self, cfg, *, backend, groups, layer: int, seed: int, fp8: bool, dtype, device, norm=None
    ):
        super().__init__()
        m = cfg.model
        tp_group, tp = groups.tp_group, M.world(groups.tp_group)
        r = M.rank_in(tp_group)
        self.swiglu = m.swiglu
        kw = dict(
            backend=backend,
            tp_group=tp_group,
            seed=seed,
            bias=m.add_bias_linear,
            sequence_parallel=cfg.parallel.sequence_parallel,
            dtype=dtype,
            device=device,
            fp8=fp8,
        )
        name = f"layers.{layer}.mlp"
        rows = None
        if m.swiglu:  # full fc1 = [gate; up], each [ffn, h]: this rank takes its chunk of both
            n = m.ffn // tp
            rows = torch.cat(
                [torch.arange(r * n, (r + 1) * n), m.ffn + torch.arange(r * n, (r + 1) * n)]
            )
        out1 = 2 * m.ffn if m.swiglu else m.ffn
        self.fc1 = ColumnParallelLinear(
            m.hidden_size,
            out1,
            name=f"{name}.fc1",
            rows=rows,
            std=m.init_method_std,
            norm=norm,
            **kw,
        )
        self.fc2 = RowParallelLinear(
            m.ffn,
            m.hidden_size,
            name=f"{name}.fc2",
            std=m.init_method_std / (2.0 * m.num_layers) ** 0.5,
            **kw,
        )

    def forward(self, x):  # x: [s(/tp), b, h] -> [s(/tp), b, h]
        h = self.fc1(x)  # [s, b, ffn/tp (x2 for swiglu)]
        if self.swiglu:
            gate, up = h.chunk(2, dim=-1)
            h = F.silu(gate) * up
        else:
            h = F.gelu(h, approximate="tanh")
        return self.fc2(h)


class TEFusedMLP(nn.Module):
    """te backend, SP off: norm + fc1 + activation + fc2 in one te.LayerNormMLP (the activation's
    output is cast to FP8 inside its kernel). Holds the same shards as ``MLP`` (fc1 rows, fc2
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
            )
            inn.fc1_weight.copy_(w1[rows.to(dev)])
            w2 = full_normal(
                (m.hidden_size, m.ffn), std2, param_seed(seed, f"{name}.fc2"), dev, dtype
            )
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
