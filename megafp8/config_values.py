"""Values derived from a run configuration, and the grammar of its compound values.

Written once, for ``megafp8.validate`` and for the code that uses them: the derived sizes (padded
vocab, data-parallel size, global batch) and the parsers of ``data_path`` (``"A"`` or a blend
``"w1 A w2 B"``) and ``split`` (``"969,30,1"``). Nothing here touches ``torch.distributed``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import numpy as np

if TYPE_CHECKING:
    from megafp8.config import Config


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: round the vocab up to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def data_parallel_size(cfg: Config, world_size: int) -> int:
    p = cfg.parallel
    return world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)


def global_batch_size(cfg: Config, dp: int) -> int:
    """Samples per optimizer step: ``global_batch_size``, or the last batch of a step schedule, or
    one micro-batch per DP rank."""
    t = cfg.train
    steps = parse_step_schedule(t.step_batch_size_schedule, cfg.model.seq_length)
    if steps:
        return steps[-1][1]
    return t.global_batch_size or t.micro_batch_size * dp


_SUFFIX = {"K": 10**3, "M": 10**6, "B": 10**9, "T": 10**12}


def _count(text: str, entry: str, what: str) -> int:
    """ "250B" -> 250 * 10**9 (K, M, B, T suffixes; a decimal before one: "1.5B")."""
    t = text.strip().upper()
    mult = _SUFFIX.get(t[-1:], 1)
    try:
        return int(float(t[:-1] if mult > 1 else t) * mult)
    except ValueError:
        raise ValueError(
            f'step_batch_size_schedule entry "{entry}": {what} "{text}" is not a number '
            "(K, M, B, T suffixes allowed)"
        ) from None


def parse_step_schedule(value, seq_length: int) -> list[tuple[int, int]] | None:
    """Megatron's ``--step-batch-size-schedule`` "THRESHOLD:BS THRESHOLD:BS ..." (spaces or
    commas; K, M, B, T suffixes) -> [(threshold in samples, global batch)], sorted. Thresholds
    are tokens, turned into samples by ``// seq_length``; the first must be 0, the rest
    strictly increasing (in samples), every batch >= 1. None when not given."""
    if not value:
        return None
    steps = []
    for entry in str(value).replace(",", " ").split():
        if ":" not in entry:
            raise ValueError(
                f'step_batch_size_schedule entry "{entry}": give THRESHOLD:BATCH_SIZE '
                '(e.g. "0:768 250B:1536")'
            )
        th, bs = entry.split(":", 1)
        steps.append((_count(th, entry, "threshold") // seq_length, _count(bs, entry, "batch")))
    steps.sort(key=lambda x: x[0])
    if steps[0][0] != 0:
        raise ValueError(
            f"step_batch_size_schedule={value!r}: the first threshold must be 0 "
            f"(the smallest is {steps[0][0]} samples)"
        )
    for (a, _), (b, _) in zip(steps[:-1], steps[1:], strict=True):
        if b <= a:
            raise ValueError(
                f"step_batch_size_schedule={value!r}: thresholds must be strictly increasing in "
                f"samples (tokens // seq_length={seq_length}); two fall at {a} samples"
            )
    if any(bs < 1 for _, bs in steps):
        raise ValueError(f"step_batch_size_schedule={value!r}: every batch size must be >= 1")
    return steps


def _scheduled(gbs: int, ramp, steps, consumed: int) -> int:
    """The batch due at ``consumed`` samples under a step schedule, else a ramp-up, else G."""
    if steps:
        return [bs for th, bs in steps if th <= consumed][-1]
    return ramp_batch(gbs, ramp, consumed)


def parse_rampup(value) -> tuple[int, int, int] | None:
    """``rampup_batch_size`` ("START INCREMENT SAMPLES") -> three ints; None when not given."""
    if not value:
        return None
    try:
        start, incr, samples = (int(v) for v in value)
    except ValueError:
        raise ValueError(
            f"rampup_batch_size={' '.join(map(str, value))}: give START INCREMENT SAMPLES, "
            "three integers"
        ) from None
    return start, incr, samples


def batch_size_at(cfg, dp: int, consumed: int) -> int:
    """The global batch of the iteration that starts after ``consumed`` samples. With
    Megatron's ramp-up (START, INCREMENT, SAMPLES) and global batch G: (G - START) / INCREMENT
    steps share SAMPLES evenly, each interval SAMPLES / steps samples long; the batch is START +
    INCREMENT x the intervals completed, and G once more than SAMPLES samples are consumed.
    With a step schedule: the batch of the last threshold at or below ``consumed``."""
    return _scheduled(*_plan(cfg, dp), consumed)


def _plan(cfg, dp: int):
    """(G, the parsed ramp-up or None, the parsed step schedule or None)."""
    t = cfg.train
    steps = parse_step_schedule(t.step_batch_size_schedule, cfg.model.seq_length)
    return global_batch_size(cfg, dp), parse_rampup(t.rampup_batch_size), steps


def ramp_valid(gbs: int, ramp: tuple[int, int, int]) -> bool:
    """1 <= START < G, INCREMENT >= 1 dividing G - START, SAMPLES >= 1."""
    start, incr, samples = ramp
    return 1 <= start < gbs and incr >= 1 and samples >= 1 and (gbs - start) % incr == 0


def ramp_batch(gbs: int, ramp: tuple[int, int, int] | None, consumed: int) -> int:
    """``batch_size_at`` from the global batch and the parsed ramp-up."""
    if ramp is None or consumed > ramp[2]:
        return gbs
    start, incr, samples = ramp
    per = samples / ((gbs - start) // incr)
    return start + int(consumed / per) * incr


def ramp_sizes(cfg, dp: int, consumed: int = 0) -> list[int]:
    """Every global batch a run can take from ``consumed`` samples on: the ramp's or the step
    schedule's, then global_batch_size."""
    gbs, ramp, steps = _plan(cfg, dp)
    if steps:
        due = _scheduled(gbs, ramp, steps, consumed)
        return list(dict.fromkeys([due] + [bs for th, bs in steps if th > consumed]))
    return [gbs] if ramp is None else [*range(ramp[0], gbs, ramp[1]), gbs]


def train_samples(cfg, dp: int) -> int:
    """The samples the run's ``train_iters`` iterations consume (each its own global batch)."""
    gbs, ramp, steps = _plan(cfg, dp)
    if not ramp and not steps:
        return cfg.train.train_iters * gbs
    consumed = 0
    for _ in range(cfg.train.train_iters):
        consumed += _scheduled(gbs, ramp, steps, consumed)
    return consumed


def iters_for_samples(samples: int, gbs: int, ramp, steps) -> int:
    """Iterations until ``samples`` are consumed, each taking the batch due then (Megatron's
    count for ``--train-samples`` under a ramp-up or a step schedule)."""
    iters = consumed = 0
    while consumed < samples:
        consumed, iters = consumed + _scheduled(gbs, ramp, steps, consumed), iters + 1
    return iters


def _weight(item: str) -> float | None:
    try:
        return float(item)
    except ValueError:
        return None


def parse_data_path(data_path) -> list[tuple[float | None, str]]:
    """Megatron-LM's ``--data-path`` grammar:

    - ``("A",)`` -> ``[(1.0, "A")]``: one dataset;
    - ``("0.7", "A", "0.3", "B")`` -> the weights normalized: a weighted blend;
    - ``("A", "B", ...)``, prefixes only -> ``[(None, "A"), (None, "B"), ...]``: an unweighted
      blend (one epoch of each dataset, mixed by their sizes; ``loader.build_datasets``).
    """
    items = list(data_path)
    if not items:
        raise ValueError("data_path is empty")
    if len(items) == 1:
        return [(1.0, items[0])]
    numbers = [_weight(x) for x in items[0::2]]
    if all(w is None for w in numbers) and all(_weight(x) is None for x in items[1::2]):
        return [(None, p) for p in items]
    if len(items) % 2:
        raise ValueError(
            f"data_path {items}: a blend is 'weight prefix' pairs, or prefixes without weights"
        )
    pairs = []
    for w, weight, prefix in zip(items[0::2], numbers, items[1::2], strict=True):
        if weight is None:
            raise ValueError(
                f"data_path weight {w!r} (of {prefix!r}) is not a number: give a weight "
                "before every prefix, or none"
            )
        if not weight >= 0:  # negative or nan
            raise ValueError(f"data_path weight {w!r} of {prefix!r} is negative")
        pairs.append((weight, prefix))
    total = float(np.sum([w for w, _ in pairs], dtype=np.float64))  # Megatron-LM's rounding
    if total <= 0:
        raise ValueError(f"data_path {items}: the weights sum to zero")
    return [(w / total, p) for w, p in pairs]


def split_paths(d) -> dict[str, tuple[str, ...]]:
    """The per-split blends of a ``DataConfig`` (``--train-data-path`` ...), where given."""
    paths = {s: getattr(d, f"{s}_data_path") for s in ("train", "valid", "test")}
    return {s: v for s, v in paths.items() if v}


def dataset_prefixes(d) -> list[str]:
    """Every dataset prefix a ``DataConfig`` reads: of ``data_path`` and the per-split blends."""
    blends = [d.data_path, *split_paths(d).values()]
    return [p for b in blends if b for _, p in parse_data_path(b)]


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> three fractions summing to 1 (missing parts are 0)."""
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(
            f"split={split!r} must be comma-separated numbers like '969,30,1'"
        ) from None
    if len(parts) > 3 or not all(p >= 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"split={split!r}: up to three non-negative numbers with a positive sum")
    parts += [0.0] * (3 - len(parts))
    return [p / sum(parts) for p in parts]
