"""--bf16 --accumulate-allreduce-grads-in-fp32: DeepSpeed's BF16_Optimizer adds the micro-batches'
gradients in fp32 (ZeRO-1). On the CPU in bf16: the engine and its fp32 gradient buffers, the
layouts against one process, exact resume in both checkpoint formats, a reshard, bad input."""

import os

import pytest
import torch

from megafp8.validate import validate
from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config, train_losses

FP32_ACC = dict(accumulate_allreduce_grads_in_fp32=True, zero_stage=1, lr_decay_iters=6)


def _cfg(train=None, **sections):
    t = {**dict(bf16=True, global_batch_size=8, micro_batch_size=1), **(train or {})}
    return tiny_config(train=t, optim={**FP32_ACC, **sections.pop("optim", {})}, **sections)


def _losses(cfg):
    return train_losses(cfg)


def _engine(cfg):
    from megafp8.train import build_run, init_distributed

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    groups, device = init_distributed(cfg)
    opt = build_run(cfg, groups, device).engine.optimizer
    flat = getattr(opt, "fp32_groups_gradients_flat", [])
    return type(opt).__name__, sorted({str(t.dtype) for t in flat}), len(flat)


def test_engine_accumulates_in_fp32():
    name, dtypes, n = run_distributed(_engine, 1, _cfg())[0]
    assert name == "BF16_Optimizer" and dtypes == ["torch.float32"] and n >= 2
    # without the switch: DeepSpeed's ZeRO-1 optimizer, bf16 .grad
    plain = _cfg(optim=dict(accumulate_allreduce_grads_in_fp32=False))
    assert run_distributed(_engine, 1, plain)[0][0] == "DeepSpeedZeroOptimizer"


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_losses, 1, _cfg())[0]


@pytest.mark.parametrize(
    "parallel",
    [{}, dict(tensor_model_parallel_size=2), dict(pipeline_model_parallel_size=2)],
    ids=["dp2", "tp2", "pp2"],
)
def test_layouts_give_the_one_process_losses(reference, parallel):
    """Both sum the same bf16 micro-batch gradients in fp32, in another order (and TP shards the
    GEMMs' fp32 sums), so the fp32 masters agree to ~1e-7. The bf16 weights copied from them can
    round the other way where a master sits on a rounding boundary: one bf16 ulp (2^-8) of a few
    weights, which moves the loss by about 1e-5 relative. Bound: 2e-4."""
    got = run_distributed(_losses, 2, _cfg(parallel=parallel))
    assert got[0] == got[1]
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(reference), rtol=2e-4, atol=0)
    assert reference[-1] < reference[0]


@pytest.fixture(scope="module")
def full():
    return run_distributed(_losses, 2, _cfg(train=dict(train_iters=6)))[0]


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_resume_is_exact(tmp_path, fmt, full):
    ck = str(tmp_path / "ck")
    first = run_distributed(_losses, 2, _cfg(train=dict(train_iters=3, save=ck, ckpt_format=fmt)))
    rest = run_distributed(_losses, 2, _cfg(train=dict(train_iters=6, load=ck, ckpt_format=fmt)))
    assert first[0] == full[:3] and rest[0] == full[3:]
    if fmt == "torch_dist":  # into one process: the masters and moments move, the sums reorder
        one = run_distributed(_losses, 1, _cfg(train=dict(train_iters=6, load=ck)))[0]
        torch.testing.assert_close(torch.tensor(one), torch.tensor(full[3:]), rtol=2e-4, atol=0)


@pytest.mark.parametrize(
    "optim,parallel",
    [(dict(zero_stage=2), {}), (dict(zero_stage=0), {}), (dict(zero_stage=3), {})],
)
def test_other_zero_stages_are_one_line(optim, parallel):
    with pytest.raises(ValueError, match=f"zero_stage={optim['zero_stage']}, .*BF16_Optimizer"):
        validate(_cfg(optim=optim, parallel=parallel), 1)


def test_expert_parallelism_is_one_line():
    moe = dict(num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32)
    cfg = _cfg(model=moe, parallel=dict(expert_model_parallel_size=2),
               train=dict(global_batch_size=None))  # fmt: skip
    with pytest.raises(ValueError, match="expert_model_parallel_size=2: fp32 gradient"):
        validate(cfg, 2)
