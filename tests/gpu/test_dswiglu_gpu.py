"""fp8/dswiglu.py on the GPU: the one-kernel SwiGLU backward with its FP8 cast and transpose
writes TE's bytes (``bgrad_quantize(dswiglu(grad, x))``: row-wise and column-wise data, amax,
scale_inv; the bias gradient within the fp32 sum order), for shapes that are not multiples of
its tiles, each usage and both FP8 formats; and te.LayerNormMLP run with it installed gives the
same outputs and gradients, bit for bit (fc1's bias gradient to rounding), as with TE's own
kernels."""

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
    scale = torch.full((1,), 2.0**14 if fmt == "e5m2" else 2.0**8, device="cuda")
    amax = torch.full((1,), 1e-9, device="cuda")  # an earlier cast's amax, kept if larger
    return Float8Quantizer(scale, amax, dt, rowwise=row, columnwise=col)


@pytest.mark.parametrize(
    "shape,fmt,row,col",
    [
        ((1040, 400), "e5m2", True, True),  # neither dim a multiple of the 64 x 64 tile
        ((64, 3, 176), "e5m2", True, True),  # [s, b, n]
        ((512, 256), "e4m3", True, True),
        ((512, 256), "e5m2", True, False),
        ((512, 256), "e5m2", False, True),
    ],
)
def test_bytes_equal_te_two_kernels(shape, fmt, row, col):
    _bytes_equal(shape, fmt, row, col)


@pytest.mark.parametrize("bias_grad", [True, False])
@pytest.mark.parametrize(
    "config",
    [
        {"RCP": True, "TRANS": False},
        {"RCP": True, "CLAMP": False},  # the cast saturates by itself
        {"RCP": False, "TRANS": True},
        {"BM": 128, "BN": 64, "WARPS": 8},
        {"BM": 64, "BN": 128, "WARPS": 4},
        {"BM": 32, "BN": 128, "WARPS": 4, "TRANS": True},
    ],
)
def test_every_launch_variant_writes_tes_bytes(config, bias_grad):
    """The launch variants the kernel probe times (tiles, warps, the reciprocal, the transposed
    store) write the same bytes; without the bias gradient none is returned."""
    _bytes_equal((1040, 400), "e5m2", True, True, config=config, bias_grad=bias_grad)


def _bytes_equal(shape, fmt, row, col, **kw):
    import transformer_engine.pytorch  # noqa: F401 (loads TE's core library first)
    import transformer_engine_torch as tex

    from megafp8.fp8 import dswiglu

    gen = torch.Generator(device="cuda").manual_seed(sum(shape))
    *lead, n = shape
    g = (torch.randn(*shape, device="cuda", generator=gen) * 1e-4).bfloat16()
    x = (torch.randn(*lead, 2 * n, device="cuda", generator=gen) * 3).bfloat16()
    x.view(-1)[:64] = torch.tensor([0.0, -0.0, 90.0, -90.0] * 16)  # exp under/overflow
    g.view(-1)[64:96] = torch.tensor([1e4, -1e4, 3e3, -7e2] * 8)  # beyond FP8's range: saturate
    # TE's cast writes both copies (it refuses a column-wise copy alone); the kernel what is asked
    qt, qo = _quantizer(fmt), _quantizer(fmt, row, col)
    assert dswiglu.available(g, x, qo)
    dact = tex.dswiglu(g, x, None)
    bt, t = tex.bgrad_quantize(dact, qt)
    bo, o = dswiglu._fused(g, x, qo, **kw)  # the kernel itself, not the checked entry
    if row:
        assert torch.equal(o._data, t._data)
    if col:
        assert torch.equal(o._transpose, t._transpose)
    assert torch.equal(o._scale_inv, t._scale_inv)
    assert torch.equal(qo.amax, qt.amax)
    if not kw.get("bias_grad", True):
        assert bo is None
        return
    assert bo.dtype == bt.dtype and bo.shape == bt.shape
    # fp32 sums of the same bf16 values in two orders (each off by at most rows x 2^-24 of the
    # column's sum of magnitudes), each rounded once to bf16 (2^-9 relative)
    d = dact.float().reshape(-1, dact.shape[-1])
    bound = 2**-8 * bt.float().abs() + d.shape[0] * 2**-23 * d.abs().sum(0)
    assert ((bo.float() - bt.float()).abs() <= bound).all()


@pytest.mark.parametrize("bias", [False, True])
def test_layernorm_mlp_same_bits_with_it(bias):
    """Three forward and backward passes (the FP8 scales updated between them): outputs, input
    and weight gradients equal bit for bit; fc1's bias gradient (a column sum in another order)
    equal to rounding."""
    from megafp8.fp8 import dswiglu
    from tests.gpu.te_mlp import three_passes

    calls = []
    fused = dswiglu.dswiglu_quantize

    def run(on: bool):
        dswiglu.install(on)
        dswiglu.biased_mlp(bias)  # as the te backend says it: no fc1 bias, no bias gradient
        return three_passes(bias)

    try:
        dswiglu.dswiglu_quantize = lambda *a, **k: calls.append(1) or fused(*a, **k)
        dswiglu._checked.clear()
        mine = run(True)
        assert calls, "the fused kernel was not called"
        assert dswiglu._checked and all(dswiglu._checked.values())  # it ran, not TE's
        ref = run(False)
        assert len(calls) == 3
    finally:
        dswiglu.dswiglu_quantize = fused
        dswiglu.install(False)
        dswiglu._installed.pop("bias_grad", None)
    for a, b in zip(mine[0], ref[0], strict=True):
        assert torch.equal(a, b)
    assert mine[1].keys() == ref[1].keys()
    for name, a in mine[1].items():
        b = ref[1][name]
        if name == "fc1_bias":
            assert torch.allclose(a, b, rtol=2**-6, atol=2**-6 * float(b.abs().max()))
            assert bool(b.abs().max() > 0)
        else:
            assert torch.equal(a, b), name


def test_the_first_call_check_passes_without_a_warning(recwarn):
    from megafp8.fp8 import dswiglu

    g = (torch.randn(256, 128, device="cuda") * 1e-3).bfloat16()
    x = torch.randn(256, 256, device="cuda").bfloat16()
    dswiglu._checked.clear()
    dswiglu.dswiglu_quantize(g, x, _quantizer("e5m2"))
    assert dswiglu._checked == {(torch.bfloat16, torch.float8_e5m2): True}
    assert not [w for w in recwarn if "differs from TE" in str(w.message)]


def test_the_default_puts_it_in_te_and_the_flag_takes_it_out():
    import transformer_engine.common.recipe as ter
    from transformer_engine.pytorch.module import layernorm_mlp as lm

    from megafp8.fp8 import dswiglu
    from megafp8.fp8.recipe import Fp8Recipe
    from megafp8.fp8.te_backend import TEBackend
    from megafp8.parallel.mappings import SOLO

    def swiglu_bwd():
        return lm._get_act_func_supported_list(ter.DelayedScaling())["swiglu"][2]

    try:
        on = TEBackend(Fp8Recipe(), amax_group=SOLO, fused_mlp=True)  # the default
        assert on.fuses_dswiglu and swiglu_bwd() is dswiglu.dswiglu_quantize
        off = TEBackend(Fp8Recipe(), amax_group=SOLO, fused_mlp=True, fused_dswiglu=False)
        assert not off.fuses_dswiglu and swiglu_bwd() is None
        bf16 = TEBackend(None, amax_group=SOLO, fused_mlp=True, fused_dswiglu=True)
        assert not bf16.fuses_dswiglu and swiglu_bwd() is None
    finally:
        dswiglu.install(False)
