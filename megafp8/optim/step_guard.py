"""Whether an iteration's optimizer update happens, decided where it can be withheld:
``StepGuard`` wraps the AdamW's ``step`` (skip, the norm's ``found_inf``, the clip's
``grad_scale``, the bf16 update), ``StepPolicy`` judges the loss (NaN/inf, spikes) on every rank
(README, "Bad steps"). ``zero.build_engine`` installs the guard."""

from __future__ import annotations

import collections
import math

import torch
import torch.distributed as dist


class StepGuard:
    """Installed as the ``step`` of torch's AdamW (the optimizer stays an AdamW), so that its
    update can be withheld: with ``skip`` set, ``step()`` changes nothing (weights, both moments
    and the step count stay). DeepSpeed calls it at the accumulation
    boundary (ZeRO 0: once; ZeRO 1-3: once per parameter group, on this rank's fp32 partition);
    the rest of that boundary step happens as usual: gradients cleared, the engine's step and
    sample counters advanced, ZeRO's unchanged fp32 partitions copied back to the parameters.

    ``check_grads`` (ZeRO 0 in fp32, the one layout where DeepSpeed applies an update whose
    gradients are not finite; its ZeRO 1-3 and bf16 optimizers skip such a step themselves):
    one MAX all-reduce over every rank of a "some local gradient is NaN or inf" flag, so all
    ranks withhold the update together; the result is in ``nonfinite_grad``.

    ``norm_of`` (``norm_skip``: ZeRO 1/2 in bf16, DeepSpeed's overflow check off): returns the
    step's global gradient norm (a tensor, the same on every rank), and a non-finite one
    withholds the update. A fused AdamW gets it as ``found_inf`` and skips on the GPU, without
    waiting for it; another reads it on the host (``nonfinite_grad``).

    ``grad_scale`` (set by ``lean_step``'s clip before each group's step, fused AdamW only): the
    fused kernel divides the gradients by it as it reads them, in place of a pass over them.

    ``skip_if`` (a 0-d float tensor on the device, 1.0: withhold; set by ``StepPolicy`` where
    ``on_device()``): the bad-loss verdict, joined to the norm's ``found_inf``, so the host
    need not wait for the loss before the step.

    ``bf16_update`` (set by ``lean_step``'s step around each group's ``optimizer.step()``,
    fused AdamW only): ``(grads, out)``, the group's bf16 gradient pieces and bf16 partition;
    the update then goes through ``adamw_bf16.step`` (reads the bf16 gradients, writes the bf16
    weights) with the same ``found_inf`` and ``grad_scale``."""

    def __init__(self, opt: torch.optim.Optimizer):
        self.opt, self._step = opt, opt.step
        self.skip = self.check_grads = self.nonfinite_grad = False
        self.norm_of = None
        self.skip_if: torch.Tensor | None = None
        self.grad_scale = None  # set by lean_step's clip for the next fused step, then cleared
        self.bf16_update: tuple | None = None  # (grads, out) during lean_step's group step
        self._found: tuple = (None, None)  # (the norm, its found_inf), once per step
        opt.step, opt.step_guard = self.step, self

    def on_device(self) -> bool:
        """Whether every update goes through the fused kernel's ``found_inf`` (``skip_if``)."""
        return bool(self.opt.defaults.get("fused")) and self.norm_of is not None

    def _found_inf(self):
        norm = self.norm_of()
        if not torch.is_tensor(norm):  # no norm this step: the loss's verdict alone
            return self.skip_if
        if self._found[0] is not norm:
            found = (~torch.isfinite(norm)).float().reshape(())
            if self.skip_if is not None:
                found = torch.maximum(found, self.skip_if)
            self._found = (norm, found)
        return self._found[1]

    def step(self, closure=None):
        scale, self.grad_scale = self.grad_scale, None
        fused = bool(self.opt.defaults.get("fused"))
        found = self._found_inf() if self.norm_of is not None and not self.skip else None
        if found is not None and not fused:
            self.nonfinite_grad = bool(found)
        if self.check_grads:
            groups = self.opt.param_groups
            grads = [p.grad for g in groups for p in g["params"] if p.grad is not None]
            bad = torch.zeros((), dtype=torch.float32, device=grads[0].device if grads else None)
            for gr in grads:
                bad = torch.maximum(bad, (~torch.isfinite(gr)).any().float())
            if dist.is_initialized() and dist.get_world_size() > 1:
                dist.all_reduce(bad, op=dist.ReduceOp.MAX)
            self.nonfinite_grad = bool(bad)
        if self.skip or self.nonfinite_grad:
            return None
        if self.bf16_update is not None and fused:
            from megafp8.optim import adamw_bf16

            grads, out = self.bf16_update
            return adamw_bf16.step(self.opt, grads, out, grad_scale=scale, found_inf=found)
        if not fused or (found is None and scale is None):
            return self._step(closure)
        # the fused kernel divides the gradients by grad_scale and leaves everything as it was
        # where found_inf is set
        self.opt.found_inf, self.opt.grad_scale = found, scale
        try:
            return self._step(closure)
        finally:
            self.opt.found_inf = self.opt.grad_scale = None


def step_guard(engine) -> StepGuard | None:
    """The StepGuard of the AdamW inside DeepSpeed's optimizer wrappers (ZeRO, bf16), or None."""
    opt = getattr(engine, "optimizer", None)
    for _ in range(4):
        if getattr(opt, "step_guard", None) is not None:
            return opt.step_guard
        opt = getattr(opt, "optimizer", None)
    return None


class StepPolicy:
    """Whether an iteration's optimizer update happens: NaN/inf and spiky losses (README, "Bad
    steps"); every rank holds one and reaches the same verdict.

    ``before_step(loss)`` runs just before the accumulation boundary's ``engine.step()``, with the
    iteration's loss already known on every rank (DP mean; under PP broadcast from the last
    stage). It withholds the update (``StepGuard.skip``) when the loss is NaN or inf
    (``check_for_nan_in_loss_and_grad``) or a spike (``check_for_spiky_loss``: loss > factor x
    the mean of the last ``spiky_loss_window`` losses of iterations that were not skipped, once
    that many are known). The gradient norm only exists inside the step: a non-finite one makes
    DeepSpeed skip the update itself (``engine.skipped_steps``; ZeRO 0 fp32: ``check_grads``).
    ``after_step(loss, grad_norm)`` then sets ``verdict``: ``skipped`` (the update did not
    happen), ``nan`` (loss or grad norm not finite) and ``what`` (for the error under ``stop``).
    """

    def __init__(self, t, engine):
        self.engine, self.opt = engine, step_guard(engine)
        self.check_nan, self.spiky = t.check_for_nan_in_loss_and_grad, t.check_for_spiky_loss
        self.stop = t.nan_policy == "stop" and t.exit_on_nan  # --no-exit-on-nan: skip
        self.factor, self.window = t.spiky_loss_factor, t.spiky_loss_window
        self.losses: collections.deque = collections.deque(maxlen=self.window)
        self.skipped = self.nan = 0  # totals over the run
        self._interval = [0, 0]  # skipped, nan since the last console line
        self.verdict: dict = {"skipped": False, "nan": False, "what": ""}
        self._ds_skipped = 0

    def on_device(self) -> bool:
        """Whether ``before_step`` can take the loss as a tensor not yet waited for: the update
        goes through a fused AdamW whose ``found_inf`` can carry the verdict."""
        return self.opt is not None and self.opt.on_device()

    def _spike_bound(self) -> float | None:
        """factor x the window's mean, rounded to fp32 (the loss's dtype) so that the device's
        comparison and the host's are the same; None until the window is full."""
        if not (self.spiky and len(self.losses) == self.window):
            return None
        bound = self.factor * (sum(self.losses) / len(self.losses))
        return float(torch.tensor(bound, dtype=torch.float32))

    def is_spike(self, loss: float) -> bool:
        bound = self._spike_bound()
        return bound is not None and loss > bound

    def _bad_loss(self, loss: float) -> bool:
        """The host's verdict on the loss: NaN/inf (when checked) or a spike."""
        return (self.check_nan and not math.isfinite(loss)) or self.is_spike(loss)

    def before_step(self, loss: float | torch.Tensor) -> None:
        """A float loss: the verdict on the host. A tensor (``on_device()`` only): the same
        verdict computed on the device, for the fused kernel's ``found_inf``."""
        if torch.is_tensor(loss):
            bad = torch.zeros((), dtype=torch.bool, device=loss.device)
            if self.check_nan:
                bad = bad | ~torch.isfinite(loss)
            bound = self._spike_bound()
            if bound is not None:
                bad = bad | (loss.float() > bound)
            self.opt.skip, self.opt.nonfinite_grad = False, False
            self.opt.skip_if = bad.float().reshape(())
        else:
            if self.opt is not None:
                self.opt.skip, self.opt.nonfinite_grad = self._bad_loss(loss), False
        self._ds_skipped = getattr(self.engine, "skipped_steps", 0)

    def after_step(self, loss: float, grad_norm: float | None) -> dict:
        opt = self.opt
        bad_loss = self.check_nan and not math.isfinite(loss)
        bad_norm = grad_norm is not None and not math.isfinite(grad_norm)
        bad_grad = self.check_nan and (bad_norm or (opt is not None and opt.nonfinite_grad))
        on_device = opt is not None and opt.skip_if is not None  # the device judged the loss
        skipped = (
            opt is not None
            and (opt.skip or opt.nonfinite_grad or (opt.norm_of is not None and bad_norm))
        ) or (getattr(self.engine, "skipped_steps", 0) > self._ds_skipped)
        skipped = skipped or (on_device and self._bad_loss(loss))
        if opt is not None:
            opt.skip = opt.nonfinite_grad = False
            opt.skip_if = None
        what = f"lm loss is {loss}" if bad_loss else f"grad norm is {grad_norm}" if bad_grad else ""
        if not what and skipped and self.is_spike(loss):
            what = f"lm loss {loss:.4g} > {self.factor:g} x the mean of the last {self.window}"
        self.skipped += skipped
        self.nan += bad_loss or bad_grad
        self._interval[0] += skipped
        self._interval[1] += bad_loss or bad_grad
        if not skipped and math.isfinite(loss):
            self.losses.append(loss)
        self.verdict = {"skipped": skipped, "nan": bad_loss or bad_grad, "what": what}
        return self.verdict

    def take_interval(self, reset: bool = True) -> tuple[int, int]:
        """(skipped, nan) iterations since the last call that reset them: the console line's
        counts."""
        got = tuple(self._interval)
        if reset:
            self._interval = [0, 0]
        return got

    def state_dict(self) -> dict:
        return {"losses": list(self.losses), "skipped": self.skipped, "nan": self.nan}

    def load_state_dict(self, sd: dict) -> None:
        self.losses.extend(sd.get("losses", []))
        self.skipped, self.nan = sd.get("skipped", 0), sd.get("nan", 0)
