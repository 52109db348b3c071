"""Vocab-parallel cross-entropy in two Triton kernels, one read of the logits each way.

The unfused loss (``layers._VocabParallelCE``) makes an fp32 copy of the ``[tokens, V/tp]`` logits
and passes over it about ten times (max, shift, exp, sum, divide; scatter, scale, cast back); at
8k tokens x 50k vocab that is ~20 GB of memory traffic per micro-batch. Here:

- forward: one kernel per row streams the logits (any dtype, math in fp32) and keeps a running
  max ``m``, the running ``sum exp(z - m)`` and the target's logit when it falls in this rank's
  slice. Across TP ranks the three per-row numbers are combined (a MAX and a SUM all-reduce of
  ``[tokens]`` vectors): ``lse = M + log(sum_r d_r exp(m_r - M))``, ``loss = lse - z_target``.
- backward: one kernel per row writes ``(softmax(z) - onehot(target)) * grad`` from the saved
  logits and ``lse``, in the logits' dtype, in place into the logits buffer when the caller
  allows it (the logits are needed by nothing else).

Only the logits themselves and two fp32 numbers per token are kept for backward.
"""

from __future__ import annotations

import importlib.util

import torch

from megafp8.parallel import mappings as M

_HAVE_TRITON = importlib.util.find_spec("triton") is not None
if _HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _ce_forward_kernel(
        logits_ptr, stride, target_ptr, start, n_cols, m_ptr, d_ptr, zt_ptr, BLOCK: tl.constexpr
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        t = tl.load(target_ptr + row) - start
        inside = (t >= 0) & (t < n_cols)
        zt = tl.load(base + tl.where(inside, t, 0)).to(tl.float32)
        zt = tl.where(inside, zt, 0.0)
        m = -float("inf")
        d = 0.0
        for off in range(0, n_cols, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            z = tl.load(base + cols, mask=cols < n_cols, other=-float("inf")).to(tl.float32)
            m_new = tl.maximum(m, tl.max(z, axis=0))
            d = d * tl.exp(m - m_new) + tl.sum(tl.exp(z - m_new), axis=0)
            m = m_new
        tl.store(m_ptr + row, m)
        tl.store(d_ptr + row, d)
        tl.store(zt_ptr + row, zt)

    @triton.jit
    def _ce_backward_kernel(
        logits_ptr,
        stride,
        out_ptr,
        out_stride,
        target_ptr,
        start,
        n_cols,
        lse_ptr,
        grad_ptr,
        BLOCK: tl.constexpr,
    ):
        row = tl.program_id(0).to(tl.int64)
        base = logits_ptr + row * stride
        out = out_ptr + row * out_stride
        t = tl.load(target_ptr + row) - start
        lse = tl.load(lse_ptr + row)
        g = tl.load(grad_ptr + row)
        for off in range(0, n_cols, BLOCK):
            cols = off + tl.arange(0, BLOCK)
            mask = cols < n_cols
            z = tl.load(base + cols, mask=mask, other=0.0).to(tl.float32)
            p = tl.exp(z - lse) - tl.where(cols == t, 1.0, 0.0)
            tl.store(out + cols, (p * g).to(out_ptr.dtype.element_ty), mask=mask)


def available(logits: torch.Tensor) -> bool:
    """Whether the fused kernels can take these logits (CUDA, Triton importable, rows dense)."""
    return _HAVE_TRITON and logits.is_cuda and logits.stride(-1) == 1


_BLOCK = 4096
_WARPS = 8


class _FusedVocabParallelCE(torch.autograd.Function):
    @staticmethod
    def forward(ctx, logits, target, group, start, inplace):
        v = logits.shape[-1]
        z = logits.reshape(-1, v)  # a view for [s, b, v] contiguous logits
        t = target.reshape(-1).contiguous()  # [s*b]
        n = z.shape[0]
        m = torch.empty(n, device=z.device, dtype=torch.float32)
        d, zt = torch.empty_like(m), torch.empty_like(m)
        if n:
            _ce_forward_kernel[(n,)](
                z, z.stride(0), t, start, v, m, d, zt, BLOCK=_BLOCK, num_warps=_WARPS
            )
        if M.world(group) > 1:
            mx = m.clone()
            M.all_reduce(mx, group, op=torch.distributed.ReduceOp.MAX)
            both = torch.stack([d * torch.exp(m - mx), zt])
            M.all_reduce(both, group)
            lse = mx + both[0].log()
            zt = both[1]
        else:
            lse = m + d.log()
        ctx.save_for_backward(z, t, lse)
        ctx.start, ctx.inplace, ctx.shape = start, inplace, logits.shape
        return (lse - zt).reshape(target.shape)  # [s*b] -> [s, b]

    @staticmethod
    def backward(ctx, g):
        z, t, lse = ctx.saved_tensors
        out = z if ctx.inplace else torch.empty_like(z)
        g = g.reshape(-1).float().contiguous()  # [s*b]
        n, v = z.shape
        if n:
            _ce_backward_kernel[(n,)](
                z,
                z.stride(0),
                out,
                out.stride(0),
                t,
                ctx.start,
                v,
                lse,
                g,
                BLOCK=_BLOCK,
                num_warps=_WARPS,
            )
        return out.reshape(ctx.shape), None, None, None, None  # [s*b, V/tp] -> [s, b, V/tp]


def fused_vocab_parallel_cross_entropy(logits, target, group, start, inplace=False):
    """Per-token loss ``[...]`` from this rank's logits slice ``[..., V/tp]`` starting at vocab
    id ``start``. ``inplace``: the gradient overwrites the logits (the caller keeps no use of
    them)."""
    return _FusedVocabParallelCE.apply(logits, target, group, start, inplace)
