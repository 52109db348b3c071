"""Pre-norm transformer block: x + drop(attn(norm(x))), then x + drop(mlp(norm(x)))."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megafp8.fp8 import norm_residual
from megafp8.model.attention import SelfAttention
from megafp8.model.mlp import MLP
from megafp8.model.moe import MoELayer
from megafp8.parallel.layers import allreduce_grad_hook
from megafp8.parallel.random import TP_STREAM


def make_norm(cfg, backend, groups, dtype, device) -> nn.Module:
    """LayerNorm or RMSNorm from the backend. Under SP the norm runs on sequence shards, so its
    weights' gradients are summed over TP."""
    m = cfg.model
    norm = backend.make_norm(
        m.normalization,
        m.hidden_size,
        m.norm_epsilon,
        zero_centered_gamma=m.apply_layernorm_1p,
        dtype=dtype,
        device=device,
    )
    if cfg.parallel.sequence_parallel:
        for p in norm.parameters():
            allreduce_grad_hook(p, groups.tp_group)
    return norm


class TransformerBlock(nn.Module):
    """Pre-norm block: x + drop(attn(norm1(x))), then x + drop(mlp(norm2(x))).

    Every rank holds the full norms (replicated; their gradients summed over TP under SP) and its
    TP shards of the attention and MLP. The residual stream is [s, b, h], or the sequence shard
    [s/tp, b, h] under SP, where dropout on it runs on the TP RNG stream. A backend that fuses the
    norm into the next GEMM gets it there (``norm1``/``norm2`` are then identities).
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
        recompute=None,
    ):
        super().__init__()
        m = cfg.model
        self.recompute = recompute  # a Recompute plan (model/recompute.py), or None
        # Backends that fuse the norm into the next GEMM (TE's LayerNormLinear) get it there; not
        # under SP, where the norm must run on sequence shards before the all-gather.
        fuse = backend.fuses_norm and not cfg.parallel.sequence_parallel
        norm = (m.normalization, m.norm_epsilon, m.apply_layernorm_1p) if fuse else None
        attn_norm = norm if m.kv_heads % groups.tp == 0 else None
        kw = dict(
            backend=backend,
            groups=groups,
            layer=layer,
            seed=seed,
            fp8=fp8,
            dtype=dtype,
            device=device,
        )
        self.norm1 = nn.Identity() if attn_norm else make_norm(cfg, backend, groups, dtype, device)
        self.attn = SelfAttention(
            cfg, rng=rng, kv_group=kv_group, norm=attn_norm, recompute=recompute, **kw
        )
        moe = m.is_moe_layer(layer)  # the MoE router needs the normed input itself
        fused2 = norm is not None and not moe
        self.norm2 = nn.Identity() if fused2 else make_norm(cfg, backend, groups, dtype, device)
        if moe:
            from megafp8.config_values import global_batch_size

            t = cfg.train
            micro = global_batch_size(cfg, groups.dp) // (t.micro_batch_size * groups.dp)
            self.mlp = MoELayer(cfg, backend=backend, layer=layer, seed=seed, fp8=fp8,
                                dtype=dtype, device=device, aux_scale=1.0 / micro,
                                groups=groups)  # fmt: skip
        elif norm and backend.fuses_mlp:
            fused = dict(groups=groups, layer=layer, seed=seed, fp8=fp8, dtype=dtype, device=device)
            self.mlp = backend.make_fused_mlp(cfg, **fused)
        else:
            self.mlp = MLP(cfg, norm=norm, **kw)
        # the residual's gradient added inside the fused RMSNorm's backward where the branch's
        # first module holds that norm and takes x itself (no TP: fp8/norm_residual.py)
        fold = backend.norm_residual_add and groups.tp == 1 and m.normalization == "RMSNorm"
        self.fold = (bool(fold and attn_norm), bool(fold and fused2))
        self.p = cfg.model.hidden_dropout
        self.sp, self.rng = cfg.parallel.sequence_parallel, rng

    def _drop(self, x):
        if self.p == 0.0 or not self.training:
            return x
        if self.sp and self.rng is not None:  # the residual stream is sharded: per-rank stream
            with self.rng.fork(TP_STREAM):
                return F.dropout(x, self.p, True)
        return F.dropout(x, self.p, True)

    def _part(self, name: str, module):
        """``module``, or its checkpointed call when selective recompute names it."""
        rc = self.recompute
        if rc is None or not rc.selective(name) or isinstance(module, nn.Identity):
            return module
        return lambda *args: rc(module, *args)

    def forward(self, x: torch.Tensor, rope=None, mask=None) -> torch.Tensor:  # [s(/tp), b, h]
        norm1, norm2 = self._part("layernorm", self.norm1), self._part("layernorm", self.norm2)
        x = self._add(0, x, self._drop(self.attn(norm1(x), rope, mask)))
        return self._add(1, x, self._drop(self._part("mlp", self.mlp)(norm2(x))))

    def _add(self, branch: int, x, y):
        return norm_residual.residual_add(x, y) if self.fold[branch] else x + y
