"""The SwiGLU backward, its FP8 cast and its transpose in one Triton kernel (te backend, delayed
scaling).

In te.LayerNormMLP's backward the gradient of fc1's output is made in two passes over memory:
TE's ``dswiglu`` writes it in bf16 ([tokens, 2 * ffn]), then ``bgrad_quantize`` reads it back and
writes the FP8 copy fc1's dgrad GEMM reads (row-wise) and the transposed one its wgrad GEMM
reads (column-wise), with the amax and the bias gradient. At the Llama-3-8B shape (8192 tokens,
ffn 14336) that bf16 tensor is 470 MB written and read again per layer and micro-batch. Here one
kernel reads fc2's dgrad and fc1's output once and writes both FP8 copies: the same arithmetic
in the same order as TE's two kernels (fp32, ``expf``, IEEE division, each gradient rounded to
the activation dtype before it is scaled), so that the FP8 bytes, the amax and ``scale_inv``
are TE's (tests/gpu/test_dswiglu_gpu.py compares them byte for byte). The bias gradient is a
column sum in another order than TE's: equal to rounding, not byte for byte.

On by default (``--no-te-fused-dswiglu`` keeps TE's kernels): on an H100 it writes TE's bytes
and takes 0.511 ms where TE's two kernels take 0.726 at the Llama shape (BENCHMARKS.md).
Without fc1 biases (the te backend says so through ``biased_mlp``) the bias gradient, which TE
computes and drops, is not written.
``install(True)`` puts ``dswiglu_quantize`` in TE's table of fused activation backwards for
delayed scaling (TE has fused ones for gelu, relu and silu there, none for swiglu); any other
case (another quantizer, a CPU tensor, no Triton) takes TE's own two kernels inside it. Since
the kernel repeats TE's arithmetic, which another TE version could change, the first call of a
process runs both ways and compares the bytes, at the run's scale and at one that spreads the
call's values over the whole FP8 range; on a difference TE's kernels take over, with a warning.
"""

from __future__ import annotations

import importlib.util
import math
import os
import warnings

import torch

_HAVE_TRITON = importlib.util.find_spec("triton") is not None
if _HAVE_TRITON:
    import triton
    import triton.language as tl
    from triton.language.extra import libdevice

    @triton.jit
    def sigmoid(a, RCP: tl.constexpr):
        """TE's sigmoid in fp32: 1 / (1 + expf(-a)), the reciprocal correctly rounded (rcp_rn,
        or IEEE division with RCP off: the same value)."""
        one = tl.zeros_like(a) + 1.0
        if RCP:
            return libdevice.rcp_rn(one + libdevice.exp(-a))
        return libdevice.div_rn(one, one + libdevice.exp(-a))

    @triton.jit
    def to_fp8(y, scale, out_ptr, FMAX: tl.constexpr, CLAMP: tl.constexpr):
        """``y * scale`` in ``out_ptr``'s FP8 format as TE's cast makes it: saturated to the
        largest finite value (NaN stays NaN), rounded to nearest even."""
        p = y * scale
        if CLAMP:  # the cast itself saturates where it can
            p = tl.clamp(p, -FMAX, FMAX, propagate_nan=tl.PropagateNan.ALL)
        return p.to(out_ptr.dtype.element_ty, fp_downcast_rounding="rtne")

    @triton.jit
    def store_fp8(out_ptr, out_t_ptr, q, rows, cols, c0, ld, M, N,
                  ROWWISE: tl.constexpr, COLWISE: tl.constexpr, TRANS: tl.constexpr):  # fmt: skip
        """The FP8 tile ``q`` at ``rows`` and columns ``c0 + cols`` (``cols < N``) of the
        row-wise copy [M, ld] and of the column-wise one [ld, M] (TRANS: stored from an
        explicitly transposed tile)."""
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        cc = c0 + cols
        if ROWWISE:
            tl.store(out_ptr + rows.to(tl.int64)[:, None] * ld + cc[None, :], q, mask=mask)
        if COLWISE:
            if TRANS:
                tmask = (cols < N)[:, None] & (rows < M)[None, :]
                t = out_t_ptr + cc.to(tl.int64)[:, None] * M + rows[None, :]
                tl.store(t, tl.trans(q), mask=tmask)
            else:
                tl.store(out_t_ptr + cc.to(tl.int64)[None, :] * M + rows[:, None], q, mask=mask)

    @triton.jit
    def store_scale_inv(scale_ptr, scale_inv_ptr, BN: tl.constexpr):
        """TE's scale_inv: 1 / scale, correctly rounded (one program writes it)."""
        zero = tl.zeros([BN], tl.int32)
        inv = libdevice.div_rn(tl.full([BN], 1.0, tl.float32), tl.load(scale_ptr + zero))
        tl.store(scale_inv_ptr + zero, inv, mask=tl.arange(0, BN) == 0)

    @triton.jit
    def _dswiglu_cast_transpose_kernel(
        g_ptr,  # [M, N] fc2's dgrad
        x_ptr,  # [M, 2N] fc1's output: [activation input | gate]
        out_ptr,  # [M, 2N] FP8, row-wise
        out_t_ptr,  # [2N, M] FP8, column-wise (transposed)
        dbias_ptr,  # [cdiv(M, BM), 2N] fp32: column sums of this program's rows
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
        DBIAS: tl.constexpr,  # write the column sums (fc1 has a bias)
        RCP: tl.constexpr,  # 1 / y as the correctly rounded reciprocal (the same value as div_rn)
        TRANS: tl.constexpr,  # the column-wise copy stored from an explicitly transposed tile
        CLAMP: tl.constexpr,  # saturate before the cast (the cast itself saturates where it can)
    ):
        pm = tl.program_id(0)
        pn = tl.program_id(1)
        rows = pm * BM + tl.arange(0, BM)
        cols = pn * BN + tl.arange(0, BN)
        mask = (rows < M)[:, None] & (cols < N)[None, :]
        rows64 = rows.to(tl.int64)
        g = tl.load(g_ptr + rows64[:, None] * N + cols[None, :], mask=mask, other=0.0)
        xa = x_ptr + rows64[:, None] * (2 * N) + cols[None, :]
        a = tl.load(xa, mask=mask, other=0.0)
        b = tl.load(xa + N, mask=mask, other=0.0)
        adt = g.dtype
        g, a, b = g.to(tl.float32), a.to(tl.float32), b.to(tl.float32)
        # TE's silu and dsilu: s = sigmoid(a); dsilu = a * s (1 - s) + s (one fused multiply-add,
        # as nvcc contracts it); d_act = dsilu * g * gate; d_gate = g * silu
        s = sigmoid(a, RCP)
        dsilu = tl.fma(a, s * (1.0 - s), s)
        da = ((dsilu * g) * b).to(adt).to(tl.float32)
        db = (g * (a * s)).to(adt).to(tl.float32)
        amax = tl.maximum(tl.max(tl.max(tl.abs(da), 1), 0), tl.max(tl.max(tl.abs(db), 1), 0))
        tl.atomic_max(amax_ptr, amax)
        scale = tl.load(scale_ptr)
        qa = to_fp8(da, scale, out_ptr, FMAX, CLAMP)
        qb = to_fp8(db, scale, out_ptr, FMAX, CLAMP)
        store_fp8(out_ptr, out_t_ptr, qa, rows, cols, 0, 2 * N, M, N, ROWWISE, COLWISE, TRANS)
        store_fp8(out_ptr, out_t_ptr, qb, rows, cols, N, 2 * N, M, N, ROWWISE, COLWISE, TRANS)
        if DBIAS:
            cmask = cols < N
            drow = dbias_ptr + pm.to(tl.int64) * (2 * N)
            tl.store(drow + cols, tl.sum(da, 0), mask=cmask)
            tl.store(drow + N + cols, tl.sum(db, 0), mask=cmask)
        if (pm == 0) & (pn == 0):
            store_scale_inv(scale_ptr, scale_inv_ptr, BN)


# the launch: tile rows and columns, warps, the reciprocal by rcp_rn, the transposed store, the
# saturation before the cast
CONFIG = {"BM": 32, "BN": 128, "WARPS": 4, "RCP": True, "TRANS": False, "CLAMP": True}
LAUNCH_ENV = "MEGAFP8_DSWIGLU_LAUNCH"


def parse_launch(spec: str, config: dict | None = None, env: str = LAUNCH_ENV) -> dict:
    """``"BM=128,BN=64,WARPS=8,RCP=1"`` (``bench/kernel_probes.py --probes dswiglu`` prints the
    fastest as such) -> the launch's keys and values, among ``config``'s keys (this kernel's by
    default); one line naming the bad part and ``env`` otherwise."""
    keys = CONFIG if config is None else config
    out = {}
    for part in filter(None, (p.strip() for p in spec.split(","))):
        key, _, value = part.partition("=")
        key = key.strip().upper()
        if key not in keys or not value.strip().isdigit():
            raise ValueError(
                f"{env}: '{part}' is not KEY=INTEGER with KEY one of {', '.join(keys)}"
            )
        v = int(value)
        if key in ("BM", "BN", "WARPS"):
            if v < 1 or v & (v - 1):
                raise ValueError(f"{env}: {key}={v} is not a power of two")
            out[key] = v
        else:
            out[key] = bool(v)
    return out


def launch_spec(config: dict) -> str:
    return ",".join(f"{k}={int(v)}" for k, v in config.items())


CONFIG.update(parse_launch(os.environ.get(LAUNCH_ENV, "")))

_installed: dict = {}


def available(grad: torch.Tensor, x: torch.Tensor, quantizer) -> bool:
    """The kernel applies: Triton, CUDA tensors, and ``fits``."""
    return _HAVE_TRITON and grad.is_cuda and x.is_cuda and fits(grad, x, quantizer)


def fits(grad: torch.Tensor, x: torch.Tensor, quantizer) -> bool:
    """One 16-bit float dtype, fc1's output twice fc2's dgrad wide over the same tokens, and TE's
    delayed-scaling quantizer (one scale per tensor)."""
    if grad.dtype not in (torch.bfloat16, torch.float16) or x.dtype != grad.dtype:
        return False
    if type(quantizer).__name__ != "Float8Quantizer" or _torch_fp8(quantizer) is None:
        return False
    n = grad.shape[-1]
    return x.shape[-1] == 2 * n and grad.numel() // max(n, 1) == x.numel() // max(2 * n, 1)


def _torch_fp8(quantizer) -> torch.dtype | None:
    """The torch dtype of the quantizer's FP8 format, by the name of TE's enum member (TE's
    ``DType`` is an IntEnum, whose ``str`` is its number)."""
    name = getattr(quantizer.dtype, "name", None) or str(quantizer.dtype)
    if "E5M2" in name:
        return torch.float8_e5m2
    if "E4M3" in name:
        return torch.float8_e4m3fn
    return None


def _te(grad, x, quantizer):
    import transformer_engine.pytorch  # noqa: F401 (loads TE's core library first)
    import transformer_engine_torch as tex

    return tex.bgrad_quantize(tex.dswiglu(grad, x, None), quantizer)


def fp8_out(quantizer, shape, x: torch.Tensor):
    """TE's empty FP8 tensor of ``shape`` for ``quantizer``, and the row-wise and column-wise
    bytes the kernels write, as torch FP8 tensors (empty where TE allocated none: what TE
    allocates decides what is written; it skips the transpose where the GPU's FP8 GEMM takes
    other layouts)."""
    out = quantizer.make_empty(list(shape), dtype=x.dtype, device=x.device)
    f8 = _torch_fp8(quantizer)
    none = torch.empty(0, dtype=f8, device=x.device)
    data = out._data.view(f8) if getattr(out, "_data", None) is not None else none
    data_t = out._transpose.view(f8) if getattr(out, "_transpose", None) is not None else none
    return out, data, data_t


def launch_args(c: dict, data: torch.Tensor, data_t: torch.Tensor) -> dict:
    """The launch ``c`` as both SwiGLU kernels take it, writing the copies ``fp8_out`` gave."""
    return dict(BM=c["BM"], BN=c["BN"], ROWWISE=data.numel() > 0, COLWISE=data_t.numel() > 0,
                FMAX=torch.finfo(data.dtype).max, RCP=c["RCP"], TRANS=c["TRANS"],
                CLAMP=c["CLAMP"], num_warps=c["WARPS"])  # fmt: skip


def _fused(grad, x, quantizer, bias_grad=True, config=None):
    """The kernel: (bias gradient or None without ``bias_grad``, FP8 gradient)."""
    c = {**CONFIG, **(config or {})}
    n = grad.shape[-1]
    g2 = grad.reshape(-1, n).contiguous()
    x2 = x.reshape(-1, 2 * n).contiguous()
    m = g2.shape[0]
    out, data, data_t = fp8_out(quantizer, x.shape, x)
    grid = (triton.cdiv(m, c["BM"]), triton.cdiv(n, c["BN"]))
    rows = grid[0] if bias_grad else 0
    partial = torch.empty(rows, 2 * n, dtype=torch.float32, device=x.device)
    _dswiglu_cast_transpose_kernel[grid](
        g2,
        x2,
        data,
        data_t,
        partial,
        quantizer.scale,
        quantizer.amax,
        out._scale_inv,
        m,
        n,
        DBIAS=bias_grad,
        **launch_args(c, data, data_t),
    )
    if data_t.numel():
        out._transpose_invalid = False
    return (partial.sum(0).to(x.dtype) if bias_grad else None), out


def _scratch(quantizer, scale=None):
    """A quantizer with an amax of its own, from zero (a check must not move the run's amax, and
    an earlier, larger amax must not hide this call's), on the run's scale or on ``scale``."""
    return type(quantizer)(
        quantizer.scale if scale is None else scale,
        torch.zeros_like(quantizer.amax),
        quantizer.dtype,
        rowwise=quantizer.rowwise_usage,
        columnwise=quantizer.columnwise_usage,
    )


class Inconclusive(Exception):
    """The call's values cannot test the kernel (all zero, or not finite): check a later call."""


def compare(te, fused, qt, qf) -> list[str]:
    """What differs between the FP8 tensors ``te(qt)`` and ``fused(qf)`` and their quantizers'
    amaxes: row-wise and column-wise data, scale_inv, amax (empty: nothing)."""
    t, f = te(qt), fused(qf)
    parts = [("row-wise data", t._data, f._data), ("column-wise data", t._transpose, f._transpose),
             ("scale_inv", t._scale_inv, f._scale_inv), ("amax", qt.amax, qf.amax)]  # fmt: skip
    return [f"{name} ({int((a != b).sum())} of {a.numel()})"
            for name, a, b in parts if a is not None and not torch.equal(a, b)]  # fmt: skip


def same_bytes(te, fused, quantizer) -> str | None:
    """``te`` and ``fused`` (quantizer -> FP8 tensor) on scratch amaxes, at the run's scale and
    again at a power-of-two scale that puts this call's amax at the top of the FP8 range (at the
    run's scale small values may all round to zero, which any encoding writes alike): None when
    the FP8 bytes, amax and scale_inv agree at both, else what differs. Raises ``Inconclusive``
    for a call whose values are all zero or not finite."""
    qt = _scratch(quantizer)
    bad = compare(te, fused, qt, _scratch(quantizer))
    if bad:
        return ", ".join(bad)
    amax = float(qt.amax.max())
    if not 0.0 < amax < math.inf:
        raise Inconclusive(f"amax {amax}")
    fmax = torch.finfo(_torch_fp8(quantizer)).max
    full = torch.full_like(quantizer.scale, 2.0 ** math.floor(math.log2(fmax / amax)))
    again = compare(te, fused, _scratch(quantizer, full), _scratch(quantizer, full))
    return ", ".join(f"{b} at scale {float(full.flatten()[0]):g}" for b in again) or None


def _same_bytes(grad, x, quantizer, **kw) -> str | None:
    """``same_bytes`` for this kernel and TE's two on one call's operands."""
    return same_bytes(
        lambda q: _te(grad, x, q)[1], lambda q: _fused(grad, x, q, **kw)[1], quantizer
    )


def checked(table: dict, key, check, what: str, flag: str) -> bool | None:
    """Whether the kernel may make this call: the first call for ``key`` runs ``check()`` (None
    or what differs from TE's bytes) and files the answer in ``table``; a difference, or a kernel
    that does not build, warns once and leaves TE's kernels every later call. None: this call
    could not check (all zero, not finite, no memory for the check), so TE's kernels make it and
    a later call checks."""
    if key not in table:
        try:
            diff = check()
        except (torch.cuda.OutOfMemoryError, Inconclusive):
            return None
        except Exception as e:  # a Triton that cannot build it: TE's kernels
            diff = f"the kernel failed: {type(e).__name__}: {e}"
        table[key] = diff is None
        if diff is not None:
            warnings.warn(
                f"megafp8: the {what} differs from TE's kernels ({diff}); "
                f"using TE's kernels ({flag} silences this)",
                stacklevel=3,
            )
    return table[key]


# (activation dtype, FP8 dtype) -> whether the kernel wrote TE's bytes on its first call
_checked: dict[tuple, bool] = {}


def dswiglu_quantize(grad: torch.Tensor, x: torch.Tensor, quantizer, **_):
    """(bias gradient, FP8 gradient of fc1's output) from fc2's dgrad ``grad`` [..., N] and fc1's
    output ``x`` [..., 2N], as TE's ``bgrad_quantize(dswiglu(grad, x), quantizer)`` returns them.

    The first call for each pair of dtypes runs both ways on its operands and compares the bytes
    (the kernel repeats TE's arithmetic, which a TE version could change), at the run's scale and
    at one that fills the FP8 range: on any difference, or if the kernel does not build, a warning
    says so and TE's kernels make every later call. A call with nothing to compare (all zero, or
    not finite) or no memory for the check takes TE's kernels and leaves the check to a later
    call."""
    if not available(grad, x, quantizer):
        return _te(grad, x, quantizer)
    key = (x.dtype, _torch_fp8(quantizer))
    bias_grad = _installed.get("bias_grad", True)
    # checks the launch the calls make (one compiled kernel)
    ok = checked(_checked, key, lambda: _same_bytes(grad, x, quantizer, bias_grad=bias_grad),
                 "fused SwiGLU backward", "--no-te-fused-dswiglu")  # fmt: skip
    if not ok:
        return _te(grad, x, quantizer)
    return _fused(grad, x, quantizer, bias_grad=bias_grad)


def biased_mlp(bias: bool) -> None:
    """Tell the kernel whether a te.LayerNormMLP built for the run has fc1 biases. Until every
    MLP built said it had none, the kernel writes the bias gradient (TE drops it without a bias;
    one MLP with a bias keeps it on for the process: the table is process-wide)."""
    _installed["bias_grad"] = _installed.get("bias_grad", False) or bias


def _table() -> bool:
    """Wrap TE's table of activations for te.LayerNormMLP once, so that under delayed scaling
    swiglu's forward (fp8/swiglu_fwd.py) and fused backward (this module) are ours while they
    are switched on. False where TE has no such table."""
    try:
        from transformer_engine.pytorch.module import layernorm_mlp as lm
    except ImportError:
        return False
    if "orig" not in _installed:
        orig = getattr(lm, "_get_act_func_supported_list", None)
        if orig is None:
            return False
        _installed["orig"] = orig

        def table(recipe=None):
            funcs = _installed["orig"](recipe)
            if recipe is None or not recipe.delayed() or "swiglu" not in funcs:
                return funcs
            fwd, bwd, fused = was = funcs["swiglu"]
            if _installed.get("on") and fwd is not None and fused is None:
                fused = dswiglu_quantize
            if _installed.get("fwd") is not None and fwd is not None:
                fwd = _installed["fwd"]
            if (fwd, bwd, fused) != was:
                funcs = dict(funcs)
                funcs["swiglu"] = (fwd, bwd, fused)
            return funcs

        lm._get_act_func_supported_list = table
    return True


def install(enabled: bool) -> bool:
    """Put (or take back) ``dswiglu_quantize`` as swiglu's fused backward in TE's LayerNormMLP
    for delayed scaling. Returns whether it is in place. TE versions without that table keep
    their own path. The table is TE's, one per process: the backend built last decides."""
    if not _table():
        return False
    _installed["on"] = bool(enabled and _HAVE_TRITON)
    return _installed["on"]


def install_forward(fn) -> bool:
    """Put ``fn`` (or, with None, TE's own again) as swiglu's forward in the same table, for
    delayed scaling. Returns whether one of ours is in place."""
    if not _table():
        return False
    _installed["fwd"] = fn if _HAVE_TRITON else None
    return _installed["fwd"] is not None
