"""fp8/swiglu_fwd.py on the GPU: the one-kernel SwiGLU forward with its FP8 cast and transpose
writes TE's bytes (``swiglu(x, quantizer)``: row-wise and column-wise data, amax, scale_inv) for
shapes that are not multiples of its tiles, each usage, both FP8 formats and every launch the
probe times; and te.LayerNormMLP run with it installed gives the same outputs and gradients, bit
for bit, as with TE's own kernel."""

import pytest
import torch

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _quantizer(fmt, row=True, col=True):
    import transformer_engine.pytorch  # noqa: F401 (loads TE's core library first)
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    dt = tex.DType.kFloat8E5M2 if fmt == "e5m2" else tex.DType.kFloat8E4M3
    scale = torch.full((1,), 2.0**4, device="cuda")
    amax = torch.full((1,), 1e-9, device="cuda")  # an earlier cast's amax, kept if larger
    return Float8Quantizer(scale, amax, dt, rowwise=row, columnwise=col)


def _bytes_equal(shape, fmt, row=True, col=True, config=None):
    from megafp8.fp8 import swiglu_fwd

    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    *lead, n = shape
    x = (torch.randn(*lead, 2 * n, device="cuda", generator=gen) * 3).bfloat16()
    x.view(-1)[:64] = torch.tensor([0.0, -0.0, 90.0, -90.0] * 16)  # exp under/overflow
    x.view(-1, 2 * n)[1, :8] = 200.0  # with the gate below, beyond FP8's range: saturate
    x.view(-1, 2 * n)[1, n : n + 8] = torch.tensor([300.0, -300.0] * 4)
    # TE's kernel writes the column-wise copy from the row-wise one (it needs both); the kernel
    # writes what is asked
    qt, qo = _quantizer(fmt), _quantizer(fmt, row, col)
    assert swiglu_fwd.available(x, qo)
    t = swiglu_fwd._te(x, qt)
    o = swiglu_fwd._fused(x, qo, config=config)  # the kernel itself, not the checked entry
    assert t._data is not None and t._transpose is not None  # a GPU whose GEMM needs it
    assert (o._data is not None) == row and (o._transpose is not None) == col
    if row:
        assert torch.equal(o._data, t._data)
    if col:
        assert torch.equal(o._transpose, t._transpose)
    assert torch.equal(o._scale_inv, t._scale_inv)
    assert torch.equal(qo.amax, qt.amax)


@pytest.mark.parametrize(
    "shape,fmt,row,col",
    [
        ((1040, 400), "e4m3", True, True),  # neither dim a multiple of the tile
        ((64, 3, 176), "e4m3", True, True),  # [s, b, n]
        ((512, 256), "e5m2", True, True),
        ((512, 256), "e4m3", True, False),
        ((512, 256), "e4m3", False, True),
    ],
)
def test_bytes_equal_tes_kernel(shape, fmt, row, col):
    _bytes_equal(shape, fmt, row, col)


@pytest.mark.parametrize(
    "config",
    [
        {"RCP": False},
        {"CLAMP": False},  # the cast saturates by itself
        {"TRANS": True},
        {"BM": 64, "BN": 64, "WARPS": 4},
        {"BM": 128, "BN": 64, "WARPS": 8},
        {"BM": 64, "BN": 128, "WARPS": 8, "TRANS": True},
    ],
)
def test_every_launch_variant_writes_tes_bytes(config):
    _bytes_equal((1040, 400), "e4m3", config=config)


@pytest.mark.parametrize("bias", [False, True])
def test_layernorm_mlp_same_bits_with_it(bias):
    """Three forward and backward passes (the FP8 scales updated between them): outputs and all
    gradients equal bit for bit with the kernel and with TE's own."""
    from megafp8.fp8 import swiglu_fwd
    from tests.gpu.te_mlp import three_passes

    calls = []
    fused = swiglu_fwd._fused

    def run(on: bool):
        swiglu_fwd.install(on)
        return three_passes(bias)

    try:
        swiglu_fwd._fused = lambda *a, **k: calls.append(1) or fused(*a, **k)
        swiglu_fwd._checked.clear()
        mine = run(True)
        assert swiglu_fwd._checked and all(swiglu_fwd._checked.values())  # it ran, not TE's
        n = len(calls)
        assert n >= 3, "the fused kernel was not called"
        ref = run(False)
        assert len(calls) == n
    finally:
        swiglu_fwd._fused = fused
        swiglu_fwd.install(False)
    for a, b in zip(mine[0], ref[0], strict=True):
        assert torch.equal(a, b)
    assert mine[1].keys() == ref[1].keys()
    for name, a in mine[1].items():
        assert torch.equal(a, ref[1][name]), name


def test_the_first_call_check_passes_without_a_warning(recwarn):
    from megafp8.fp8 import swiglu_fwd

    x = torch.randn(256, 256, device="cuda").bfloat16()
    swiglu_fwd._checked.clear()
    swiglu_fwd.swiglu_quantize(x, _quantizer("e4m3"))
    assert swiglu_fwd._checked == {(torch.bfloat16, torch.float8_e4m3fn): True}
    assert not [w for w in recwarn if "differs from TE" in str(w.message)]


def test_the_flag_puts_it_in_te_beside_the_fused_backward():
    import transformer_engine.common.recipe as ter
    from transformer_engine.pytorch.module import layernorm_mlp as lm

    from megafp8.fp8 import dswiglu, swiglu_fwd
    from megafp8.fp8.recipe import Fp8Recipe
    from megafp8.fp8.te_backend import TEBackend
    from megafp8.parallel.mappings import SOLO

    def swiglu():
        return lm._get_act_func_supported_list(ter.DelayedScaling())["swiglu"]

    try:
        off = TEBackend(Fp8Recipe(), amax_group=SOLO, fused_mlp=True)  # the default: TE's
        assert not off.fuses_swiglu and swiglu()[0] is not swiglu_fwd.swiglu_quantize
        on = TEBackend(Fp8Recipe(), amax_group=SOLO, fused_mlp=True, fused_swiglu=True)
        assert on.fuses_swiglu and swiglu()[0] is swiglu_fwd.swiglu_quantize
        assert swiglu()[2] is dswiglu.dswiglu_quantize
        bf16 = TEBackend(None, amax_group=SOLO, fused_mlp=True, fused_swiglu=True)
        assert not bf16.fuses_swiglu and swiglu()[0] is not swiglu_fwd.swiglu_quantize
    finally:
        swiglu_fwd.install(False)
        dswiglu.install(False)
