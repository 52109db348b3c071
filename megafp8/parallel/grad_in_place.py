"""Gradients added into a parameter's ``.grad`` in place, out of autograd's sight, on every
micro-batch after the first (when ``.grad`` exists): the word embedding's rows, and the output
layer's weight gradient under gradient accumulation fusion.

**Embedding.** Autograd's embedding backward makes a dense ``[V, h]`` gradient for every
micro-batch (zeros, then the rows of this micro-batch's tokens) and gradient accumulation then
adds it to ``.grad``: per micro-batch a write, a scatter and a read-read-write pass over the
whole table (~4 GB on a 128k x 4096 bf16 table) although only the rows of the micro-batch's
tokens change. Here the tokens are sorted (stable: within a token, in position order), each
token's gradient rows are summed in fp32 in that order, rounded to the weight's dtype and added
to its row of ``.grad``: the same two roundings as the dense gradient and its add, touching
only those rows. One Triton kernel on CUDA; the same arithmetic in torch ops elsewhere.
Deterministic (no atomics).

**Output layer** (``linear``, with ``--gradient-accumulation-fusion``, as Megatron-LM fuses its
output layer's accumulation): the weight gradient GEMM adds into ``.grad`` (``addmm_``: fp32
accumulation inside the GEMM, one rounding) instead of writing a fresh ``[V, h]`` gradient
that accumulation then adds.

Only where ``.grad`` is read once, at the accumulation boundary, and no gradient hook must see
each micro-batch's gradient (``optim.zero.grads_accumulate_in_param``): the backward hands
autograd no gradient for the weight on those micro-batches.
"""

from __future__ import annotations

import importlib.util

import torch
import torch.nn.functional as F

_HAVE_TRITON = importlib.util.find_spec("triton") is not None
if _HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _add_rows_kernel(grad_ptr, g_ptr, ids_ptr, perm_ptr, end_ptr, h, BLOCK: tl.constexpr):
        """Program (i, c): when sorted position i starts a token's run [i, end[i]), that
        token's gradient rows summed in fp32, rounded, added into its row of ``grad``."""
        i = tl.program_id(0)
        cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
        cmask = cols < h
        row = tl.load(ids_ptr + i)
        prev = tl.load(ids_ptr + i - 1, mask=i > 0, other=-1)
        if row != prev:
            end = tl.load(end_ptr + i)
            acc = tl.zeros([BLOCK], dtype=tl.float32)
            j = i
            while j < end:
                src = tl.load(perm_ptr + j)
                acc += tl.load(g_ptr + src * h + cols, mask=cmask, other=0.0).to(tl.float32)
                j += 1
            dt = grad_ptr.dtype.element_ty
            dst = grad_ptr + row * h + cols
            old = tl.load(dst, mask=cmask, other=0.0).to(tl.float32)
            tl.store(dst, (old + acc.to(dt).to(tl.float32)).to(dt), mask=cmask)


def _runs(ids: torch.Tensor):
    """Stable sort of the flat token ids -> (sorted ids, their positions, for each sorted
    position the end of the run of equal ids it belongs to), without a host wait."""
    s, perm = torch.sort(ids.reshape(-1), stable=True)
    n = s.numel()
    pos = torch.arange(n, device=s.device)
    start = torch.ones(n, dtype=torch.bool, device=s.device)
    start[1:] = s[1:] != s[:-1]
    # the next start after each position (n past the last): a reversed running minimum
    nxt = torch.full((n,), n, dtype=torch.long, device=s.device)
    nxt[:-1] = torch.where(start[1:], pos[1:], n)
    end = torch.flip(torch.cummin(torch.flip(nxt, [0]), 0).values, [0])
    return s, perm, end, start


def add_rows(grad: torch.Tensor, ids: torch.Tensor, g: torch.Tensor) -> None:
    """``grad[t] += round(sum of g's rows whose id is t)`` for each id t in ``ids``; ``g`` is
    ``[*ids.shape, h]``. The Triton kernel on CUDA, torch ops with the same order elsewhere."""
    h = grad.shape[1]
    g = g.reshape(-1, h)
    s, perm, end, start = _runs(ids)
    if grad.is_cuda and _HAVE_TRITON:
        g = g.contiguous()
        block = min(1024, triton.next_power_of_2(h))
        grid = (s.numel(), triton.cdiv(h, block))
        _add_rows_kernel[grid](grad, g, s, perm, end, h, BLOCK=block, num_warps=4)
        return
    run = torch.cumsum(start, 0) - 1  # each sorted position's run
    sums = torch.zeros(int(run[-1]) + 1, h, dtype=torch.float32, device=g.device)
    sums.index_add_(0, run, g[perm].float())  # in sorted order: within a run, position order
    grad.index_add_(0, s[start], sums.to(grad.dtype))


class _Embedding(torch.autograd.Function):
    @staticmethod
    def forward(ctx, ids, weight):
        ctx.save_for_backward(ids)
        ctx.weight = weight
        return F.embedding(ids, weight)

    @staticmethod
    def backward(ctx, g):
        (ids,) = ctx.saved_tensors
        w = ctx.weight
        if w.grad is None:  # the first micro-batch: autograd's dense gradient becomes .grad
            return None, torch.ops.aten.embedding_backward(g, ids, w.shape[0], -1, False, False)
        add_rows(w.grad, ids, g)
        return None, None


def embedding(ids: torch.Tensor, weight: torch.Tensor, grad_in_place: bool) -> torch.Tensor:
    """``F.embedding(ids, weight)``; with ``grad_in_place`` and gradients enabled, its weight
    gradient is added into ``weight.grad`` where that exists (module docstring)."""
    if grad_in_place and torch.is_grad_enabled() and weight.requires_grad:
        return _Embedding.apply(ids, weight)
    return F.embedding(ids, weight)


class _Linear(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight):
        ctx.save_for_backward(x)
        ctx.weight = weight  # the parameter itself: its .grad is read in backward
        return F.linear(x, weight)

    @staticmethod
    def backward(ctx, g):
        (x,) = ctx.saved_tensors
        w = ctx.weight
        dx = g @ w if ctx.needs_input_grad[0] else None
        g2, x2 = g.reshape(-1, g.shape[-1]), x.reshape(-1, x.shape[-1])
        if w.grad is None:  # the first micro-batch: a fresh gradient becomes .grad
            return dx, g2.t() @ x2
        w.grad.addmm_(g2.t(), x2)
        return dx, None


def linear(x: torch.Tensor, weight: torch.Tensor, grad_in_place: bool) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias); with ``grad_in_place`` and gradients enabled, the
    weight gradient GEMM adds into ``weight.grad`` where that exists (module docstring)."""
    if grad_in_place and torch.is_grad_enabled() and weight.requires_grad:
        return _Linear.apply(x, weight)
    return F.linear(x, weight)
