"""fp8/dswiglu.py and fp8/swiglu_fwd.py off the GPU: where the fused SwiGLU backward and forward go
into TE's table (swiglu under delayed scaling only, and only while switched on), and that every
case the kernels do not cover takes TE's own kernels. TE is stood in for by modules of the same
names; the kernels' bytes against TE's are tested on the GPU (tests/gpu/test_dswiglu_gpu.py,
tests/gpu/test_swiglu_fwd_gpu.py)."""

import enum
import sys
import types

import pytest
import torch

from megafp8.fp8 import dswiglu, swiglu_fwd


class _Recipe:
    def __init__(self, kind):
        self.kind = kind

    def delayed(self):
        return self.kind == "delayed"


@pytest.fixture
def fake_te(monkeypatch):
    calls = []
    lm = types.ModuleType("transformer_engine.pytorch.module.layernorm_mlp")

    def table(recipe=None):
        fused = "dbias_dsilu" if recipe is not None else None
        return {"silu": ("silu", "dsilu", fused), "swiglu": ("swiglu", "dswiglu", None)}

    lm._get_act_func_supported_list = table
    tex = types.ModuleType("transformer_engine_torch")
    tex.dswiglu = lambda g, x, q: calls.append(("dswiglu", q)) or g
    tex.bgrad_quantize = lambda t, q: calls.append(("bgrad_quantize", q)) or ("dbias", t)
    tex.swiglu = lambda x, q: calls.append(("swiglu", q)) or x
    mods = {
        "transformer_engine": types.ModuleType("transformer_engine"),
        "transformer_engine.pytorch": types.ModuleType("transformer_engine.pytorch"),
        "transformer_engine.pytorch.module": types.ModuleType("transformer_engine.pytorch.module"),
        "transformer_engine.pytorch.module.layernorm_mlp": lm,
        "transformer_engine_torch": tex,
    }
    mods["transformer_engine.pytorch.module"].layernorm_mlp = lm
    for name, mod in mods.items():
        monkeypatch.setitem(sys.modules, name, mod)
    monkeypatch.setattr(dswiglu, "_installed", {})
    monkeypatch.setattr(dswiglu, "_HAVE_TRITON", True)  # the table's logic, not the kernel
    return lm, calls


def test_swiglu_gets_the_fused_backward_under_delayed_scaling_only(fake_te):
    lm, _ = fake_te
    assert dswiglu.install(True)
    delayed = lm._get_act_func_supported_list(_Recipe("delayed"))
    assert delayed["swiglu"] == ("swiglu", "dswiglu", dswiglu.dswiglu_quantize)
    assert delayed["silu"] == ("silu", "dsilu", "dbias_dsilu")  # TE's own fusions kept
    for other in (_Recipe("mxfp8"), _Recipe("current"), None):
        assert lm._get_act_func_supported_list(other)["swiglu"][2] is None
    assert not dswiglu.install(False)
    assert lm._get_act_func_supported_list(_Recipe("delayed"))["swiglu"][2] is None
    assert dswiglu.install(True)  # installed once, switched back on
    assert lm._get_act_func_supported_list(_Recipe("delayed"))["swiglu"][2] is not None


def test_install_without_triton_keeps_te(fake_te, monkeypatch):
    lm, _ = fake_te
    monkeypatch.setattr(dswiglu, "_HAVE_TRITON", False)
    assert not dswiglu.install(True)
    assert lm._get_act_func_supported_list(_Recipe("delayed"))["swiglu"][2] is None


class Float8Quantizer:  # the name the kernel accepts, TE's constructor
    def __init__(self, scale=None, amax=None, dtype=None, rowwise=True, columnwise=True):
        self.scale, self.amax, self.dtype = scale, amax, dtype
        self.rowwise_usage, self.columnwise_usage = rowwise, columnwise


def test_cases_the_kernel_does_not_cover_take_te_kernels(fake_te):
    _, calls = fake_te
    g, x = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 16, dtype=torch.bfloat16)
    q = Float8Quantizer(dtype=_TEDType.kFloat8E5M2)
    assert not dswiglu.available(g, x, q)  # CPU tensors
    assert dswiglu.dswiglu_quantize(g, x, q) == ("dbias", g)
    assert calls == [("dswiglu", None), ("bgrad_quantize", q)]

    class OtherQuantizer:
        pass

    assert dswiglu.fits(g, x, q) and dswiglu.fits(g.half(), x.half(), q)
    assert dswiglu.fits(g.view(2, 2, 8), x, q)  # [s, b, n] against [s * b, 2n]
    assert not dswiglu.fits(g, x, OtherQuantizer())  # current scaling, MXFP8, ...
    assert not dswiglu.fits(g, x.float(), q)
    assert not dswiglu.fits(g.float(), x.float(), q)
    assert not dswiglu.fits(g, x[:, :12], q)
    assert not dswiglu.fits(g, x[:2], q)


def _fp8(q, data, amax=3.0):
    q.amax.copy_(torch.clamp(q.amax, min=amax))  # a cast maxes its amax into the history slot
    t = types.SimpleNamespace(_data=data, _transpose=data.flip(0), _scale_inv=torch.ones(1))
    return "dbias", t


@pytest.mark.parametrize("wrong", [None, "bytes", "amax", "raises"])
def test_first_call_checks_the_kernel_against_te(monkeypatch, wrong):
    """The first call runs both ways on scratch amaxes: the kernel is used only if its bytes,
    amax and scale_inv are TE's; otherwise (or if it does not build) a warning, and TE's kernels
    from then on. The run's own amax is moved only by the call that counts."""
    used = []

    def te(g, x, q):
        used.append("te")
        return _fp8(q, torch.arange(6))

    def fused(g, x, q, **kw):
        used.append("fused")
        if wrong == "raises":
            raise RuntimeError("no kernel")
        data = torch.arange(6)
        if wrong == "bytes":
            data[4] = 0
        return _fp8(q, data, 5.0 if wrong == "amax" else 3.0)

    monkeypatch.setattr(dswiglu, "available", lambda *a: True)
    monkeypatch.setattr(dswiglu, "_te", te)
    monkeypatch.setattr(dswiglu, "_fused", fused)
    monkeypatch.setattr(dswiglu, "_checked", {})
    g, x = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 16, dtype=torch.bfloat16)
    q = Float8Quantizer(torch.ones(1), torch.zeros(1), "E5M2")
    if wrong is None:
        dswiglu.dswiglu_quantize(g, x, q)
        assert used == ["te", "fused", "te", "fused", "fused"]  # two scales checked, the call
    else:
        with pytest.warns(UserWarning, match="differs from TE's kernels"):
            dswiglu.dswiglu_quantize(g, x, q)
        assert used[-1] == "te" and used.count("fused") == 1
    used.clear()
    dswiglu.dswiglu_quantize(g, x, q)  # checked once per dtype pair
    assert used == (["fused"] if wrong is None else ["te"])


def test_the_check_leaves_the_runs_amax_alone_and_starts_its_own_from_zero(monkeypatch):
    """The scratch amaxes start at zero (an earlier, larger amax would hide a wrong one) and the
    run's amax is not moved by the check."""
    seen = []

    def cast(amax):
        def run(g, x, q, **kw):
            seen.append(float(q.amax))
            return _fp8(q, torch.arange(6), amax)

        return run

    monkeypatch.setattr(dswiglu, "_te", cast(3.0))
    monkeypatch.setattr(dswiglu, "_fused", cast(2.0))  # a wrong amax
    q = Float8Quantizer(torch.ones(1), torch.full((1,), 9.0), "E5M2")
    assert dswiglu._same_bytes(None, None, q) == "amax (1 of 1)"
    assert seen == [0.0, 0.0] and float(q.amax) == 9.0
    monkeypatch.setattr(dswiglu, "_fused", cast(3.0))
    assert dswiglu._same_bytes(None, None, q) is None


class _TEDType(enum.IntEnum):  # TE's DType: an IntEnum, whose str() is its number
    kBFloat16 = 4
    kFloat8E4M3 = 7
    kFloat8E5M2 = 8


def test_the_fp8_format_is_read_from_tes_enum_by_name():
    g, x = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 16, dtype=torch.bfloat16)
    assert str(_TEDType.kFloat8E5M2) == "8"
    q = Float8Quantizer(torch.ones(1), torch.zeros(1), _TEDType.kFloat8E5M2)
    assert dswiglu._torch_fp8(q) == torch.float8_e5m2
    q.dtype = _TEDType.kFloat8E4M3
    assert dswiglu._torch_fp8(q) == torch.float8_e4m3fn
    q.dtype = "DType.kFloat8E5M2"  # TE's pybind enum's str
    assert dswiglu._torch_fp8(q) == torch.float8_e5m2
    q.dtype = _TEDType.kBFloat16  # not an FP8 format: TE's kernels
    assert dswiglu._torch_fp8(q) is None and not dswiglu.fits(g, x, q)


def _scale_dependent(wrong_above_one: bool):
    """A cast whose bytes are all zero at scale 1 (small gradients) and not above it; with
    ``wrong_above_one`` the kernel's bytes differ from TE's only there."""

    def run(g, x, q, **kw):
        big = float(q.scale.flatten()[0]) > 1
        data = torch.arange(6) if big else torch.zeros(6, dtype=torch.int64)
        if big and wrong_above_one:
            data = data.flip(0)
        return _fp8(q, data, 1e-3)

    return run


def test_the_check_compares_again_over_the_whole_fp8_range(monkeypatch):
    """At the run's scale small gradients can all round to zero, which any encoding writes
    alike; the check compares again at a scale that puts the call's amax at the top of the FP8
    range, and catches what differs only there."""
    monkeypatch.setattr(dswiglu, "available", lambda *a: True)
    monkeypatch.setattr(dswiglu, "_te", _scale_dependent(False))
    monkeypatch.setattr(dswiglu, "_fused", _scale_dependent(True))
    monkeypatch.setattr(dswiglu, "_checked", {})
    q = Float8Quantizer(torch.ones(1), torch.zeros(1), _TEDType.kFloat8E5M2)
    diff = dswiglu._same_bytes(None, None, q)
    # 57344 / 1e-3 lies between 2^25 and 2^26
    assert diff == ("row-wise data (6 of 6) at scale 3.35544e+07, "
                    "column-wise data (6 of 6) at scale 3.35544e+07")  # fmt: skip
    assert float(q.amax) == 0.0  # the run's amax untouched by the check
    g, x = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 16, dtype=torch.bfloat16)
    with pytest.warns(UserWarning, match="at scale"):
        dswiglu.dswiglu_quantize(g, x, q)
    assert dswiglu._checked == {(torch.bfloat16, torch.float8_e5m2): False}
    monkeypatch.setattr(dswiglu, "_fused", _scale_dependent(False))
    assert dswiglu._same_bytes(None, None, q) is None


def test_a_call_with_nothing_to_compare_leaves_the_check_to_a_later_call(monkeypatch, recwarn):
    used, amax = [], [0.0]

    def cast(name):
        def run(g, x, q, **kw):
            used.append(name)
            return _fp8(q, torch.zeros(6, dtype=torch.int64), amax[0])

        return run

    monkeypatch.setattr(dswiglu, "available", lambda *a: True)
    monkeypatch.setattr(dswiglu, "_te", cast("te"))
    monkeypatch.setattr(dswiglu, "_fused", cast("fused"))
    monkeypatch.setattr(dswiglu, "_checked", {})
    g, x = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 16, dtype=torch.bfloat16)
    q = Float8Quantizer(torch.ones(1), torch.zeros(1), _TEDType.kFloat8E5M2)
    for value in (0.0, float("inf")):  # all zero; not finite
        amax[0] = value
        used.clear()
        dswiglu.dswiglu_quantize(g, x, q)
        assert used == ["te", "fused", "te"] and dswiglu._checked == {}
    amax[0] = 0.5
    used.clear()
    dswiglu.dswiglu_quantize(g, x, q)
    assert used == ["te", "fused", "te", "fused", "fused"]
    assert dswiglu._checked == {(torch.bfloat16, torch.float8_e5m2): True}
    assert not [w for w in recwarn if "differs from TE" in str(w.message)]


def test_the_bias_gradient_is_written_unless_every_mlp_built_has_no_fc1_bias(monkeypatch):
    """TE drops fc1's bias gradient when the MLP has no bias: the kernel skips it only after the
    backend said so for every MLP it built; one with a bias keeps it on for the process, and a
    process that never said (a te.LayerNormMLP built directly) gets it."""
    asked = []

    def fused(g, x, q, bias_grad=True, config=None):
        asked.append(bias_grad)
        return ("dbias" if bias_grad else None), g

    monkeypatch.setattr(dswiglu, "available", lambda *a: True)
    monkeypatch.setattr(dswiglu, "_fused", fused)
    monkeypatch.setattr(dswiglu, "_checked", {(torch.bfloat16, torch.float8_e5m2): True})
    monkeypatch.setattr(dswiglu, "_installed", {})
    g, x = torch.zeros(4, 8, dtype=torch.bfloat16), torch.zeros(4, 16, dtype=torch.bfloat16)
    q = Float8Quantizer(torch.ones(1), torch.zeros(1), "E5M2")
    assert dswiglu.dswiglu_quantize(g, x, q)[0] == "dbias"  # never told: written
    dswiglu.biased_mlp(False)
    dswiglu.biased_mlp(False)
    assert dswiglu.dswiglu_quantize(g, x, q)[0] is None
    dswiglu.biased_mlp(True)
    dswiglu.biased_mlp(False)  # built later without a bias: the biased one still needs it
    assert dswiglu.dswiglu_quantize(g, x, q)[0] == "dbias"
    assert asked == [True, False, True]


def test_the_launch_from_the_environment_is_checked_in_one_line():
    assert dswiglu.parse_launch("BM=128, bn=64,WARPS=8,RCP=1,CLAMP=0") == {
        "BM": 128, "BN": 64, "WARPS": 8, "RCP": True, "CLAMP": False
    }  # fmt: skip
    assert dswiglu.parse_launch("") == {}
    assert dswiglu.parse_launch(dswiglu.launch_spec(dswiglu.CONFIG)) == dswiglu.CONFIG
    bad = {"BM=x": "'BM=x' is not KEY=INTEGER", "TILE=4": "KEY one of BM, BN",
           "BN=96": "BN=96 is not a power of two", "WARPS=0": "WARPS=0"}  # fmt: skip
    for spec, says in bad.items():
        with pytest.raises(ValueError, match=says):
            dswiglu.parse_launch(spec)


def test_the_forward_goes_in_beside_the_backward_and_comes_out_alone(fake_te):
    lm, _ = fake_te
    assert swiglu_fwd.install(True)
    table = lm._get_act_func_supported_list  # TE's, wrapped once
    assert table(_Recipe("delayed"))["swiglu"] == (swiglu_fwd.swiglu_quantize, "dswiglu", None)
    assert dswiglu.install(True)
    both = (swiglu_fwd.swiglu_quantize, "dswiglu", dswiglu.dswiglu_quantize)
    assert table(_Recipe("delayed"))["swiglu"] == both
    for other in (_Recipe("mxfp8"), _Recipe("current"), None):
        assert table(other)["swiglu"] == ("swiglu", "dswiglu", None)
    assert not swiglu_fwd.install(False)
    assert table(_Recipe("delayed"))["swiglu"] == ("swiglu", "dswiglu", dswiglu.dswiglu_quantize)
    assert table(_Recipe("delayed"))["silu"] == ("silu", "dsilu", "dbias_dsilu")


def test_forward_install_without_triton_keeps_te(fake_te, monkeypatch):
    lm, _ = fake_te
    monkeypatch.setattr(dswiglu, "_HAVE_TRITON", False)
    assert not swiglu_fwd.install(True)
    assert lm._get_act_func_supported_list(_Recipe("delayed"))["swiglu"][0] == "swiglu"


def test_forward_cases_the_kernel_does_not_cover_take_tes_kernel(fake_te):
    _, calls = fake_te
    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    q = Float8Quantizer(dtype=_TEDType.kFloat8E4M3)
    assert swiglu_fwd.fits(x, q) and swiglu_fwd.fits(x.half().view(2, 2, 16), q)
    assert not swiglu_fwd.available(x, q)  # a CPU tensor
    assert swiglu_fwd.swiglu_quantize(x, q) is x
    assert swiglu_fwd.swiglu_quantize(x, None) is x  # TE's high-precision call
    assert calls == [("swiglu", q), ("swiglu", None)]

    class OtherQuantizer:
        pass

    assert not swiglu_fwd.fits(x, OtherQuantizer())
    assert not swiglu_fwd.fits(x.float(), q)
    assert not swiglu_fwd.fits(x[:, :15], q)  # odd: no [activation | gate] halves
    q.dtype = _TEDType.kBFloat16
    assert not swiglu_fwd.fits(x, q)


@pytest.mark.parametrize("wrong", [None, "bytes", "raises"])
def test_the_forwards_first_call_checks_it_against_te(monkeypatch, wrong):
    used = []

    def te(x, q):
        used.append("te")
        return _fp8(q, torch.arange(6))[1]

    def fused(x, q, **kw):
        used.append("fused")
        if wrong == "raises":
            raise RuntimeError("no kernel")
        return _fp8(q, torch.arange(6).flip(0) if wrong else torch.arange(6))[1]

    monkeypatch.setattr(swiglu_fwd, "available", lambda *a: True)
    monkeypatch.setattr(swiglu_fwd, "_te", te)
    monkeypatch.setattr(swiglu_fwd, "_fused", fused)
    monkeypatch.setattr(swiglu_fwd, "_checked", {})
    x = torch.zeros(4, 16, dtype=torch.bfloat16)
    q = Float8Quantizer(torch.ones(1), torch.zeros(1), _TEDType.kFloat8E4M3)
    if wrong is None:
        swiglu_fwd.swiglu_quantize(x, q)
        assert used == ["te", "fused", "te", "fused", "fused"]
    else:
        with pytest.warns(UserWarning, match="fused SwiGLU forward differs.*--no-te-fused-swiglu"):
            swiglu_fwd.swiglu_quantize(x, q)
        assert used[-1] == "te" and used.count("fused") == 1
    assert float(q.amax) == 3.0  # the run's amax moved by the call itself only
    used.clear()
    swiglu_fwd.swiglu_quantize(x, q)
    assert used == (["fused"] if wrong is None else ["te"])


def test_the_forwards_launch_from_the_environment_is_checked_in_one_line():
    cfg, env = swiglu_fwd.CONFIG, swiglu_fwd.LAUNCH_ENV
    assert dswiglu.parse_launch("BM=64,WARPS=8,TRANS=1", cfg, env) == {
        "BM": 64, "WARPS": 8, "TRANS": True
    }  # fmt: skip
    with pytest.raises(ValueError, match="MEGAFP8_SWIGLU_LAUNCH: 'BK=4' is not KEY=INTEGER"):
        dswiglu.parse_launch("BK=4", cfg, env)
