"""FP8 recipe arithmetic and the torch backend's GEMMs."""

import pytest
import torch

from megafp8.fp8.recipe import (
    E4M3,
    E5M2,
    Fp8Recipe,
    Fp8State,
    ScalingMeta,
    cast_to_fp8,
    compute_scale,
)
from megafp8.fp8.torch_backend import Fp8Linear, fp8_gemm
from megafp8.parallel.mappings import SOLO


def test_compute_scale_by_hand():
    amax = torch.tensor([2.0, 0.0, float("inf"), float("nan"), 448.0])
    old = torch.full((5,), 3.0)
    got = compute_scale(amax, old, 448.0, margin=1)
    # 448/2/2 = 112; zero/inf/nan amax keep the old scale 3; 448/448/2 = 0.5
    assert got.tolist()[:3] == [112.0, 3.0, 3.0]
    assert got[3].item() == 3.0 and got[4].item() == 0.5


def test_delayed_history_max_and_most_recent():
    for algo, expect in (("max", 448.0 / 8.0), ("most_recent", 448.0 / 2.0)):
        r = Fp8Recipe("hybrid", "delayed", margin=0, amax_history_len=3, amax_compute_algo=algo)
        st = Fp8State(r, amax_group=SOLO)
        m = st.meta("lin", "x")
        for a in (8.0, 4.0, 2.0):  # three steps; each records one amax then updates
            m.quantize(torch.tensor([a, -a / 2]), SOLO)
            st.update()
        # after the updates the history is rolled: slot 0 empty, newest amax at slot 1
        assert m.amax_history.tolist() == [0.0, 2.0, 4.0]
        assert m.scale.item() == pytest.approx(expect)


def test_delayed_scale_used_is_the_previous_one():
    st = Fp8State(Fp8Recipe(amax_history_len=4), amax_group=SOLO)
    m = st.meta("l", "x")
    _, sinv = m.quantize(torch.tensor([10.0]), SOLO)
    assert sinv.item() == 1.0  # first use: initial scale 1
    st.update()
    _, sinv = m.quantize(torch.tensor([1.0]), SOLO)
    assert sinv.item() == pytest.approx(10.0 / 448.0)


def test_current_scaling_uses_own_amax():
    m = ScalingMeta(Fp8Recipe(recipe="tensorwise"), "x")
    x = torch.tensor([1.0, -3.5, 0.25])
    q, sinv = m.quantize(x, SOLO)
    assert sinv.item() == pytest.approx(3.5 / 448.0)
    assert q.float().abs().max().item() == 448.0


def test_hybrid_formats():
    r = Fp8Recipe("hybrid")
    assert (r.dtype("x"), r.dtype("w"), r.dtype("g")) == (E4M3, E4M3, E5M2)
    assert Fp8Recipe("e4m3").dtype("g") == E4M3


def test_saturation_and_underflow():
    s = torch.tensor(1.0)
    q = cast_to_fp8(torch.tensor([1e6, -1e6, 500.0]), s, E4M3)
    assert q.float().tolist() == [448.0, -448.0, 448.0]  # clamps, never nan
    q = cast_to_fp8(torch.tensor([1e9]), s, E5M2)
    assert q.float().item() == 57344.0
    tiny = cast_to_fp8(torch.tensor([1e-4, 2.0**-9]), s, E4M3)  # below e4m3's 2^-9 subnormal
    assert tiny.float().tolist() == [0.0, 2.0**-9]


def _q(x, meta_scale, dtype):
    return cast_to_fp8(x, meta_scale, dtype).double()  # the FP8 values, exactly


@pytest.mark.parametrize("fmt", ["hybrid", "e4m3"])
def test_three_gemms_bitwise_equal_exact_fp8_products(fmt):
    torch.manual_seed(0)
    st = Fp8State(Fp8Recipe(fmt, "tensorwise"), amax_group=SOLO)
    lin = Fp8Linear(
        48,
        32,
        False,
        name="l",
        state=st,
        gemm="emulated",
        group=SOLO,
        dtype=torch.float32,
        device=None,
    )
    with torch.no_grad():
        lin.weight.normal_()
    x = torch.randn(2, 8, 48, requires_grad=True)
    g = torch.randn(2, 8, 32)
    y = lin(x)
    y.backward(g)
    sx = 448.0 / x.detach().abs().amax()
    sw = 448.0 / lin.weight.detach().abs().amax()
    gdt = E5M2 if fmt == "hybrid" else E4M3
    sg = (57344.0 if fmt == "hybrid" else 448.0) / g.abs().amax()
    xq, wq = _q(x.detach().reshape(-1, 48), sx, E4M3), _q(lin.weight.detach(), sw, E4M3)
    gq = _q(g.reshape(-1, 32), sg, gdt)
    # the FP8 values multiplied exactly, summed in float64, scaled once, rounded once to fp32
    mm = lambda a, sa, b, sb: ((a @ b) * (sa.reciprocal().double() * sb.reciprocal())).float()
    assert torch.equal(y.detach().reshape(-1, 32), mm(xq, sx, wq.t(), sw))
    assert torch.equal(x.grad.reshape(-1, 48), mm(gq, sg, wq, sw))
    assert torch.equal(lin.weight.grad, mm(gq.t(), sg, xq, sx))


def test_emulated_gemm_does_not_depend_on_summation_order():
    """The CPU emulation sums exact FP8 products in float64: permuting K, or splitting it into
    partial GEMMs added in any order, gives the same bits (the basis of the parallel tests'
    tolerances: a GEMM never moves a value across an FP8 rounding boundary by its blocking)."""
    g = torch.Generator().manual_seed(4)
    a = (torch.randn(24, 96, generator=g) * 30).to(E4M3)
    b = (torch.randn(96, 40, generator=g) * 30).to(E4M3)
    sa, sb = torch.tensor(0.013), torch.tensor(0.71)
    ref = fp8_gemm(a, sa, b, sb, torch.float32, "emulated")
    perm = torch.randperm(96, generator=g)
    assert torch.equal(fp8_gemm(a[:, perm], sa, b[perm], sb, torch.float32, "emulated"), ref)
    parts = [a.double()[:, i : i + 32] @ b.double()[i : i + 32] for i in (64, 0, 32)]
    split = ((parts[0] + parts[1] + parts[2]) * (sa.double() * sb.double())).float()
    assert torch.equal(split, ref)


def test_scaled_mm_matches_emulation():
    """torch._scaled_mm on the same quantized operands: equal up to fp32 summation order."""
    torch.manual_seed(1)
    a = torch.randn(32, 64).to(E4M3)
    b = torch.randn(48, 64).to(E4M3)
    sa, sb = torch.tensor(0.37), torch.tensor(1.7)
    ref = fp8_gemm(a, sa, b.t(), sb, torch.float32, "emulated")
    got = fp8_gemm(a, sa, b.t(), sb, torch.float32, "scaled_mm")
    bound = 64 * 2e-7 * ((a.float().abs() * sa) @ (b.float().abs() * sb).t())
    assert ((got - ref).abs() <= bound + 1e-30).all()


@pytest.mark.parametrize("fmt,tol", [("e4m3", 0.08), ("hybrid", 0.12)])
def test_error_bounds_vs_fp32(fmt, tol):
    """Relative error of FP8 vs fp32 on Gaussian data: E4M3 has 3 mantissa bits (unit roundoff
    2^-4 = 6%), per element errors average out in the dot products; E5M2 gradients have 2 bits."""
    torch.manual_seed(2)
    st = Fp8State(Fp8Recipe(fmt, "tensorwise"), amax_group=SOLO)
    lin = Fp8Linear(
        256,
        128,
        False,
        name="l",
        state=st,
        gemm="emulated",
        group=SOLO,
        dtype=torch.float32,
        device=None,
    )
    ref = torch.nn.Linear(256, 128, bias=False)
    with torch.no_grad():
        lin.weight.normal_()
        ref.weight.copy_(lin.weight)
    x = torch.randn(64, 256)
    g = torch.randn(64, 128)
    xa, xb = x.clone().requires_grad_(), x.clone().requires_grad_()
    lin(xa).backward(g)
    ref(xb).backward(g)
    rel = lambda a, b: ((a - b).norm() / b.norm()).item()
    assert rel(lin(x), ref(x)) < 0.05
    assert rel(xa.grad, xb.grad) < tol
    assert rel(lin.weight.grad, ref.weight.grad) < tol
    assert rel(lin(x), ref(x)) > 1e-4  # it really is quantized


def test_state_dict_round_trip():
    st = Fp8State(Fp8Recipe(amax_history_len=4), amax_group=SOLO)
    st.meta("a", "x").quantize(torch.tensor([3.0]), SOLO)
    st.update()
    st2 = Fp8State(Fp8Recipe(amax_history_len=4), amax_group=SOLO)
    st2.load_state_dict(st.state_dict())
    assert torch.equal(st2.meta("a", "x").scale, st.meta("a", "x").scale)
    assert torch.equal(st2.meta("a", "x").amax_history, st.meta("a", "x").amax_history)


@pytest.mark.parametrize(
    "te_ok,fmt,choice,expected",
    [
        (True, None, "auto", "te"),  # BF16 runs on TE's fused kernels where they exist
        (True, "hybrid", "auto", "te"),
        (False, None, "auto", "none"),
        (False, "hybrid", "auto", "torch"),
        (True, None, "none", "none"),  # the plain PyTorch modules, on request
        (True, None, "torch", "none"),  # the torch backend is an FP8 recipe: nothing to do
        (False, None, "te", "te"),
    ],
)
def test_backend_choice(monkeypatch, te_ok, fmt, choice, expected):
    import importlib.util

    from megafp8.config import Fp8Config
    from megafp8.fp8 import backend, te_backend

    find = importlib.util.find_spec
    present = lambda n, *a: object() if n == "transformer_engine" else find(n, *a)  # noqa: E731
    monkeypatch.setattr(backend.importlib.util, "find_spec", present)
    monkeypatch.setattr(te_backend, "te_available", lambda: te_ok)
    f = Fp8Config(fp8_format=fmt, fp8_backend=choice)
    assert backend.resolve_backend_name(f) == expected
