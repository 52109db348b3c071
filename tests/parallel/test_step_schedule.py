"""Megatron's step-wise batch schedule (``--step-batch-size-schedule "THRESHOLD:BS ..."``):
parsing against Megatron's own example worked by hand, the batch of each iteration and the
sample-counted lr through training, DP 2 equal to one process, ``--train-samples`` counting the
schedule's iterations, and the one-line errors (bad entries, a batch that does not fit the
layout, given together with ``--global-batch-size``), the layout checked from the resumed
position on."""

import pytest

from megafp8.config_values import (
    batch_size_at,
    global_batch_size,
    parse_step_schedule,
    ramp_sizes,
    train_samples,
)
from megafp8.optim.schedule import learning_rate
from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config
from tests.parallel.test_pp_train import _check
from tests.parallel.test_rampup import _cfg as ramp_cfg
from tests.parallel.test_rampup import _records

SEQ = 32  # tiny_config's seq_length: thresholds are tokens, 32 per sample


def test_megatron_example_by_hand():
    """Megatron's help: "0:768 250B:1536 500B:3072 750B:6144" at seq 2048 is 768 samples per
    step from 0, 1536 from 250e9 // 2048 = 122070312 samples, 3072 from 244140625, 6144 (the
    global batch) from 366210937."""
    steps = parse_step_schedule("0:768 250B:1536 500B:3072 750B:6144", 2048)
    assert steps == [(0, 768), (122070312, 1536), (244140625, 3072), (366210937, 6144)]
    schedule = "0:768 250B:1536 500B:3072 750B:6144"
    cfg = tiny_config(
        model=dict(seq_length=2048, max_position_embeddings=2048),
        train=dict(micro_batch_size=8, step_batch_size_schedule=schedule),
    )
    assert global_batch_size(cfg, 1) == 6144
    at = [batch_size_at(cfg, 1, c) for c in (0, 122070311, 122070312, 244140625, 10**12)]
    assert at == [768, 768, 1536, 3072, 6144]
    assert ramp_sizes(cfg, 1) == [768, 1536, 3072, 6144]
    assert ramp_sizes(cfg, 1, 122070312) == [1536, 3072, 6144]
    # commas, suffixes with decimals, any order: Megatron sorts the entries
    assert parse_step_schedule("1.5K:16,0:8", 1) == [(0, 8), (1500, 16)]


def _cfg(**kw):
    """test_rampup's run (4 layers, micro-batch 2, 6 iterations, warmup 2, cosine) with the
    schedule 2 from 0, 4 from 4 samples, 8 from 12 in place of its ramp-up."""
    sched = dict(global_batch_size=None, rampup_batch_size=(),
                 step_batch_size_schedule=f"0:2 {4 * SEQ}:4 {12 * SEQ}:8")  # fmt: skip
    return ramp_cfg(**{**kw, "train": {**sched, **kw.get("train", {})}})


def test_trains_with_the_scheduled_batches_and_sample_counted_lr():
    """Thresholds 0, 4 and 12 samples: consumed 0, 2, 4, 8, 12, 20 give batches 2, 2, 4, 4, 8,
    8 (28 samples); the lr after each step is the schedule at consumed / 8 (the last batch)."""
    cfg = _cfg()
    assert train_samples(cfg, 1) == 28
    got = run_distributed(_records, 1, cfg)[0]
    assert [r[2] for r in got] == [2, 2, 4, 4, 8, 8]
    want = [learning_rate(cfg.optim, c / 8, 6) for c in (2, 4, 8, 12, 20, 28)]
    assert [r[3] for r in got] == pytest.approx(want, rel=1e-12)
    assert got[-1][0] < got[0][0]


def test_dp2_matches_one_process():
    ref = run_distributed(_records, 1, _cfg())[0]
    got = run_distributed(_records, 2, _cfg(train=dict(micro_batch_size=1)))
    assert all(g == got[0] for g in got)
    assert [r[2] for r in got[0]] == [2, 2, 4, 4, 8, 8]
    _check([r[:2] for r in got[0]][:5], [r[:2] for r in ref][:5])


def test_train_samples_and_lr_samples_count_the_schedule():
    """--train-samples 28: 6 iterations (2 + 2 + 4 + 4 + 8 + 8); --lr-warmup-samples 16 is 2
    iterations of the last batch, 8."""
    from megafp8.cli import parse_args

    cfg = parse_args(
        ["--mock-data", "--micro-batch-size", "2", "--seq-length", str(SEQ),
         "--step-batch-size-schedule", f"0:2 {4 * SEQ}:4 {12 * SEQ}:8", "--train-samples", "28",
         "--lr-warmup-samples", "16"]
    )  # fmt: skip
    assert (cfg.train.train_iters, cfg.optim.lr_warmup_iters) == (6, 2)


@pytest.mark.parametrize(
    "train,message",
    [
        (dict(step_batch_size_schedule="0:2 x:4"), 'entry "x:4": threshold "x" is not a number'),
        (dict(step_batch_size_schedule="0:2 64"), 'entry "64": give THRESHOLD:BATCH_SIZE'),
        (dict(step_batch_size_schedule="64:2 128:4"), "the first threshold must be 0"),
        (dict(step_batch_size_schedule="0:2 16:4"), "two fall at 0 samples"),  # 16 // 32 = 0
        (dict(global_batch_size=8), "step_batch_size_schedule and global_batch_size: give one"),
        (dict(rampup_batch_size=("2", "2", "12")), "and rampup_batch_size: give one"),
        (dict(step_batch_size_schedule="0:3 64:8"), "a step-schedule batch=3 is not divisible"),
    ],
    ids=["number", "entry", "first", "increasing", "gbs", "ramp", "divisible"],
)
def test_bad_schedules_are_one_line(train, message):
    from megafp8.validate import validate

    with pytest.raises(ValueError, match=message):
        validate(_cfg(train=train), 1)


def test_layout_checked_from_the_resumed_position(tmp_path):
    """At DP 2 x micro 2 batch 2 does not fit. A fresh run is refused; resuming, only the
    batches still due count: validate checks the last one, resume the rest at the consumed
    samples it loads (``check_batches``)."""
    from megafp8.validate import validate
    from megafp8.validate_data import check_batches

    cfg = _cfg(train=dict(micro_batch_size=2))
    with pytest.raises(ValueError, match="a step-schedule batch=2 is not divisible by "
                       "micro_batch_size=2 x data-parallel size 2"):  # fmt: skip
        validate(cfg, 2)
    assert validate(_cfg(train=dict(load=str(tmp_path))), 2) == 2
    for consumed, bad in [(0, True), (3, True), (4, False), (20, False)]:
        errors = []
        check_batches(cfg, 2, consumed, errors)
        assert bool(errors) == bad, (consumed, errors)


def _train(cfg):
    from megafp8.train import train

    train(cfg)


def test_a_fresh_run_with_load_checks_every_batch(tmp_path):
    """--load on an empty directory starts from 0 samples: the first batch (1, below micro-batch
    2) is refused before the first iteration, though validate checked only the last."""
    from megafp8.validate import validate

    sched = f"0:1 {4 * SEQ}:4 {12 * SEQ}:8"
    cfg = _cfg(train=dict(load=str(tmp_path), step_batch_size_schedule=sched))
    assert validate(cfg, 1) == 1
    with pytest.raises(AssertionError, match="at 0 consumed samples: a step-schedule batch=1 is"):
        run_distributed(_train, 1, cfg)
