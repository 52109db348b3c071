"""The experts of an MoE layer: each an MLP (fc1 -> GELU or SwiGLU -> fc2), run as a loop of the
backend's GEMMs (``Expert``, one pair per expert) or as two grouped GEMMs over all of this rank's
experts (``GroupedExperts``, ``--moe-grouped-gemm`` on a backend that has them: TE's
GroupedLinear). Both hold the same weights, initialized from seeds of the experts' one-process
names, and mark each weight with that name.
"""

from __future__ import annotations

import torch
from torch import nn

from megafp8.model.mlp import activate
from megafp8.parallel.layers import full_normal, mark_full, param_seed
from megafp8.parallel.mappings import SOLO

FP8_ROWS = 16  # FP8 GEMMs take row counts in multiples of 16


def _linear(backend, n_in, n_out, *, name, std, seed, bias, fp8, dtype, device):
    lin = backend.make_linear(n_in, n_out, bias, name=name, group=SOLO, fp8=fp8, dtype=dtype,
                              device=device)  # fmt: skip
    with torch.no_grad():
        dev = lin.weight.device
        lin.weight.copy_(full_normal((n_out, n_in), std, param_seed(seed, name), dev, dtype))
        if lin.bias is not None:
            lin.bias.zero_()
    mark_full(lin.weight, f"{name}.weight")
    if lin.bias is not None:
        mark_full(lin.bias, f"{name}.bias")
    return lin


class Expert(nn.Module):
    """fc2(act(fc1(x))) on [n, h] rows (``mlp.activate``); SwiGLU: fc1 = [gate; up]."""

    def __init__(self, cfg, ffn: int, *, backend, name, seed, fp8, dtype, device):
        super().__init__()
        m = cfg.model
        self.m = m
        kw = dict(seed=seed, bias=m.add_bias_linear, fp8=fp8, dtype=dtype, device=device)
        out1 = 2 * ffn if m.swiglu else ffn
        std2 = m.init_method_std / (2.0 * m.num_layers) ** 0.5
        self.fc1 = _linear(backend, m.hidden_size, out1, name=f"{name}.fc1",
                           std=m.init_method_std, **kw)  # fmt: skip
        self.fc2 = _linear(backend, ffn, m.hidden_size, name=f"{name}.fc2", std=std2, **kw)

    def forward(self, x):  # [n, h] -> [n, h]
        return self.fc2(activate(self.fc1(x), self.m))


class GroupedExperts(nn.Module):
    """This rank's experts as fc1 and fc2 grouped GEMMs: ``weights[i]`` of each is expert
    ``names[i]``'s (the same values, seeds and names as ``Expert``)."""

    def __init__(self, cfg, ffn: int, *, backend, names, seed, fp8, dtype, device):
        super().__init__()
        m = cfg.model
        self.m, n, bias = m, len(names), m.add_bias_linear
        out1 = 2 * ffn if m.swiglu else ffn
        kw = dict(fp8=fp8, dtype=dtype, device=device)
        self.fc1 = backend.make_grouped_linear(n, m.hidden_size, out1, bias, **kw)
        self.fc2 = backend.make_grouped_linear(n, ffn, m.hidden_size, bias, **kw)
        std2 = m.init_method_std / (2.0 * m.num_layers) ** 0.5
        for fc, std, shape in (("fc1", m.init_method_std, (out1, m.hidden_size)),
                               ("fc2", std2, (m.hidden_size, ffn))):  # fmt: skip
            lin = getattr(self, fc)
            for i, name in enumerate(names):
                w = lin.weights[i]
                with torch.no_grad():
                    w.copy_(full_normal(shape, std, param_seed(seed, f"{name}.{fc}"), w.device,
                                        dtype))  # fmt: skip
                mark_full(w, f"{name}.{fc}.weight")
                if bias:
                    with torch.no_grad():
                        lin.biases[i].zero_()
                    mark_full(lin.biases[i], f"{name}.{fc}.bias")

    def forward(self, x, splits: list[int]):  # [sum(splits), h] -> [sum(splits), h]
        return self.fc2(activate(self.fc1(x, splits), self.m), splits)


def run_experts(experts, rows, counts: list[int], wants: list[int]) -> torch.Tensor:
    """rows [sum(counts), h] grouped by expert -> their outputs; expert i runs on ``wants[i]``
    rows (>= counts[i]: the rest zeros, which change neither the amax nor the kept rows)."""
    h = rows.shape[-1]
    if isinstance(experts, GroupedExperts):
        starts = torch.tensor([0, *wants[:-1]]).cumsum(0).tolist()
        pos = torch.cat([torch.arange(s, s + n) for s, n in zip(starts, counts, strict=True)])
        pos = pos.to(rows.device)
        x = rows.new_zeros(sum(wants), h).index_copy(0, pos, rows)
        return experts(x, wants).index_select(0, pos)
    outs, extra, start = [], 0.0, 0
    for expert, n, want in zip(experts, counts, wants, strict=True):
        inp = rows[start : start + n]
        start += n
        if want > n:
            inp = torch.cat([inp, inp.new_zeros(want - n, h)])
        y = expert(inp)
        if n == 0:  # no tokens: its zero rows still give every weight a (zero) gradient
            extra = extra + 0.0 * y.sum()
        outs.append(y[:n])  # [n_e, h]
    return torch.cat(outs) + extra
