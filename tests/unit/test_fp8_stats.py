"""``--log-fp8-stats``: per GEMM and role, the amax, the scale, and the shares of values that
saturated and flushed to zero, from the iteration's first cast of each; in TensorBoard at each
log, every pipeline stage's layers included."""

import glob

import pytest
import torch

from megafp8.fp8.recipe import Fp8Recipe, Fp8State
from megafp8.parallel.mappings import SOLO
from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config


def test_shares_are_counted_exactly():
    state = Fp8State(Fp8Recipe(fp8_format="hybrid", amax_history_len=4), amax_group=SOLO)
    mx = state.meta("layers.0.attn.qkv", "x")  # E4M3, max 448, scale 1 before any update
    x = torch.tensor([500.0, -1000.0, 1.0, 2.0, 1e-12, 0.0, 3.0, -4.0])
    state.start_stats()
    mx.quantize(x, SOLO)
    mx.quantize(x * 1000, SOLO)  # a later cast in the same window is not counted
    stats = state.take_stats()
    assert stats == {
        "layers.0.attn.qkv.x/amax": 1000.0,
        "layers.0.attn.qkv.x/scale": 1.0,
        "layers.0.attn.qkv.x/saturated": 2 / 8,  # 500 and -1000 clamp to +-448
        "layers.0.attn.qkv.x/flushed": 1 / 8,  # 1e-12 is below E4M3's smallest subnormal
    }
    mx.quantize(x, SOLO)  # outside a window: nothing recorded
    assert state.stats is None and state.take_stats() == {}


def _train_and_read(cfg):
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    from tests.helpers.tiny import train_losses

    train_losses(cfg)
    if torch.distributed.get_rank() != 0:
        return None
    acc = EventAccumulator(glob.glob(cfg.logging.tensorboard_dir + "/events*")[0])
    acc.Reload()
    tags = [t for t in acc.Tags()["scalars"] if t.startswith("fp8/")]
    return {t: [e.value for e in acc.Scalars(t)] for t in tags}, {
        t: [e.step for e in acc.Scalars(t)] for t in tags
    }


@pytest.mark.parametrize("pp", [1, 2])
def test_training_logs_fp8_stats_of_every_layer(tmp_path, pp):
    cfg = tiny_config(
        model=dict(num_layers=2),
        parallel=dict(pipeline_model_parallel_size=pp),
        fp8=dict(fp8_format="hybrid", fp8_amax_history_len=4),
        train=dict(train_iters=4),
        logging=dict(log_interval=2, log_fp8_stats=True, tensorboard_dir=str(tmp_path / "tb")),
    )
    values, steps = run_distributed(_train_and_read, pp, cfg)[0]
    gemms = [f"layers.{i}.{g}" for i in range(2) for g in ("attn.qkv", "attn.proj", "mlp.fc1",
                                                            "mlp.fc2")]  # fmt: skip
    expected = {f"fp8/{g}/{r}/{s}" for g in gemms for r in "xwg"
                for s in ("amax", "scale", "saturated", "flushed")}  # fmt: skip
    assert set(values) == expected  # every layer of every stage
    for tag, v in values.items():
        assert steps[tag] == [2, 4]  # at each log (log_interval 2)
        if tag.endswith("/amax"):
            assert all(a > 0 for a in v), tag
        if tag.endswith(("/saturated", "/flushed")):
            assert all(0.0 <= a <= 1.0 for a in v), tag
    # delayed scaling: the first iteration casts with scale 1, later ones with learned scales
    assert any(v[-1] != 1.0 for t, v in values.items() if t.endswith("/scale"))


def test_fp8_stats_need_fp8():
    from megafp8.cli import parse_args
    from megafp8.validate import validate

    with pytest.raises(ValueError, match="log_fp8_stats=True needs FP8"):
        validate(parse_args(["--mock-data", "--log-fp8-stats"]), 1)
