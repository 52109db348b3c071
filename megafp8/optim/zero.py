"""DeepSpeed engine over the data-parallel group: ZeRO stage 0-3, torch AdamW, gradient clipping.

The optimizer is torch's AdamW (fused on CUDA), handed to DeepSpeed as a client optimizer, so no
JIT-compiled DeepSpeed op (FusedAdam, CPUAdam) is ever built. ZeRO shards over
``groups.as_deepspeed_mpu().get_data_parallel_group()`` only.
"""

from __future__ import annotations

import collections
import contextlib
import importlib
import io
import logging
import math
import os

import torch
import torch.distributed as dist

from megafp8.config_values import global_batch_size
from megafp8.optim import lean_step

log = logging.getLogger(__name__)


def import_deepspeed():
    """Import DeepSpeed without building its shared-memory comm op (30-80 s of compile)."""
    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    import deepspeed

    importlib.import_module("deepspeed.comm.torch").build_shm_op = lambda: None
    for name in ("deepspeed", "DeepSpeed"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return deepspeed


def deepspeed_config(cfg, dp: int) -> dict:
    t, o = cfg.train, cfg.optim
    gbs = global_batch_size(cfg, dp)
    zero = {"stage": o.zero_stage}
    if o.zero_stage >= 1 and cfg.parallel.expert_model_parallel_size > 1:
        zero["contiguous_gradients"] = True  # DeepSpeed's MoE groups need it
    if o.zero_stage >= 2:
        zero.update(
            {
                "overlap_comm": False,
                "contiguous_gradients": True,
                "reduce_bucket_size": 50_000_000,
                "allgather_bucket_size": 50_000_000,
            }
        )
    if o.zero_stage == 3:
        zero.update(
            {"stage3_param_persistence_threshold": 0, "stage3_prefetch_bucket_size": 50_000_000}
        )
    if o.overlap_grad_reduce and o.zero_stage >= 1:  # reduce buckets while backward goes on
        zero["overlap_comm"] = True
    return {
        "train_batch_size": gbs,
        "train_micro_batch_size_per_gpu": t.micro_batch_size,
        "gradient_accumulation_steps": gbs // (t.micro_batch_size * dp),
        "gradient_clipping": o.clip_grad,
        "zero_optimization": zero,
        # ZeRO 1/2 in bf16: no per-gradient overflow scan (StepGuard.norm_of skips on the norm)
        "bf16": {
            "enabled": bool(t.bf16),
            **({"check_grad_overflow": False} if norm_skip(cfg) else {}),
        },
        # DeepSpeed reduces bf16 gradients in bf16 unless told; Megatron reduces in fp32 unless
        # --grad-reduce-in-bf16. One DP rank reduces nothing: no fp32 round trip there.
        **(
            {"communication_data_type": "bf16" if o.grad_reduce_in_bf16 else "fp32"}
            if (t.bf16 and dp > 1) or o.grad_reduce_in_bf16
            else {}
        ),  # fmt: skip
        # fp32 gradient accumulation: DeepSpeed's BF16_Optimizer (ZeRO-1)
        **(
            {"data_types": {"grad_accum_dtype": "fp32"}}
            if t.bf16 and o.accumulate_allreduce_grads_in_fp32
            else {}
        ),
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
        # DeepSpeed's throughput timer waits for the device at every forward and step (each
        # micro-batch then starts from an empty GPU queue); the training loop times iterations
        "timers": {"throughput": {"enabled": False}},
    }


def norm_skip(cfg) -> bool:
    """Whether a non-finite gradient is caught by the global gradient norm alone (``StepGuard``
    ``norm_of``) instead of DeepSpeed's bf16 overflow check. That check scans every gradient
    (amax, amin, isfinite: ~8 kernel launches each) and waits for the GPU (``.item()``) before
    each step; the norm DeepSpeed computes anyway is NaN or inf exactly when a gradient is.
    ZeRO 1/2 in bf16 without fp32 accumulation (DeepSpeedZeroOptimizer: the check's owner)."""
    o = cfg.optim
    return bool(
        cfg.train.bf16 and o.zero_stage in (1, 2) and not o.accumulate_allreduce_grads_in_fp32
    )


def grads_accumulate_in_param(cfg) -> bool:
    """Whether a gradient may be added into a parameter's ``.grad`` in place, out of autograd's
    sight: DeepSpeed reads ``.grad`` once, at the accumulation boundary, and none of its hooks
    must see each micro-batch's gradient. ZeRO-1 without overlap (ZeRO-2/3 and overlap reduce
    inside hooks; the fp32 accumulation of BF16_Optimizer, ZeRO-0's in bf16 included, adds
    inside hooks). The word embedding's backward (with ``embedding_grad_in_place``) and the
    output layer's (under gradient accumulation fusion) do so (``parallel/grad_in_place.py``)."""
    o, t = cfg.optim, cfg.train
    return bool(
        o.zero_stage == 1
        and not o.overlap_grad_reduce
        and not (t.bf16 and o.accumulate_allreduce_grads_in_fp32)
    )


def wgrad_fusion(cfg) -> bool:
    """Whether the te backend's weight gradients accumulate inside their wgrad GEMM (TE's
    ``fuse_wgrad_accumulation`` into ``main_grad``, here the parameter's own ``.grad``): no
    separate gradient per micro-batch, no add. Only where ``grads_accumulate_in_param``. Not
    under PP with activation recompute: a recomputed forward reads the weight cache's
    first-micro-batch flag at backward time, when another micro-batch's forward may have set
    it, and TE overwrites ``main_grad`` on the first micro-batch."""
    return bool(
        cfg.fp8.gradient_accumulation_fusion
        and grads_accumulate_in_param(cfg)
        and not (cfg.parallel.pipeline_model_parallel_size > 1 and cfg.model.recompute_granularity)
    )


DECOUPLED = ("embedding.weight", "output")  # the input embedding and the untied output layer


def param_groups(model: torch.nn.Module, weight_decay: float, decoupled: bool = False):
    """Megatron's grouping: no weight decay on biases and 1-D parameters (norms); with
    ``decoupled``, the embedding and output layer in groups of their own (their own lr)."""
    groups: dict[tuple[bool, bool], list] = {}
    for name, p in model.named_parameters():
        if p.requires_grad:
            if name.startswith("chunks."):  # GPTModelChunks: "chunks.<c>." + the model's name
                name = name.split(".", 2)[2]
            key = (p.ndim >= 2, decoupled and name in DECOUPLED)
            groups.setdefault(key, []).append(p)
    return [
        {"params": ps, "weight_decay": weight_decay if decay else 0.0, "decoupled": dec}
        for (decay, dec), ps in sorted(groups.items(), key=lambda kv: (not kv[0][0], kv[0][1]))
    ]


def bound_groups(pgroups: list[dict], max_numel: int) -> list[dict]:
    """Each parameter group cut, in model order, into groups of at most ``max_numel`` elements
    (a larger tensor alone), same options. At the step, DeepSpeed's ZeRO 1/2 flattens one group's
    bf16 gradients and casts them to fp32 before stepping it, then frees both: with one group of
    every weight that transient is 6 bytes per parameter of the model (36 GB at 6 B parameters)
    on top of everything else; with bounded groups it is 6 x ``max_numel`` bytes. 0: unbounded.
    """
    if max_numel <= 0:
        return pgroups
    out = []
    for g in pgroups:
        chunk: list = []
        numel = 0
        for p in g["params"]:
            if chunk and numel + p.numel() > max_numel:
                out.append({**g, "params": chunk})
                chunk, numel = [], 0
            chunk.append(p)
            numel += p.numel()
        if chunk:
            out.append({**g, "params": chunk})
    return out


def count_once_in_grad_norm(model, groups) -> None:
    """Under pipelining, DeepSpeed's ZeRO-0 clipping counts a parameter that is not marked model
    parallel only where ``mpu.get_model_parallel_rank() == 0`` (tp x pp rank 0): the first stage
    alone. Mark this stage's replicated parameters (norms, biases, positions) on its TP rank 0, so
    each stage's are counted once (ZeRO 1/2 already count them on every stage's TP rank 0)."""
    if groups.pp == 1 or groups.coords.tp != 0:
        return
    for p in model.parameters():
        if not hasattr(p, "tensor_model_parallel"):
            p.model_parallel = True


def build_engine(model, cfg, groups):
    """``deepspeed.initialize`` with the mpu; returns the engine."""
    ds = import_deepspeed()
    count_once_in_grad_norm(model, groups)
    o = cfg.optim
    fused = torch.cuda.is_available() and next(model.parameters()).is_cuda
    fused = fused or o.use_precision_aware_optimizer  # torch's fused AdamW runs on the CPU too
    pgroups = param_groups(model, o.weight_decay, decoupled=o.decoupled_lr is not None)
    if groups.ep > 1:  # experts reduced and sharded over their own group (optim/experts.py)
        from megafp8.optim.experts import register_expert_groups, split_expert_groups

        register_expert_groups(model, groups)
        pgroups = split_expert_groups(pgroups, groups.ep)
    pgroups = bound_groups(pgroups, o.optimizer_group_max_numel)
    opt = torch.optim.AdamW(
        pgroups,
        lr=o.lr,
        betas=(o.adam_beta1, o.adam_beta2),
        eps=o.adam_eps,
        fused=fused or None,
    )
    guard = StepGuard(opt)
    # DeepSpeed's BF16_Optimizer prints its memory for every parameter group
    quiet = cfg.train.bf16 and o.accumulate_allreduce_grads_in_fp32
    with contextlib.redirect_stdout(io.StringIO()) if quiet else contextlib.nullcontext():
        engine, _, _, _ = ds.initialize(
            model=model,
            optimizer=opt,
            config=deepspeed_config(cfg, groups.dp),
            mpu=groups.as_deepspeed_mpu(),
            dist_init_required=False,
        )
    if o.zero_stage == 0 and not cfg.train.bf16 and cfg.train.check_for_nan_in_loss_and_grad:
        guard.check_grads = True  # the one layout where DeepSpeed steps on non-finite gradients
    if norm_skip(cfg):  # set by DeepSpeed's ZeRO 1/2 step before it steps the groups
        guard.norm_of = lambda: getattr(engine.optimizer, "_global_grad_norm", None)
    # ZeRO 1/2: norm and clip without host waits; --use-precision-aware-optimizer: the step too
    lean_step.install(engine.optimizer, bf16_step=o.use_precision_aware_optimizer)
    if o.use_precision_aware_optimizer and not lean_step.bf16_step_ok(engine.optimizer):
        raise ValueError(
            f"--use-precision-aware-optimizer: the optimizer {type(engine.optimizer).__name__} "
            "cannot take it (it needs DeepSpeed's ZeRO 1/2 optimizer in bf16 with fp32 masters, "
            "a fused AdamW, no offload and, on CUDA, Triton)"
        )
    return engine


def set_lr(engine, lr: float, decoupled_lr: float | None = None) -> None:
    """``decoupled_lr`` (Megatron's ``--decoupled-lr``) for the embedding and output layer."""
    for g in engine.optimizer.param_groups:
        g["lr"] = decoupled_lr if g.get("decoupled") and decoupled_lr is not None else lr


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
