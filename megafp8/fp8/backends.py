"""One GEMM protocol, three backends: "te" (Transformer Engine), "torch" (our recipe +
torch._scaled_mm
or its bitwise emulation), "none" (plain bf16/fp32).

A backend builds the *local* linear of a layer (``make_linear``; the TP layers put the collectives
around it), wraps the model forward in its autocast, and runs ``update()`` after each micro-batch.

The torch backend's GEMMs, for y = x w^T with x [M, K], w [N, K], output gradient g [M, N]:

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

import contextlib
import importlib.util
import logging
import math
import warnings

import torch
import torch.nn.functional as F
from torch import nn

from megafp8.fp8.recipe import Fp8Recipe, Fp8State, ScalingMeta
from megafp8.parallel.mappings import world

log = logging.getLogger(__name__)


def fp8_gemm(a_q, a_sinv, b_q, b_sinv, out_dtype, gemm: str) -> torch.Tensor:
    """``(a_q * a_sinv) @ (b_q * b_sinv)`` for a [M, K], b [K, N] in FP8."""
    if gemm == "emulated":
        # FP8 values are exact in float64, and so are their products; a sum of them is exact
        # while it stays within 53 bits, so the result does not depend on the summation order
        # (the blocking of the CPU's BLAS). The scales are applied once, to the sum, as in
        # ``_scaled_mm``; one rounding to ``out_dtype``.
        acc = a_q.double() @ b_q.double()
        return (acc * (a_sinv.double() * b_sinv.double())).to(out_dtype)
    a_q = a_q if a_q.is_contiguous() else a_q.contiguous()  # row-major first operand
    if not b_q.t().is_contiguous():  # column-major second operand
        b_q = b_q.t().contiguous().t()
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
        return y.reshape(*x.shape[:-1], weight.shape[0])

    @staticmethod
    def backward(ctx, gy):
        xq, sx, wq, sw = ctx.saved_tensors
        g2 = gy.reshape(-1, gy.shape[-1])  # [M, N]
        gq, sg = ctx.mg.quantize(g2, ctx.group)
        dx = dw = None
        if ctx.needs_input_grad[0]:
            dx = fp8_gemm(gq, sg, wq, sw, gy.dtype, ctx.gemm).reshape(ctx.shape)  # [M, K]
        if ctx.needs_input_grad[1]:
            dw = fp8_gemm(gq.t(), sg, xq, sx, ctx.wdtype, ctx.gemm)  # [N, K]
        return dx, dw, None, None, None, None, None


def init_weight_(w: torch.Tensor, std: float, generator: torch.Generator | None = None) -> None:
    with torch.no_grad():
        w.normal_(0.0, std, generator=generator)


class LocalLinear(nn.Module):
    """y = x w^T (+ b) on this rank's shard; FP8 through ``state`` when given, else plain."""

    def __init__(
        self,
        in_features,
        out_features,
        bias,
        *,
        name,
        state: Fp8State | None,
        gemm: str,
        group,
        dtype,
        device=None,
    ):
        super().__init__()
        self.name, self.state, self.gemm, self.group = name, state, gemm, group
        self.weight = nn.Parameter(
            torch.empty(out_features, in_features, dtype=dtype, device=device)
        )
        self.bias = (
            nn.Parameter(torch.zeros(out_features, dtype=dtype, device=device)) if bias else None
        )

    def forward(self, x):
        if self.state is None:
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


class Backend:
    """The protocol. ``fp8`` says whether this backend's GEMMs are FP8 at all; ``fuses_norm``
    whether ``make_norm_linear`` exists (a norm fused into the GEMM that follows it)."""

    name = "none"
    fp8 = False
    fuses_norm = False

    def make_linear(
        self,
        in_features,
        out_features,
        bias,
        *,
        name,
        group=None,
        fp8=True,
        dtype=torch.float32,
        device=None,
    ) -> nn.Module:
        return LocalLinear(
            in_features,
            out_features,
            bias,
            name=name,
            state=None,
            gemm="",
            group=None,
            dtype=dtype,
            device=device,
        )

    def autocast(self):
        return contextlib.nullcontext()

    def microbatch(self, index: int | None) -> None:
        """Before each micro-batch's forward: its index within the iteration (``None`` outside
        training, e.g. evaluation)."""

    def update(self) -> None:
        """After each micro-batch's forward + backward."""

    def state_dict(self) -> dict:
        return {}

    def load_state_dict(self, sd: dict) -> None:
        pass


class TorchBackend(Backend):
    name, fp8 = "torch", True

    def __init__(self, recipe: Fp8Recipe, amax_group=None, gemm: str = "auto"):
        if recipe.recipe == "mxfp8":
            raise ValueError("fp8_recipe='mxfp8' needs the te backend")
        self.state = Fp8State(recipe, amax_group)
        self.gemm = gemm

    def make_linear(
        self,
        in_features,
        out_features,
        bias,
        *,
        name,
        group=None,
        fp8=True,
        dtype=torch.float32,
        device=None,
    ):
        if not fp8:
            return super().make_linear(
                in_features, out_features, bias, name=name, dtype=dtype, device=device
            )
        dev = torch.device(device) if device is not None else torch.device("cpu")
        gemm = (
            self.gemm
            if self.gemm != "auto"
            else ("scaled_mm" if dev.type == "cuda" else "emulated")
        )
        return LocalLinear(
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

    def update(self):
        self.state.update()

    def state_dict(self):
        return self.state.state_dict()

    def load_state_dict(self, sd):
        self.state.load_state_dict(sd)


class TEBackend(Backend):
    """Transformer Engine modules and recipes; imported only when selected."""

    name, fp8 = "te", True

    def __init__(
        self,
        recipe: Fp8Recipe | None,
        amax_group=None,
        fused_norm: bool = True,
        weight_cache: bool = True,
    ):
        import transformer_engine.common.recipe as ter
        import transformer_engine.pytorch as te

        # TE recognizes the attention's interleaved q/k/v views by their pointers and warns that
        # it prefers the packed tensor; that path selects the views inside TE, whose backward
        # zero-fills and sums three full qkv gradients. Keep the views, drop the warning.
        warnings.filterwarnings("ignore", "Relying on pointer-based detection", DeprecationWarning)
        self.te = te
        self.fp8 = recipe is not None
        self.amax_group = amax_group
        self.te_recipe = None
        self.fuses_norm = fused_norm
        # FP8 weight cache over micro-batches: the weights change only at the optimizer step, so
        # the first micro-batch of an iteration casts them (and their transposes) to FP8 and
        # the others reuse the cast (TE's ``is_first_microbatch``); None (eval) casts every time.
        self.cache = WeightCache()
        self.weight_cache = weight_cache
        if recipe is not None:
            fmt = ter.Format.HYBRID if recipe.fp8_format == "hybrid" else ter.Format.E4M3
            if recipe.recipe == "delayed":
                self.te_recipe = ter.DelayedScaling(
                    fp8_format=fmt,
                    margin=recipe.margin,
                    amax_history_len=recipe.amax_history_len,
                    amax_compute_algo=recipe.amax_compute_algo,
                )
            elif recipe.recipe == "tensorwise":
                self.te_recipe = ter.Float8CurrentScaling(fp8_format=fmt)
            else:
                self.te_recipe = ter.MXFP8BlockScaling(fp8_format=fmt)

    def make_linear(
        self,
        in_features,
        out_features,
        bias,
        *,
        name,
        group=None,
        fp8=True,
        dtype=torch.float32,
        device=None,
    ):
        return TELinear(
            self.te,
            in_features,
            out_features,
            bias,
            fp8=fp8 and self.fp8,
            recipe=self.te_recipe,
            dtype=dtype,
            device=device,
            cache=self.cache,
        )

    def make_norm_linear(
        self, in_features, out_features, bias, *, normalization, eps, fp8=True, dtype, device
    ):
        return TELinear(
            self.te,
            in_features,
            out_features,
            bias,
            fp8=fp8 and self.fp8,
            recipe=self.te_recipe,
            dtype=dtype,
            device=device,
            norm=(normalization, eps),
            cache=self.cache,
        )

    def microbatch(self, index: int | None) -> None:
        self.cache.first = None if index is None or not self.weight_cache else index == 0

    def autocast(self):
        if not self.fp8:
            return contextlib.nullcontext()
        return self.te.autocast(
            enabled=True, recipe=self.te_recipe, amax_reduction_group=self.amax_group
        )


class WeightCache:
    """Shared by a TE backend's modules: ``first`` is TE's ``is_first_microbatch`` (True: cast
    the weights to FP8 and keep them; False: reuse the kept cast; None: no cache)."""

    def __init__(self):
        self.first: bool | None = None


class TELinear(nn.Module):
    """A te.Linear (or, with ``norm``, a te.LayerNormLinear: the norm and the FP8 cast of its output
    in one kernel) whose ``weight``/``bias`` are the local shard; outside FP8 for BF16 layers."""

    def __init__(
        self,
        te,
        in_features,
        out_features,
        bias,
        *,
        fp8,
        recipe,
        dtype,
        device,
        norm=None,
        cache=None,
    ):
        super().__init__()
        self.fp8, self.te, self.cache = fp8, te, cache or WeightCache()
        kw = dict(
            bias=bias, params_dtype=dtype, device=device or "cuda", init_method=lambda w: None
        )
        if norm is None:
            self.inner = te.Linear(in_features, out_features, **kw)
        else:
            self.inner = te.LayerNormLinear(
                in_features, out_features, eps=norm[1], normalization=norm[0], **kw
            )
        self.weight = self.inner.weight
        self.bias = self.inner.bias if bias else None

    def norm_parameters(self) -> list[nn.Parameter]:
        """The fused norm's weights (empty for a plain linear)."""
        names = ("layer_norm_weight", "layer_norm_bias")
        return [p for n in names if isinstance(p := getattr(self.inner, n, None), nn.Parameter)]

    def forward(self, x):
        if self.fp8:
            return self.inner(x, is_first_microbatch=self.cache.first)
        with self.te.autocast(enabled=False):
            return self.inner(x)


def te_available() -> bool:
    if importlib.util.find_spec("transformer_engine") is None or not torch.cuda.is_available():
        return False
    try:
        import transformer_engine.pytorch as te

        return bool(
            te.is_fp8_available()[0]
            if isinstance(te.is_fp8_available(), tuple)
            else te.is_fp8_available()
        )
    except Exception:  # a broken TE install: fall back to the torch backend
        return False


def resolve_backend_name(f) -> str:
    """``auto``: te where TE and a GPU are present, else torch; ``none`` when FP8 is off."""
    if f.fp8_backend == "te":
        return "te"
    if not f.enabled:
        return "none"
    if f.fp8_backend == "auto":
        return "te" if te_available() else "torch"
    return f.fp8_backend


def build_backend(f, amax_group=None, tp_group=None) -> Backend:
    """From an ``Fp8Config``. Under current scaling the torch backend reduces amaxes over TP."""
    name = resolve_backend_name(f)
    recipe = Fp8Recipe.from_config(f) if f.enabled else None
    if name == "te":
        if not importlib.util.find_spec("transformer_engine"):
            raise ValueError("fp8_backend='te' needs Transformer Engine: pip install -e .[te]")
        tp = world(tp_group)
        if recipe is not None and tp > 1:
            log.warning(
                "FP8 on the te backend at tensor_model_parallel_size=%d: its gradients are not "
                "yet proven equal to one process's (tests/gpu/test_te_tp.py); those of "
                "--fp8-backend torch are",
                tp,
            )
        return TEBackend(
            recipe, amax_group, fused_norm=f.te_fused_norm, weight_cache=f.te_weight_cache
        )
    if name == "torch":
        if recipe is None:
            return Backend()
        return TorchBackend(recipe, amax_group, f.fp8_gemm)
    return Backend()


def std_for_output_layer(std: float, num_layers: int) -> float:
    """Megatron's scaled init for the projections that write into the residual stream."""
    return std / math.sqrt(2.0 * num_layers)
