"""Activation recompute: Megatron's ``--recompute-*`` flags, with their meaning.

A checkpointed region keeps only its inputs in the forward; its activations are computed again in
the backward. ``full`` granularity checkpoints whole layers of each pipeline stage (or model chunk
under the interleaved schedule): ``uniform`` splits the stage's layers into consecutive groups of
``recompute_num_layers``, each group one region that keeps only its input; ``block`` checkpoints
each of the stage's first ``recompute_num_layers`` layers and keeps the rest whole. ``selective``
checkpoints parts of every layer, those named in ``recompute_modules``: ``core_attn`` (softmax(q
k^T) v, whose score matrix is the largest activation of unfused attention), ``mlp`` (fc1,
activation, fc2; with a fused norm, the norm too) and ``layernorm`` (the norms not fused into a
GEMM).

The recomputed forward gives the first forward's values: torch's checkpoint replays the default
RNG streams, ``RngTracker.recompute_contexts`` the tensor-parallel stream (dropout), and the
backend its FP8 state (``Backend.checkpoint``: the first forward's scales, no amax recorded
twice). Outside training (no gradients) nothing is checkpointed.
"""

from __future__ import annotations

import torch


class Recompute:
    """The recompute plan of one model (chunk) and the call that checkpoints a region."""

    def __init__(self, cfg, backend, rng=None):
        m = cfg.model
        self.granularity, self.method = m.recompute_granularity, m.recompute_method
        self.num_layers = m.recompute_num_layers
        self.modules = frozenset(m.recompute_modules) if self.granularity == "selective" else ()
        self.backend = backend
        self.contexts = (rng.recompute_contexts,) if rng is not None else ()

    def selective(self, module: str) -> bool:
        """Whether ``module`` (core_attn, mlp, layernorm) is checkpointed inside each layer."""
        return module in self.modules

    def __call__(self, fn, *args):
        """``fn(*args)``, checkpointed when gradients are being recorded."""
        if not torch.is_grad_enabled():
            return fn(*args)
        return self.backend.checkpoint(fn, *args, contexts=self.contexts)

    def layer_groups(self, n: int) -> list[tuple[range, bool]]:
        """The stage's ``n`` layers (positions 0..n-1) as consecutive (range, checkpointed)
        groups under full recompute; one unchecked group otherwise."""
        if self.granularity != "full" or n == 0:
            return [(range(n), False)]
        k = self.num_layers
        if self.method == "uniform":
            return [(range(i, min(i + k, n)), True) for i in range(0, n, k)]
        k = min(k, n)  # block: the first k layers one by one, then the rest kept whole
        rest = [(range(k, n), False)] if k < n else []
        return [(range(i, i + 1), True) for i in range(k)] + rest
