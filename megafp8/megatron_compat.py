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
    _f("no-position-embedding", "switch", "check", "accepted with rope (which has no table)"),
    _f("kv-channels", int, "check", "must equal hidden_size / num_attention_heads"),
    _f("rotary-percent", float, "check", "must be 1.0 (the whole head dim rotates)"),
    _f("context-parallel-size", int, "check", "must be 1: context parallelism is not available"),
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
    _f("tiktoken-pattern", str, "notice", "only for TikTokenizer, which is not supported"),
    _f("wandb-project", str, "notice", "use --tensorboard-dir"),
    _f("wandb-exp-name", str, "notice", "use --tensorboard-dir"),
    _f("log-num-zeros-in-grad", "switch", "notice", "not computed"),
    _f("no-bias-swiglu-fusion", "switch", "notice", "the activation is torch's or TE's"),
    _f("no-bias-gelu-fusion", "switch", "notice", "the activation is torch's or TE's"),
    _f("no-bias-dropout-fusion", "switch", "notice", "dropout and residual add are torch ops"),
    _f("no-rope-fusion", "switch", "notice", "RoPE comes from the backend"),
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
        "rampup-batch-size",
        "+",
        "refuse",
        "batch ramp-up is not supported: give a constant --global-batch-size",
    ),
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
    gbs = _get(values, "global_batch_size")
    if given.get("use_distributed_optimizer"):
        values.setdefault("zero_stage", 1)
    for flag, field in (
        ("train_samples", "train_iters"),
        ("lr_warmup_samples", "lr_warmup_iters"),
        ("lr_decay_samples", "lr_decay_iters"),
    ):
        if given.get(flag) is not None:
            values[field] = _iters(flag.replace("_", "-"), given[flag], gbs)
    if given.get("lr_warmup_fraction") is not None:
        frac = given["lr_warmup_fraction"]
        if not 0.0 <= frac <= 1.0:
            raise ValueError(f"--lr-warmup-fraction {frac} must be in [0, 1]")
        span = _get(values, "lr_decay_iters") or _get(values, "train_iters")
        values["lr_warmup_iters"] = int(frac * int(span))
    if given.get("recompute_activations"):
        values.setdefault("recompute_granularity", "selective")
    if given.get("num_layers_per_virtual_pipeline_stage") is not None:
        values["virtual_pipeline_model_parallel_size"] = _virtual(
            given["num_layers_per_virtual_pipeline_stage"], values
        )
    _checks(given, values)
    return notices


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
    cp = given.get("context_parallel_size")
    if cp is not None and cp != 1:
        raise ValueError(f"--context-parallel-size {cp}: context parallelism is not available")
