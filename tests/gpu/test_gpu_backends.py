"""GPU-only checks (``-m gpu``), run on the GPU machine, never in CI."""

import pytest
import torch

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")


@cuda
def test_scaled_mm_matches_emulation_on_gpu():
    from megafp8.fp8.backends import fp8_gemm
    from megafp8.fp8.recipe import E4M3, E5M2

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
    from megafp8.fp8.backends import build_backend

    f = Fp8Config(fp8_format="hybrid", fp8_recipe=recipe, fp8_backend="te", fp8_amax_history_len=4)
    be = build_backend(f)
    lin = be.make_linear(256, 128, False, name="l", dtype=torch.bfloat16, device="cuda")
    with torch.no_grad():
        lin.weight.normal_(0, 0.02)
    x = torch.randn(512, 256, device="cuda", dtype=torch.bfloat16)
    ref = x.float() @ lin.weight.float().t()
    for _ in range(3):  # delayed scaling needs a step to see amaxes
        with be.autocast():
            y = lin(x)
    rel = ((y.float() - ref).norm() / ref.norm()).item()
    assert 1e-4 < rel < 0.06


@cuda
@pytest.mark.parametrize("backend", ["te", "torch"])
def test_tiny_gpt_trains_in_fp8_on_gpu(backend):
    if backend == "te":
        _te()
    import os

    os.environ.setdefault("MASTER_PORT", "29533")
    from megafp8.config import Config
    from megafp8.train import train

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
    losses = [r["lm loss"] for r in train(cfg)]
    assert sum(losses[-5:]) / 5 < losses[0] - 0.5


@cuda
def test_te_weight_cache_reuses_the_cast_within_an_iteration():
    """Micro-batch 0 casts the weight to FP8 and keeps it; later micro-batches reuse that cast
    (so an in-place change of the weight is not seen until the next iteration); None recasts."""
    _te()
    from megafp8.config import Fp8Config
    from megafp8.fp8.backends import build_backend

    f = Fp8Config(fp8_format="hybrid", fp8_backend="te", fp8_amax_history_len=4)
    be = build_backend(f)
    lin = be.make_linear(256, 128, False, name="l", dtype=torch.bfloat16, device="cuda")
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
