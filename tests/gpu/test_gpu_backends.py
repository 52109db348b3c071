"""GPU-only checks (``-m gpu``), run on the GPU machine, never in CI."""

import functools
import math
import os

import pytest
import torch

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_scaled_mm_matches_emulation_on_gpu():
    from megafp8.fp8.recipe import E4M3, E5M2
    from megafp8.fp8.torch_backend import fp8_gemm

    torch.manual_seed(0)
    a = torch.randn(256, 512, device="cuda").to(E4M3)
    b = torch.randn(128, 512, device="cuda").to(E5M2)
    sa, sb = torch.tensor(0.5, device="cuda"), torch.tensor(2.0, device="cuda")
    got = fp8_gemm(a, sa, b.t(), sb, torch.float32, "scaled_mm")
    # The reference in float64: Hopper's FP8 tensor cores accumulate with fewer bits than fp32
    # (about 14 between cuBLAS's promotions to fp32), so compare norm-relative errors, not bits;
    # a wrong scale or operand order would be off by O(1).
    ref = (a.double() * 0.5) @ (b.double() * 2.0).t()
    rel = ((got.double() - ref).norm() / ref.norm()).item()
    assert rel < 2e-3, rel


def _te():
    return pytest.importorskip("transformer_engine.pytorch")


@cuda
@pytest.mark.parametrize("recipe", ["delayed", "tensorwise"])
def test_te_linear_fp8_error_bounds(recipe):
    _te()
    from megafp8.config import Fp8Config
    from megafp8.fp8.backend import build_backend
    from megafp8.parallel.mappings import SOLO

    f = Fp8Config(fp8_format="hybrid", fp8_recipe=recipe, fp8_backend="te", fp8_amax_history_len=4)
    be = build_backend(f, amax_group=SOLO, tp_group=SOLO)
    lin = be.make_linear(256, 128, False, name="l", group=SOLO, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        lin.weight.normal_(0, 0.02)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ lin.weight.float().t()
    for _ in range(3):  # delayed scaling needs a step to see amaxes
        with be.autocast():
            y = lin(x)
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert 1e-4 < rel < 0.06


def _fp8_gemms(model, backend):
    """The model's GEMM modules that run in FP8 (TE modules with FP8 on, or our Fp8Linear); a
    fused MLP (te.LayerNormMLP, the default) is one module of two GEMMs."""
    if backend == "te":
        from megafp8.fp8.te_backend import TEFusedMLP, TELinear

        kinds = (TELinear, TEFusedMLP)
        return [m for m in model.modules() if isinstance(m, kinds) and m.fp8]
    from megafp8.fp8.torch_backend import Fp8Linear

    return [m for m in model.modules() if isinstance(m, Fp8Linear)]


def _loss_without_fp8(model, backend, gemms, batch):
    """The same weights and batch with every FP8 GEMM switched to its bf16 path."""
    from megafp8.fp8.plain_ops import PlainLinear

    for m in gemms:
        if backend == "te":
            m.fp8 = False  # TELinear then runs under te.autocast(enabled=False)
        else:
            m.forward = functools.partial(PlainLinear.forward, m)  # torch's bf16 GEMM
    try:
        with torch.no_grad():
            return float(model(*batch))
    finally:
        for m in gemms:
            if backend == "te":
                m.fp8 = True
            else:
                del m.forward


@cuda
@pytest.mark.parametrize("backend", ["te", "torch"])
def test_tiny_gpt_trains_in_fp8_on_gpu(backend):
    """A tiny GPT learns with FP8 GEMMs, and FP8 really ran (it cannot pass with FP8 silently
    off): the backend is an FP8 one, all 4 GEMMs of every block (qkv, proj, fc1, fc2) are FP8
    modules, after training each holds non-zero amaxes of its input, weight and output gradient
    in its delayed-scaling history and a scale moved off its initial 1, and the trained model's
    loss on a batch changes when the same weights run their GEMMs in bf16 instead."""
    if backend == "te":
        _te()
    os.environ.setdefault("MASTER_PORT", "29533")
    from megafp8.config import Config
    from megafp8.train import build_run, init_distributed, train

    cfg = Config().replace(
        model=dict(
            num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=128, vocab_size=512
        ),
        fp8=dict(fp8_format="hybrid", fp8_backend=backend, fp8_amax_history_len=16),
        train=dict(micro_batch_size=8, global_batch_size=16, train_iters=30, bf16=True),
        optim=dict(lr=3e-3, min_lr=3e-4, lr_warmup_iters=3, zero_stage=2),
        data=dict(mock_data=True),
        logging=dict(log_interval=10),
    )
    groups, device = init_distributed(cfg)
    run = build_run(cfg, groups, device)
    assert run.backend.name == backend and run.backend.fp8
    gemms = _fp8_gemms(run.model, backend)
    per_module = [2 if type(m).__name__ == "TEFusedMLP" else 1 for m in gemms]
    assert sum(per_module) == 4 * cfg.model.num_layers
    assert backend != "te" or len(gemms) == 3 * cfg.model.num_layers  # qkv, proj, fused MLP
    losses = [r["lm loss"] for r in train(cfg, run)]
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5

    if backend == "te":  # TE's DelayedScaling state: forward [input, weight, output] per GEMM,
        for m in gemms:  # backward [grad output, grad input]; amax_history is [len, tensors]
            fwd, bwd = m.inner.fp8_meta["scaling_fwd"], m.inner.fp8_meta["scaling_bwd"]
            for i in range(fwd.scale.numel() // 3):  # input and weight of each of its GEMMs
                f, b = slice(3 * i, 3 * i + 2), 2 * i
                assert (fwd.amax_history.amax(0)[f] > 0).all() and (fwd.scale[f] != 1).all()
                assert bwd.amax_history.amax(0)[b] > 0 and bwd.scale[b] != 1
    else:  # our recipe: one ScalingMeta per (GEMM, role x / w / g)
        metas = run.backend.state.metas
        assert len(metas) == 3 * len(gemms)
        for key, meta in metas.items():
            assert meta.amax_history.max() > 0 and meta.scale != 1, key

    g = torch.Generator(device="cpu").manual_seed(0)
    tokens = torch.randint(0, 512, (8, 129), generator=g).to(device)
    batch = (tokens[:, :-1], tokens[:, 1:], torch.ones(8, 128, device=device))
    run.model.eval()
    run.backend.microbatch(None)
    with torch.no_grad(), run.backend.autocast():
        fp8_loss = float(run.model(*batch))
    with run.backend.autocast():
        bf16_loss = _loss_without_fp8(run.model, backend, gemms, batch)
    # FP8 quantization moves the loss, but only by its noise (a few percent at most)
    assert fp8_loss != bf16_loss
    assert abs(fp8_loss - bf16_loss) < 0.05 * bf16_loss


@cuda
def test_te_weight_cache_reuses_the_cast_within_an_iteration():
    """Micro-batch 0 casts the weight to FP8 and keeps it; later micro-batches reuse that cast
    (so an in-place change of the weight is not seen until the next iteration); None recasts."""
    _te()
    from megafp8.config import Fp8Config
    from megafp8.fp8.backend import build_backend
    from megafp8.parallel.mappings import SOLO

    f = Fp8Config(fp8_format="hybrid", fp8_backend="te", fp8_amax_history_len=4)
    be = build_backend(f, amax_group=SOLO, tp_group=SOLO)
    lin = be.make_linear(256, 128, False, name="l", group=SOLO, dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        lin.weight.normal_(0, 0.02)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)

    def fwd(index):
        be.microbatch(index)
        with be.autocast(), torch.no_grad():
            return lin(x).float()

    for _ in range(2):  # let the delayed scales settle
        fwd(None)
    y0 = fwd(0)
    with torch.no_grad():
        lin.weight.mul_(0.5)
    assert torch.equal(fwd(1), y0)  # the cached cast of the old weight
    for index in (None, 0):  # no cache, or a new iteration: the new weight
        rel = ((fwd(index) - 0.5 * y0).norm() / y0.norm()).item()
        assert rel < 0.02
    be.weight_cache = False
    be.microbatch(1)
    assert be.cache.first is None


@cuda
@pytest.mark.parametrize("kernel", ["triton", "te"])
@pytest.mark.parametrize("hd", [64, 96])
@pytest.mark.parametrize("docs", [False, True], ids=["positions", "documents"])
@pytest.mark.parametrize("hpg", [1, 4])
def test_te_fused_qkv_rope_equals_the_torch_path(hpg, docs, hd, kernel, monkeypatch):
    """The te backend splits the grouped QKV output and applies RoPE in one kernel (ours in
    Triton, or TE's where Triton is missing); the plain backend splits with views and rotates in
    fp32 torch ops. Both compute x cos + rot(x) sin in fp32 from the same angles and round once
    to bf16, so they differ only where their fp32 sin and cos (~1e-7 relative apart) put a value
    on the other side of a bf16 rounding boundary: at most one bf16 ulp (2^-8 relative) per
    element, plus ~1e-6 of the input scale where the two products cancel. Gradients: the fused
    backward rotates in fp32 and rounds once; the torch path's autograd rounds each of g cos and
    rot(g) sin to bf16 (the backward of ``.float()``) before adding them, so it is off by up to
    two half-ulps of a term bounded by max|dy|: 2 x 2^-9 x 2^ceil(log2 max|dy|), on top of one
    rounding (2^-7 relative). ``documents``: one sample whose positions restart after each EOD
    (``--reset-position-ids``), the tables gathered per position (TE's kernel takes one row per
    position, so that case is the torch path when Triton is missing). Head dim 96: halves of 48
    columns, padded to 64 in the Triton kernel."""
    _te()
    pytest.importorskip("triton")
    from megafp8.config import Fp8Config
    from megafp8.fp8 import qkv_rope
    from megafp8.fp8.backend import Backend, build_backend
    from megafp8.model.documents import document_positions, gather_tables
    from megafp8.parallel.mappings import SOLO

    launched = []
    if kernel == "te":
        monkeypatch.setattr(qkv_rope, "available", lambda qkv: False)
    else:
        run = qkv_rope.split_qkv_rope
        monkeypatch.setattr(qkv_rope, "split_qkv_rope", lambda *a: launched.append(1) or run(*a))
    te_be = build_backend(Fp8Config(fp8_backend="te"), amax_group=SOLO, tp_group=SOLO)
    s, b, g = 128, 1 if docs else 2, 2
    torch.manual_seed(0)
    x = torch.randn(s, b, g, (hpg + 2) * hd, device="cuda", dtype=torch.bfloat16)
    dy = [torch.randn(s, b, n, hd, device="cuda", dtype=torch.bfloat16) for n in (g * hpg, g, g)]
    tokens = torch.arange(s, device="cuda").view(1, s)
    pos = document_positions(tokens.masked_fill(tokens % 37 == 36, -1), -1)  # 4 documents
    outs, grads = [], []
    for be in (te_be, Backend()):
        xi = x.clone().requires_grad_()
        tables = be.rope_tables(s, hd, 500000.0, "cuda")
        q, k, v = be.split_qkv(xi, hpg, gather_tables(tables, pos) if docs else tables)
        sum((t.float() * d.float()).sum() for t, d in zip((q, k, v), dy, strict=True)).backward()
        outs.append([t.detach() for t in (q, k, v)])
        grads.append(xi.grad)
    assert len(launched) == (kernel == "triton")
    scale = float(x.abs().max())
    for name, got, ref in zip("qkv", outs[0], outs[1], strict=True):
        assert got.shape == ref.shape, (name, got.shape, ref.shape)
        assert got.is_contiguous() or kernel == "te"  # the torch path's v is a view
        d = (got.float() - ref.float()).abs()
        worst = float((d / (ref.float().abs() * 2**-7 + 1e-5 * scale)).max())
        assert worst <= 1.0, (name, float(d.max()), worst, _where(d))
    d = (grads[0].float() - grads[1].float()).abs()
    big = 2.0 ** math.ceil(math.log2(max(float(t.abs().max()) for t in dy)))
    worst = float((d / (grads[1].float().abs() * 2**-7 + 2 * 2**-9 * big)).max())
    assert worst <= 1.0, ("grad", float(d.max()), worst, _where(d))


@cuda
@pytest.mark.parametrize("hpg", [1, 4])
def test_te_split_without_rope_equals_the_torch_split(hpg, monkeypatch):
    """Without RoPE the te backend splits through TE's SplitAlongDim (its backward hands back the
    dqkv buffer TE's attention wrote, instead of copying three gradients into a new one): the
    same q, k, v bit for bit and, through TE's attention (deterministic kernels), the same qkv
    gradient; one bf16 rounding of slack in case the attention's dq sums change order."""
    monkeypatch.setenv("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
    _te()
    import transformer_engine.pytorch as te

    from megafp8.config import Fp8Config
    from megafp8.fp8.backend import Backend, build_backend
    from megafp8.parallel.mappings import SOLO

    te_be = build_backend(Fp8Config(fp8_backend="te"), amax_group=SOLO, tp_group=SOLO)
    s, b, g, hd = 128, 2, 4, 64
    attn = te.DotProductAttention(g * hpg, hd, num_gqa_groups=g, attn_mask_type="causal",
                                  qkv_format="sbhd")  # fmt: skip
    torch.manual_seed(0)
    x = torch.randn(s, b, g, (hpg + 2) * hd, device="cuda", dtype=torch.bfloat16)
    dy = torch.randn(s, b, g * hpg * hd, device="cuda", dtype=torch.bfloat16)
    outs, grads = [], []
    for be in (te_be, Backend()):
        xi = x.clone().requires_grad_()
        q, k, v = be.split_qkv(xi, hpg)
        outs.append([t.detach().clone() for t in (q, k, v)])
        (attn(q, k, v) * dy).float().sum().backward()
        grads.append(xi.grad)
    for got, ref in zip(outs[0], outs[1], strict=True):
        assert got.shape == ref.shape and torch.equal(got, ref)
    top = float(grads[1].abs().max())
    torch.testing.assert_close(grads[0], grads[1], rtol=2**-7, atol=2**-8 * top)
    assert top > 0


def _where(d):
    """Index of the largest difference (position first: RoPE's angle grows with it)."""
    return [int(i) for i in torch.unravel_index(d.argmax(), d.shape)]


@cuda
@pytest.mark.parametrize("backend", ["te", "torch"])
def test_fp8_stats_on_gpu(backend):
    """``--log-fp8-stats`` on both backends: every GEMM (qkv, proj, fc1, fc2 of each layer) and
    role (x, w, g) reports a positive amax and a learned scale after a few delayed-scaling steps;
    the torch backend also the saturated and flushed shares (in [0, 1])."""
    if backend == "te":
        _te()
    os.environ.setdefault("MASTER_PORT", "29534")
    from megafp8.config import Config
    from megafp8.train import build_run, init_distributed, train_step

    cfg = Config().replace(
        model=dict(
            num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=128, vocab_size=512
        ),
        fp8=dict(fp8_format="hybrid", fp8_backend=backend, fp8_amax_history_len=16),
        train=dict(micro_batch_size=8, global_batch_size=16, train_iters=4, bf16=True),
        data=dict(mock_data=True),
        logging=dict(log_interval=2, log_fp8_stats=True),
    )
    groups, device = init_distributed(cfg)
    run = build_run(cfg, groups, device)
    it = iter(run.data.train)
    for i in range(4):  # delayed scaling: the scales move from 1 after the first updates
        if i == 3:
            run.backend.start_fp8_stats()
        train_step(run, it)
        run.iteration += 1
        run.consumed += cfg.train.global_batch_size  # where the lr schedule stands
    stats = run.backend.fp8_stats(run.model)
    gemms = [f"layers.{i}.{g}" for i in range(2) for g in ("attn.qkv", "attn.proj", "mlp.fc1",
                                                            "mlp.fc2")]  # fmt: skip
    for g in gemms:
        for r in "xwg":
            assert stats[f"{g}.{r}/amax"] > 0 and stats[f"{g}.{r}/scale"] != 1.0, (g, r, stats)
            if backend == "torch":
                assert 0.0 <= stats[f"{g}.{r}/saturated"] <= 1.0
                assert 0.0 <= stats[f"{g}.{r}/flushed"] <= 1.0


@cuda
@pytest.mark.parametrize("backend, grouped", [("te", False), ("te", True), ("torch", False)])
def test_moe_trains_in_fp8_on_gpu(backend, grouped):
    """A tiny MoE GPT (4 experts, top-2, aux and z losses) trains in FP8 on both backends (on te
    also with TE's grouped GEMM): the experts' GEMMs take their token rows padded to 16, the
    router's GEMM runs in fp32 from the bf16 weights DeepSpeed holds."""
    if backend == "te":
        _te()
    os.environ.setdefault("MASTER_PORT", "29535")
    from megafp8.config import Config
    from megafp8.train import build_run, init_distributed, train

    cfg = Config().replace(
        model=dict(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=128,
                   vocab_size=512, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=64,
                   moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3, moe_grouped_gemm=grouped),
        fp8=dict(fp8_format="hybrid", fp8_backend=backend, fp8_amax_history_len=16),
        train=dict(micro_batch_size=8, global_batch_size=16, train_iters=20, bf16=True),
        optim=dict(lr=3e-3, min_lr=3e-4, lr_warmup_iters=3),
        data=dict(mock_data=True),
        logging=dict(log_interval=10),
    )  # fmt: skip
    groups, device = init_distributed(cfg)
    run = build_run(cfg, groups, device)
    layer = run.model.layers["0"].mlp
    assert type(layer.experts).__name__ == ("GroupedExperts" if grouped else "ModuleList")
    losses = [r["lm loss"] for r in train(cfg, run)]
    assert all(math.isfinite(v) for v in losses)
    assert sum(losses[-5:]) / 5 < losses[0] - 0.3


@cuda
def test_te_grouped_experts_equal_the_loop_in_bf16():
    """TE's GroupedLinear holds the loop's weights and gives its outputs and gradients (BF16:
    up to the GEMM kernels' rounding)."""
    _te()
    import torch

    from megafp8.config import Config
    from megafp8.fp8.backend import build_backend
    from megafp8.model.moe import MoELayer
    from megafp8.parallel.mappings import SOLO

    cfg = Config().replace(model=dict(num_layers=2, hidden_size=128, num_attention_heads=4,
                                      seq_length=64, vocab_size=512, num_experts=4,
                                      moe_router_topk=2, moe_ffn_hidden_size=64, swiglu=True),
                           fp8=dict(fp8_backend="te"))  # fmt: skip
    be = build_backend(cfg.fp8, amax_group=SOLO, tp_group=SOLO)
    kw = dict(backend=be, layer=0, seed=5, fp8=False, dtype=torch.bfloat16, device="cuda")
    loop = MoELayer(cfg, **kw)
    grouped = MoELayer(cfg.replace(model=dict(moe_grouped_gemm=True)), **kw)
    x = torch.randn(64, 2, 128, device="cuda", dtype=torch.bfloat16)
    ya, yb = loop(x), grouped(x)
    torch.testing.assert_close(yb, ya, rtol=2e-2, atol=2e-3)
    ya.float().square().sum().backward()
    yb.float().square().sum().backward()
    for i, e in enumerate(loop.experts):
        torch.testing.assert_close(grouped.experts.fc1.weights[i].grad, e.fc1.weight.grad,
                                   rtol=3e-2, atol=3e-3)  # fmt: skip


def _accumulated_grads(cfg, fused: bool, micro: int = 4):
    """``micro`` micro-batches' gradients of a tiny GPT on the te backend, summed the way a
    training iteration sums them; and how many weights accumulated inside their wgrad GEMM."""
    from megafp8.fp8.backend import build_backend
    from megafp8.model.gpt import GPTModel
    from megafp8.parallel.groups import ParallelGroups

    torch.cuda.set_device(0)
    groups = ParallelGroups.single()
    be = build_backend(cfg.fp8, amax_group=groups.tp_dp_group, tp_group=groups.tp_group,
                       wgrad_fusion=fused)  # fmt: skip
    model = GPTModel(cfg, backend=be, groups=groups, vocab_size=256, device="cuda")
    g = torch.Generator().manual_seed(3)
    tokens = torch.randint(0, 256, (micro, 2, cfg.model.seq_length + 1), generator=g).cuda()
    for i in range(micro):
        be.microbatch(i)
        with be.autocast():
            loss = model(tokens[i, :, :-1], tokens[i, :, 1:], None)
        (loss / micro).backward()
        be.update()
    n_fused = len(be.cache.fused)
    be.release_main_grads()
    assert not any(hasattr(p, "main_grad") for p in model.parameters())
    return {n: p.grad.float().cpu() for n, p in model.named_parameters()}, n_fused


@cuda
@pytest.mark.parametrize("fp8", [None, "hybrid"])
def test_te_wgrad_fusion_equals_autograd_accumulation(fp8):
    """With ``wgrad_fusion`` every block's weights (qkv, proj, the fused MLP's fc1 and fc2)
    accumulate their 4 micro-batches' gradients inside TE's wgrad GEMM, into ``.grad`` itself:
    the sums equal autograd's accumulation to bf16 rounding (the GEMM adds in fp32 and rounds
    once, autograd rounds each micro-batch's gradient and then the sum). Overwriting on every
    micro-batch would leave a quarter; never overwriting on the first would add stale values."""
    _te()
    from tests.helpers.dist import run_distributed
    from tests.helpers.tiny import tiny_config

    cfg = tiny_config(
        model=dict(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=64),
        train=dict(micro_batch_size=2, bf16=True),
        fp8=dict(fp8_format=fp8, fp8_backend="te", fp8_amax_history_len=4),
    )
    ref, n_ref = run_distributed(_accumulated_grads, 1, cfg, False)[0]
    got, n_got = run_distributed(_accumulated_grads, 1, cfg, True)[0]
    assert n_ref == 0 and n_got == 4 * cfg.model.num_layers
    assert set(got) == set(ref)
    for name, g in got.items():
        rel = ((g - ref[name]).norm() / ref[name].norm()).item()
        assert rel < 1e-2, (name, rel)
