"""optim/adamw_bf16.py and lean_step's step through it: AdamW from bf16 gradients into the fp32
master and the bf16 partition in one pass equals torch's AdamW on the widened gradients (to fp32
rounding), withholds everything under found_inf, divides by grad_scale, skips ZeRO padding; a
ZeRO 1/2 run whose step goes through it (--use-precision-aware-optimizer) trains as DeepSpeed's own
step with torch's AdamW.

Tolerances: both sides do the same fp32 operations per element (about ten roundings a step) in
a different order or contraction, so they differ by a few units in the last place of fp32
(2^-23 = 1.2e-7 relative) a step; over three steps 2e-6 relative (atol 1e-9 for values near
zero). The bf16 weights are exactly the fp32 masters rounded."""

import math

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config


def _torch_adamw(p0, grads, *, fused, lr=1e-2, wd=0.1, betas=(0.9, 0.95), eps=1e-8,
                 scales=None, founds=None):  # fmt: skip
    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([p], lr=lr, betas=betas, eps=eps, weight_decay=wd, fused=fused)
    for i, g in enumerate(grads):
        p.grad = g.float()
        opt.grad_scale = None if scales is None else scales[i]
        opt.found_inf = None if founds is None else founds[i]
        opt.step()
    st = opt.state[p]
    return p.detach(), st["exp_avg"], st["exp_avg_sq"], st["step"]


def _ours(p0, grads, *, lr=1e-2, wd=0.1, betas=(0.9, 0.95), eps=1e-8, scales=None,
          founds=None, pieces=None):  # fmt: skip
    from megafp8.optim import adamw_bf16

    p = torch.nn.Parameter(p0.clone())
    opt = torch.optim.AdamW([p], lr=lr, betas=betas, eps=eps, weight_decay=wd)
    out = p0.bfloat16()
    for i, g in enumerate(grads):
        gs = [g] if pieces is None else pieces(g)
        adamw_bf16.step(opt, gs, out, grad_scale=None if scales is None else scales[i],
                        found_inf=None if founds is None else founds[i])  # fmt: skip
    st = opt.state[p]
    return p.detach(), st["exp_avg"], st["exp_avg_sq"], st["step"], out


def _data(n=1000, steps=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    p0 = torch.randn(n, generator=gen)
    grads = [(torch.randn(n, generator=gen) * 10.0 ** (-k)).bfloat16() for k in range(steps)]
    grads[1][:5] = 0.0  # a zero gradient element: Adam's denominator is eps alone
    return p0, grads


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-9)


@pytest.mark.parametrize("fused", [True, False])
def test_matches_torch_adamw(fused):
    """Three steps with weight decay and different gradient scales: weight, both moments and the
    step count as torch's fused and unfused AdamW on the fp32-widened gradients."""
    p0, grads = _data()
    p, m, v, st, out = _ours(p0, grads)
    rp, rm, rv, rst = _torch_adamw(p0, grads, fused=fused)
    _close(p, rp), _close(m, rm), _close(v, rv)
    assert float(st) == float(rst) == 3.0
    assert torch.equal(out, p.bfloat16())
    assert not torch.equal(p, p0)


def test_grad_scale_and_found_inf_as_torch_fused():
    """grad_scale divides each gradient as it is read; found_inf withholds weights, moments and
    the step count (torch's fused semantics, which StepGuard relies on)."""
    p0, grads = _data()
    scales = [torch.tensor(4.0), torch.tensor(1.0), torch.tensor(0.5)]
    founds = [torch.tensor(0.0), torch.tensor(1.0), torch.tensor(0.0)]
    p, m, v, st, out = _ours(p0, grads, scales=scales, founds=founds)
    rp, rm, rv, rst = _torch_adamw(p0, grads, fused=True, scales=scales, founds=founds)
    _close(p, rp), _close(m, rm), _close(v, rv)
    assert float(st) == float(rst) == 2.0
    assert torch.equal(out, p.bfloat16())
    # a withheld step leaves every bit
    p1, m1, v1, st1, out1 = _ours(p0, grads[:1])
    p2, m2, v2, st2, out2 = _ours(p0, grads[:2], founds=[torch.tensor(0.0), torch.tensor(1.0)])
    assert all(torch.equal(a, b) for a, b in ((p1, p2), (m1, m2), (v1, v2), (out1, out2)))
    assert float(st1) == float(st2) == 1.0


def test_pieces_and_padding():
    """Gradients given as pieces laid end to end (ZeRO's list) update the same elements as one
    flat gradient; ``_zero_padding`` pieces (here one between two gradients and one at the end)
    and the tail beyond the pieces stay untouched (a zero gradient on a zero weight changes
    nothing); more gradient than partition is an error."""
    from megafp8.optim import adamw_bf16

    p0, grads = _data(n=64)
    p0[10:18] = 0.0  # ZeRO's padding: zeros
    p0[40:] = 0.0

    def pad(n, dtype):
        t = torch.zeros(n, dtype=dtype)
        t._zero_padding = True
        return t

    def pieces(g):
        return [g[:10].reshape(2, 5), pad(8, g.dtype), g[18:40], pad(4, g.dtype)]  # 44 of 64

    p, m, v, _, out = _ours(p0, grads, pieces=pieces)
    keep = torch.ones(64, dtype=torch.bool)
    keep[10:18] = keep[40:] = False
    grads_ref = [torch.where(keep, g, torch.zeros_like(g)) for g in grads]
    rp, rm, rv, _ = _torch_adamw(p0, grads_ref, fused=True)
    _close(p, rp), _close(m, rm), _close(v, rv)
    assert torch.equal(p[~keep], p0[~keep]) and not m[~keep].any() and not v[~keep].any()
    assert torch.equal(out[~keep], p0[~keep].bfloat16()) and not torch.equal(p[keep], p0[keep])
    opt = torch.optim.AdamW([torch.nn.Parameter(torch.zeros(4))])
    with pytest.raises(ValueError, match="gradients of 6 elements for a partition of 4"):
        adamw_bf16.step(opt, [torch.zeros(6, dtype=torch.bfloat16)], torch.zeros(4).bfloat16())
    with pytest.raises(ValueError, match="bf16 partition of 3 elements for 4 fp32 ones"):
        adamw_bf16.step(opt, [torch.zeros(4, dtype=torch.bfloat16)], torch.zeros(3).bfloat16())


def _train(cfg):
    """Train ``cfg``; the history, how many group updates went through adamw_bf16, this rank's
    fp32 masters after the first step and at the end, and its final bf16 weights."""
    import megafp8.optim.adamw_bf16 as A
    import megafp8.train as T

    calls = []
    plain = A.step
    A.step = lambda *a, **k: calls.append(1) or plain(*a, **k)
    captured, first = {}, []
    build = T.build_run

    def masters(zopt):
        return torch.cat([f.detach().reshape(-1) for f in zopt.single_partition_of_fp32_groups])

    def keep(*a, **k):
        run = build(*a, **k)
        captured["run"] = run
        zopt = run.engine.optimizer
        step = zopt.step

        def once(*sa, **sk):
            out = step(*sa, **sk)
            if not first:
                first.append(masters(zopt).clone())
            return out

        zopt.step = once
        return run

    T.build_run = keep
    hist = [(r["lm loss"], r["grad norm"]) for r in T.train(cfg)]
    zopt = captured["run"].engine.optimizer
    params = captured["run"].model.parameters()
    weights = torch.cat([p.detach().reshape(-1).float() for p in params])
    return hist, len(calls), first[0], masters(zopt), weights


@pytest.mark.parametrize("zero", [1, 2])
def test_training_matches_deepspeeds_step(zero):
    """bf16 at dp 2, clipping active, --use-precision-aware-optimizer, a model whose parameters
    straddle the two ranks' partitions, of sizes that are no multiple of 64 (ffn 100), so that
    ZeRO's partitions end in padding: every group update went
    through adamw_bf16, and the run is the one without it (DeepSpeed's own step, torch's AdamW).
    The first update starts from the same weights and gradients in both, so the masters after
    it differ only by the fp32 rounding above (rtol 2e-6, atol 1e-9). After it, a master that
    lies on a bf16 rounding boundary can flip its bf16 weight by one bf16 step (2^-8 relative);
    the later gradients then differ slightly, which moves the losses by ~1e-7 and the gradient
    norms by ~1e-6 relative (bounds 1e-5 and 1e-4); Adam's normalised update can turn that into a
    sizeable share of an lr step for an element with a tiny gradient, so the final masters are
    bounded only by what two Adam updates can move an element."""
    cfg = tiny_config(
        model=dict(ffn_hidden_size=100),
        train=dict(bf16=True, train_iters=3),
        optim=dict(zero_stage=zero, optimizer_group_max_numel=5000, clip_grad=0.05),
    )
    ours, calls, first, masters, weights = run_distributed(
        _train, 2, cfg.replace(optim=dict(use_precision_aware_optimizer=True))
    )[0]
    ref, none, rfirst, rmasters, rweights = run_distributed(_train, 2, cfg)[0]
    assert none == 0 and calls >= 3 * 3  # three steps of several groups
    assert len(ours) == len(ref) == 3
    assert ours[0] == ref[0]
    assert all(gn > 0.05 for _, gn in ref)  # every step clipped
    torch.testing.assert_close(first, rfirst, rtol=2e-6, atol=1e-9)
    assert not torch.equal(first, masters)
    for (la, ga), (lb, gb) in zip(ours, ref, strict=True):
        assert la == pytest.approx(lb, rel=1e-5)
        assert ga == pytest.approx(gb, rel=1e-4)
    # Adam moves an element by at most (1 - b1) / sqrt(1 - b2) x lr = 3.2e-3 an update
    torch.testing.assert_close(masters, rmasters, rtol=0, atol=2 * 3.2e-3)
    assert torch.isfinite(weights).all() and weights.shape == rweights.shape


def _losses(cfg):
    from tests.helpers.tiny import train_losses

    return train_losses(cfg)


@pytest.mark.parametrize("fmt", ["torch", "torch_dist"])
def test_resume_is_exact(tmp_path, fmt):
    """Saved after 2 iterations with --use-precision-aware-optimizer and resumed to 4: the same
    losses as 4 straight (the moments and step count are torch AdamW's state, saved as before);
    and a checkpoint of a run without it resumes with it (the same state layout)."""
    base = tiny_config(train=dict(bf16=True, train_iters=4, ckpt_format=fmt),
                       optim=dict(use_precision_aware_optimizer=True))  # fmt: skip
    full = run_distributed(_losses, 2, base)[0]
    ck = str(tmp_path / "ck")
    first = run_distributed(_losses, 2, base.replace(train=dict(train_iters=2, save=ck)))[0]
    rest = run_distributed(_losses, 2, base.replace(train=dict(load=ck)))[0]
    assert first == full[:2] and rest == full[2:]
    plain = base.replace(optim=dict(use_precision_aware_optimizer=False))
    ck2 = str(tmp_path / "ck2")
    run_distributed(_losses, 2, plain.replace(train=dict(train_iters=2, save=ck2)))
    mixed = run_distributed(_losses, 2, base.replace(train=dict(load=ck2)))[0]
    assert len(mixed) == 2 and all(math.isfinite(x) for x in mixed)
    plain_rest = run_distributed(_losses, 2, plain.replace(train=dict(load=ck2)))[0]
    assert mixed == pytest.approx(plain_rest, rel=1e-5)  # fp32 rounding of one step's update


def _build_without_the_kernel(cfg):
    import megafp8.optim.adamw_bf16 as A
    import megafp8.train as T

    A.available = lambda device: False  # as on CUDA without Triton
    groups, device = T.init_distributed(cfg)
    try:
        T.build_run(cfg, groups, device)
    except ValueError as e:
        return str(e)
    return None


def test_no_kernel_is_one_line():
    cfg = tiny_config(train=dict(bf16=True), optim=dict(use_precision_aware_optimizer=True))
    err = run_distributed(_build_without_the_kernel, 1, cfg)[0]
    assert err is not None and "\n" not in err
    assert err.startswith("--use-precision-aware-optimizer: the optimizer DeepSpeedZeroOptimizer")
