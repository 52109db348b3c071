"""Run flags from Megatron-LM honoured by the loop: per-token loss, exit duration, resuming
without the optimizer state, manual GC."""

import gc
import math
import os
import weakref

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config, train_losses

GAS, MICRO = 3, 2


def _batches(cfg):
    """GAS micro-batches whose loss masks count different numbers of tokens (64, 46, 28)."""
    g = torch.Generator().manual_seed(0)
    s, v = cfg.model.seq_length, cfg.model.vocab_size
    out = []
    for i in range(GAS):
        tokens = torch.randint(0, v, (MICRO, s + 1), generator=g)
        mask = torch.ones(MICRO, s)
        mask[:, : 9 * i] = 0.0
        out.append({"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": mask})
    return out


def _step_against_autograd(cfg):
    """One train_step through DeepSpeed, and the same loss by plain autograd on a fresh model
    built from the same seed: (loss, grad norm) of each."""
    from megafp8.fp8.backend import Backend
    from megafp8.model.gpt import GPTModel
    from megafp8.parallel.groups import ParallelGroups
    from megafp8.train import build_run, init_distributed, train_step

    groups, device = init_distributed(cfg)
    run = build_run(cfg, groups, device)
    batches = _batches(cfg)
    loss, gnorm = train_step(run, iter(batches))
    ref = GPTModel(
        cfg, backend=Backend(), groups=ParallelGroups.single(), vocab_size=cfg.model.vocab_size
    )
    losses = [ref(b["tokens"], b["labels"], b["loss_mask"]) for b in batches]
    counts = [b["loss_mask"].sum() for b in batches]
    if cfg.train.calculate_per_token_loss:  # every counted token of the global batch alike
        total = sum(x * c for x, c in zip(losses, counts, strict=True)) / sum(counts)
    else:  # the mean of the micro-batches' means
        total = sum(losses) / len(losses)
    total.backward()
    ref_norm = math.sqrt(sum(float(p.grad.double().norm() ** 2) for p in ref.parameters()))
    return loss, gnorm, float(total), ref_norm


def test_per_token_loss_weights_every_token_alike():
    results = {}
    for per_token in (False, True):
        cfg = tiny_config(
            train=dict(
                micro_batch_size=MICRO,
                global_batch_size=MICRO * GAS,
                calculate_per_token_loss=per_token,
            ),
            optim=dict(clip_grad=0.0),
        )
        loss, gnorm, ref_loss, ref_norm = run_distributed(_step_against_autograd, 1, cfg)[0]
        # fp32, one process: the same sums in another order (DeepSpeed's accumulation)
        assert math.isclose(loss, ref_loss, rel_tol=1e-6), (per_token, loss, ref_loss)
        assert math.isclose(gnorm, ref_norm, rel_tol=1e-5), (per_token, gnorm, ref_norm)
        results[per_token] = (loss, gnorm)
    assert abs(results[True][0] - results[False][0]) > 1e-4  # the two definitions differ here


def _cfg(**kw):
    base = dict(
        train=dict(train_iters=6, micro_batch_size=4, global_batch_size=8),
        optim=dict(lr=3e-3, min_lr=3e-4, lr_warmup_iters=1, lr_decay_iters=6, zero_stage=1),
    )
    for k, v in kw.items():
        base.setdefault(k, {}).update(v)
    return tiny_config(**base)


def _losses(cfg):
    return train_losses(cfg)


def test_exit_duration_saves_and_stops(tmp_path):
    ck = str(tmp_path / "ck")
    cfg = _cfg(train=dict(save=ck, exit_duration_in_mins=1e-9))
    losses = run_distributed(_losses, 1, cfg)[0]
    assert len(losses) == 1  # the deadline had passed after the first iteration
    assert open(os.path.join(ck, "latest")).read() == "iter_0000001"


def test_exit_interval_saves_and_stops(tmp_path):
    """Megatron's --exit-interval 2 on a 5-iteration run: iterations 1 and 2, then a checkpoint
    of iteration 2 and the end of the run."""
    ck = str(tmp_path / "ck")
    cfg = _cfg(train=dict(save=ck, exit_interval=2))
    losses = run_distributed(_losses, 1, cfg)[0]
    assert len(losses) == 2
    assert open(os.path.join(ck, "latest")).read() == "iter_0000002"


def test_no_load_optim_restores_weights_not_moments(tmp_path):
    ck = str(tmp_path / "ck")
    full = run_distributed(_losses, 1, _cfg())[0]
    run_distributed(_losses, 1, _cfg(train=dict(train_iters=3, save=ck)))
    fresh = run_distributed(_losses, 1, _cfg(train=dict(load=ck, load_optim=False)))[0]
    kept = run_distributed(_losses, 1, _cfg(train=dict(load=ck)))[0]
    assert kept == full[3:]  # everything restored: bit-identical
    assert fresh[0] == full[3]  # iteration 4's loss comes from the loaded weights alone
    assert fresh[1] != full[4]  # its update used fresh Adam moments


@pytest.mark.parametrize("saved_tp", [1, 2], ids=["same-layout", "resharded"])
def test_finetune_starts_anew_from_the_weights(tmp_path, saved_tp):
    """--finetune: the weights only. A checkpoint written at lr 0 holds the initial weights (the
    same in every layout) but 3 iterations of Adam moments, step counts, RNG and data position.
    Fine-tuning from it must then give the fresh run's losses bit for bit: iteration 1's lr and
    batch, fresh moments. Also from a torch_dist checkpoint of TP 2 (the resharding load, which
    must leave the moments out as well)."""
    ck = str(tmp_path / "ck")
    frozen = _cfg(
        train=dict(train_iters=3, save=ck, ckpt_format="torch_dist" if saved_tp > 1 else "torch"),
        optim=dict(lr=0.0, min_lr=0.0),
        parallel=dict(tensor_model_parallel_size=saved_tp),
    )
    run_distributed(_losses, saved_tp, frozen)
    fresh = run_distributed(_losses, 1, _cfg())[0]
    tuned = run_distributed(_losses, 1, _cfg(train=dict(load=ck, finetune=True)))[0]
    assert len(tuned) == 6 and tuned == fresh
    kept = run_distributed(_losses, 1, _cfg(train=dict(load=ck, load_rng=False)))[0]
    assert len(kept) == 3  # without --finetune: iterations 4-6 of the saved run


def test_ckpt_step_loads_that_iteration_and_missing_checkpoints(tmp_path):
    """--ckpt-step 2 with checkpoints of iterations 2 and 4: iterations 3-6 again, bit for bit;
    an iteration with no checkpoint, and --exit-on-missing-checkpoint on an empty directory,
    are one-line errors before anything starts."""
    from megafp8.train import check_inputs

    ck, empty = str(tmp_path / "ck"), str(tmp_path / "empty")
    os.makedirs(empty)
    full = run_distributed(_losses, 1, _cfg(train=dict(save=ck, save_interval=2)))[0]
    assert sorted(n for n in os.listdir(ck) if n.startswith("iter_")) == [
        "iter_0000002", "iter_0000004", "iter_0000006"]  # fmt: skip
    again = run_distributed(_losses, 1, _cfg(train=dict(load=ck, ckpt_step=2)))[0]
    assert again == full[2:]
    with pytest.raises(ValueError, match="^ckpt_step=3: .*iter_0000003 is no complete checkpoint"):
        check_inputs(_cfg(train=dict(load=ck, ckpt_step=3)))
    with pytest.raises(ValueError, match="^load: no checkpoint in .*empty"):
        check_inputs(_cfg(train=dict(load=empty, exit_on_missing_checkpoint=True)))
    check_inputs(_cfg(train=dict(load=empty)))  # without the flag: a fresh start


def test_manual_gc_turns_the_collector_off_for_the_run():
    from megafp8.run_hooks import RunHooks

    hooks = RunHooks(_cfg(train=dict(manual_gc=True, manual_gc_interval=2)), rank=0)
    try:
        assert not gc.isenabled()
        hooks.after_step(2)  # collects, stays off
        assert not gc.isenabled()
    finally:
        hooks.close()
    assert gc.isenabled()
    late = RunHooks(_cfg(train=dict(exit_duration_in_mins=1.0)), rank=0, start_time=0.0)
    assert late.deadline_passed()
    late.close()
    hooks = RunHooks(_cfg(), rank=0)
    assert not hooks.deadline_passed()
    hooks.close()


def test_the_build_objects_leave_the_collectors_passes_for_the_run():
    """Before the loop everything alive is frozen: a full pass during training walks only what
    training made (objects made after the freeze are still collected); close() unfreezes.

    The test watches the objects themselves, not the frozen count: objects of the whole process
    (other tests' leftovers) may be freed by reference counting at any time, which lowers it."""
    from megafp8.run_hooks import RunHooks

    built = [[] for _ in range(1000)]  # alive before the loop, as the model and engine are
    old = _Box(None)  # a cycle alive at the freeze that becomes garbage during training
    old_ref = weakref.ref(old)
    hooks = RunHooks(_cfg(), rank=0)
    try:
        assert gc.isenabled()
        assert gc.get_freeze_count() >= len(built)
        del old
        cycle: list = []
        cycle.append(cycle)  # garbage made during training: a cycle only the collector frees
        ref = weakref.ref(_Box(cycle))
        gc.collect()
        assert ref() is None  # what training made is collected
        assert old_ref() is not None  # the frozen cycle is not walked
    finally:
        hooks.close()
    assert gc.get_freeze_count() == 0
    gc.collect()
    assert old_ref() is None  # unfrozen, it is collected again


def _gc_state_after_a_raise_in_the_loop(cfg):
    """train() whose second iteration raises: the collector's state once the error is out."""
    from megafp8 import train as train_mod

    real, calls = train_mod.train_step, []

    def failing(run, it, hooks=None):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("the second iteration fails")
        return real(run, it, hooks)

    train_mod.train_step = failing
    try:
        train_mod.train(cfg)
    except RuntimeError as e:
        return str(e), gc.isenabled(), gc.get_freeze_count()
    finally:
        train_mod.train_step = real
    return None, gc.isenabled(), gc.get_freeze_count()


def test_a_raise_in_the_loop_leaves_the_collector_as_it_was():
    """--manual-gc turns the collector off and the loop freezes the build's objects: an error
    inside the loop still gives both back (a process that goes on, such as a notebook or a
    test runner, keeps a working collector)."""
    cfg = _cfg(train=dict(manual_gc=True))
    err, enabled, frozen = run_distributed(_gc_state_after_a_raise_in_the_loop, 1, cfg)[0]
    assert err == "the second iteration fails"
    assert enabled and frozen == 0, (enabled, frozen)


class _Box:
    def __init__(self, v):
        self.v, self.me = v, self


def _first_batch_and_loss(cfg):
    from megafp8.train import build_run, init_distributed

    groups, device = init_distributed(cfg)
    run = build_run(cfg, groups, device)
    b = next(run.data.train)
    return b["tokens"], b["loss_mask"], run.data.eod_mask_id


def test_eod_mask_loss_reaches_the_training_batches():
    """The run's tokenizer EOD (mock data: vocab - 1) is the id masked when --eod-mask-loss."""
    tokens, mask, eod = run_distributed(
        _first_batch_and_loss, 1, _cfg(data=dict(eod_mask_loss=True))
    )[0]
    assert eod == 255 and torch.equal(mask, (tokens != 255).float())
    _, plain_mask, none = run_distributed(_first_batch_and_loss, 1, _cfg())[0]
    assert none is None and torch.all(plain_mask == 1)
