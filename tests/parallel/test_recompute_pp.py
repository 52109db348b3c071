"""Activation recompute under pipelining equals the same layout without it, to the bit: 1F1B at
pp 2 x tp 2 with SP, and interleaved at pp 2 x v 2, FP8 (delayed, torch backend) and dropout on.

Here a micro-batch's forward and its backward (where the recompute runs) are separated by other
micro-batches' forwards, after each of which the input and weight scales move on: the recomputed
forward must cast with the scales its first forward used and record no amax again, or the
gradients and the amax histories differ. Dropout draws on the tensor-parallel stream under SP."""

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.engine import PlainEngine
from tests.helpers.tiny import tiny_config
from tests.parallel.test_pp_grads import _batches


def _one(cfg, m):
    from types import SimpleNamespace

    from megafp8.fp8.backend import build_backend
    from megafp8.model.gpt import build_model
    from megafp8.parallel.groups import ParallelGroups
    from megafp8.parallel.pipeline.schedules import train_iteration
    from megafp8.parallel.random import model_parallel_seed

    p = cfg.parallel
    groups = ParallelGroups.build(
        p.tensor_model_parallel_size, p.pipeline_model_parallel_size, kv_heads=cfg.model.kv_heads
    )
    rng = model_parallel_seed(cfg.train.seed, groups.coords.tp, groups.coords.pp)
    backend = build_backend(cfg.fp8, amax_group=groups.tp_dp_group, tp_group=groups.tp_group)
    model = build_model(
        cfg, backend=backend, groups=groups, vocab_size=cfg.model.vocab_size, rng=rng
    )
    eng = PlainEngine(model, m)
    run = SimpleNamespace(cfg=cfg, groups=groups, model=model, engine=eng, backend=backend,
                          rng=rng, device=torch.device("cpu"))  # fmt: skip
    losses = [train_iteration(run, iter(_batches(cfg, m)))[0] for _ in range(2)]
    grads = {k: q.grad.clone() for k, q in model.named_parameters() if q.grad is not None}
    return losses, grads, backend.state_dict(), rng.state_dict()["streams"]


def _both(cfg, rc, m):
    return _one(cfg, m), _one(cfg.replace(model=rc), m)


def _cfg(pp, tp=1, v=None, layers=4):
    return tiny_config(
        model=dict(num_layers=layers, num_query_groups=2, hidden_dropout=0.1,
                   attention_dropout=0.1),
        parallel=dict(pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
                      sequence_parallel=tp > 1, virtual_pipeline_model_parallel_size=v),
        fp8=dict(fp8_format="hybrid", fp8_amax_history_len=4),
    )  # fmt: skip


FULL = dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1)
SELECTIVE = dict(recompute_granularity="selective", recompute_modules=("core_attn", "mlp"))
CASES = {
    "1f1b-pp2-tp2-sp-full": (_cfg(2, tp=2), FULL, 4, 4),
    "1f1b-pp2-tp2-sp-selective": (_cfg(2, tp=2), SELECTIVE, 4, 4),
    "interleaved-pp2-v2-block": (
        _cfg(2, v=2),
        dict(recompute_granularity="full", recompute_method="block", recompute_num_layers=1),
        2,
        4,
    ),
}


@pytest.mark.parametrize("case", list(CASES))
def test_recompute_under_pipelining_is_bit_identical(case):
    cfg, rc, world, m = CASES[case]
    for ref, got in run_distributed(_both, world, cfg, rc, m):
        assert got[0] == ref[0]
        assert got[1].keys() == ref[1].keys() and got[1]
        for k, g in got[1].items():
            assert torch.equal(g, ref[1][k]), k
        for k, v in got[2].items():
            assert torch.equal(v["scale"], ref[2][k]["scale"]), k
            assert torch.equal(v["amax_history"], ref[2][k]["amax_history"]), k
        for name, st in got[3].items():
            assert torch.equal(st["cpu"], ref[3][name]["cpu"]), name


def _losses(cfg):
    from tests.helpers.tiny import train_losses

    return train_losses(cfg)


def test_training_with_recompute_gives_the_same_losses():
    """Through the training loop and DeepSpeed (pp 2, ZeRO-1, FP8, dropout): 3 iterations of
    full recompute give the losses of none, to the bit."""
    cfg = _cfg(2).replace(train=dict(train_iters=3))
    ref = run_distributed(_losses, 2, cfg)[0]
    got = run_distributed(_losses, 2, cfg.replace(model=FULL))[0]
    assert got == ref and len(got) == 3
