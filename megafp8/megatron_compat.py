"""Megatron-LM flags that are not config fields of their own: each is mapped onto a field, checked,
accepted with a one-line notice that it has no effect here (and why), or refused with a one-line
error naming what to use instead.

``TABLE`` is the one list: the CLI registers every entry as a flag (so ``--help`` shows it, with
what it does here), and ``resolve`` turns the parsed values into config values, notices and errors.
Flags that are config fields themselves (``--num-layers``, ``--fp8-format``, ...) are not here.
Sample-based schedule flags (``--train-samples``, ``--lr-warmup-samples``, ``--lr-decay-samples``)
become iteration counts by dividing by the global batch size, as Megatron does with a constant
batch; ``--lr-warmup-fraction`` becomes iterations of the decay span;
``--num-layers-per-virtual-pipeline-stage n`` becomes v = num_layers / (pp x n) virtual stages.
"""

from __future__ import annotations

from dataclasses import dataclass

from megafp8.config import all_fields


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
    _f("tiktoken-pattern", str, "notice", "only for TikTokenizer, which is not supported"),
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


def add_flags(parser) -> None:
    """Register every entry of ``TABLE`` on an argparse parser (default None: not given)."""
    g = parser.add_argument_group("Megatron-LM flags mapped, accepted or refused here")
    for f in TABLE:
        kw = dict(dest=f.name.replace("-", "_"), default=None, help=f"[{f.action}] {f.help}")
        if f.kind == "switch":
            g.add_argument("--" + f.name, action="store_const", const=True, **kw)
        elif f.kind == "+":
            g.add_argument("--" + f.name, nargs="+", **kw)
        else:
            g.add_argument("--" + f.name, type=f.kind, **kw)


def _iters(name: str, samples: int, gbs: int | None) -> int:
    if not gbs:
        raise ValueError(f"--{name} {samples} needs --global-batch-size to count iterations")
    if samples % gbs:
        raise ValueError(
            f"--{name} {samples} is not a multiple of --global-batch-size {gbs} "
            "(iterations would be fractional)"
        )
    return samples // gbs


def _ramped_iters(samples: int, gbs: int | None, values: dict) -> int:
    """--train-samples under a ramp-up or a step schedule: the iterations until that many
    samples are consumed, each taking its own global batch (Megatron's count)."""
    from megafp8.config_values import iters_for_samples, parse_rampup, ramp_valid

    if not gbs:
        raise ValueError(f"--train-samples {samples} needs --global-batch-size to count iterations")
    steps = _steps(values)
    ramp = None if steps else parse_rampup(_get(values, "rampup_batch_size"))
    if ramp is not None and not ramp_valid(gbs, ramp):
        return samples // gbs  # validate() names the bad ramp-up
    return iters_for_samples(samples, gbs, ramp, steps)


def _steps(values: dict):
    """The parsed ``--step-batch-size-schedule`` (None without one)."""
    from megafp8.config_values import parse_step_schedule

    return parse_step_schedule(_get(values, "step_batch_size_schedule"), _get(values, "seq_length"))


def _get(values: dict, name: str):
    """The value given so far, else the field's default."""
    return values[name] if name in values else all_fields()[name][1].default


def resolve(given: dict, values: dict) -> list[str]:
    """``given``: compat dest -> value for the flags present; ``values``: the flat config values
    so far (field -> value), updated in place. Returns the notices; raises ValueError (one line)
    for a refused flag or a failed check."""
    notices = []
    for dest in given:
        f = BY_DEST[dest]
        if f.action == "refuse":
            raise ValueError(f"--{f.name}: {f.help}")
        if f.action == "notice":
            notices.append(f"--{f.name} has no effect here: {f.help}")
    steps = _steps(values)  # its last batch is the global batch
    gbs = steps[-1][1] if steps else _get(values, "global_batch_size")
    if given.get("use_distributed_optimizer"):
        values.setdefault("zero_stage", 1)
    for flag, field in (
        ("train_samples", "train_iters"),
        ("lr_warmup_samples", "lr_warmup_iters"),
        ("lr_decay_samples", "lr_decay_iters"),
        ("lr_wsd_decay_samples", "lr_wsd_decay_iters"),
    ):
        if (
            given.get(flag) is not None
            and flag == "train_samples"
            and (_get(values, "rampup_batch_size") or steps)
        ):
            values[field] = _ramped_iters(given[flag], gbs, values)
        elif given.get(flag) is not None:
            values[field] = _iters(flag.replace("_", "-"), given[flag], gbs)
    if given.get("lr_warmup_fraction") is not None:
        frac = given["lr_warmup_fraction"]
        if not 0.0 <= frac <= 1.0:
            raise ValueError(f"--lr-warmup-fraction {frac} must be in [0, 1]")
        span = _get(values, "lr_decay_iters") or _get(values, "train_iters")
        values["lr_warmup_iters"] = int(frac * int(span))
    if given.get("recompute_activations"):
        values.setdefault("recompute_granularity", "selective")
    if given.get("deterministic_mode"):
        values["deterministic"] = True
    if given.get("use_rotary_position_embeddings"):
        values["position_embedding_type"] = "rope"  # as Megatron: it wins over the type given
    if given.get("use_dist_ckpt"):
        values.setdefault("ckpt_format", "torch_dist")
    if given.get("num_layers_per_virtual_pipeline_stage") is not None:
        values["virtual_pipeline_model_parallel_size"] = _virtual(
            given["num_layers_per_virtual_pipeline_stage"], values
        )
    if given.get("use_checkpoint_args"):
        notices.extend(_checkpoint_args(values))
    _checks(given, values)
    return notices


# --use-checkpoint-args, as Megatron-LM's load_args_from_checkpoint: sizes are taken from the
# checkpoint where no flag gives them; the rest replace the flags' values (the vocab, the norm's
# epsilon and the dispatcher are taken here too, where no flag gives them)
FROM_CHECKPOINT_IF_NOT_GIVEN = (
    "num_layers", "hidden_size", "ffn_hidden_size", "seq_length", "num_attention_heads",
    "max_position_embeddings", "vocab_size", "make_vocab_size_divisible_by", "norm_epsilon",
    "moe_token_dispatcher_type",
)  # fmt: skip
FROM_CHECKPOINT = (
    "num_query_groups", "position_embedding_type", "rotary_base", "use_rope_scaling",
    "rope_scaling_factor", "add_bias_linear", "add_qkv_bias", "swiglu", "squared_relu",
    "untie_embeddings_and_output_weights", "apply_layernorm_1p", "normalization", "qk_layernorm",
    "attention_dropout", "hidden_dropout", "num_experts", "moe_layer_freq", "moe_ffn_hidden_size",
    "moe_router_topk", "moe_router_pre_softmax", "moe_grouped_gemm",
    "moe_shared_expert_intermediate_size", "moe_router_score_function",
    "moe_router_enable_expert_bias",
)  # fmt: skip


def _checkpoint_args(values: dict) -> list[str]:
    """Fill ``values`` with the model fields of the checkpoint the run loads; one line saying
    what was taken (or why nothing was)."""
    import json
    import os
    from types import SimpleNamespace

    from megafp8.checkpoint import load_tag

    load = values.get("load")
    if not load:
        return ["--use-checkpoint-args: no --load, the flags are used"]
    t = SimpleNamespace(
        ckpt_step=values.get("ckpt_step"),
        exit_on_missing_checkpoint=values.get("exit_on_missing_checkpoint"),
    )
    tag = load_tag(t, load) if os.path.isdir(load) else None
    if tag is None:
        return [f"--use-checkpoint-args: no checkpoint in {load}, the flags are used"]
    path = os.path.join(load, tag, "megafp8.json")
    try:
        with open(path) as f:
            saved = json.load(f)["config"]["model"]
    except (OSError, ValueError, KeyError, TypeError) as exc:
        raise ValueError(f"--use-checkpoint-args: {path} is not readable ({exc!r})") from None
    taken = []
    for name in FROM_CHECKPOINT_IF_NOT_GIVEN + FROM_CHECKPOINT:
        if name not in saved or (name in FROM_CHECKPOINT_IF_NOT_GIVEN and name in values):
            continue
        if _get(values, name) != saved[name]:  # what the run would have had otherwise
            taken.append(f"{name}={saved[name]!r}")
        values[name] = saved[name]
    return [f"--use-checkpoint-args: from {path}: " + (", ".join(taken) or "the flags' values")]


def _virtual(n: int, values: dict) -> int:
    """Megatron's --num-layers-per-virtual-pipeline-stage n: v = num_layers / (pp x n)."""
    layers, pp = int(_get(values, "num_layers")), int(_get(values, "pipeline_model_parallel_size"))
    if n < 1 or layers % (pp * n):
        raise ValueError(
            f"--num-layers-per-virtual-pipeline-stage {n}: num_layers={layers} must be a multiple "
            f"of pipeline_model_parallel_size={pp} x {n}"
        )
    v, given_v = layers // (pp * n), _get(values, "virtual_pipeline_model_parallel_size")
    if given_v is not None and int(given_v) != v:
        raise ValueError(
            f"--num-layers-per-virtual-pipeline-stage {n} gives virtual_pipeline_model_parallel_"
            f"size={v} (num_layers={layers} / (pp={pp} x {n})), but {given_v} was given"
        )
    return v


def _checks(given: dict, values: dict) -> None:
    if given.get("no_position_embedding") and _get(values, "position_embedding_type") != "rope":
        raise ValueError(
            "--no-position-embedding: a model without any position encoding is not supported; "
            "use --position-embedding-type rope"
        )
    kvc = given.get("kv_channels")
    if kvc is not None:
        h, heads = _get(values, "hidden_size"), _get(values, "num_attention_heads")
        if int(h) // int(heads) != kvc:
            raise ValueError(
                f"--kv-channels {kvc} must equal hidden_size / num_attention_heads "
                f"({h} / {heads}): other head widths are not supported"
            )
    rp = given.get("rotary_percent")
    if rp is not None and rp != 1.0:
        raise ValueError(f"--rotary-percent {rp}: only 1.0 (the whole head dim) is supported")
    for name, want in (("optimizer", "adam"), ("dataloader_type", "single"),
                       ("dist_ckpt_format", "torch_dist"), ("exp_avg_dtype", "fp32"),
                       ("exp_avg_sq_dtype", "fp32"), ("main_params_dtype", "fp32")):  # fmt: skip
        got = given.get(name)
        if got is not None and got != want:
            raise ValueError(f"--{name.replace('_', '-')} {got}: {BY_DEST[name].help}")
    mg = given.get("main_grads_dtype")
    if mg is not None and mg not in ("fp32", "bf16"):
        raise ValueError(f"--main-grads-dtype {mg}: {BY_DEST['main_grads_dtype'].help}")
    for name in ("expert_tensor_parallel_size", "num_distributed_optimizer_instances"):
        got = given.get(name)
        if got is not None and got != 1:
            raise ValueError(f"--{name.replace('_', '-')} {got}: {BY_DEST[name].help}")
    rd = given.get("moe_router_dtype")
    if rd is not None and rd != "fp32":
        raise ValueError(f"--moe-router-dtype {rd}: only fp32 (the router's dtype here)")
    cp = given.get("context_parallel_size")
    if cp is not None and cp != 1:
        raise ValueError(f"--context-parallel-size {cp}: context parallelism is not available")
