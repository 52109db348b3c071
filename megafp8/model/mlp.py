"""MLP split by the ffn dim over TP: column-parallel fc1 (GELU, SwiGLU or squared ReLU),
row-parallel fc2."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megafp8.parallel import mappings as M
from megafp8.parallel.layers import ColumnParallelLinear, RowParallelLinear


def activate(h: torch.Tensor, m) -> torch.Tensor:
    """The MLP's activation of fc1's output: SwiGLU silu(gate) * up on [gate | up], squared
    ReLU relu(h)^2, or GELU (tanh)."""
    if m.swiglu:
        gate, up = h.chunk(2, dim=-1)
        return F.silu(gate) * up
    if m.squared_relu:
        return F.relu(h).square()
    return F.gelu(h, approximate="tanh")


class MLP(nn.Module):
    """fc2(act(fc1(x))) with act GELU (tanh), squared ReLU, or SwiGLU: silu(x W_gate^T) *
    (x W_up^T).

    Shards: this TP rank holds ffn / tp rows of fc1 (for SwiGLU its chunk of both the gate and the
    up halves of [gate; up]) and the matching ffn / tp columns of fc2, whose partial outputs are
    summed over TP (reduce-scattered along the sequence under SP).
    """

    def __init__(
        self, cfg, *, backend, groups, layer: int, seed: int, fp8: bool, dtype, device, norm=None
    ):
        super().__init__()
        m = cfg.model
        tp_group, tp = groups.tp_group, M.world(groups.tp_group)
        r = M.rank_in(tp_group)
        self.m = m
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
            weight_grad_group=M.SOLO,
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
        return self.fc2(activate(h, self.m))
