"""Every Triton kernel of megafp8 compiles for an H100/H200 (sm_90) without a GPU: Triton's front
end, its PTX and ptxas, for the launches the code and the kernel probes use. What the kernels
compute is tested on the GPU (tests/gpu); this catches a kernel that no longer builds before a
GPU runs it (a kernel that fails to build falls back to slower library code at run time, with a
warning, so a broken build would otherwise show only as lost speed)."""

import pytest

triton = pytest.importorskip("triton")

from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

SM90 = GPUTarget("cuda", 90, 32)


@pytest.fixture(autouse=True)
def _fresh_cache(tmp_path_factory, monkeypatch):
    """Each run compiles for real (Triton would otherwise reuse its cache in the home folder)."""
    monkeypatch.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.getbasetemp() / "triton"))


def _compile(fn, types: dict, consts: dict, warps: int):
    """``fn`` with its runtime arguments of ``types`` (name -> Triton type) and ``consts``
    (name -> value); returns the cubin."""
    sig = {**types, **{name: "constexpr" for name in consts}}
    src = ASTSource(fn=fn, signature=sig, constexprs=dict(consts))
    k = triton.compile(src, target=SM90, options={"num_warps": warps})
    assert k.asm["cubin"], f"{fn.__name__}: no cubin"
    return k.asm["cubin"]


def _fp8(name):
    return {"e4m3": ("fp8e4nv", 448.0), "e5m2": ("fp8e5", 57344.0)}[name]


SWIGLU_LAUNCHES = [
    {},  # the default
    {"RCP": False, "TRANS": True},
    {"CLAMP": False},
    {"BM": 64, "BN": 64, "WARPS": 8},
    {"BM": 128, "BN": 128, "WARPS": 16},
]


@pytest.mark.parametrize("fmt", ["e4m3", "e5m2"])
@pytest.mark.parametrize("launch", SWIGLU_LAUNCHES)
def test_the_swiglu_kernels_compile(launch, fmt):
    from megafp8.fp8 import dswiglu, swiglu_fwd

    f8, fmax = _fp8(fmt)
    kernels = ((swiglu_fwd, (True, True)), (dswiglu, (True, True)), (dswiglu, (False, True)))
    for mod, usage in kernels:
        c = {**mod.CONFIG, **launch}
        consts = dict(BM=c["BM"], BN=c["BN"], ROWWISE=usage[0], COLWISE=usage[1], FMAX=fmax,
                      RCP=c["RCP"], TRANS=c["TRANS"], CLAMP=c["CLAMP"])  # fmt: skip
        out = {"out_ptr": "*" + f8, "out_t_ptr": "*" + f8}
        scales = {"scale_ptr": "*fp32", "amax_ptr": "*fp32", "scale_inv_ptr": "*fp32"}
        dims = {"M": "i32", "N": "i32"}
        if mod is swiglu_fwd:
            types = {"x_ptr": "*bf16", **out, **scales, **dims}
            fn = mod._swiglu_cast_transpose_kernel
        else:
            types = {"g_ptr": "*bf16", "x_ptr": "*bf16", **out, "dbias_ptr": "*fp32"}
            types.update({**scales, **dims})
            consts["DBIAS"] = usage[0]
            fn = mod._dswiglu_cast_transpose_kernel
        _compile(fn, types, consts, c["WARPS"])


@pytest.mark.parametrize("block,warps", [(2048, 8), (1024, 4), (16384, 16)])
def test_the_adamw_kernel_compiles(block, warps):
    from megafp8.optim import adamw_bf16

    ptrs = {"p_ptr": "*fp32", "g_ptr": "*bf16", "m_ptr": "*fp32", "v_ptr": "*fp32",
            "out_ptr": "*bf16", "n": "i32", "scal_ptr": "*fp32", "scale_ptr": "*fp32",
            "found_ptr": "*fp32"}  # fmt: skip
    names = ["lr_wd", "beta1", "one_minus_beta1", "beta2", "one_minus_beta2", "eps"]
    hyper = dict.fromkeys(names, "fp32")
    for scale in (False, True):
        consts = dict(HAS_SCALE=scale, HAS_FOUND=scale, BLOCK=block)
        _compile(adamw_bf16._adamw_kernel, {**ptrs, **hyper}, consts, warps)


def test_the_cross_entropy_kernels_compile():
    from megafp8.parallel import fused_cross_entropy as ce

    for dt in ("bf16", "fp32"):
        fwd = {"logits_ptr": "*" + dt, "stride": "i32", "target_ptr": "*i64", "start": "i32",
               "n_cols": "i32", "m_ptr": "*fp32", "d_ptr": "*fp32", "zt_ptr": "*fp32"}  # fmt: skip
        _compile(ce._ce_forward_kernel, fwd, {"BLOCK": ce._BLOCK}, ce._WARPS)
        bwd = {"logits_ptr": "*" + dt, "stride": "i32", "out_ptr": "*" + dt, "out_stride": "i32",
               "target_ptr": "*i64", "start": "i32", "n_cols": "i32", "lse_ptr": "*fp32",
               "grad_ptr": "*fp32"}  # fmt: skip
        _compile(ce._ce_backward_kernel, bwd, {"BLOCK": ce._BLOCK}, ce._WARPS)


def test_the_embedding_rows_kernel_compiles():
    from megafp8.parallel import grad_in_place

    types = {"grad_ptr": "*bf16", "g_ptr": "*bf16", "ids_ptr": "*i64", "perm_ptr": "*i64",
             "end_ptr": "*i64", "h": "i32"}  # fmt: skip
    for block in (1024, 128):
        _compile(grad_in_place._add_rows_kernel, types, {"BLOCK": block}, 4)


@pytest.mark.parametrize("groups,hpg,hd", [(8, 4, 128), (32, 1, 96), (4, 2, 64)])
def test_the_qkv_rope_kernels_compile(groups, hpg, hd):
    from megafp8.fp8 import qkv_rope

    launch = qkv_rope._launch_args(groups, hpg, hd)
    warps = launch.pop("num_warps")
    bf = "*bf16"
    fwd = {"qkv_ptr": bf, "ang_ptr": "*fp32", "q_ptr": bf, "k_ptr": bf, "v_ptr": bf,
           "div": "i32", "G": "i32"}  # fmt: skip
    _compile(qkv_rope._forward_kernel, fwd, launch, warps)
    bwd = {"dq_ptr": bf, "dk_ptr": bf, "dv_ptr": bf, "ang_ptr": "*fp32", "dqkv_ptr": bf,
           "div": "i32", "G": "i32"}  # fmt: skip
    _compile(qkv_rope._backward_kernel, bwd, launch, warps)
