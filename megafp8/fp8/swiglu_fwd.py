"""The SwiGLU forward with its FP8 cast and its transpose in one Triton kernel (te backend,
delayed scaling; ``--te-fused-swiglu``).

In te.LayerNormMLP's FP8 forward, TE's ``swiglu`` reads fc1's output ([tokens, 2 * ffn], bf16)
and writes fc2's FP8 input row-wise with its amax; where the backward needs the column-wise copy
(fc2's weight-gradient GEMM on Hopper reads the transpose), TE's core then runs a separate
transpose that reads that FP8 tensor back and writes it transposed. At the Llama-3-8B shape
(8192 tokens, ffn 14336) that is 117 MB read again and one more launch per layer and
micro-batch. Here one kernel reads fc1's output once and writes both copies: TE's arithmetic in
TE's order (fp32, ``expf``, IEEE division: ``y = (a / (1 + exp(-a))) * gate``, the amax of
``|y|``, ``y * scale`` saturated and rounded to nearest even), so that the bytes, the amax and
``scale_inv`` are TE's (tests/gpu/test_swiglu_fwd_gpu.py compares them byte for byte).

``install(True)`` puts ``swiglu_quantize`` as swiglu's forward in TE's table for delayed scaling
(fp8/dswiglu.py keeps that table); calls it does not cover (no quantizer, another quantizer, a
CPU tensor, no Triton) take TE's ``swiglu``. As with the fused backward, the first call of a
process runs both ways on its operands and compares the bytes at the run's scale and at one
that spreads the values over the whole FP8 range; on a difference TE's kernel takes over, with a
warning.
"""

from __future__ import annotations

import os

import torch

from megafp8.fp8 import dswiglu
from megafp8.fp8.dswiglu import _HAVE_TRITON, _torch_fp8

if _HAVE_TRITON:
    import triton
    import triton.language as tl

    from megafp8.fp8.dswiglu import sigmoid, store_fp8, store_scale_inv, to_fp8

    @triton.jit
    def _swiglu_cast_transpose_kernel(
        x_ptr,  # [M, 2N] fc1's output: [activation input | gate]
        out_ptr,  # [M, N] FP8, row-wise
        out_t_ptr,  # [N, M] FP8, column-wise (transposed)
        scale_ptr,
        amax_ptr,
        scale_inv_ptr,
        M,
        N,
        BM: tl.constexpr,
        BN: tl.constexpr,
        ROWWISE: tl.constexpr,
        COLWISE: tl.constexpr,
        FMAX: tl.constexpr,
        RCP: tl.constexpr,  # 1 / y as the correctly rounded reciprocal (the same value as div_rn)
        TRANS: tl.constexpr,  # the column-wise copy stored from an explicitly transposed tile
        CLAMP: tl.constexpr,  # saturate before the cast (the cast itself saturates where it can)
    ):
        pm = tl.program_id(0)
        pn = tl.program_id(1)
        rows = pm * BM + tl.arange(0, BM)
        cols = pn * BN + tl.arange(0, BN)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        xa = x_ptr + rows.to(tl.int64)[:, None] * (2 * N) + cols[None, :]
        a = tl.load(xa, mask=mask, other=0.0).to(tl.float32)
        b = tl.load(xa + N, mask=mask, other=0.0).to(tl.float32)
        y = (a * sigmoid(a, RCP)) * b  # TE's silu(a) * gate in fp32
        tl.atomic_max(amax_ptr, tl.max(tl.max(tl.abs(y), 1), 0))
        q = to_fp8(y, tl.load(scale_ptr), out_ptr, FMAX, CLAMP)
        store_fp8(out_ptr, out_t_ptr, q, rows, cols, 0, N, M, N, ROWWISE, COLWISE, TRANS)
        if (pm == 0) & (pn == 0):
            store_scale_inv(scale_ptr, scale_inv_ptr, BN)


# the launch: tile rows and columns, warps, the reciprocal by rcp_rn, the transposed store, the
# saturation before the cast (keys and their meaning as fp8/dswiglu.py's)
CONFIG = {"BM": 32, "BN": 128, "WARPS": 4, "RCP": True, "TRANS": False, "CLAMP": True}
LAUNCH_ENV = "MEGAFP8_SWIGLU_LAUNCH"
CONFIG.update(dswiglu.parse_launch(os.environ.get(LAUNCH_ENV, ""), CONFIG, LAUNCH_ENV))


def fits(x: torch.Tensor, quantizer) -> bool:
    """A 16-bit float input with an even last dimension, and TE's delayed-scaling quantizer (one
    scale per tensor)."""
    if x.dtype not in (torch.bfloat16, torch.float16) or x.dim() < 1 or x.shape[-1] % 2:
        return False
    return type(quantizer).__name__ == "Float8Quantizer" and _torch_fp8(quantizer) is not None


def available(x: torch.Tensor, quantizer) -> bool:
    """The kernel applies: Triton, a CUDA tensor with elements, and ``fits``."""
    return _HAVE_TRITON and x.is_cuda and x.numel() > 0 and fits(x, quantizer)


def _te(x, quantizer):
    import transformer_engine.pytorch  # noqa: F401 (loads TE's core library first)
    import transformer_engine_torch as tex

    return tex.swiglu(x, quantizer)


def _fused(x, quantizer, config=None):
    """The kernel: the FP8 tensor TE's ``swiglu(x, quantizer)`` returns."""
    c = {**CONFIG, **(config or {})}
    n = x.shape[-1] // 2
    x2 = x.reshape(-1, 2 * n).contiguous()
    m = x2.shape[0]
    out, data, data_t = dswiglu.fp8_out(quantizer, [*x.shape[:-1], n], x)
    grid = (triton.cdiv(m, c["BM"]), triton.cdiv(n, c["BN"]))
    _swiglu_cast_transpose_kernel[grid](
        x2, data, data_t, quantizer.scale, quantizer.amax, out._scale_inv, m, n,
        **dswiglu.launch_args(c, data, data_t),
    )  # fmt: skip
    if data_t.numel():
        out._transpose_invalid = False
    return out


def _same_bytes(x, quantizer, **kw) -> str | None:
    """``dswiglu.same_bytes`` for this kernel and TE's on one call's input."""
    return dswiglu.same_bytes(lambda q: _te(x, q), lambda q: _fused(x, q, **kw), quantizer)


# (activation dtype, FP8 dtype) -> whether the kernel wrote TE's bytes on its first call
_checked: dict[tuple, bool] = {}


def swiglu_quantize(x: torch.Tensor, quantizer, **_):
    """fc2's FP8 input from fc1's output ``x`` [..., 2N], as TE's ``swiglu(x, quantizer)``
    returns it. The first call for each pair of dtypes compares the kernel's bytes with TE's
    (fp8/dswiglu.py: ``checked``); until a call has checked them, and after a difference, TE's
    kernel makes the call."""
    if quantizer is None or not available(x, quantizer):
        return _te(x, quantizer)
    key = (x.dtype, _torch_fp8(quantizer))
    ok = dswiglu.checked(_checked, key, lambda: _same_bytes(x, quantizer),
                         "fused SwiGLU forward", "--no-te-fused-swiglu")  # fmt: skip
    return _fused(x, quantizer) if ok else _te(x, quantizer)


def install(enabled: bool) -> bool:
    """Put (or take back) ``swiglu_quantize`` as swiglu's forward in TE's LayerNormMLP for
    delayed scaling. Returns whether it is in place."""
    return dswiglu.install_forward(swiglu_quantize if enabled else None)
