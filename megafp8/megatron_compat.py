"""Megatron-LM flags that are not config fields of their own: each is mapped onto a field, checked,
accepted with a one-line notice that it has no effect here (and why), or refused with a one-line
error naming what to use instead.

``megatron_flags.TABLE`` is the one list: the CLI registers every entry as a flag (so ``--help``
shows it, with what it does here), and ``resolve`` turns the parsed values into config values,
notices and errors.
Flags that are config fields themselves (``--num-layers``, ``--fp8-format``, ...) are not here.
Sample-based schedule flags (``--train-samples``, ``--lr-warmup-samples``, ``--lr-decay-samples``)
become iteration counts by dividing by the global batch size, as Megatron does with a constant
batch; ``--lr-warmup-fraction`` becomes iterations of the decay span;
``--num-layers-per-virtual-pipeline-stage n`` becomes v = num_layers / (pp x n) virtual stages.
"""

from __future__ import annotations

from megafp8.config import all_fields
from megafp8.megatron_flags import BY_DEST, TABLE


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
                       ("exp_avg_sq_dtype", "fp32"), ("main_params_dtype", "fp32"),
                       ("expert_tensor_parallel_size", 1),
                       ("num_distributed_optimizer_instances", 1)):  # fmt: skip
        got = given.get(name)
        if got is not None and got != want:
            raise ValueError(f"--{name.replace('_', '-')} {got}: {BY_DEST[name].help}")
    mg = given.get("main_grads_dtype")
    if mg is not None and mg not in ("fp32", "bf16"):
        raise ValueError(f"--main-grads-dtype {mg}: {BY_DEST['main_grads_dtype'].help}")
    rd = given.get("moe_router_dtype")
    if rd is not None and rd != "fp32":
        raise ValueError(f"--moe-router-dtype {rd}: only fp32 (the router's dtype here)")
    cp = given.get("context_parallel_size")
    if cp is not None and cp != 1:
        raise ValueError(f"--context-parallel-size {cp}: context parallelism is not available")
