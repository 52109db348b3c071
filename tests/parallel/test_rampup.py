"""Megatron's batch-size ramp-up (``--rampup-batch-size START INCREMENT SAMPLES``): the batch of
each iteration against Megatron's definition worked by hand; training through it: the small
batches equal a run of that constant batch bit for bit, a resume mid-ramp continues bit for bit,
the lr schedule counts samples, and DP 2, PP 2 (1F1B, 1 to 4 micro-batches) and PP 2 x VPP 2
(interleaved, 2 to 8 micro-batches) equal one process."""

import pytest

from megafp8.config_values import batch_size_at, ramp_sizes, train_samples
from megafp8.optim.schedule import learning_rate
from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config
from tests.parallel.test_pp_train import _check


def test_megatron_example_by_hand():
    """Megatron's help: 16 8 300000 with global batch 1024 is (1024 - 16) / 8 = 126 steps of
    300000 / 126 = 2380.95 samples: 16 up to 2380 consumed, 24 from 2381, 16 + 63 x 8 = 520 at
    150000, 1024 at 300000 and after."""
    cfg = tiny_config(train=dict(global_batch_size=1024, micro_batch_size=8,
                                 rampup_batch_size=("16", "8", "300000")))  # fmt: skip
    at = [batch_size_at(cfg, 1, c) for c in (0, 2380, 2381, 150000, 299999, 300000, 300001)]
    assert at == [16, 16, 24, 520, 1016, 1024, 1024]
    sizes = ramp_sizes(cfg, 1)
    assert sizes[:3] == [16, 24, 32] and sizes[-1] == 1024 and len(sizes) == 127


def _cfg(**kw):
    base = dict(
        train=dict(train_iters=6, micro_batch_size=2, global_batch_size=8,
                   rampup_batch_size=("2", "2", "12")),
        optim=dict(lr=1e-3, min_lr=1e-4, lr_warmup_iters=2, lr_decay_style="cosine"),
        model=dict(num_layers=4, num_query_groups=2),
    )  # fmt: skip
    for k, v in kw.items():
        base.setdefault(k, {}).update(v)
    return tiny_config(**base)


def _records(cfg):
    from megafp8.train import train

    return [(r["lm loss"], r["grad norm"], r["global batch size"], r["learning rate"])
            for r in train(cfg)]  # fmt: skip


def test_ramp_trains_with_megatrons_batches_and_sample_counted_lr():
    """2 2 12 to 8: intervals of 12 / 3 = 4 samples; consumed 0, 2, 4, 8, 14, 22 give batches
    2, 2, 4, 6, 8, 8 (30 samples). The lr after each step is the schedule at consumed / 8
    full batches (warmup 2 = 16 samples): 2/8, 4/8, 8/8, 14/8, 22/8, 30/8."""
    cfg = _cfg()
    assert train_samples(cfg, 1) == 30
    got = run_distributed(_records, 1, cfg)[0]
    assert [r[2] for r in got] == [2, 2, 4, 6, 8, 8]
    want = [learning_rate(cfg.optim, c / 8, 6) for c in (2, 4, 8, 14, 22, 30)]
    assert [r[3] for r in got] == pytest.approx(want, rel=1e-12)
    assert got[-1][0] < got[0][0]


def test_small_batches_equal_a_constant_batch_run():
    """With a constant lr, iterations 1 and 2 (batch 2) are those of a run at batch 2."""
    const = dict(lr_decay_style="constant", lr_warmup_iters=0)
    ramp = run_distributed(_records, 1, _cfg(optim=const))[0]
    two = run_distributed(
        _records, 1, _cfg(optim=const, train=dict(global_batch_size=2, rampup_batch_size=()))
    )[0]
    assert [r[:2] for r in ramp[:2]] == [r[:2] for r in two[:2]]


def test_resume_mid_ramp_is_bit_identical(tmp_path):
    ck = str(tmp_path / "ck")
    full = run_distributed(_records, 1, _cfg())[0]
    run_distributed(_records, 1, _cfg(train=dict(train_iters=3, save=ck)))
    rest = run_distributed(_records, 1, _cfg(train=dict(load=ck)))[0]
    assert rest == full[3:]


@pytest.mark.parametrize(
    "world,train,parallel",
    [
        (2, dict(micro_batch_size=1), {}),
        (2, {}, dict(pipeline_model_parallel_size=2)),
        # interleaved: 2, 2, 4, 6, 8, 8 micro-batches, each a multiple of PP
        (
            2,
            dict(micro_batch_size=1),
            dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2),
        ),
    ],
    ids=["dp2", "pp2", "pp2-vpp2"],
)
def test_parallel_ramp_matches_one_process(world, train, parallel):
    ref = run_distributed(_records, 1, _cfg())[0]
    got = run_distributed(_records, world, _cfg(train=train, parallel=parallel))
    assert all(g == got[0] for g in got)
    assert [r[2] for r in got[0]] == [2, 2, 4, 6, 8, 8]
    _check([r[:2] for r in got[0]][:5], [r[:2] for r in ref][:5])


def test_bad_ramps_are_one_line():
    from megafp8.validate import validate

    for ramp, message in [
        (("2", "4", "12"), "INCREMENT >= 1 dividing global_batch_size - START"),
        (("8", "2", "12"), "need 1 <= START < global_batch_size=8"),
        (("2", "x", "12"), "give START INCREMENT SAMPLES, three integers"),
        (("3", "1", "12"), "a ramp-up batch=3 is not divisible by micro_batch_size=2"),
    ]:
        with pytest.raises(ValueError, match=message):
            validate(_cfg(train=dict(rampup_batch_size=ramp)), 1)


def test_train_samples_count_the_ramp():
    """--train-samples 30 with the ramp above: 6 iterations (2 + 2 + 4 + 6 + 8 + 8)."""
    from megafp8.cli import parse_args

    cfg = parse_args("--mock-data --micro-batch-size 2 --global-batch-size 8 --rampup-batch-size"
                     " 2 2 12 --train-samples 30".split())  # fmt: skip
    assert cfg.train.train_iters == 6
