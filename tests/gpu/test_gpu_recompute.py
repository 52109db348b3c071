"""Activation recompute on the GPU (``-m gpu``): on both FP8 backends, with TE's checkpoint on the
te backend, full and selective recompute give the gradients and FP8 scaling state of no
recompute. Deterministic kernels (as ``--deterministic`` sets them) so that two runs of the same
backward agree to the bit; the recomputed forward repeats the first one's kernels on the same
values and casts with the same scales."""

import os

import pytest
import torch

pytestmark = pytest.mark.gpu
cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
SELECTIVE = dict(recompute_granularity="selective", recompute_modules=("core_attn", "mlp"))


def _run(backend_name, recompute):
    from types import SimpleNamespace

    from megafp8.config import Config
    from megafp8.fp8.backend import build_backend
    from megafp8.model.gpt import GPTModel
    from megafp8.parallel.groups import ParallelGroups
    from megafp8.parallel.pipeline.schedules import no_pipelining
    from megafp8.parallel.random import model_parallel_seed
    from tests.helpers.engine import PlainEngine

    cfg = Config().replace(
        model=dict(num_layers=3, hidden_size=256, num_attention_heads=8, num_query_groups=2,
                   seq_length=256, vocab_size=1024, swiglu=True, normalization="RMSNorm",
                   position_embedding_type="rope", hidden_dropout=0.1, **recompute),
        fp8=dict(fp8_format="hybrid", fp8_backend=backend_name, fp8_amax_history_len=4),
        train=dict(micro_batch_size=2, global_batch_size=6, bf16=True, seed=3),
        data=dict(mock_data=True),
    )  # fmt: skip
    groups = ParallelGroups.single()
    rng = model_parallel_seed(cfg.train.seed, 0, 0)
    backend = build_backend(cfg.fp8, amax_group=groups.tp_dp_group, tp_group=groups.tp_group)
    model = GPTModel(cfg, backend=backend, groups=groups, vocab_size=1024, device="cuda", rng=rng)
    run = SimpleNamespace(cfg=cfg, groups=groups, model=model, engine=PlainEngine(model, 3),
                          backend=backend, rng=rng, device=torch.device("cuda"))  # fmt: skip
    g = torch.Generator().manual_seed(1)
    losses = []
    for _ in range(2):
        batches = []
        for _ in range(3):
            t = torch.randint(0, 1024, (2, 257), generator=g)
            ones = torch.ones(2, 256)
            batches.append({"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": ones})
        for p in model.parameters():
            p.grad = None
        losses.append(no_pipelining(run, iter(batches))[0])
    grads = {k: p.grad.clone() for k, p in model.named_parameters()}
    state = {}
    for name, m in model.named_modules():
        meta = getattr(getattr(m, "inner", None), "fp8_meta", None)
        if meta and "scaling_fwd" in meta:  # TE's delayed scaling state of this GEMM
            for d in ("scaling_fwd", "scaling_bwd"):
                state[f"{name}.{d}"] = (meta[d].scale.clone(), meta[d].amax_history.clone())
    for k, v in backend.state_dict().items():  # ours (torch backend)
        state[k] = (v["scale"], v["amax_history"])
    return losses, grads, state


@cuda
@pytest.mark.parametrize("recompute", [FULL, SELECTIVE], ids=["full", "selective"])
@pytest.mark.parametrize("backend", ["te", "torch"])
def test_recompute_on_gpu_changes_nothing(backend, recompute):
    if backend == "te":
        pytest.importorskip("transformer_engine.pytorch")
    os.environ["NVTE_ALLOW_NONDETERMINISTIC_ALGO"] = "0"
    os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    torch.use_deterministic_algorithms(True)
    try:
        ref = _run(backend, {})
        got = _run(backend, recompute)
    finally:
        torch.use_deterministic_algorithms(False)
    assert got[0] == ref[0]
    for k, g in got[1].items():
        assert torch.equal(g, ref[1][k]), k
    assert got[2] and got[2].keys() == ref[2].keys()
    for k, (scale, hist) in got[2].items():
        assert torch.equal(scale, ref[2][k][0]) and torch.equal(hist, ref[2][k][1]), k


@cuda
def test_default_gpu_stream_keeps_the_default_seed_in_a_fresh_process():
    """Seeding the streams before anything touched CUDA (as a fresh training process does) leaves
    the GPU's default generator on the default seed, the same on every TP rank: dropout on the
    replicated residual stream must agree across TP ranks. A fresh process, since CUDA must not be
    initialized before the seeding."""
    import subprocess
    import sys

    code = (
        "import torch; from megafp8.parallel.random import model_parallel_seed; "
        "model_parallel_seed(1234, tp_rank=1, pp_rank=0); print(torch.cuda.initial_seed())"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.split()[-1] == "1234"
