"""DeepSpeed engine over the data-parallel group: ZeRO stage 0-3, torch AdamW, gradient clipping.

The optimizer is torch's AdamW (fused on CUDA), handed to DeepSpeed as a client optimizer, so no
JIT-compiled DeepSpeed op (FusedAdam, CPUAdam) is ever built. ZeRO shards over
``groups.as_deepspeed_mpu().get_data_parallel_group()`` only.
"""

from __future__ import annotations

import importlib
import logging
import os

import torch

from megafp8.config import global_batch_size

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
        "bf16": {"enabled": bool(t.bf16)},
        **({"communication_data_type": "bf16"} if o.grad_reduce_in_bf16 else {}),
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }


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
    opt = torch.optim.AdamW(
        param_groups(model, o.weight_decay, decoupled=o.decoupled_lr is not None),
        lr=o.lr,
        betas=(o.adam_beta1, o.adam_beta2),
        eps=o.adam_eps,
        fused=fused or None,
    )
    engine, _, _, _ = ds.initialize(
        model=model,
        optimizer=opt,
        config=deepspeed_config(cfg, groups.dp),
        mpu=groups.as_deepspeed_mpu(),
        dist_init_required=False,
    )
    return engine


def set_lr(engine, lr: float, decoupled_lr: float | None = None) -> None:
    """``decoupled_lr`` (Megatron's ``--decoupled-lr``) for the embedding and output layer."""
    for g in engine.optimizer.param_groups:
        g["lr"] = decoupled_lr if g.get("decoupled") and decoupled_lr is not None else lr
