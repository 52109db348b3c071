"""Expert parallelism against one process with the same weights: EP 2 and 4, both dispatchers,
with TP 2 (with and without SP), with PP 2, under ZeRO 1 and 2, top-1 with a capacity (the same
drops), clipping with the one-process gradient norm, FP8 (delayed scaling: the same DP layout's
losses without EP, up to the gradient sums' order), exact resume, and `torchrun ...
pretrain_gpt.py --expert-model-parallel-size 2` printing the one-process losses.

fp32 tolerance: the EP layouts reduce gradients over other groups, in another order than one
process (as DP does, tests/parallel/test_tp_dp_zero.py): 5 Adam steps stay within 2e-5 relative.
"""

import os
import re
import subprocess
import sys

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config, train_losses

MOE = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32, moe_aux_loss_coeff=1e-2,
           moe_z_loss_coeff=1e-3, num_query_groups=2)  # fmt: skip


def _cfg(**sections):
    model = {**MOE, **sections.pop("model", {})}
    return tiny_config(model=model, **sections)


def _losses(cfg):
    return train_losses(cfg)


def _close(got, ref, rtol=2e-5):
    torch.testing.assert_close(torch.tensor(got), torch.tensor(ref), rtol=rtol, atol=0.0)


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_losses, 1, _cfg())[0]


LAYOUTS = {
    "ep2-alltoall": (2, dict(expert_model_parallel_size=2), {}),
    "ep2-allgather": (
        2,
        dict(expert_model_parallel_size=2),
        dict(moe_token_dispatcher_type="allgather"),
    ),
    "ep4": (4, dict(expert_model_parallel_size=4), {}),
    "tp2-ep2": (4, dict(expert_model_parallel_size=2, tensor_model_parallel_size=2), {}),
    "tp2-sp-ep2": (
        4,
        dict(expert_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True),
        {},
    ),
    "pp2-ep2": (4, dict(expert_model_parallel_size=2, pipeline_model_parallel_size=2), {}),
}


@pytest.mark.parametrize("zero", [1, 2])
@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_ep_layouts_give_the_one_process_losses(reference, layout, zero):
    if zero == 2 and layout not in ("ep2-alltoall", "tp2-sp-ep2"):
        pytest.skip("ZeRO-2 on two layouts is enough: the expert groups are the same")
    n, parallel, model = LAYOUTS[layout]
    got = run_distributed(
        _losses, n, _cfg(parallel=parallel, model=model, optim=dict(zero_stage=zero))
    )
    assert all(g == got[0] for g in got)
    _close(got[0], reference)


@pytest.mark.parametrize("zero", [1, 2])
def test_bounded_optimizer_groups_under_ep(reference, zero):
    """Optimizer groups bounded to 2048 elements: DeepSpeed's dense and expert groups are each cut
    into several (the expert ones keep their expert-DP group); the one-process losses still."""
    cfg = _cfg(parallel=dict(expert_model_parallel_size=2),
               optim=dict(zero_stage=zero, optimizer_group_max_numel=2048))  # fmt: skip
    got = run_distributed(_losses, 4, cfg)
    assert all(g == got[0] for g in got)
    _close(got[0], reference)


def test_top1_with_a_capacity_drops_as_one_process():
    cfg = _cfg(model=dict(moe_router_topk=1, moe_expert_capacity_factor=1.0))
    ref = run_distributed(_losses, 1, cfg)[0]
    got = run_distributed(_losses, 2, cfg.replace(parallel=dict(expert_model_parallel_size=2)))
    _close(got[0], ref)


def _norms(cfg):
    from megafp8.train import train

    return [(r["lm loss"], r["grad norm"]) for r in train(cfg)]


def test_clipping_counts_each_expert_once():
    """clip_grad small enough to clip every step: the gradient norm is one process's, so each
    expert shard (on its EP rank, partitioned over its expert-DP group) is counted once."""
    cfg = _cfg(train=dict(train_iters=3), optim=dict(clip_grad=0.05))
    ref = run_distributed(_norms, 1, cfg)[0]
    got = run_distributed(_norms, 4, cfg.replace(parallel=dict(expert_model_parallel_size=2)))[0]
    for (l1, n1), (l2, n2) in zip(ref, got, strict=True):
        assert n2 == pytest.approx(n1, rel=1e-5) and l2 == pytest.approx(l1, rel=2e-5)


def test_fp8_delayed_ep_equals_the_same_dp_layout():
    """Delayed scaling: each expert's amaxes are reduced over its replicas only (TP x expert-DP),
    which is every token it saw, so EP 2 gives DP 2's losses without EP. (DP's scales differ
    from one process's by the micro-batch order of the amax updates, not by EP.) The first loss
    to the bit (the same forward). After that EP sums each expert's gradient over all tokens in
    one GEMM where DP adds two ranks' halves: fp32 reassociation (slack 2e-5, as above), which can
    flip an FP8 value (tests/parallel/test_tp.py), so the bound is half the run's FP8 noise (its
    gap to fp32) plus that slack. Experts' amaxes over the wrong group would change their scales
    for every step."""
    fp8 = dict(fp8_format="hybrid", fp8_amax_history_len=4)
    dp = run_distributed(_losses, 2, _cfg(fp8=fp8))[0]
    fp32 = run_distributed(_losses, 2, _cfg())[0]
    ep = run_distributed(_losses, 2, _cfg(fp8=fp8, parallel=dict(expert_model_parallel_size=2)))
    gap = max(abs(a - b) for a, b in zip(dp, fp32, strict=True))
    assert gap > 0 and ep[0][0] == dp[0]  # FP8 really ran; the same first forward
    for got, want in zip(ep[0], dp, strict=True):
        assert abs(got - want) <= 0.5 * gap + 2e-5 * abs(want), (ep[0], dp, fp32)


def test_resume_under_ep_gives_identical_losses(tmp_path):
    ck = str(tmp_path / "ck")
    par = dict(expert_model_parallel_size=2)
    sched = dict(lr_decay_iters=6)
    full = run_distributed(_losses, 2, _cfg(train=dict(train_iters=6), parallel=par,
                                            optim=sched))[0]  # fmt: skip
    run_distributed(_losses, 2, _cfg(train=dict(train_iters=3, save=ck, save_interval=3),
                                     parallel=par, optim=sched))  # fmt: skip
    names = os.listdir(os.path.join(ck, "iter_0000003"))
    assert {"experts_ep_00_mp_rank_00.pt", "experts_ep_01_mp_rank_00.pt"} <= set(names), names
    rest = run_distributed(_losses, 2, _cfg(train=dict(train_iters=6, load=ck), parallel=par,
                                            optim=sched))[0]  # fmt: skip
    assert rest == full[3:]


@pytest.mark.parametrize(
    "model, parallel, optim, words",
    [
        (dict(num_experts=3), dict(expert_model_parallel_size=2), {}, "not divisible"),
        ({}, dict(expert_model_parallel_size=3), {}, "must divide the data-parallel size"),
        (dict(num_experts=None), dict(expert_model_parallel_size=2), {}, "needs --num-experts"),
        ({}, dict(expert_model_parallel_size=2), dict(zero_stage=3), "ZeRO 1 or 2"),
        ({}, dict(expert_model_parallel_size=2), dict(zero_stage=0), "ZeRO 1 or 2"),
        (dict(num_experts=None, moe_router_topk=1), {}, {}, "need --num-experts"),
    ],
)
def test_bad_ep_input_is_one_line(model, parallel, optim, words):
    from megafp8.validate import validate

    cfg = _cfg(model=model, parallel=parallel, optim=optim)
    with pytest.raises(ValueError, match=words) as e:
        validate(cfg, 4)
    assert "\n" not in str(e.value)


ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARGS = (
    "--mock-data --vocab-size 256 --make-vocab-size-divisible-by 64 --num-layers 2 "
    "--hidden-size 64 --num-attention-heads 4 --seq-length 32 --micro-batch-size 2 "
    "--global-batch-size 8 --train-iters 5 --lr 1e-3 --lr-warmup-iters 1 --log-interval 1 "
    "--seed 11 --num-experts 4 --moe-router-topk 2 --moe-ffn-hidden-size 32 "
    "--moe-aux-loss-coeff 1e-2"
).split()


def _run(extra, nproc):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "pretrain_gpt.py"]
    if nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", str(29300 + os.getpid() % 300), "pretrain_gpt.py"]  # fmt: skip
    p = subprocess.run(cmd + ARGS + extra, cwd=ROOT, env=env, capture_output=True, text=True,
                       timeout=300)  # fmt: skip
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", p.stdout)]
    assert len(losses) == 5, p.stdout
    return losses


@pytest.mark.slow
def test_torchrun_ep2_prints_the_one_process_losses():
    ref = _run([], 1)
    got = _run(["--expert-model-parallel-size", "2"], 4)
    assert got[0] == pytest.approx(ref[0], rel=1e-6)
    _close(got, ref)


def test_seq_aux_loss_and_expert_bias_under_sp_equal_one_process():
    """Under SP each rank holds a sequence shard: the per-sequence balancing sums run over TP,
    the expert-bias loads over TP x DP."""
    moe = dict(moe_router_load_balancing_type="seq_aux_loss", moe_aux_loss_coeff=0.1,
               moe_router_enable_expert_bias=True, moe_router_bias_update_rate=1e-2)  # fmt: skip
    cfg = _cfg(model=moe)
    ref = run_distributed(_losses, 1, cfg)[0]
    par = dict(expert_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True)
    got = run_distributed(_losses, 4, cfg.replace(parallel=par))
    _close(got[0], ref)
