"""Training with injected bad iterations, and before/after snapshots of the weights and the
optimizer state: what the bad-step tests share (tests/unit/test_bad_steps.py,
tests/parallel/test_bad_steps_pp.py)."""

from __future__ import annotations

import logging

import torch


class _NanGrad(torch.autograd.Function):
    """Identity forward; NaN gradient backward (a finite loss whose gradients are not)."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, g):
        return g * float("nan")


class Capture(logging.Handler):
    def __init__(self):
        super().__init__(logging.INFO)
        self.lines: list[str] = []

    def emit(self, record):
        self.lines.append(record.getMessage())


def snapshot(run) -> list[torch.Tensor]:
    """This rank's model parameters, the optimizer's own parameters (ZeRO's fp32 partitions)
    and every tensor of its state (Adam's moments and step counts)."""
    from megafp8.optim.step_guard import step_guard

    opt = step_guard(run.engine).opt
    out = [p.detach().clone() for p in run.model.parameters()]
    for g in opt.param_groups:
        for p in g["params"]:
            out.append(p.detach().clone())
            for v in opt.state.get(p, {}).values():
                out.append(torch.as_tensor(v).detach().clone())
    return out


def same(a, b) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b, strict=True))


def train_injected(cfg, inject: dict, rank: int | None = None, load_run=None, fused=False):
    """Train ``cfg`` under the current process group. ``inject``: {iteration: kind}, kind "nan"
    (the loss of one micro-batch times NaN), "spike" (every loss x 100) or "nangrad" (a finite
    loss with NaN gradients), on rank ``rank`` only (None: every rank), on the last stage.
    ``fused``: the AdamW made fused (as on the GPU), so the policy judges the loss on the device.

    Returns (history, {iteration: weights and optimizer state unchanged by it}, log lines of
    rank 0, error message or None); each history record also holds the lr its step ran with
    ("applied lr")."""
    import torch.distributed as dist

    import megafp8.train as T

    groups, device = T.init_distributed(cfg)
    run = T.build_run(cfg, groups, device)
    if fused:
        from megafp8.optim.step_guard import step_guard

        opt = step_guard(run.engine).opt
        opt.defaults["fused"] = True
        for g in opt.param_groups:
            g["fused"] = True
        T._attach_policies(run, dist.get_rank() == 0)
        assert run.policy.on_device(), "the fused AdamW should take the device path"
    me = dist.get_rank()
    calls = {"n": 0}
    orig = run.model.forward

    def forward(*a, **kw):
        y = orig(*a, **kw)
        it = run.iteration + 1
        kind = inject.get(it)
        if kind is None or (rank is not None and me != rank) or y.dim() != 0:
            return y
        calls["n"] += 1
        if kind == "nan" and calls["n"] == 1:
            return y * float("nan")
        if kind == "spike":
            return y * 100.0
        if kind == "nangrad":
            return _NanGrad.apply(y)
        return y

    run.model.forward = forward
    unchanged: dict = {}
    applied: dict = {}
    step = T.train_step

    def train_step(r, it, hooks=None):
        before = snapshot(r)
        out = step(r, it, hooks)
        unchanged[r.iteration + 1] = same(before, snapshot(r))
        applied[r.iteration + 1] = r.engine.optimizer.param_groups[0]["lr"]
        return out

    T.train_step = train_step
    cap = Capture()
    lg = logging.getLogger("megafp8")
    lg.setLevel(logging.INFO)
    lg.addHandler(cap)
    err = None
    try:
        hist = T.train(cfg, run)
    except FloatingPointError as e:
        hist, err = [], str(e)
    finally:
        T.train_step = step
        lg.removeHandler(cap)
    for rec in hist:
        rec["applied lr"] = applied[rec["iteration"]]
    return hist, unchanged, cap.lines if me == 0 else [], err
