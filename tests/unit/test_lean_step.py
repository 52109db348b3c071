"""optim/lean_step.py: DeepSpeed's ZeRO 1/2 gradient norm and clip, replaced on the instance, give
DeepSpeed's own results (norm: fp32 against fp64 accumulation; clip: bit for bit), the same
gradients counted under TP and ZeRO padding, the same -1 for a non-finite norm; the clip factor
reaches a fused AdamW as its grad_scale; training matches DeepSpeed's own step."""

import math

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config


def _cfg(tp=1, zero=1, bf16=False, **optim):
    return tiny_config(
        train=dict(bf16=bf16),
        parallel=dict(tensor_model_parallel_size=tp),
        optim=dict(zero_stage=zero, optimizer_group_max_numel=5000, **optim),
    )


def _against_deepspeed(cfg):
    """Per group, on random gradients of this rank's partition: the lean norm and DeepSpeed's,
    finite and with one inf; the lean clip and DeepSpeed's on one flat fp32 gradient."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Z

    import megafp8.train as T

    groups, device = T.init_distributed(cfg)
    run = T.build_run(cfg, groups, device)
    zopt = run.engine.optimizer
    from megafp8.optim import lean_step

    assert zopt.get_grad_norm_direct.func is lean_step.grad_norm  # installed by build_engine
    gen = torch.Generator().manual_seed(11 + groups.coords.tp)
    out = {"groups": len(zopt.params_in_partition), "norms": [], "clips": [], "global": []}
    for params in zopt.params_in_partition:
        grads = [torch.randn(p.shape, generator=gen) * 0.3 for p in params]
        pad = torch.full((3,), 1e3)
        pad._zero_padding = True  # ZeRO's alignment padding: not counted
        for gs in (grads, [pad, *grads]):
            mine = zopt.get_grad_norm_direct(gs, params)
            ref = Z.get_grad_norm_direct(zopt, gs, params)
            out["norms"].append((float(mine), float(ref)))
        grads[0][0] = math.inf
        out["norms"].append((float(zopt.get_grad_norm_direct(grads, params)),
                             float(Z.get_grad_norm_direct(zopt, grads, params))))  # fmt: skip
    # the step's global norm over all groups at once, against DeepSpeed's per-group combination
    saved = dict(zopt.averaged_gradients)
    for bad in (False, True):
        for i, params in enumerate(zopt.params_in_partition):
            zopt.averaged_gradients[i] = [torch.randn(p.shape, generator=gen) for p in params]
        if bad:  # one gradient of the last group, on every rank
            zopt.averaged_gradients[len(zopt.params_in_partition) - 1][0][0] = math.nan
        out["global"].append((float(zopt.scaled_global_norm()), float(Z.scaled_global_norm(zopt))))
    zopt.averaged_gradients.clear()
    zopt.averaged_gradients.update(saved)
    for norm in (0.25, 3.0, -1.0, math.inf, math.nan):
        flat = torch.randn(50, generator=gen)
        a, b = flat.clone(), flat.clone()
        zopt.unscale_and_clip_grads([a], torch.tensor(norm))
        Z.unscale_and_clip_grads(zopt, [b], torch.tensor(norm))
        out["clips"].append((norm, torch.equal(a, b), torch.equal(a, flat)))
    return out


@pytest.mark.parametrize("tp,zero", [(1, 1), (2, 1), (1, 2)])
def test_norm_and_clip_match_deepspeed(tp, zero):
    """TP 2: a replicated parameter (norms, row-parallel biases) counted on TP rank 0 only, the
    norm summed over the model-parallel group, as DeepSpeed does; ZeRO 2 (dp 2) the same."""
    got = run_distributed(_against_deepspeed, 2, _cfg(tp, zero))
    for r in got:
        assert r["groups"] > 2  # bounded groups: several
        for mine, ref in r["norms"]:
            if ref == -1.0:
                assert mine == -1.0
            else:
                assert mine == pytest.approx(ref, rel=2e-6) and ref > 0
        assert sum(ref == -1.0 for _, ref in r["norms"]) == r["groups"]
        # clipped (3.0, invalid norms: gradients x 0) or not (0.25): DeepSpeed's bits
        assert [(n, same) for n, same, _ in r["clips"]] == [
            (n, True) for n in (0.25, 3.0, -1.0, math.inf, r["clips"][-1][0])
        ]
        (mine, ref), (bad_mine, bad_ref) = r["global"]
        assert mine == pytest.approx(ref, rel=2e-6) and ref > 0
        assert bad_mine == bad_ref == math.inf
        # below the clip (0.25 < 1) the gradient stays; above it, it is scaled; invalid: zeroed
        assert [unchanged for *_, unchanged in r["clips"]][:2] == [True, False]
    if tp == 2:  # the model-parallel sum makes the norm the same on both ranks
        assert [m for m, _ in got[0]["norms"]] == [m for m, _ in got[1]["norms"]]


NORMS = (4.0, 0.5, 8.0)


def test_clip_factor_goes_to_a_fused_adamw():
    """With a fused AdamW under StepGuard the gradients stay as they are and the kernel divides
    them by the factor: the update equals the multiplied one's (to rounding), and nothing stays
    set after the step."""
    import types

    from megafp8.optim import lean_step
    from megafp8.optim.step_guard import StepGuard

    def make(fused):
        p = torch.nn.Parameter(torch.linspace(-1, 1, 16))
        opt = torch.optim.AdamW([p], lr=0.1, fused=fused)
        return p, opt, StepGuard(opt)

    zopt = types.SimpleNamespace(clip_grad=1.0, loss_scale=1.0)
    results = []
    for fused in (True, False):
        p, opt, guard = make(fused)
        zopt.optimizer = opt
        for _ in range(3):
            g = torch.linspace(0.5, 2.0, 16)
            lean_step.unscale_and_clip(zopt, None, [g], torch.tensor(4.0))
            assert torch.equal(g, torch.linspace(0.5, 2.0, 16)) == fused
            assert (guard.grad_scale is not None) == fused
            p.grad = g
            opt.step()
            assert guard.grad_scale is None and getattr(opt, "grad_scale", None) is None
        results.append((p.detach().clone(), opt.state[p]["exp_avg"].clone()))
    for a, b in zip(*results, strict=True):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-7)
    # factors 4, 1 and 8 (Adam would not see one constant factor): unclipped steps differ
    p, opt, _ = make(False)
    for _ in NORMS:
        p.grad = torch.linspace(0.5, 2.0, 16)
        opt.step()
    assert not torch.allclose(opt.state[p]["exp_avg"], results[1][1], rtol=0.1)


def _train(cfg, mode: str):
    """Train ``cfg``: ``lean`` (as installed), ``deepspeed`` (DeepSpeed's own step), or
    ``unwidened`` (lean, DeepSpeed's own concatenation and ``.to``); the history and the dtypes
    of the gradient partitions the lean step handed over."""
    import megafp8.optim.lean_step as L
    import megafp8.train as T

    widened = []
    if mode == "deepspeed":
        L.install = lambda opt, **k: False
    elif mode == "unwidened":
        L.widened_partition = lambda zopt, fallback, i: fallback(i)
    else:
        plain = L.widened_partition

        def counted(zopt, fallback, i):
            out = plain(zopt, fallback, i)
            widened.append(None if out is None else out.dtype)
            return out

        L.widened_partition = counted
    hist = [(r["lm loss"], r["grad norm"]) for r in T.train(cfg)]
    return hist, widened


def test_widened_partition_is_deepspeeds_flat_fp32_gradient(monkeypatch):
    """A pre-flattened bf16 buffer: a new fp32 tensor of its values. Else the group's bf16
    gradients concatenated, zero-padded to the partition size on the last rank (DeepSpeed's
    ``flatten_dense_tensors_aligned``): the same values as DeepSpeed's ``cat`` then ``.to``.
    Already fp32, absent, or not DeepSpeed's shape: handed back unchanged."""
    import types

    from megafp8.optim import lean_step

    flat = (torch.randn(1000) * 1e-3).bfloat16()
    grads = [(torch.randn(s) * 1e-3).bfloat16() for s in ((6, 5), (7,), (3, 4))]
    zopt = types.SimpleNamespace(
        single_partition_of_fp32_groups=[torch.zeros(1000), torch.zeros(52)],
        partition_size=[1000, 52],
        averaged_gradients={0: None, 1: grads},
    )
    wide = lean_step.widened_partition(zopt, lambda i: flat, 0)
    assert wide.dtype == torch.float32 and torch.equal(wide, flat.float())
    assert wide.data_ptr() != flat.data_ptr()
    monkeypatch.setattr(lean_step, "_last_rank", lambda z, i: True)
    wide = lean_step.widened_partition(zopt, lambda i: None, 1)
    ref = torch.cat([*(g.reshape(-1) for g in grads), torch.zeros(3, dtype=torch.bfloat16)])
    assert wide.dtype == torch.float32 and torch.equal(wide, ref.to(torch.float32))
    # short of the partition size, and not the last rank: DeepSpeed's assertion speaks
    monkeypatch.setattr(lean_step, "_last_rank", lambda z, i: False)
    assert lean_step.widened_partition(zopt, lambda i: None, 1) is None
    same = torch.randn(1000)
    assert lean_step.widened_partition(zopt, lambda i: same, 0) is same
    assert lean_step.widened_partition(zopt, lambda i: None, 0) is None
    zopt.averaged_gradients[1] = grads + [torch.zeros(10, dtype=torch.bfloat16)]  # too many
    assert lean_step.widened_partition(zopt, lambda i: None, 1) is None


@pytest.mark.parametrize("zero", [1, 2])
def test_training_matches_deepspeeds_step(zero):
    """Five iterations at dp 2, clipping active (clip 0.05): the losses and grad norms of the
    lean step and of DeepSpeed's own agree to the norm's fp32-vs-fp64 rounding."""
    cfg = _cfg(1, zero, clip_grad=0.05)
    lean, _ = run_distributed(_train, 2, cfg, "lean")[0]
    ref, _ = run_distributed(_train, 2, cfg, "deepspeed")[0]
    assert len(lean) == len(ref) == 5
    assert all(gn > 0.05 for _, gn in ref)  # every step clipped
    for (la, ga), (lb, gb) in zip(lean, ref, strict=True):
        assert la == pytest.approx(lb, rel=1e-5)
        assert ga == pytest.approx(gb, rel=1e-5)


@pytest.mark.parametrize("zero", [1, 2])
def test_widened_gradients_train_bit_for_bit_as_deepspeeds_widening(zero):
    """ZeRO 1 and 2 in bf16 at dp 2: every flat gradient partition reaches the step in fp32 from
    the multi-tensor copy, and the five iterations' losses and grad norms are exactly those of
    the same step with DeepSpeed's ``cat`` and ``.to`` (the same values, so the same bits)."""
    cfg = _cfg(1, zero, True, clip_grad=0.05)
    lean, widened = run_distributed(_train, 2, cfg, "lean")[0]
    ref, none = run_distributed(_train, 2, cfg, "unwidened")[0]
    assert len(widened) >= 5 and set(widened) == {torch.float32} and not none
    assert len(lean) == 5 and lean == ref


def _train_counted(cfg, bypass: bool):
    """Train ``cfg`` with ZeRO-1's one-rank reduction bypass on (as installed) or off
    (DeepSpeed's own reduction); the history, how many gradients went through DeepSpeed's bucket
    and how many boundaries took the bypass."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer as Z

    import megafp8.optim.lean_step as L
    import megafp8.train as T

    calls = {"bucket": 0, "bypass": 0}
    plain_bucket, plain_alone = Z.reduce_independent_p_g_buckets_and_remove_grads, L.alone

    def bucket(self, *a, **k):
        calls["bucket"] += 1
        return plain_bucket(self, *a, **k)

    def alone(zopt):
        out = bypass and plain_alone(zopt)
        calls["bypass"] += int(out)
        return out

    Z.reduce_independent_p_g_buckets_and_remove_grads = bucket
    L.alone = alone
    hist = [(r["lm loss"], r["grad norm"]) for r in T.train(cfg)]
    return hist, calls


@pytest.mark.parametrize("aware", [False, True])
def test_one_rank_zero1_skips_the_reduction_bit_for_bit(aware):
    """ZeRO-1 in bf16 on one data-parallel rank, clipping active, with and without the
    precision-aware step: no gradient goes through DeepSpeed's bucket (its copies and its
    division by 1), and the five iterations' losses and grad norms are exactly those of
    DeepSpeed's own reduction. At dp 2 the bypass stands aside."""
    cfg = _cfg(1, 1, True, clip_grad=0.05, use_precision_aware_optimizer=aware)
    mine, seen = run_distributed(_train_counted, 1, cfg, True)[0]
    ref, ref_seen = run_distributed(_train_counted, 1, cfg, False)[0]
    assert seen == {"bucket": 0, "bypass": 5}
    assert ref_seen["bucket"] > 0 and ref_seen["bypass"] == 0
    assert len(mine) == 5 and mine == ref
    assert all(gn > 0.05 for _, gn in ref)  # every step clipped
    if not aware:
        _, two = run_distributed(_train_counted, 2, _cfg(1, 1, True), True)[0]
        assert two["bypass"] == 0 and two["bucket"] > 0
