"""The batch and data rules of ``validate`` (``validate.py``): global batch against micro batch,
data-parallel size and accumulation steps, for every batch of a ramp-up or step schedule; a data
source, blends and split that parse as the loader parses them; the checkpoint-path flags.
Each appends its problems to ``e``, one line each, naming the fields and their values."""

from __future__ import annotations

from megafp8.config import Config
from megafp8.config_values import (
    global_batch_size,
    parse_data_path,
    parse_rampup,
    parse_split,
    parse_step_schedule,
    ramp_sizes,
    ramp_valid,
    split_paths,
)


def batches(cfg: Config, dp: int, e: list[str]) -> None:
    """global batch = micro batch x dp x accumulation steps, for every batch of a ramp-up."""
    t = cfg.train
    try:
        ramp = parse_rampup(t.rampup_batch_size)
        steps = parse_step_schedule(t.step_batch_size_schedule, cfg.model.seq_length)
    except ValueError as exc:
        e.append(str(exc))
        return
    if steps and (t.global_batch_size is not None or ramp is not None):
        other = "global_batch_size" if t.global_batch_size is not None else "rampup_batch_size"
        e.append(
            f"step_batch_size_schedule and {other}: give one (the schedule's last batch, "
            f"{steps[-1][1]}, is the global batch)"
        )
        return
    gbs = global_batch_size(cfg, dp)
    if ramp is not None:
        start, incr, samples = ramp
        if not ramp_valid(gbs, ramp):
            e.append(
                f"rampup_batch_size={start} {incr} {samples}: need 1 <= START < "
                f"global_batch_size={gbs}, INCREMENT >= 1 dividing global_batch_size - START, "
                "SAMPLES >= 1"
            )
            return
    # resuming, a step schedule's batches already passed need not fit this layout (Megatron's
    # rule): here the last one only; train() checks those still due once the resume has set the
    # consumed samples
    check_batches(cfg, dp, steps[-1][0] if steps and t.load else 0, e)


def check_batches(cfg: Config, dp: int, consumed: int, e: list[str]) -> None:
    """Each global batch due from ``consumed`` samples on fills whole micro-batches on every DP
    rank (and, interleaved, a multiple of PP micro-batches)."""
    t, p = cfg.train, cfg.parallel
    gbs = global_batch_size(cfg, dp)
    pp, vpp = p.pipeline_model_parallel_size, p.virtual_pipeline_model_parallel_size or 1
    kind = "a step-schedule batch" if t.step_batch_size_schedule else "a ramp-up batch"
    for size in ramp_sizes(cfg, dp, consumed):
        name = "global_batch_size" if size == gbs else kind
        if size % (t.micro_batch_size * dp):
            e.append(
                f"{name}={size} is not divisible by micro_batch_size={t.micro_batch_size} "
                f"x data-parallel size {dp}"
            )
            return
        m = size // (t.micro_batch_size * dp)
        if vpp > 1 and pp > 1 and m % pp:
            e.append(
                f"virtual_pipeline_model_parallel_size={vpp}: the interleaved schedule needs the "
                f"micro-batches per iteration ({name}={size} / (micro_batch_size="
                f"{t.micro_batch_size} x data-parallel size {dp}) = {m}) to be a multiple of "
                f"pipeline_model_parallel_size={pp}"
            )
            return


def data(cfg: Config, e: list[str]) -> None:
    """A source of data; ``data_path`` and ``split`` parse as the loader will parse them."""
    d, t = cfg.data, cfg.train
    per_split = split_paths(d)
    if per_split and (d.data_path or d.mock_data):
        given = "data_path" if d.data_path else "mock_data"
        e.append(f"{', '.join(f'{s}_data_path' for s in per_split)} and {given}: give one")
    elif per_split and "train" not in per_split:
        e.append("valid/test_data_path without train_data_path: no data to train on")
    elif not d.mock_data and not d.data_path and not per_split:
        e.append("no data: give data_path (--data-path) or mock_data (--mock-data)")
    blends = [(parse_data_path, v) for v in (d.data_path, *per_split.values())]
    for parse, value in [*blends, (parse_split, d.split)]:
        if value:
            try:
                parse(value)
            except ValueError as exc:
                e.append(str(exc))
    if d.tiktoken_pattern not in (None, "v1", "v2"):
        e.append(f"tiktoken_pattern={d.tiktoken_pattern!r} must be v1 or v2")
    if t.most_recent_k is not None and t.most_recent_k < 1:
        e.append(f"most_recent_k={t.most_recent_k} must be >= 1 (the newest is always kept)")
    if t.save_retain_interval is not None and t.save_retain_interval < 1:
        e.append(f"save_retain_interval={t.save_retain_interval} must be >= 1")
    if t.save_interval and not t.save:
        e.append(f"save_interval={t.save_interval} needs save (--save DIR)")
    if t.ckpt_step is not None and not t.load:
        e.append(f"ckpt_step={t.ckpt_step} needs load (--load DIR)")
    if t.finetune and not t.load:
        e.append("finetune needs load (--load DIR): the checkpoint whose weights it starts from")
    ab = cfg.model.attention_backend
    if d.reset_attention_mask and ab not in ("auto", "local"):
        e.append(
            f"reset_attention_mask needs attention_backend auto or local, got {ab}: the "
            "documents' mask runs through torch's SDPA"
        )
