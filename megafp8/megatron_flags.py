"""The table of Megatron-LM flags that are not config fields of their own (``megatron_compat``
registers and resolves them): each ``Flag`` is mapped onto a field, checked, accepted with a
one-line notice that it has no effect here (and why), or refused with a one-line error naming
what to use instead. ``help`` is what ``--help`` shows and what the notice or error says."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Flag:
    """``kind``: "switch" (no value), or a python type for one value, or "+" for a list."""

    name: str
    kind: object
    action: str  # "map" (handled in resolve), "check", "notice", "refuse"
    help: str


def _f(name, kind, action, help):
    return Flag(name, kind, action, help)


TABLE = [
    # mapped onto our fields
    _f(
        "use-distributed-optimizer",
        "switch",
        "map",
        "ZeRO-1 over DP (--zero-stage 1) unless a stage is given",
    ),
    _f("train-samples", int, "map", "train_iters = samples / global batch"),
    _f("lr-warmup-samples", int, "map", "lr_warmup_iters = samples / global batch"),
    _f("lr-decay-samples", int, "map", "lr_decay_iters = samples / global batch"),
    _f("lr-wsd-decay-samples", int, "map", "lr_wsd_decay_iters = samples / global batch"),
    _f("lr-warmup-fraction", float, "map", "lr_warmup_iters = fraction x the decay iterations"),
    _f(
        "num-layers-per-virtual-pipeline-stage",
        int,
        "map",
        "virtual_pipeline_model_parallel_size = num_layers / (pp x this) (interleaved 1F1B)",
    ),
    _f(
        "group-query-attention",
        "switch",
        "map",
        "GQA with --num-query-groups (which alone suffices here)",
    ),
    _f(
        "recompute-activations",
        "switch",
        "map",
        "selective recompute (--recompute-granularity selective)",
    ),
    _f("deterministic-mode", "switch", "map", "deterministic kernels (--deterministic)"),
    _f(
        "use-checkpoint-args",
        "switch",
        "map",
        "the model's shape from the --load checkpoint (as Megatron-LM: the sizes where no flag "
        "gives them, the rest always)",
    ),
    _f(
        "use-rotary-position-embeddings",
        "switch",
        "map",
        "--position-embedding-type rope (deprecated in Megatron-LM for that flag)",
    ),
    _f("use-dist-ckpt", "switch", "map", "--ckpt-format torch_dist unless a format is given"),
    _f("no-position-embedding", "switch", "check", "accepted with rope (which has no table)"),
    _f("optimizer", str, "check", "must be adam (AdamW, decoupled weight decay, as Megatron's)"),
    _f("dataloader-type", str, "check", "must be single (Megatron's pretraining sampler order)"),
    _f("dist-ckpt-format", str, "check", "must be torch_dist"),
    _f(
        "main-grads-dtype",
        str,
        "check",
        "fp32 or bf16: with --use-precision-aware-optimizer the step reads the bf16 gradients "
        "(bf16 accumulation; fp32 is --accumulate-allreduce-grads-in-fp32, without it)",
    ),
    _f("main-params-dtype", str, "check", "must be fp32: the master weights are fp32"),
    _f("exp-avg-dtype", str, "check", "must be fp32: Adam's moments are fp32"),
    _f("exp-avg-sq-dtype", str, "check", "must be fp32: Adam's moments are fp32"),
    _f("kv-channels", int, "check", "must equal hidden_size / num_attention_heads"),
    _f("rotary-percent", float, "check", "must be 1.0 (the whole head dim rotates)"),
    _f("context-parallel-size", int, "check", "must be 1: context parallelism is not available"),
    _f(
        "expert-tensor-parallel-size",
        int,
        "check",
        "must be 1: each TP rank holds its experts whole (split over EP only)",
    ),
    _f(
        "num-distributed-optimizer-instances",
        int,
        "check",
        "must be 1: one ZeRO optimizer over the data-parallel group",
    ),
    # accepted, no effect here
    _f("use-mcore-models", "switch", "notice", "the only model here"),
    _f(
        "fp8-param-gather",
        "switch",
        "notice",
        "TE's weight cache casts weights to FP8 once per iteration; ZeRO gathers bf16",
    ),
    _f(
        "overlap-param-gather",
        "switch",
        "notice",
        "DeepSpeed schedules the ZeRO parameter all-gather",
    ),
    _f(
        "no-create-attention-mask-in-dataloader",
        "switch",
        "notice",
        "no mask is ever built (causal kernels)",
    ),
    _f(
        "no-masked-softmax-fusion",
        "switch",
        "notice",
        "attention runs in fused kernels (SDPA or TE)",
    ),
    _f("no-mmap-bin-files", "switch", "notice", ".bin files are always memory-mapped"),
    _f("transformer-impl", str, "notice", "--fp8-backend, --attention-backend choose"),
    _f("use-flash-attn", "switch", "notice", "--attention-backend chooses (auto: TE picks)"),
    _f("attention-softmax-in-fp32", "switch", "notice", "the fused kernels' softmax is fp32"),
    _f("apply-query-key-layer-scaling", "switch", "notice", "an fp16 guard (no fp16 here)"),
    _f("no-async-tensor-model-parallel-allreduce", "switch", "notice", "TP collectives are ours"),
    _f("use-cpu-initialization", "switch", "notice", "each weight is drawn from its own seed"),
    _f("exit-signal-handler", "switch", "notice", "always on: SIGTERM/SIGUSR1 save and exit"),
    _f("async-save", "switch", "notice", "checkpoints are written synchronously, atomically"),
    _f("ckpt-fully-parallel-save", "switch", "notice", "every rank writes its own shards"),
    _f("ckpt-fully-parallel-load", "switch", "notice", "every rank reads its own shards"),
    _f(
        "auto-detect-ckpt-format",
        "switch",
        "notice",
        "a checkpoint records its format",
    ),
    _f("log-validation-ppl-to-tensorboard", "switch", "notice", "always written"),
    _f("log-memory-to-tensorboard", "switch", "notice", "written with --log-memory (the default)"),
    _f("log-timers-to-tensorboard", "switch", "notice", "no timers; use --profile"),
    _f("timing-log-level", int, "notice", "no timers; use --profile"),
    _f("timing-log-option", str, "notice", "no timers; use --profile"),
    _f("tensorboard-log-interval", int, "notice", "TensorBoard is written every --log-interval"),
    _f("tp-comm-overlap", "switch", "notice", "TP communication is not overlapped with GEMMs"),
    _f("overlap-p2p-communication", "switch", "notice", "pipeline sends are asynchronous anyway"),
    _f("ddp-bucket-size", int, "notice", "DeepSpeed's ZeRO reduces the gradients"),
    _f("ddp-average-in-collective", "switch", "notice", "DeepSpeed's ZeRO reduces the gradients"),
    _f("no-persist-layer-norm", "switch", "notice", "the norms are torch's or TE's"),
    _f(
        "override-opt_param-scheduler",
        "switch",
        "notice",
        "the lr schedule always follows this run's flags",
    ),
    _f("initial-loss-scale", float, "notice", "fp16 loss scaling (bf16 needs none)"),
    _f("min-loss-scale", float, "notice", "fp16 loss scaling (bf16 needs none)"),
    _f("loss-scale-window", float, "notice", "fp16 loss scaling (bf16 needs none)"),
    _f("hysteresis", int, "notice", "fp16 loss scaling (bf16 needs none)"),
    _f("wandb-project", str, "notice", "use --tensorboard-dir"),
    _f("wandb-exp-name", str, "notice", "use --tensorboard-dir"),
    _f("log-num-zeros-in-grad", "switch", "notice", "not computed"),
    _f("no-bias-swiglu-fusion", "switch", "notice", "the activation is torch's or TE's"),
    _f("no-bias-gelu-fusion", "switch", "notice", "the activation is torch's or TE's"),
    _f("no-bias-dropout-fusion", "switch", "notice", "dropout and residual add are torch ops"),
    _f("no-rope-fusion", "switch", "notice", "RoPE comes from the backend"),
    _f(
        "cross-entropy-fusion-impl",
        str,
        "notice",
        "the fused loss is megafp8's own kernels (--cross-entropy-loss-fusion)",
    ),
    _f("num-dataset-builder-threads", int, "notice", "one process per node builds the index"),
    _f("enable-cuda-graph", "switch", "notice", "kernels are launched without CUDA graphs"),
    _f(
        "moe-router-dtype",
        str,
        "notice",
        "the router's logits and probabilities are fp32 here (fp32 only; the experts' outputs "
        "are weighted in the activation dtype)",
    ),
    _f("moe-permute-fusion", "switch", "notice", "the token permutation is torch's"),
    _f("moe-shared-expert-overlap", "switch", "notice", "the shared expert is not overlapped"),
    _f("moe-per-layer-logging", "switch", "notice", "per-layer MoE scalars are always written"),
    _f("keep-fp8-transpose-cache", "switch", "notice", "TE's weight cache decides"),
    _f("check-weight-hash-across-dp-replicas-interval", int, "notice", "not checked"),
    _f("record-memory-history", "switch", "notice", "use --profile"),
    _f("cuda-graph-impl", str, "notice", "kernels are launched without CUDA graphs"),
    _f(
        "distribute-saved-activations",
        "switch",
        "notice",
        "full recompute keeps each region's input whole on every TP rank",
    ),
    # refused: not available, or what to use instead
    _f(
        "fp16",
        "switch",
        "refuse",
        "fp16 needs loss scaling, not supported: use --bf16 (and --fp8-format hybrid)",
    ),
    _f(
        "no-save-optim",
        "switch",
        "refuse",
        "checkpoints always hold the optimizer state (so a resume is exact)",
    ),
    _f("no-save-rng", "switch", "refuse", "checkpoints always hold the RNG streams"),
    _f(
        "use-checkpoint-opt_param-scheduler",
        "switch",
        "refuse",
        "the lr schedule follows this run's flags: give the saved run's schedule flags",
    ),
    _f("rotary-interleaved", "switch", "refuse", "RoPE here rotates halves (Megatron's default)"),
    _f(
        "use-torch-fsdp2",
        "switch",
        "refuse",
        "data parallelism here is DeepSpeed ZeRO: --zero-stage 3 shards parameters, "
        "gradients and optimizer states",
    ),
    _f("use-legacy-models", "switch", "refuse", "the model here is the Megatron Core one"),
    _f(
        "use-megatron-fsdp",
        "switch",
        "refuse",
        "data parallelism here is DeepSpeed ZeRO: --zero-stage 3 shards parameters, "
        "gradients and optimizer states",
    ),
    _f(
        "data-parallel-sharding-strategy",
        str,
        "refuse",
        "data parallelism here is DeepSpeed ZeRO: --zero-stage 1, 2 or 3",
    ),
    _f(
        "pipeline-model-parallel-layout",
        str,
        "refuse",
        "stages hold equal layers: --decoder-first-pipeline-num-layers and "
        "--decoder-last-pipeline-num-layers make the first and last ones uneven",
    ),
    _f(
        "account-for-embedding-in-pipeline-split",
        "switch",
        "refuse",
        "use --decoder-first-pipeline-num-layers to give the first stage fewer layers",
    ),
    _f(
        "account-for-loss-in-pipeline-split",
        "switch",
        "refuse",
        "use --decoder-last-pipeline-num-layers to give the last stage fewer layers",
    ),
    _f(
        "moe-router-topk-scaling-factor",
        float,
        "refuse",
        "not available: the routing weights are the router's probabilities",
    ),
    _f("moe-router-num-groups", int, "refuse", "group-limited routing is not available"),
    _f("moe-router-group-topk", int, "refuse", "group-limited routing is not available"),
    _f("window-size", str, "refuse", "sliding-window attention is not available"),
]

BY_DEST = {f.name.replace("-", "_"): f for f in TABLE}
