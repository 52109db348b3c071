"""End-to-end training on one process: FP8 learns and tracks fp32, exact resume, atomic saves."""

import os

import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config, train_losses


def _losses(cfg):
    return train_losses(cfg)


def _cfg(**kw):
    base = dict(
        train=dict(train_iters=30, micro_batch_size=4, global_batch_size=8),
        optim=dict(lr=3e-3, min_lr=3e-4, lr_warmup_iters=3, zero_stage=0),
    )
    for k, v in kw.items():
        base.setdefault(k, {}).update(v)
    return tiny_config(**base)


@pytest.mark.slow
def test_fp8_learns_and_tracks_fp32():
    fp32 = run_distributed(_losses, 1, _cfg())[0]
    fp8 = run_distributed(_losses, 1, _cfg(fp8=dict(fp8_format="hybrid", fp8_amax_history_len=16)))[
        0
    ]
    cur = run_distributed(_losses, 1, _cfg(fp8=dict(fp8_format="hybrid", fp8_recipe="tensorwise")))[
        0
    ]
    for losses in (fp32, fp8, cur):
        assert sum(losses[-5:]) / 5 < losses[0] - 0.5  # mock data is learnable: the loss falls
    # FP8 quantization noise (E4M3 3-bit mantissa, E5M2 gradients) moves the curve a little; after
    # 30 steps the mean of the last 5 losses stays within 3% of fp32's.
    for losses in (fp8, cur):
        assert abs(sum(losses[-5:]) - sum(fp32[-5:])) / sum(fp32[-5:]) < 0.03
        assert losses != fp32  # the FP8 path really quantized


@pytest.mark.parametrize("fp8", [None, "hybrid"])
def test_resume_gives_identical_losses(tmp_path, fp8):
    common = dict(
        optim=dict(lr_decay_iters=6),
        fp8=dict(fp8_format=fp8, fp8_amax_history_len=4),
        model=dict(hidden_dropout=0.1),
    )
    full = run_distributed(_losses, 1, _cfg(train=dict(train_iters=6), **common))[0]
    ck = str(tmp_path / "ck")
    first = run_distributed(_losses, 1, _cfg(train=dict(train_iters=3, save=ck), **common))[0]
    assert open(os.path.join(ck, "latest")).read() == "iter_0000003"
    rest = run_distributed(_losses, 1, _cfg(train=dict(train_iters=6, load=ck), **common))[0]
    assert len(full) == 6
    assert first == full[:3]
    assert rest == full[3:]  # bit-identical: data position, RNG, optimizer and FP8 state restored


def _crash_during_save(ck):
    from megafp8 import checkpoint
    from megafp8.train import build_run, init_distributed, save, train

    cfg = _cfg(train=dict(train_iters=2, save=ck), optim=dict(lr_decay_iters=3))
    groups, device = init_distributed(cfg)
    run = build_run(cfg, groups, device)
    train(cfg, run)  # saves iter 2 completely
    run.iteration = 4
    real = run.engine.save_checkpoint

    def dying(save_dir, tag, **kw):
        real(save_dir, tag=tag, **kw)  # the shards are written ...
        raise KeyboardInterrupt("killed mid-save")  # ... but the process dies before the rename

    run.engine.save_checkpoint = dying
    try:
        save(run)
    except KeyboardInterrupt:
        pass
    return checkpoint.latest_tag(ck), sorted(os.listdir(ck))


def test_crash_mid_save_keeps_previous_checkpoint(tmp_path):
    """A process killed between writing the shards and the rename leaves ``latest`` on the
    previous checkpoint, and that checkpoint resumes to the loss an uninterrupted run has at the
    same iteration (bit-identical: weights, optimizer, data position and RNG all restored)."""
    ck = str(tmp_path / "ck")
    tag, entries = run_distributed(_crash_during_save, 1, ck)[0]
    assert tag == "iter_0000002"
    assert "iter_0000004" not in entries  # never looks complete
    # the same lr schedule in every run (decay over 3 iterations, not over train_iters)
    sched = dict(optim=dict(lr_decay_iters=3))
    full = run_distributed(_losses, 1, _cfg(train=dict(train_iters=3), **sched))[0]
    losses = run_distributed(_losses, 1, _cfg(train=dict(train_iters=3, load=ck), **sched))[0]
    assert len(full) == 3
    assert losses == full[2:]


def _microbatch_calls(cfg):
    from megafp8.fp8 import backend as backends

    seen = []
    orig = backends.Backend.microbatch

    def record(self, index):
        seen.append(index)
        return orig(self, index)

    backends.Backend.microbatch = record
    try:
        train_losses(cfg)
    finally:
        backends.Backend.microbatch = orig
    return seen


def test_backend_sees_each_micro_batch_index_and_none_in_eval():
    """The TE weight cache rests on this: index 0 starts an iteration, eval passes None."""
    cfg = _cfg(
        train=dict(train_iters=2, micro_batch_size=2, global_batch_size=8, eval_interval=2),
    )
    cfg = cfg.replace(train=dict(eval_iters=1))
    seen = run_distributed(_microbatch_calls, 1, cfg)[0]
    assert seen[:8] == [0, 1, 2, 3, 0, 1, 2, 3]
    assert None in seen[8:] and all(i is None for i in seen[8:])


def _engine_after_outside_init(cfg):
    """torch.distributed already set up (here: by the test helper), LOCAL_RANK not in the
    environment (a second in-process run after the first's variables were cleared): the engine
    still builds, as DeepSpeed reads LOCAL_RANK."""
    from megafp8.train import build_run, init_distributed

    os.environ.pop("LOCAL_RANK", None)
    groups, device = init_distributed(cfg)
    run = build_run(cfg, groups, device)
    return os.environ["LOCAL_RANK"], type(run.engine).__name__


def test_init_distributed_after_an_outside_init():
    assert run_distributed(_engine_after_outside_init, 1, tiny_config()) == [
        ("0", "DeepSpeedEngine")
    ]


def _eval_reads(cfg):
    import logging

    from megafp8.data.loader import DataIterators

    reads, lines = [], []
    orig = DataIterators.eval_iterator

    def record(self, split, start=0):
        it = orig(self, split, start)
        reads.append((split, start, len(self.datasets[split])))
        return it

    class Lines(logging.Handler):
        def emit(self, r):
            if "validation loss" in r.getMessage():
                lines.append(r.getMessage().split(" | lm loss value")[0])

    handler, logger = Lines(), logging.getLogger("megafp8")
    level = logger.level
    logger.addHandler(handler)
    logger.setLevel(logging.INFO)
    DataIterators.eval_iterator = record
    try:
        train_losses(cfg)
    finally:
        DataIterators.eval_iterator = orig
        logger.removeHandler(handler)
        logger.setLevel(level)
    return reads, lines


def test_evaluations_read_on_through_the_validation_split():
    """Megatron-LM's evaluation: each periodic one reads the eval_iters global batches after
    the previous one's; at the end of training one more on the validation split, then one on
    the test split from its start. The validation split holds exactly enough samples for them
    all: (train_iters // eval_interval + 1) x eval_iters x gbs = 3 x 1 x 8."""
    cfg = _cfg(train=dict(train_iters=4, micro_batch_size=2, global_batch_size=8, eval_interval=2))
    cfg = cfg.replace(train=dict(eval_iters=1))
    reads, lines = run_distributed(_eval_reads, 1, cfg)[0]
    assert reads == [("valid", 0, 24), ("valid", 8, 24), ("valid", 16, 24), ("test", 0, 8)]
    assert lines == [
        "validation loss at iteration 2",
        "validation loss at iteration 4",
        "validation loss at iteration 4 on validation set",
        "validation loss at iteration 4 on test set",
    ]


def test_console_loss_is_the_interval_mean():
    """As Megatron-LM's console line: with --log-interval 3 iteration 1 gets a line of its own,
    and the lm loss printed at iterations 3 and 6 is the mean of iterations 1-3 and 4-6; the
    history keeps each iteration's."""
    cfg = tiny_config(train=dict(train_iters=6), logging=dict(log_interval=3, log_memory=False))
    hist, lines = run_distributed(_train_lines, 1, cfg)[0]
    losses = [r["lm loss"] for r in hist]
    assert len(set(losses)) == 6  # they differ, so a mean is not any one of them
    lines = [x for x in lines if x.startswith(" iteration ")]
    assert [int(x.split()[1].split("/")[0]) for x in lines] == [1, 3, 6]
    printed = [float(x.split("lm loss: ")[1].split(" |")[0]) for x in lines]
    want = [losses[0], sum(losses[:3]) / 3, sum(losses[3:]) / 3]
    assert printed == pytest.approx(want, rel=1e-6)  # printed with 7 significant digits


def _train_lines(cfg):
    import logging

    from megafp8.train import train
    from tests.unit.bad_steps_util import Capture

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    cap, lg = Capture(), logging.getLogger("megafp8")
    lg.addHandler(cap)
    lg.setLevel(logging.INFO)
    return train(cfg), cap.lines
