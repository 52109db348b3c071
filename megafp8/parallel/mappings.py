"""Autograd collectives over an explicit group (Megatron's mappings, groups passed in).

Tensor-parallel (TP) regions split the last dim; sequence-parallel (SP) regions split dim 0 of the
sequence-first ``[s, b, h]`` activations. A group of size 1 communicates nothing; one process alone
(no torch.distributed) passes ``SOLO``. ``None`` is not a group: a forgotten group is an error.
On gloo, which has no reduce-scatter, reduce-scatter is an all-reduce followed by taking this rank's
chunk: the same numbers, more traffic (CPU tests only; NCCL uses the real collective).
"""

from __future__ import annotations

import torch
import torch.distributed as dist


class _Solo:
    """The group of this process alone, usable without torch.distributed."""

    def __repr__(self) -> str:
        return "SOLO"


SOLO = _Solo()


def world(group) -> int:
    """The size of ``group`` (1 for ``SOLO``); ``None`` raises TypeError."""
    if group is SOLO:
        return 1
    if group is None:
        raise TypeError("no process group given (None); one process alone is mappings.SOLO")
    return dist.get_world_size(group)


def rank_in(group) -> int:
    return 0 if world(group) == 1 else dist.get_rank(group)


def _is_gloo(group) -> bool:
    return dist.get_backend(group) == "gloo"


def all_reduce(x: torch.Tensor, group, op=dist.ReduceOp.SUM) -> torch.Tensor:
    if world(group) > 1:
        dist.all_reduce(x, op=op, group=group)
    return x


def _all_gather(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = world(group)
    if n == 1:
        return x
    x = x.contiguous()
    if dim == 0 and not _is_gloo(group):
        out = torch.empty((n * x.shape[0], *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.all_gather_into_tensor(out, x, group=group)
        return out
    parts = [torch.empty_like(x) for _ in range(n)]
    dist.all_gather(parts, x, group=group)
    return torch.cat(parts, dim=dim)


def _split(x: torch.Tensor, group, dim: int) -> torch.Tensor:
    n = world(group)
    if n == 1:
        return x
    if x.shape[dim] % n:
        raise ValueError(f"dim {dim} of size {x.shape[dim]} is not divisible by the group size {n}")
    # clone: a dim-0 chunk is already contiguous, and a view would keep the whole tensor alive
    # this rank's 1/n of dim ``dim``
    return x.chunk(n, dim=dim)[rank_in(group)].clone(memory_format=torch.contiguous_format)


def _reduce_scatter(x: torch.Tensor, group, dim: int = 0) -> torch.Tensor:
    n = world(group)
    if n == 1:
        return x
    if dim == 0 and not _is_gloo(group):
        x = x.contiguous()
        out = torch.empty((x.shape[0] // n, *x.shape[1:]), dtype=x.dtype, device=x.device)
        dist.reduce_scatter_tensor(out, x, group=group)
        return out
    x = x.clone()
    dist.all_reduce(x, group=group)
    return _split(x, group, dim)


class _Copy(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return x

    @staticmethod
    def backward(ctx, g):
        return all_reduce(g.clone(), ctx.group), None


class _Reduce(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        return all_reduce(x.clone(), group)

    @staticmethod
    def backward(ctx, g):
        return g, None


class _Scatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, -1)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.group, -1), None


class _Gather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _all_gather(x, group, -1)

    @staticmethod
    def backward(ctx, g):
        return _split(g, ctx.group, -1), None


class _ScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _split(x, group, 0)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.group, 0), None


class _GatherSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group, tensor_parallel_output_grad):
        ctx.group, ctx.tp_grad = group, tensor_parallel_output_grad
        return _all_gather(x, group, 0)

    @staticmethod
    def backward(ctx, g):
        if ctx.tp_grad:
            return _reduce_scatter(g, ctx.group, 0), None, None
        return _split(g, ctx.group, 0), None, None


class _ReduceScatterSeq(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group, 0)

    @staticmethod
    def backward(ctx, g):
        return _all_gather(g, ctx.group, 0), None


def copy_to_tensor_parallel_region(x, group):
    """Forward: identity. Backward: all-reduce (sum) of the gradient over ``group``."""
    return x if world(group) == 1 else _Copy.apply(x, group)


def reduce_from_tensor_parallel_region(x, group):
    """Forward: all-reduce (sum) over ``group``. Backward: identity."""
    return x if world(group) == 1 else _Reduce.apply(x, group)


def scatter_to_tensor_parallel_region(x, group):
    """Forward: keep this rank's chunk of the last dim. Backward: all-gather along the last dim."""
    return x if world(group) == 1 else _Scatter.apply(x, group)


def gather_from_tensor_parallel_region(x, group):
    """Forward: all-gather along the last dim. Backward: keep this rank's chunk of the gradient."""
    return x if world(group) == 1 else _Gather.apply(x, group)


def scatter_to_sequence_parallel_region(x, group):
    """Forward: keep this rank's chunk of dim 0 (sequence). Backward: all-gather along dim 0."""
    return x if world(group) == 1 else _ScatterSeq.apply(x, group)


def gather_from_sequence_parallel_region(x, group, tensor_parallel_output_grad: bool = True):
    """Forward: all-gather along dim 0. Backward: reduce-scatter along dim 0 when the gathered
    tensor fed TP-split compute (each rank holds a partial gradient), else split."""
    return x if world(group) == 1 else _GatherSeq.apply(x, group, tensor_parallel_output_grad)


def reduce_scatter_to_sequence_parallel_region(x, group):
    """Forward: reduce-scatter (sum) along dim 0. Backward: all-gather along dim 0."""
    return x if world(group) == 1 else _ReduceScatterSeq.apply(x, group)
