"""The grouped QKV output split into q, k, v with RoPE on q and k: one Triton kernel each way.

The te backend's attention takes q [s, b, g * hpg, hd], k and v [s, b, g, hd], each contiguous,
from the QKV output [s, b, g, (hpg + 2) * hd] (per group: hpg query heads, one key, one value).
One program per token reads that token's whole row once, rotates the query and key heads in fp32
(Megatron's non-interleaved, rotate-half layout: ``x cos + (-x2, x1) sin``) and writes the three
outputs, rounding once. The backward reads dq, dk, dv of the token, applies the inverse rotation
(``dy cos + (dy2, -dy1) sin``) and writes the token's row of the QKV gradient, again rounding
once. The cosines and sines are computed in the kernel from the fp32 angles with libdevice's
full-range ``cos`` / ``sin`` (positions reach 10^5 radians, beyond fast-math approximations).

The angles are [s, 1, 1, hd] (one row per position, shared by the batch) or [s, b, 1, hd] (one
row per token: per-sample positions of packed documents).
"""

from __future__ import annotations

import importlib.util

import torch

_HAVE_TRITON = importlib.util.find_spec("triton") is not None
if _HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def _tables(ang_ptr, t, div, c, HALF: tl.constexpr, cmask):
        row = ang_ptr + (t // div) * (2 * HALF)
        a1 = tl.load(row + c, mask=cmask, other=0.0)
        a2 = tl.load(row + HALF + c, mask=cmask, other=0.0)
        return libdevice.cos(a1), libdevice.sin(a1), libdevice.cos(a2), libdevice.sin(a2)

    @triton.jit
    def _load(rows, c, HALF: tl.constexpr, mask):
        x1 = tl.load(rows[:, None] + c[None, :], mask=mask, other=0.0).to(tl.float32)
        x2 = tl.load(rows[:, None] + HALF + c[None, :], mask=mask, other=0.0).to(tl.float32)
        return x1, x2

    @triton.jit
    def _store(rows, c, HALF: tl.constexpr, y1, y2, mask):
        tl.store(rows[:, None] + c[None, :], y1, mask=mask)
        tl.store(rows[:, None] + HALF + c[None, :], y2, mask=mask)

    @triton.jit
    def _forward_kernel(
        qkv_ptr,
        ang_ptr,
        q_ptr,
        k_ptr,
        v_ptr,
        div,
        G,
        HPG: tl.constexpr,
        HALF: tl.constexpr,
        HALF_P: tl.constexpr,
        ROWS: tl.constexpr,
        HP: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        hd: tl.constexpr = 2 * HALF
        r = tl.arange(0, ROWS)
        g, h = r // HP, r % HP  # group, head within the group (hpg queries, key, value)
        c = tl.arange(0, HALF_P)
        cmask = c < HALF
        ok = (g < G) & (h < HPG + 2)
        if HALF_P == HALF:
            m = ok[:, None]  # rows only: the columns stay contiguous for vector access
        else:
            m = ok[:, None] & cmask[None, :]
        src = qkv_ptr + t * G * (HPG + 2) * hd + (g * (HPG + 2) + h) * hd
        x1, x2 = _load(src, c, HALF, m)
        cos1, sin1, cos2, sin2 = _tables(ang_ptr, t, div, c, HALF, cmask)
        rot = (h < HPG + 1)[:, None]
        y1 = tl.where(rot, x1 * cos1[None, :] - x2 * sin1[None, :], x1)
        y2 = tl.where(rot, x2 * cos2[None, :] + x1 * sin2[None, :], x2)
        # three stores, each whole rows masked, so that each keeps its vectorized addresses
        qd = q_ptr + t * G * HPG * hd + (g * HPG + h) * hd
        kd = k_ptr + t * G * hd + g * hd
        vd = v_ptr + t * G * hd + g * hd
        y1, y2 = y1.to(q_ptr.dtype.element_ty), y2.to(q_ptr.dtype.element_ty)
        _store(qd, c, HALF, y1, y2, m & (h < HPG)[:, None])
        _store(kd, c, HALF, y1, y2, m & (h == HPG)[:, None])
        _store(vd, c, HALF, y1, y2, m & (h == HPG + 1)[:, None])

    @triton.jit
    def _backward_kernel(
        dq_ptr,
        dk_ptr,
        dv_ptr,
        ang_ptr,
        dqkv_ptr,
        div,
        G,
        HPG: tl.constexpr,
        HALF: tl.constexpr,
        HALF_P: tl.constexpr,
        ROWS: tl.constexpr,
        HP: tl.constexpr,
    ):
        t = tl.program_id(0).to(tl.int64)
        hd: tl.constexpr = 2 * HALF
        r = tl.arange(0, ROWS)
        g, h = r // HP, r % HP
        c = tl.arange(0, HALF_P)
        cmask = c < HALF
        ok = (g < G) & (h < HPG + 2)
        if HALF_P == HALF:
            m = ok[:, None]  # rows only: the columns stay contiguous for vector access
        else:
            m = ok[:, None] & cmask[None, :]
        qs = dq_ptr + t * G * HPG * hd + (g * HPG + h) * hd
        ks = dk_ptr + t * G * hd + g * hd
        vs = dv_ptr + t * G * hd + g * hd
        # three loads, each whole rows masked (vectorized addresses), summed
        q1, q2 = _load(qs, c, HALF, m & (h < HPG)[:, None])
        k1, k2 = _load(ks, c, HALF, m & (h == HPG)[:, None])
        v1, v2 = _load(vs, c, HALF, m & (h == HPG + 1)[:, None])
        d1, d2 = q1 + k1 + v1, q2 + k2 + v2
        cos1, sin1, cos2, sin2 = _tables(ang_ptr, t, div, c, HALF, cmask)
        rot = (h < HPG + 1)[:, None]
        x1 = tl.where(rot, d1 * cos1[None, :] + d2 * sin2[None, :], d1)
        x2 = tl.where(rot, d2 * cos2[None, :] - d1 * sin1[None, :], d2)
        dst = dqkv_ptr + t * G * (HPG + 2) * hd + (g * (HPG + 2) + h) * hd
        tl.store(dst[:, None] + c[None, :], x1.to(dqkv_ptr.dtype.element_ty), mask=m)
        tl.store(dst[:, None] + HALF + c[None, :], x2.to(dqkv_ptr.dtype.element_ty), mask=m)


def available(qkv: torch.Tensor) -> bool:
    """Triton is installed and the tensor is on a GPU."""
    return _HAVE_TRITON and qkv.is_cuda


def _launch_args(g: int, hpg: int, hd: int) -> dict:
    """One token per program, its heads padded to powers of two; ~64 fp32 values of each half
    tile per thread (H100, Llama's 8 groups x 6 heads x 128: 2 warps ran both kernels in 70 us
    against 98-130 us at 8 warps; 32 groups x 3 heads: 4 warps)."""
    hp = triton.next_power_of_2(hpg + 2)
    rows = triton.next_power_of_2(g) * hp
    half_p = triton.next_power_of_2(hd // 2)
    warps = min(16, max(1, rows * half_p // 2048))
    return dict(HPG=hpg, HALF=hd // 2, HALF_P=half_p, ROWS=rows, HP=hp, num_warps=warps)


class _SplitQKVRope(torch.autograd.Function):
    @staticmethod
    def forward(ctx, qkv, angles, hpg):
        s, b, g, width = qkv.shape
        hd = width // (hpg + 2)
        qkv, angles = qkv.contiguous(), angles.contiguous().float()
        q = qkv.new_empty(s, b, g * hpg, hd)
        k, v = qkv.new_empty(s, b, g, hd), qkv.new_empty(s, b, g, hd)
        div = b if angles.shape[1] == 1 else 1  # shared rows, or one row per token
        _forward_kernel[(s * b,)](qkv, angles, q, k, v, div, g, **_launch_args(g, hpg, hd))
        ctx.save_for_backward(angles)
        ctx.shape, ctx.hpg, ctx.div = qkv.shape, hpg, div
        return q, k, v

    @staticmethod
    def backward(ctx, dq, dk, dv):
        (angles,) = ctx.saved_tensors
        s, b, g, width = ctx.shape
        hpg, hd = ctx.hpg, width // (ctx.hpg + 2)
        like = next(t for t in (dq, dk, dv) if t is not None)
        dq, dk, dv = (
            torch.zeros(s, b, n, hd, dtype=like.dtype, device=like.device) if t is None
            else t.contiguous()
            for t, n in ((dq, g * hpg), (dk, g), (dv, g))
        )  # fmt: skip
        dqkv = like.new_empty(ctx.shape)
        _backward_kernel[(s * b,)](dq, dk, dv, angles, dqkv, ctx.div, g, **_launch_args(g, hpg, hd))
        return dqkv, None, None


def split_qkv_rope(qkv: torch.Tensor, angles: torch.Tensor, heads_per_group: int):
    """qkv [s, b, g, (hpg + 2) * hd] on a GPU, angles fp32 [s, 1, 1, hd] or [s, b, 1, hd] ->
    q [s, b, g * hpg, hd], k and v [s, b, g, hd] (each contiguous), RoPE on q and k."""
    s, b, g, width = qkv.shape
    hd = width // (heads_per_group + 2)
    if width != (heads_per_group + 2) * hd or hd % 2 or angles.shape[-1] != hd:
        raise ValueError(
            f"split_qkv_rope: qkv width {width} is not (heads_per_group {heads_per_group} + 2) x "
            f"an even head dim matching the angles' {angles.shape[-1]}"
        )
    if angles.shape[0] != s or angles.shape[1] not in (1, b):
        raise ValueError(f"split_qkv_rope: angles {tuple(angles.shape)} for qkv {tuple(qkv.shape)}")
    return _SplitQKVRope.apply(qkv, angles, heads_per_group)
