"""megafp8.optim.schedule.learning_rate against values worked out by hand.

Every test uses lr = 1.0, min_lr = 0.1 and 4 warmup iterations, so (lr - min_lr) = 0.9 and

    warmup (it <= 4):  init + (lr - init) * it / 4   (init = lr_warmup_init, 0 unless set)
    linear:            0.1 + 0.9 * (1 - r)
    cosine:            0.1 + 0.9 * (1 + cos(pi r)) / 2
    exponential (WSD): 0.1 + 0.9 * (2 * 0.5**r - 1)
    minus_sqrt (WSD):  0.1 + 0.9 * (1 - sqrt(r))
    inverse-square-root: max(0.1, sqrt(4 / it))

with r = (it - 4) / (decay_iters - 4) for linear/cosine and r = (it - start) / wsd_iters with
start = decay_iters - wsd_iters for WSD. The expected numbers below are written as those
expressions with r substituted (cos(pi/4) = 2**-0.5, 0.5**0.25 = 2**-0.25), not computed by the
module under test.
"""

import pytest

from megafp8.config import OptimConfig
from megafp8.optim.schedule import learning_rate

TRAIN = 20  # decay_iters defaults to train_iters: r = (it - 4) / 16


def opt(**kw) -> OptimConfig:
    base = dict(lr=1.0, min_lr=0.1, lr_warmup_iters=4)
    base.update(kw)
    return OptimConfig(**base)


def lrs(o, its, train=TRAIN):
    return [learning_rate(o, it, train) for it in its]


@pytest.mark.parametrize("style", ["constant", "linear", "cosine", "WSD", "inverse-square-root"])
def test_linear_warmup_from_zero_reaches_lr_at_warmup(style):
    """Megatron-LM's warmup, whatever the decay style: the first step at 0, then 0.25, 0.5,
    0.75, and 1.0 at it = 4 (its scheduler has taken 4 steps)."""
    got = lrs(opt(lr_decay_style=style), range(5))
    assert got == pytest.approx([0.0, 0.25, 0.5, 0.75, 1.0], abs=1e-15)


def test_warmup_starts_at_lr_warmup_init():
    """--lr-warmup-init 0.2: 0.2 + 0.8 * it / 4 -> 0.2, 0.4, 0.6, 0.8, 1.0."""
    got = lrs(opt(lr_warmup_init=0.2, lr_decay_style="linear"), range(5))
    assert got == pytest.approx([0.2, 0.4, 0.6, 0.8, 1.0], abs=1e-15)


def test_no_warmup_starts_at_lr():
    """Without warmup iteration 0 already runs at the peak lr (r = 0)."""
    o = opt(lr_warmup_iters=0, lr_decay_style="linear")
    # r = it / 20: it = 0 -> 1.0, it = 10 -> 0.1 + 0.9 * 0.5
    assert lrs(o, [0, 10]) == pytest.approx([1.0, 0.55], abs=1e-15)


def test_constant_ignores_decay_and_min_lr():
    """constant: the peak lr after warmup, also at and past decay_iters (min_lr unused)."""
    assert lrs(opt(lr_decay_style="constant"), [4, 10, 19, 20, 50]) == [1.0] * 5


def test_linear_decay():
    """r = (it - 4) / 16: it 4 -> r 0; 8 -> 1/4; 12 -> 1/2; 19 -> 15/16; >= 20 -> min_lr."""
    got = lrs(opt(lr_decay_style="linear"), [4, 8, 12, 19, 20, 25])
    want = [1.0, 0.1 + 0.9 * 0.75, 0.1 + 0.9 * 0.5, 0.1 + 0.9 / 16, 0.1, 0.1]
    assert got == pytest.approx(want, abs=1e-12)


def test_cosine_decay():
    """cosine: it 8 -> r 1/4, (1 + cos(pi/4)) / 2; 12 -> r 1/2, 1/2;
    16 -> r 3/4, (1 - cos(pi/4)) / 2."""
    got = lrs(opt(lr_decay_style="cosine"), [4, 8, 12, 16, 20])
    c = 2**-0.5  # cos(pi / 4)
    want = [1.0, 0.1 + 0.9 * (1 + c) / 2, 0.55, 0.1 + 0.9 * (1 - c) / 2, 0.1]
    assert got == pytest.approx(want, abs=1e-12)


def test_lr_decay_iters_overrides_train_iters():
    """lr_decay_iters = 12: r = (it - 4) / 8, and min_lr from iteration 12 on (train_iters 20)."""
    got = lrs(opt(lr_decay_style="linear", lr_decay_iters=12), [6, 8, 12, 19])
    assert got == pytest.approx([0.1 + 0.9 * 0.75, 0.55, 0.1, 0.1], abs=1e-12)


# WSD with decay_iters 20 and wsd_iters 8: stable until start = 12, then r = (it - 12) / 8:
# it 12 -> r 0, 14 -> 1/4, 16 -> 1/2, 18 -> 3/4; min_lr from 20.
WSD_ITS = [4, 11, 12, 14, 16, 18, 20]
WSD_WANT = {
    "linear": [1.0, 0.1 + 0.9 * 0.75, 0.1 + 0.9 * 0.5, 0.1 + 0.9 * 0.25],
    "cosine": [1.0, 0.1 + 0.9 * (1 + 2**-0.5) / 2, 0.55, 0.1 + 0.9 * (1 - 2**-0.5) / 2],
    # 2 * 0.5**r - 1: r 1/4 -> 2**0.75 - 1; r 1/2 -> 2**0.5 - 1; r 3/4 -> 2**0.25 - 1
    "exponential": [
        1.0,
        0.1 + 0.9 * (2**0.75 - 1),
        0.1 + 0.9 * (2**0.5 - 1),
        0.1 + 0.9 * (2**0.25 - 1),
    ],
    # 1 - sqrt(r): r 1/4 -> 1/2; r 1/2 -> 1 - 2**-0.5; r 3/4 -> 1 - 3**0.5 / 2
    "minus_sqrt": [1.0, 0.55, 0.1 + 0.9 * (1 - 2**-0.5), 0.1 + 0.9 * (1 - 3**0.5 / 2)],
}


@pytest.mark.parametrize("anneal", sorted(WSD_WANT))
def test_wsd_each_anneal_style(anneal):
    """WSD: lr through the stable phase (iterations 4..12), then the chosen anneal to min_lr."""
    o = opt(lr_decay_style="WSD", lr_wsd_decay_iters=8, lr_wsd_decay_style=anneal)
    want = [1.0, 1.0, *WSD_WANT[anneal], 0.1]
    assert lrs(o, WSD_ITS) == pytest.approx(want, abs=1e-12)


def test_wsd_default_anneal_is_a_tenth_of_the_post_warmup_span():
    """lr_wsd_decay_iters unset: (104 - 4) // 10 = 10 iterations of anneal, start = 94;
    it 99 -> r 1/2 (linear: 0.55), it 93 and 94 -> lr."""
    o = opt(lr_decay_style="WSD", lr_wsd_decay_style="linear")
    assert lrs(o, [93, 94, 99, 104], train=104) == pytest.approx([1.0, 1.0, 0.55, 0.1], abs=1e-12)


def test_warmup_then_decay_is_continuous_at_the_boundary():
    """The peak lr is reached once, at it = 4, where warmup ends and decay starts (r = 0)."""
    for style in ("linear", "cosine"):
        o = opt(lr_decay_style=style)
        assert learning_rate(o, 3, TRAIN) == 0.75 and learning_rate(o, 4, TRAIN) == 1.0
        assert learning_rate(o, 5, TRAIN) < 1.0


def test_inverse_square_root_decays_from_the_warmup_and_floors_at_min_lr():
    """sqrt(4 / it): 1.0 at it = 4, 1/2 at 16, 1/4 at 64 (r is unused); past decay_iters (20
    here) min_lr; within them the floor is min_lr (0.25 -> 0.3 with min_lr 0.3, at it = 64 with
    decay_iters 100). At it = decay_iters itself the formula still holds (sqrt(4 / 20)), as in
    Megatron-LM, whose min_lr starts after its decay steps."""
    o = opt(lr_decay_style="inverse-square-root")
    assert lrs(o, [4, 16, 20, 21]) == pytest.approx([1.0, 0.5, (4 / 20) ** 0.5, 0.1], abs=1e-15)
    assert lrs(o, [64], train=100) == pytest.approx([0.25], abs=1e-15)
    floor = opt(lr_decay_style="inverse-square-root", min_lr=0.3)
    assert lrs(floor, [16, 64], train=100) == pytest.approx([0.5, 0.3], abs=1e-15)


def test_unknown_style_raises():
    with pytest.raises(ValueError, match="unknown decay style"):
        learning_rate(opt(lr_decay_style="step"), 10, TRAIN)


def _first_steps(cfg):
    """Train ``cfg`` in one process: its records, and whether the weights after the run are the
    initial ones bit for bit."""
    import torch

    import megafp8.train as T

    groups, device = T.init_distributed(cfg)
    run = T.build_run(cfg, groups, device)
    before = [p.detach().clone() for p in run.model.parameters()]
    recs = T.train(cfg, run)
    same = all(torch.equal(a, b) for a, b in zip(before, run.model.parameters(), strict=True))
    return [r["learning rate"] for r in recs], same


def test_training_takes_its_first_step_at_the_warmup_init_and_logs_the_next_lr():
    """As Megatron-LM: with 2 warmup iterations from 0 the first step changes no weight (lr 0,
    so no decay either); the console line of iteration k shows the lr after its step,
    learning_rate(k): 0.5e-3 and 1e-3 for iterations 1 and 2. A second step does move them."""
    from tests.helpers.dist import run_distributed
    from tests.helpers.tiny import tiny_config

    def cfg(iters):
        return tiny_config(
            train=dict(micro_batch_size=2, global_batch_size=4, train_iters=iters, seed=7),
            optim=dict(lr=1e-3, min_lr=1e-4, lr_warmup_iters=2, zero_stage=1),
        )

    one, unchanged = run_distributed(_first_steps, 1, cfg(1))[0]
    assert unchanged and one == pytest.approx([0.5e-3], abs=1e-15)
    two, unchanged = run_distributed(_first_steps, 1, cfg(2))[0]
    assert not unchanged and two == pytest.approx([0.5e-3, 1e-3], abs=1e-15)
