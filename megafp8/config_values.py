"""Values derived from a run configuration, and the grammar of its compound values.

Written once, for ``megafp8.validate`` and for the code that uses them: the derived sizes (padded
vocab, data-parallel size, global batch) and the parsers of ``data_path`` (``"A"`` or a blend
``"w1 A w2 B"``) and ``split`` (``"969,30,1"``). Nothing here touches ``torch.distributed``.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

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
    """Samples per optimizer step: ``global_batch_size``, or one micro-batch per DP rank."""
    t = cfg.train
    return t.global_batch_size or t.micro_batch_size * dp


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
    INCREMENT x the intervals completed, and G once more than SAMPLES samples are consumed."""
    return ramp_batch(global_batch_size(cfg, dp), parse_rampup(cfg.train.rampup_batch_size),
                      consumed)  # fmt: skip


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


def ramp_sizes(cfg, dp: int) -> list[int]:
    """Every global batch a run can take: the ramp's, then global_batch_size."""
    gbs, ramp = global_batch_size(cfg, dp), parse_rampup(cfg.train.rampup_batch_size)
    return [gbs] if ramp is None else [*range(ramp[0], gbs, ramp[1]), gbs]


def train_samples(cfg, dp: int) -> int:
    """The samples the run's ``train_iters`` iterations consume (each its own global batch)."""
    gbs, ramp = global_batch_size(cfg, dp), parse_rampup(cfg.train.rampup_batch_size)
    if not ramp:
        return cfg.train.train_iters * gbs
    consumed = 0
    for _ in range(cfg.train.train_iters):
        consumed += ramp_batch(gbs, ramp, consumed)
    return consumed


def parse_data_path(data_path) -> list[tuple[float, str]]:
    """``("A",)`` -> ``[(1.0, "A")]``; ``("0.7", "A", "0.3", "B")`` -> normalized weight pairs."""
    items = list(data_path)
    if not items:
        raise ValueError("data_path is empty")
    if len(items) == 1:
        return [(1.0, items[0])]
    if len(items) % 2:
        raise ValueError(f"data_path {items}: a blend is 'weight prefix' pairs")
    pairs = []
    for w, prefix in zip(items[0::2], items[1::2], strict=True):
        try:
            weight = float(w)
        except ValueError:
            raise ValueError(f"data_path weight {w!r} (of {prefix!r}) is not a number") from None
        if not weight >= 0:  # negative or nan
            raise ValueError(f"data_path weight {w!r} of {prefix!r} is negative")
        pairs.append((weight, prefix))
    total = sum(w for w, _ in pairs)
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
