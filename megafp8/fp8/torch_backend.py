"""The "torch" backend: our FP8 recipe (``fp8/recipe.py``) with torch's FP8 GEMM.

For y = x w^T with x [M, K], w [N, K] and output gradient g [M, N], the three GEMMs are

    forward  y  = (x_q * sx^-1) @ (w_q * sw^-1)^T
    dgrad    dx = (g_q * sg^-1) @ (w_q * sw^-1)
    wgrad    dw = (g_q * sg^-1)^T @ (x_q * sx^-1)

with ``x_q, w_q`` E4M3 and ``g_q`` E5M2 under HYBRID. ``gemm="scaled_mm"`` runs them with
``torch._scaled_mm`` (FP8 tensor cores on Hopper); ``gemm="emulated"`` multiplies the same FP8
values exactly in float64, applies the two scales to the sum and rounds once: a result that does not
depend on the summation order, so parallel layouts and CPUs agree to the bit wherever their inputs
do. On the CPU the emulation is the default since ``_scaled_mm`` there is a reference loop.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F

from megafp8.fp8.backend import Backend
from megafp8.fp8.overflow_guard import layer_name
from megafp8.fp8.plain_ops import PlainLinear
from megafp8.fp8.recipe import Fp8Recipe, Fp8State, ScaleTape, ScalingMeta
from megafp8.parallel.mappings import world


def fp8_gemm(a_q, a_sinv, b_q, b_sinv, out_dtype, gemm: str) -> torch.Tensor:
    """``(a_q * a_sinv) @ (b_q * b_sinv)`` for a [M, K], b [K, N] in FP8."""
    if gemm == "emulated":
        # FP8 values are exact in float64, and so are their products; a sum of them is exact
        # while it stays within 53 bits, so the result does not depend on the summation order
        # (the blocking of the CPU's BLAS). The scales are applied once, to the sum, as in
        # ``_scaled_mm``; one rounding to ``out_dtype``.
        acc = a_q.double() @ b_q.double()  # [M, N]
        return (acc * (a_sinv.double() * b_sinv.double())).to(out_dtype)
    a_q = a_q if a_q.is_contiguous() else a_q.contiguous()  # row-major first operand
    if not b_q.t().is_contiguous():  # column-major second operand
        b_q = b_q.t().contiguous().t()  # same [K, N], stored column-major
    return torch._scaled_mm(a_q, b_q, scale_a=a_sinv, scale_b=b_sinv, out_dtype=out_dtype)


class _Fp8LinearFn(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, mx: ScalingMeta, mw: ScalingMeta, mg: ScalingMeta, group, gemm):
        x2 = x.reshape(-1, x.shape[-1])  # [M, K]
        xq, sx = mx.quantize(x2, group)
        wq, sw = mw.quantize(weight, group)
        y = fp8_gemm(xq, sx, wq.t(), sw, x.dtype, gemm)  # [M, N]
        ctx.save_for_backward(xq, sx, wq, sw)
        ctx.mg, ctx.group, ctx.gemm, ctx.shape, ctx.wdtype = mg, group, gemm, x.shape, weight.dtype
        return y.reshape(*x.shape[:-1], weight.shape[0])  # [..., N]

    @staticmethod
    def backward(ctx, gy):
        xq, sx, wq, sw = ctx.saved_tensors
        g2 = gy.reshape(-1, gy.shape[-1])  # [M, N]
        gq, sg = ctx.mg.quantize(g2, ctx.group)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = fp8_gemm(gq, sg, wq, sw, gy.dtype, ctx.gemm).reshape(ctx.shape)  # [..., K]
        if ctx.needs_input_grad[1]:
            dw = fp8_gemm(gq.t(), sg, xq, sx, ctx.wdtype, ctx.gemm)  # [N, K]
        return dx, dw, None, None, None, None, None


class Fp8Linear(PlainLinear):
    """y = x w^T (+ b) on this rank's shard, its three GEMMs in FP8 with the scales of ``state``
    (input ``x``, weight ``w`` and output gradient ``g`` of the GEMM called ``name``). Current
    scaling reduces each amax over ``group`` (the ranks holding shards of this GEMM)."""

    plain = False
    fp8 = True  # False: the layer fell back (``TorchBackend.fall_back_to_bf16``), plain GEMMs

    def __init__(
        self, in_features, out_features, bias, *, name, state: Fp8State, gemm, group, dtype, device
    ):
        super().__init__(in_features, out_features, bias, dtype=dtype, device=device)
        self.name, self.state, self.gemm, self.group = name, state, gemm, group

    def forward(self, x):  # [..., in] -> [..., out]
        if not self.fp8:
            return F.linear(x, self.weight, self.bias)
        s = self.state
        y = _Fp8LinearFn.apply(
            x,
            self.weight,
            s.meta(self.name, "x"),
            s.meta(self.name, "w"),
            s.meta(self.name, "g"),
            self.group,
            self.gemm,
        )
        return y if self.bias is None else y + self.bias


class TorchBackend(Backend):
    name, fp8 = "torch", True

    def __init__(
        self, recipe: Fp8Recipe, *, amax_group, gemm: str = "auto", expert_amax_group=None
    ):
        if recipe.recipe == "mxfp8":
            raise ValueError("fp8_recipe='mxfp8' needs the te backend")
        self.state = Fp8State(recipe, amax_group=amax_group, expert_amax_group=expert_amax_group)
        self.gemm = gemm

    def make_linear(
        self, in_features, out_features, bias, *, name, group, fp8=True, dtype, device=None
    ):
        world(group)
        if not fp8:
            return PlainLinear(in_features, out_features, bias, dtype=dtype, device=device)
        dev = torch.device(device) if device is not None else torch.device("cpu")
        gemm = self.gemm
        if gemm == "auto":
            gemm = "scaled_mm" if dev.type == "cuda" else "emulated"
        return Fp8Linear(
            in_features,
            out_features,
            bias,
            name=name,
            state=self.state,
            gemm=gemm,
            group=group,
            dtype=dtype,
            device=device,
        )

    def update(self, roles=None):
        self.state.update(roles)

    def fp8_overflows(self, model):
        out: dict = {}
        for gemm, flag in self.state.take_overflow().items():
            lay = layer_name(gemm)
            if lay is not None:
                out[lay] = flag if lay not in out else torch.maximum(out[lay], flag)
        return out

    def fall_back_to_bf16(self, model, layer):
        mods = [m for m in model.modules() if isinstance(m, Fp8Linear) and m.fp8]
        mods = [m for m in mods if layer_name(m.name) == layer]
        for m in mods:
            m.fp8 = False
        return len(mods)

    def start_fp8_stats(self):
        self.state.start_stats()

    def fp8_stats(self, model):
        return self.state.take_stats()

    def recompute_contexts(self):
        tape = ScaleTape()  # the region's forward keeps its scales; the recompute casts with them
        return self.state.recording(tape), self.state.replaying(tape)

    def state_dict(self):
        return self.state.state_dict()

    def load_state_dict(self, sd):
        self.state.load_state_dict(sd)
