"""Tensor-parallel layers (Megatron's), each taking its TP group.

Every layer initializes the *full* weight from a seed derived from its name, then keeps this rank's
rows/columns, so a model built at any TP size holds the same numbers as the single-process model.
Sharded parameters carry ``tensor_model_parallel=True`` and ``partition_dim`` (DeepSpeed's gradient
clipping counts them on every rank, replicated ones on TP rank 0 only). Parameters replicated across
TP but applied to sequence shards (norms and row-parallel biases under SP) carry
``sequence_parallel=True`` and get their gradient all-reduced over TP by a hook, before any
accumulation or ZeRO reduction sees it.
"""

from __future__ import annotations

import zlib

import torch
import torch.nn.functional as F
from torch import nn

from megafp8.parallel import fused_cross_entropy as fce
from megafp8.parallel import mappings as M
from megafp8.parallel.grad_in_place import embedding


def param_seed(seed: int, name: str) -> int:
    """A stable per-parameter seed: the same on every rank and every run."""
    return (seed * 1_000_003 + zlib.crc32(name.encode())) % (2**63 - 1)


def full_normal(shape, std: float, seed: int, device, dtype) -> torch.Tensor:
    gen = torch.Generator(device=device)
    gen.manual_seed(seed)
    return (
        torch.empty(shape, device=device, dtype=torch.float32)
        .normal_(0.0, std, generator=gen)
        .to(dtype)
    )


def mark_tp(p: nn.Parameter, dim: int, full_name: str, index: torch.Tensor) -> nn.Parameter:
    """Mark a shard: ``p == full[full_name].index_select(dim, index)`` (read by the equivalence
    tests and by resharding)."""
    p.tensor_model_parallel, p.partition_dim, p.partition_stride = True, dim, 1
    p.full_name, p.full_index = full_name, index.cpu()
    return p


def mark_full(p: nn.Parameter, full_name: str) -> nn.Parameter:
    """A parameter that equals the single-process model's ``full_name`` (replicated)."""
    p.full_name = full_name
    return p


def allreduce_grad_hook(p: nn.Parameter, group) -> nn.Parameter:
    """The gradient of ``p`` is summed over ``group`` (its partial uses live on several ranks)."""
    if M.world(group) > 1:
        p.sequence_parallel = True
        p.register_hook(lambda g: M.all_reduce(g.clone(), group))
    return p


class _SeqGatherLinear(torch.autograd.Function):
    """y = all_gather_seq(x) A^T + b that saves the sequence shard x, not the gathered input, and
    all-gathers it again in backward (Megatron's trade: one more all-gather of s*b*h per GEMM in
    backward for (1 - 1/tp) * s*b*h fewer saved elements). Backward: dx is reduce-scattered."""

    @staticmethod
    def forward(ctx, x, weight, bias, group):
        ctx.save_for_backward(x, weight)
        ctx.group, ctx.has_bias = group, bias is not None
        return F.linear(M._all_gather(x, group, 0), weight, bias)  # [s, b, out/tp]

    @staticmethod
    def backward(ctx, gy):
        x, weight = ctx.saved_tensors
        full = M._all_gather(x, ctx.group, 0)  # [s, b, in], gathered again
        dx = M._reduce_scatter(gy @ weight, ctx.group, 0)  # [s/tp, b, in]
        g2 = gy.reshape(-1, gy.shape[-1])  # [s*b, out/tp]
        dw = g2.t() @ full.reshape(-1, full.shape[-1])  # [out/tp, s*b] @ [s*b, in]
        db = g2.sum(0) if ctx.has_bias else None
        return dx, dw, db, None


class ColumnParallelLinear(nn.Module):
    """y = x A^T + b with A split by rows (output features): rank r holds ``rows`` of the full A.

    Forward: x is copied to (or, under SP, all-gathered along the sequence into) the TP region; the
    output stays split along its last dim. Backward: the input gradient is all-reduced (or, under
    SP, reduce-scattered along the sequence). ``rows`` defaults to this rank's contiguous chunk.
    ``norm=(kind, eps, zero_centered_gamma)`` fuses that norm in front of the GEMM (backends with
    ``fuses_norm``).
    """

    def __init__(
        self,
        in_features,
        out_features,
        *,
        backend,
        name,
        tp_group,
        std,
        seed,
        bias=True,
        sequence_parallel=False,
        rows: torch.Tensor | None = None,
        weight_grad_group,
        dtype=torch.float32,
        device=None,
        fp8=True,
        norm: tuple[str, float, bool] | None = None,
    ):
        super().__init__()
        tp, r = M.world(tp_group), M.rank_in(tp_group)
        if norm is not None and sequence_parallel:
            raise ValueError(f"{name}: a fused norm would run on the gathered sequence under SP")
        if rows is None:
            if out_features % tp:
                raise ValueError(f"{name}: out_features={out_features} not divisible by tp={tp}")
            n = out_features // tp
            rows = torch.arange(r * n, (r + 1) * n)
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        if norm is None:
            self.linear = backend.make_linear(
                in_features,
                len(rows),
                bias,
                name=name,
                group=tp_group,
                fp8=fp8,
                dtype=dtype,
                device=device,
            )
        else:  # the norm over x (replicated across TP) fused with this GEMM
            self.linear = backend.make_norm_linear(
                in_features,
                len(rows),
                bias,
                normalization=norm[0],
                eps=norm[1],
                zero_centered_gamma=norm[2],
                fp8=fp8,
                dtype=dtype,
                device=device,
            )
            # The fused norm sees only this rank's share of its output gradient (the TP copy is
            # in front of it), so its weights get partial gradients: sum them over TP.
            for p in self.linear.norm_parameters():
                allreduce_grad_hook(p, tp_group)
        dev = self.linear.weight.device
        with torch.no_grad():
            full = full_normal((out_features, in_features), std, param_seed(seed, name), dev, dtype)
            self.linear.weight.copy_(full[rows.to(dev)])
            if self.linear.bias is not None:
                self.linear.bias.zero_()
        self.rows = rows
        params = [("weight", self.linear.weight), ("bias", self.linear.bias)]
        for kind, p in params:
            if p is None:
                continue
            if tp > 1 or len(rows) != out_features:
                mark_tp(p, 0, f"{name}.linear.{kind}", rows)
            else:
                mark_full(p, f"{name}.linear.{kind}")
            if M.world(weight_grad_group) > 1:  # rows replicated within weight_grad_group
                allreduce_grad_hook(p, weight_grad_group)
                # gradient-norm clipping counts a shard on every rank that marks it so, and an
                # unmarked parameter on TP rank 0 only: mark the first copy alone, so each
                # replicated row is counted once
                p.tensor_model_parallel = M.rank_in(weight_grad_group) == 0

    @property
    def weight(self):
        return self.linear.weight

    def forward(self, x):  # x: [s(/tp under SP), b, in] -> [s, b, out/tp]
        if self.sequence_parallel:
            lin = self.linear
            if lin.plain:  # torch's GEMM: run it here, saving the shard, not the gather
                return _SeqGatherLinear.apply(x, lin.weight, lin.bias, self.tp_group)
            x = M.gather_from_sequence_parallel_region(x, self.tp_group, True)
        else:
            x = M.copy_to_tensor_parallel_region(x, self.tp_group)
        return self.linear(x)


class RowParallelLinear(nn.Module):
    """y = x A^T + b with A split by columns (input features); x arrives split along its last dim.

    Forward: local GEMM, then all-reduce (or, under SP, reduce-scatter along the sequence), then the
    bias. Backward: identity (or all-gather along the sequence) for the gradient.
    """

    def __init__(
        self,
        in_features,
        out_features,
        *,
        backend,
        name,
        tp_group,
        std,
        seed,
        bias=True,
        sequence_parallel=False,
        dtype=torch.float32,
        device=None,
        fp8=True,
    ):
        super().__init__()
        tp, r = M.world(tp_group), M.rank_in(tp_group)
        if in_features % tp:
            raise ValueError(f"{name}: in_features={in_features} not divisible by tp={tp}")
        n = in_features // tp
        self.tp_group, self.sequence_parallel = tp_group, sequence_parallel
        # Without TP there is no reduction before the bias: the GEMM adds it (in its epilogue).
        fold = bias and tp == 1
        self.linear = backend.make_linear(
            n, out_features, fold, name=name, group=tp_group, fp8=fp8, dtype=dtype, device=device
        )
        dev = self.linear.weight.device
        with torch.no_grad():
            full = full_normal((out_features, in_features), std, param_seed(seed, name), dev, dtype)
            self.linear.weight.copy_(full[:, r * n : (r + 1) * n])
        if tp > 1:
            mark_tp(
                self.linear.weight, 1, f"{name}.linear.weight", torch.arange(r * n, (r + 1) * n)
            )
        else:
            mark_full(self.linear.weight, f"{name}.linear.weight")
        self.bias = None
        if fold:
            with torch.no_grad():
                self.linear.bias.zero_()
            mark_full(self.linear.bias, f"{name}.bias")
        elif bias:
            self.bias = mark_full(
                nn.Parameter(torch.zeros(out_features, dtype=dtype, device=dev)), f"{name}.bias"
            )
            if sequence_parallel:
                allreduce_grad_hook(self.bias, tp_group)

    @property
    def weight(self):
        return self.linear.weight

    def forward(self, x):  # x: [s, b, in/tp] -> [s(/tp under SP), b, out]
        y = self.linear(x)
        if self.sequence_parallel:
            y = M.reduce_scatter_to_sequence_parallel_region(y, self.tp_group)
        else:
            y = M.reduce_from_tensor_parallel_region(y, self.tp_group)
        return y if self.bias is None else y + self.bias


class VocabParallelEmbedding(nn.Module):
    """Embedding table split along the vocab: rank r holds rows [r*V/tp, (r+1)*V/tp).

    Forward: look up the tokens in this rank's range (others give zeros), all-reduce over TP.
    Backward: identity; each rank's rows receive only their tokens' gradients. With
    ``grad_in_place`` (set by the run where ``.grad`` accumulates untouched by hooks), those rows
    are added into ``.grad`` directly after the first micro-batch (``grad_in_place.py``).
    """

    grad_in_place = False

    def __init__(
        self, vocab_size, hidden, *, name, tp_group, std, seed, dtype=torch.float32, device=None
    ):
        super().__init__()
        tp, r = M.world(tp_group), M.rank_in(tp_group)
        if vocab_size % tp:
            raise ValueError(f"{name}: vocab_size={vocab_size} not divisible by tp={tp}")
        n = vocab_size // tp
        self.start, self.end, self.tp_group = r * n, (r + 1) * n, tp_group
        full = full_normal(
            (vocab_size, hidden), std, param_seed(seed, name), device or "cpu", dtype
        )
        self.weight = nn.Parameter(full[self.start : self.end].clone())
        if tp > 1:
            mark_tp(self.weight, 0, f"{name}.weight", torch.arange(self.start, self.end))
        else:
            mark_full(self.weight, f"{name}.weight")

    def forward(self, tokens):  # tokens: [b, s] or [s, b] -> [..., h]
        if M.world(self.tp_group) == 1:
            return embedding(tokens, self.weight, self.grad_in_place)
        outside = (tokens < self.start) | (tokens >= self.end)
        local = (tokens - self.start).masked_fill(outside, 0)
        out = embedding(local, self.weight, self.grad_in_place)  # [..., h]
        out = out.masked_fill(outside.unsqueeze(-1), 0.0)
        return M.reduce_from_tensor_parallel_region(out, self.tp_group)


class _VocabParallelCE(torch.autograd.Function):
    """Cross-entropy over logits split along the vocab, never gathering the full vocab.

    loss = log(sum_v exp(z_v - m)) - (z_t - m), with the max m, the sum and the target logit z_t
    each
    reduced over TP. Backward: softmax - onehot(target), on this rank's vocab slice.
    """

    @staticmethod
    def forward(ctx, logits, target, group, start):
        # One fp32 buffer [s, b, V/tp], worked in place: shifted logits, then exp, then softmax.
        z = logits.float()
        z = z.clone() if z.data_ptr() == logits.data_ptr() else z
        m = z.amax(dim=-1)
        M.all_reduce(m, group, op=torch.distributed.ReduceOp.MAX)
        z.sub_(m.unsqueeze(-1))  # [s, b, V/tp] - [s, b, 1]
        v = z.shape[-1]
        outside = (target < start) | (target >= start + v)
        local_t = (target - start).masked_fill(outside, 0)
        zt = z.gather(-1, local_t.unsqueeze(-1)).squeeze(-1).masked_fill(outside, 0.0)  # [s, b]
        e = z.exp_()
        s = e.sum(dim=-1)
        both = torch.stack([zt, s])
        M.all_reduce(both, group)
        zt, s = both[0], both[1]
        loss = s.log() - zt
        e.div_(s.unsqueeze(-1))  # softmax [s, b, V/tp]
        ctx.save_for_backward(e, local_t, outside)
        ctx.dtype = logits.dtype
        return loss

    @staticmethod
    def backward(ctx, g):
        softmax, local_t, outside = ctx.saved_tensors
        grad = softmax
        onehot = (~outside).to(grad.dtype)
        grad.scatter_add_(-1, local_t.unsqueeze(-1), -onehot.unsqueeze(-1))  # - onehot [s, b, 1]
        grad.mul_(g.unsqueeze(-1))  # [s, b, V/tp] * [s, b, 1]
        return grad.to(ctx.dtype), None, None, None


def vocab_parallel_cross_entropy(logits, target, tp_group, fused=False, inplace=False):
    """Per-token loss from logits ``[..., V/tp]`` (this rank's vocab slice) and full targets.
    ``fused``: the Triton kernels where they can run (CUDA), else this module's torch version;
    ``inplace``: the fused backward may overwrite the logits with their gradient."""
    start = M.rank_in(tp_group) * logits.shape[-1]
    if fused and fce.available(logits):
        return fce.fused_vocab_parallel_cross_entropy(logits, target, tp_group, start, inplace)
    return _VocabParallelCE.apply(logits, target, tp_group, start)
