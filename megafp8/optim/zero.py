"""DeepSpeed engine over the data-parallel group: ZeRO stage 0-3, torch AdamW, gradient clipping.

The optimizer is torch's AdamW (fused on CUDA), handed to DeepSpeed as a client optimizer, so no
JIT-compiled DeepSpeed op (FusedAdam, CPUAdam) is ever built. ZeRO shards over
``groups.as_deepspeed_mpu().get_data_parallel_group()`` only.
"""

from __future__ import annotations

import contextlib
import importlib
import io
import logging
import os

import torch

from megafp8.config_values import global_batch_size
from megafp8.optim import lean_step
from megafp8.optim.step_guard import StepGuard

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
