"""--log-params-norm (Megatron's): the norm of all the weights, each element counted once over
the job. One process: the logged norm after the last step equals the model's own; DP 2, PP 2 x
TP 2 with SP, and experts over EP 2 x TP 2 log one process's norms."""

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config
from tests.parallel.test_moe_ep import MOE


def _cfg(moe=False, **parallel):
    model = {"num_layers": 4, "num_query_groups": 2, **(MOE if moe else {})}
    return tiny_config(model=model, logging=dict(log_params_norm=True), parallel=parallel)


def _norms(cfg):
    from megafp8.train import build_run, init_distributed, train

    groups, device = init_distributed(cfg)
    run = build_run(cfg, groups, device)
    hist = train(cfg, run)
    # float64: torch's fp32 norm of one long vector is itself off by ~1e-5 on the CPU
    whole = torch.cat([p.detach().double().flatten() for p in run.model.parameters()]).norm()
    return [r["params norm"] for r in hist], whole.item()


def test_one_process_logs_the_models_norm():
    logged, whole = run_distributed(_norms, 1, _cfg())[0]
    assert len(logged) == 5 and logged[-1] == pytest.approx(whole, rel=1e-6)
    assert logged[0] != logged[-1]  # the weights moved


@pytest.mark.parametrize(
    "world,moe,parallel",
    [
        (2, False, {}),  # DP 2: replicas counted once
        (4, False, dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                        sequence_parallel=True)),
        (4, True, dict(expert_model_parallel_size=2, tensor_model_parallel_size=2)),
    ],
    ids=["dp2", "pp2-tp2-sp", "ep2-tp2"],
)  # fmt: skip
def test_parallel_layouts_log_one_process_norms(world, moe, parallel):
    """fp32 sums over shards and stages in another order, and 5 steps whose updates differ by
    fp32 reassociation (tests/parallel/test_pp_train.py: 2e-5 of the loss): 1e-5 of the norm;
    a replica counted twice or a shard left out is O(1) (a layer is ~1/4 of the norm)."""
    ref, _ = run_distributed(_norms, 1, _cfg(moe))[0]
    got = run_distributed(_norms, world, _cfg(moe, **parallel))
    assert all(g[0] == got[0][0] for g in got)  # the same on every rank
    assert got[0][0] == pytest.approx(ref, rel=1e-5)
