"""Bad steps at pp = 1: a NaN loss or gradient stops the run naming the iteration, or (skip) its
update does not happen: weights, ZeRO's fp32 partitions and Adam's moments and step counts are
bit-identical across it, on every rank, while the iterations around it train; a loss spike is
skipped the same way; both are counted in the console line (Megatron's fields), and neither
moves the lr schedule (Megatron-LM's skipped iterations)."""

import pytest

from megafp8.optim.schedule import learning_rate
from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config
from tests.unit.bad_steps_util import train_injected


def _cfg(zero=1, **train):
    return tiny_config(
        train=dict(micro_batch_size=2, global_batch_size=8, train_iters=6, **train),
        optim=dict(zero_stage=zero),
    )


def _counts(lines, it):
    """(skipped, nan) of the console line of iteration ``it``."""
    (line,) = [x for x in lines if x.startswith(f" iteration {it:8d}/")]
    field = lambda k: int(line.split(f"{k}: ")[1].split(" |")[0])  # noqa: E731
    return field("number of skipped iterations"), field("number of nan iterations")


def test_nan_stop_names_the_iteration():
    _, _, _, err = run_distributed(train_injected, 1, _cfg(), {3: "nan"})[0]
    assert err == "lm loss is nan at iteration 3"


@pytest.mark.parametrize("zero", [1, 2])
def test_nan_on_one_rank_and_spike_are_skipped(zero):
    """dp 2, the NaN on rank 1 only; a x100 loss at iteration 5 once the window (2) is full."""
    cfg = _cfg(zero, nan_policy="skip", check_for_spiky_loss=True, spiky_loss_window=2)
    got = run_distributed(train_injected, 2, cfg, {3: "nan", 5: "spike"}, 1)
    for hist, unchanged, _, err in got:
        assert err is None and len(hist) == 6
        assert unchanged == {1: False, 2: False, 3: True, 4: False, 5: True, 6: False}
        assert [r["skipped"] for r in hist] == [False, False, True, False, True, False]
        assert [r["iteration"] for r in hist] == [1, 2, 3, 4, 5, 6]  # the counter moves on
        # the schedule does not: steps taken after iterations 1-6 are 1, 2, 2, 3, 3, 4, and
        # each step runs at the lr of the steps taken before it
        lr = [learning_rate(cfg.optim, k, 6) for k in range(5)]
        assert len(set(lr)) == 5  # warmup 1, then cosine: each step's lr differs
        assert [r["applied lr"] for r in hist] == [lr[0], lr[1], lr[2], lr[2], lr[3], lr[3]]
        assert [r["learning rate"] for r in hist] == [lr[1], lr[2], lr[2], lr[3], lr[3], lr[4]]
    lines = got[0][2]
    assert [_counts(lines, i) for i in range(1, 7)] == [(0, 0), (0, 0), (1, 1), (0, 0), (1, 0),
                                                        (0, 0)]  # fmt: skip
    assert "lm loss: NAN |" in [x for x in lines if x.startswith(" iteration        3/")][0]


def test_first_line_leaves_the_counts_to_the_interval_line():
    """--log-interval 3: iteration 1's own line (Megatron's) shows its skip, and the line of
    iteration 3 still counts it, with the interval's lm loss the mean of the updated iterations."""
    cfg = _cfg(nan_policy="skip").replace(logging=dict(log_interval=3, log_memory=False))
    hist, _, lines, err = run_distributed(train_injected, 1, cfg, {1: "nan"})[0]
    assert err is None and [r["skipped"] for r in hist] == [True] + [False] * 5
    assert [_counts(lines, i) for i in (1, 3, 6)] == [(1, 1), (1, 1), (0, 0)]
    line3 = [x for x in lines if x.startswith(" iteration        3/")][0]
    loss3 = float(line3.split("lm loss: ")[1].split(" |")[0])
    assert loss3 == pytest.approx((hist[1]["lm loss"] + hist[2]["lm loss"]) / 2, rel=1e-6)


def test_loss_judged_on_the_device():
    """ZeRO 1 in bf16 with a fused AdamW (the GPU's path): the host launches the step before it
    reads the loss; the NaN loss (one rank) and the spike are withheld inside the fused kernel
    all the same, and counted as on the host path."""
    cfg = _cfg(1, nan_policy="skip", check_for_spiky_loss=True, spiky_loss_window=2, bf16=True)
    got = run_distributed(train_injected, 2, cfg, {3: "nan", 5: "spike"}, 1, None, True)
    for hist, unchanged, _, err in got:
        assert err is None and len(hist) == 6
        assert unchanged == {1: False, 2: False, 3: True, 4: False, 5: True, 6: False}
        assert [r["skipped"] for r in hist] == [False, False, True, False, True, False]
    assert [_counts(got[0][2], i) for i in range(1, 7)] == [(0, 0), (0, 0), (1, 1), (0, 0),
                                                             (1, 0), (0, 0)]  # fmt: skip


@pytest.mark.parametrize("zero,bf16", [(0, False), (1, False), (1, True), (2, True)])
def test_nan_gradient_with_a_finite_loss_is_skipped(zero, bf16):
    """The grad norm is only known inside the step: DeepSpeed's ZeRO skips a non-finite one
    itself in fp32, at ZeRO 0 in fp32 the optimizer checks the gradients over every rank, and
    at ZeRO 1/2 in bf16 (DeepSpeed's overflow scan off) the optimizer skips on the norm."""
    cfg = _cfg(zero, nan_policy="skip", bf16=bf16)
    got = run_distributed(train_injected, 2, cfg, {2: "nangrad"}, 0)
    for _, unchanged, _, err in got:
        assert err is None
        assert unchanged == {i: i == 2 for i in range(1, 7)}
    assert _counts(got[0][2], 2) == (1, 1)


@pytest.mark.parametrize("zero", [1, 2])
def test_bad_steps_under_the_precision_aware_optimizer(zero):
    """--use-precision-aware-optimizer (adamw_bf16 reads found_inf): a NaN gradient at
    iteration 2 (rank 0), a NaN loss at 4 (rank 1) and a spike at 6 leave every weight, master,
    moment and step count as they were and are reported skipped; the others train."""
    cfg = _cfg(zero, nan_policy="skip", bf16=True, check_for_spiky_loss=True, spiky_loss_window=2)
    cfg = cfg.replace(optim=dict(use_precision_aware_optimizer=True))
    for inject, rank, bad in (({2: "nangrad"}, 0, {2}), ({4: "nan", 6: "spike"}, 1, {4, 6})):
        got = run_distributed(train_injected, 2, cfg, inject, rank)
        for hist, unchanged, _, err in got:
            assert err is None
            assert unchanged == {i: i in bad for i in range(1, 7)}
            assert [r["skipped"] for r in hist] == [i in bad for i in range(1, 7)]


def test_nan_gradient_stop():
    _, _, _, err = run_distributed(train_injected, 1, _cfg(), {2: "nangrad"})[0]
    assert err.startswith("grad norm is ") and err.endswith(" at iteration 2")


def test_no_exit_on_nan_is_skip():
    cfg = _cfg(exit_on_nan=False)
    _, unchanged, _, err = run_distributed(train_injected, 1, cfg, {2: "nan"})[0]
    assert err is None and unchanged[2] and not unchanged[3]


@pytest.mark.parametrize("fused", [True, False])
def test_norm_skip_withholds_the_update(fused):
    """StepGuard.norm_of: a NaN or inf global norm leaves the weights, both moments and the step
    count as they were (fused AdamW: through ``found_inf``, without reading the norm on the
    host; otherwise read on the host); a finite one steps; nothing stays set afterwards."""
    import torch

    from megafp8.optim.step_guard import StepGuard

    p = torch.nn.Parameter(torch.ones(8))
    opt = torch.optim.AdamW([p], lr=0.1, fused=fused)
    guard = StepGuard(opt)
    norm = {}
    guard.norm_of = lambda: norm["v"]
    p.grad, norm["v"] = torch.full((8,), 0.5), torch.tensor(1.0)
    opt.step()  # the state exists from here
    for bad in (float("nan"), float("inf")):
        p.grad = torch.full((8,), 0.5)
        norm["v"] = torch.tensor(bad)
        before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
        opt.step()
        assert torch.equal(p, before[0]), bad
        assert all(torch.equal(v, before[1][k]) for k, v in opt.state[p].items()), bad
        assert getattr(opt, "found_inf", None) is None
        guard.nonfinite_grad = False  # StepPolicy.before_step's reset
    norm["v"], before = torch.tensor(1.0), p.detach().clone()
    opt.step()
    assert (p < before).all() and float(opt.state[p]["step"]) == 2.0


def test_loss_verdict_on_the_device_withholds_the_update():
    """StepGuard.skip_if (StepPolicy's device verdict on the loss) reaches the fused kernel as
    found_inf, with a finite norm and with none; 0.0 lets the update happen."""
    import torch

    from megafp8.optim.step_guard import StepGuard

    p = torch.nn.Parameter(torch.ones(4))
    opt = torch.optim.AdamW([p], lr=0.1, fused=True)
    guard = StepGuard(opt)
    assert not guard.on_device()  # no norm_of: the host decides
    p.grad = torch.full((4,), 0.5)
    opt.step()
    for norm in (torch.tensor(1.0), None):
        guard.norm_of = lambda n=norm: n
        assert guard.on_device()
        guard.skip_if = torch.tensor(1.0)
        before = (p.detach().clone(), {k: v.clone() for k, v in opt.state[p].items()})
        opt.step()
        assert torch.equal(p, before[0]) and float(opt.state[p]["step"]) == 1.0, norm
        guard.skip_if, guard._found = torch.tensor(0.0), (None, None)
        opt.step()
        assert (p < before[0]).all(), norm
        opt.state[p]["step"].fill_(1.0)


def test_norm_skip_counts_the_skip():
    """On the fused path nothing is read on the host inside the step: the policy learns of the
    withheld update from the non-finite grad norm the step reports."""
    import types

    import torch

    from megafp8.optim.step_guard import StepGuard, StepPolicy

    opt = torch.optim.AdamW([torch.nn.Parameter(torch.ones(2))], fused=True)
    guard = StepGuard(opt)
    policy = StepPolicy(_cfg(nan_policy="skip").train, types.SimpleNamespace(optimizer=opt))
    for norm_of, gn, want in [(None, float("inf"), False), (lambda: None, float("inf"), True),
                              (lambda: None, 1.0, False)]:  # fmt: skip
        guard.norm_of = norm_of
        policy.before_step(2.0)
        v = policy.after_step(2.0, gn)
        assert (v["skipped"], v["nan"]) == (want, gn != 1.0), norm_of
