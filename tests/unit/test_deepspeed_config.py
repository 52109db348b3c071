"""megafp8.optim.zero: the DeepSpeed config dict, the weight-decay grouping, and the engine
DeepSpeed builds from them (batch sizes, accumulation, ZeRO stage, clipping, AdamW settings)."""

import pytest
import torch
from torch import nn

from megafp8.optim.zero import bound_groups, deepspeed_config, param_groups
from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config

ZERO2_EXTRA = {
    "overlap_comm": False,
    "contiguous_gradients": True,
    "reduce_bucket_size": 50_000_000,
    "allgather_bucket_size": 50_000_000,
}
ZERO3_EXTRA = {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 50_000_000}


def cfg_of(micro, gbs, stage, clip=1.0, bf16=False):
    return tiny_config(
        train=dict(micro_batch_size=micro, global_batch_size=gbs, bf16=bf16),
        optim=dict(zero_stage=stage, clip_grad=clip),
    )


@pytest.mark.parametrize(
    "micro, gbs, dp, stage, clip, bf16, gas, zero",
    [
        # gas = gbs / (micro * dp): 8 / (2 * 2) = 2
        (2, 8, 2, 1, 1.0, False, 2, {"stage": 1}),
        # 32 / (1 * 4) = 8; ZeRO 2 adds its bucket settings; bf16 on
        (1, 32, 4, 2, 0.5, True, 8, {"stage": 2, **ZERO2_EXTRA}),
        # 24 / (3 * 1) = 8; ZeRO 3 adds the stage-3 keys on top of stage 2's; clipping off
        (3, 24, 1, 3, 0.0, False, 8, {"stage": 3, **ZERO2_EXTRA, **ZERO3_EXTRA}),
        # ZeRO 0 (plain DDP-style data parallelism): 16 / (4 * 4) = 1
        (4, 16, 4, 0, 1.0, False, 1, {"stage": 0}),
    ],
)
def test_config_dict(micro, gbs, dp, stage, clip, bf16, gas, zero):
    """Every key the engine reads, for four (micro, global batch, dp, stage) combinations."""
    d = deepspeed_config(cfg_of(micro, gbs, stage, clip, bf16), dp)
    assert d["train_batch_size"] == gbs
    assert d["train_micro_batch_size_per_gpu"] == micro
    assert d["gradient_accumulation_steps"] == gas
    # DeepSpeed's own invariant: train_batch = micro * gas * dp
    assert d["train_batch_size"] == micro * gas * dp
    assert d["gradient_clipping"] == clip
    assert d["zero_optimization"] == zero
    # ZeRO 1/2 in bf16: the norm decides a skip (test_norm_skip_rule), not DeepSpeed's scan
    assert d["bf16"] == {"enabled": bf16, **({"check_grad_overflow": False} if bf16 else {})}
    assert "fp16" not in d  # fp32 unless bf16: never DeepSpeed's loss-scaled fp16
    assert "optimizer" not in d and d["zero_allow_untested_optimizer"] is True  # client AdamW


def test_global_batch_defaults_to_micro_times_dp():
    """global_batch_size unset: one micro-batch per rank per iteration (2 * 3 = 6, gas 1)."""
    d = deepspeed_config(cfg_of(2, None, 1), 3)
    assert (d["train_batch_size"], d["gradient_accumulation_steps"]) == (6, 1)


def test_param_groups_exempt_biases_and_norms_from_weight_decay():
    """Matrices decay; biases and norm weights (1-D) do not; frozen parameters are left out."""
    net = nn.Sequential(nn.Linear(4, 3), nn.LayerNorm(3), nn.Linear(3, 2, bias=False))
    net[2].weight.requires_grad_(False)
    groups = param_groups(net, 0.1)
    assert [g["weight_decay"] for g in groups] == [0.1, 0.0]
    decay, no_decay = ({id(p) for p in g["params"]} for g in groups)
    assert decay == {id(net[0].weight)}
    assert no_decay == {id(net[0].bias), id(net[1].weight), id(net[1].bias)}


def test_bound_groups_cut_in_model_order():
    """Each group is cut, in order, into groups of at most max_numel elements, same options; a
    tensor above the bound is a group of its own; nothing is lost or repeated."""
    sizes = [30, 50, 40, 200, 10, 10, 90]
    ps = [nn.Parameter(torch.zeros(n)) for n in sizes]
    groups = [{"params": ps[:5], "weight_decay": 0.1, "decoupled": False},
              {"params": ps[5:], "weight_decay": 0.0, "decoupled": True}]  # fmt: skip
    got = bound_groups(groups, 100)
    assert [[p.numel() for p in g["params"]] for g in got] == [
        [30, 50], [40], [200], [10], [10, 90]
    ]  # fmt: skip
    assert [g["weight_decay"] for g in got] == [0.1, 0.1, 0.1, 0.1, 0.0]
    assert [g["decoupled"] for g in got] == [False] * 4 + [True]
    assert [id(p) for g in got for p in g["params"]] == [id(p) for p in ps]
    assert bound_groups(groups, 10**9) == groups
    assert bound_groups(groups, 0) == groups  # 0: no bound (checkpoints saved before the bound)


def _engine_settings(cfg):
    from megafp8.fp8.backend import Backend
    from megafp8.model.gpt import GPTModel
    from megafp8.optim.zero import build_engine
    from megafp8.parallel.groups import ParallelGroups

    groups = ParallelGroups.build()
    model = GPTModel(cfg, backend=Backend(), groups=groups, vocab_size=cfg.model.vocab_size)
    eng = build_engine(model, cfg, groups)
    pg = eng.optimizer.param_groups
    return {
        "batch": (
            eng.train_batch_size(),
            eng.train_micro_batch_size_per_gpu(),
            eng.gradient_accumulation_steps(),
        ),
        "stage": eng.zero_optimization_stage(),
        "clip": eng.gradient_clipping(),
        "bf16": eng.bfloat16_enabled(),
        "dtype": next(model.parameters()).dtype,
        "groups": [(g["lr"], tuple(g["betas"]), g["eps"], g["weight_decay"]) for g in pg],
        "adamw": type(getattr(eng.optimizer, "optimizer", eng.optimizer)).__name__,
        "flat": [t.numel() for t in getattr(eng.optimizer, "bit16_groups_flat", [])],
        "comm": str(getattr(eng.optimizer, "communication_data_type", None)),
        "numels": [[p.numel() for p in g] for g in getattr(eng.optimizer, "bit16_groups", [])],
    }


def test_engine_takes_the_settings():
    """DeepSpeed (2 data-parallel ranks, ZeRO 2) reads the dict as intended: 16 = 2 x 4 x 2,
    clipping 0.25, fp32, and torch AdamW with the configured lr, betas, eps and decay groups."""
    cfg = tiny_config(
        train=dict(micro_batch_size=2, global_batch_size=16),
        optim=dict(
            zero_stage=2,
            clip_grad=0.25,
            lr=2e-3,
            adam_beta1=0.8,
            adam_beta2=0.95,
            adam_eps=1e-6,
            weight_decay=0.05,
        ),
    )
    got = run_distributed(_engine_settings, 2, cfg)
    assert got[0] == got[1]
    s = got[0]
    assert s["batch"] == (16, 2, 4)
    assert s["stage"] == 2 and s["clip"] == 0.25
    assert s["bf16"] is False and s["dtype"] == torch.float32
    assert s["adamw"] == "AdamW"
    assert s["groups"] == [(2e-3, (0.8, 0.95), 1e-6, 0.05), (2e-3, (0.8, 0.95), 1e-6, 0.0)]
    assert len(s["flat"]) == 2


def test_engine_steps_bounded_groups():
    """--optimizer-group-max-numel reaches DeepSpeed: ZeRO-1 flattens (and, at the step, casts to
    fp32) one bounded group at a time; the tiny model's 2-D weights (>= 4096 elements) and the
    norms land in many groups, none holding two tensors above the bound."""
    cfg = tiny_config(optim=dict(zero_stage=1, optimizer_group_max_numel=4096))
    s = run_distributed(_engine_settings, 1, cfg)[0]
    assert len(s["flat"]) > 8 and len(s["groups"]) == len(s["flat"]) == len(s["numels"])
    assert all(len(ns) == 1 or sum(ns) <= 4096 for ns in s["numels"])
    assert all(
        flat >= sum(ns) for flat, ns in zip(s["flat"], s["numels"], strict=True)
    )  # + DeepSpeed padding
    default = run_distributed(_engine_settings, 1, tiny_config())[0]
    assert len(default["flat"]) == 2
    assert sum(map(sum, default["numels"])) == sum(map(sum, s["numels"]))


def test_bf16_gradients_are_reduced_in_fp32_unless_asked():
    """Megatron's meaning: with --bf16 the DP gradient reduction runs in fp32, and in bf16 only
    with --grad-reduce-in-bf16 (DeepSpeed's own default for bf16 would be bf16)."""
    cfg = tiny_config(train=dict(bf16=True, global_batch_size=None), optim=dict(zero_stage=1))
    got = run_distributed(_engine_settings, 2, cfg)[0]
    assert got["bf16"] and got["comm"] == "torch.float32"
    cfg = cfg.replace(optim=dict(grad_reduce_in_bf16=True))
    assert run_distributed(_engine_settings, 2, cfg)[0]["comm"] == "torch.bfloat16"


@pytest.mark.parametrize(
    "flags,fused",
    [
        ("", True),  # ZeRO-1, the default: DeepSpeed reads .grad at the boundary only
        ("--no-gradient-accumulation-fusion", False),  # Megatron's flag, its meaning
        ("--zero-stage 2", False),  # reduces inside its gradient hooks
        ("--zero-stage 0", False),
        ("--overlap-grad-reduce", False),
        ("--bf16 --accumulate-allreduce-grads-in-fp32", False),  # BF16_Optimizer's hooks add
        ("--bf16", True),
        ("--pipeline-model-parallel-size 2", True),
        ("--pipeline-model-parallel-size 2 --recompute-granularity selective", False),
        ("--recompute-granularity selective", True),
    ],
)
def test_wgrad_fusion_where_deepspeed_reads_grad_once(flags, fused):
    from megafp8.cli import parse_args
    from megafp8.optim.zero import wgrad_fusion

    notices: list[str] = []
    cfg = parse_args(["--mock-data", *flags.split()], notices)
    assert notices == []  # a real flag now, not "no effect"
    assert wgrad_fusion(cfg) is fused


@pytest.mark.parametrize(
    "flags,want",
    [
        ("--bf16", True),  # ZeRO-1: DeepSpeedZeroOptimizer, the norm decides
        ("--bf16 --zero-stage 2", True),
        ("--bf16 --zero-stage 3", False),  # its own optimizer, its own check
        ("--bf16 --zero-stage 0", False),  # BF16_Optimizer
        ("--bf16 --accumulate-allreduce-grads-in-fp32", False),  # BF16_Optimizer
        ("", False),  # fp32: DeepSpeed checks the norm itself
    ],
)
def test_norm_skip_rule(flags, want):
    """ZeRO 1/2 in bf16 turn DeepSpeed's per-gradient overflow scan off (StepGuard.norm_of
    skips a non-finite norm instead); elsewhere the config keeps DeepSpeed's default."""
    from megafp8.cli import parse_args
    from megafp8.optim.zero import deepspeed_config, norm_skip

    cfg = parse_args(flags.split())
    assert norm_skip(cfg) is want
    assert deepspeed_config(cfg, 1)["bf16"].get("check_grad_overflow", True) is not want


def _device_waits(cfg):
    """Train; every stack that asks DeepSpeed's accelerator to wait for the device."""
    import traceback

    from deepspeed.accelerator import get_accelerator

    from tests.helpers.tiny import train_losses

    cls = type(get_accelerator())
    orig, calls = cls.synchronize, []

    def synchronize(self, *args, **kwargs):
        calls.append("".join(traceback.format_stack(limit=6)[:-1]))
        return orig(self, *args, **kwargs)

    cls.synchronize = synchronize
    try:
        train_losses(cfg)
    finally:
        cls.synchronize = orig
    return calls


@pytest.mark.parametrize("stage", [1, 3])
def test_training_never_waits_for_the_device(stage):
    """No device wait inside DeepSpeed during training (its throughput timer would wait at every
    forward and step: each micro-batch's launches would start from an empty GPU queue)."""
    cfg = tiny_config(
        train=dict(train_iters=5, micro_batch_size=2, global_batch_size=8),
        optim=dict(zero_stage=stage),
    )
    calls = run_distributed(_device_waits, 1, cfg)[0]
    assert not calls, f"{len(calls)} device waits, the first from:\n{calls[0]}"
