"""Weighted blends (``--data-path 0.7 A 0.3 B``) and train/valid/test splits (``--split 969,30,1``).

Split: each dataset's sequences are cut into three contiguous ranges, with Megatron's rounding.
Blend: the counts are apportioned exactly (largest remainder: dataset ``d`` gets ``N * w_d``
rounded so the counts sum to ``N``), then interleaved smoothly: dataset ``d``'s ``k``-th sample
sits at time ``(k + 0.5) / c_d`` and all samples are merged by time (ties by dataset order). Every
prefix of the blend therefore holds each dataset within about one sample of its share.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from megafp8.data.gpt_dataset import cached_arrays

_BLOCK = 1 << 22  # samples merged per block (bounded memory for huge blends)


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
    for w, prefix in zip(items[0::2], items[1::2]):
        try:
            weight = float(w)
        except ValueError:
            raise ValueError(f"data_path weight {w!r} (of {prefix!r}) is not a number") from None
        if weight < 0:
            raise ValueError(f"data_path weight {w!r} of {prefix!r} is negative")
        pairs.append((weight, prefix))
    total = sum(w for w, _ in pairs)
    if total <= 0:
        raise ValueError(f"data_path {items}: the weights sum to zero")
    return [(w / total, p) for w, p in pairs]


def parse_split(split: str) -> list[float]:
    """``"969,30,1"`` -> three fractions summing to 1 (missing parts are 0)."""
    try:
        parts = [float(x) for x in split.replace("/", ",").split(",")]
    except ValueError:
        raise ValueError(
            f"split={split!r} must be comma-separated numbers like '969,30,1'"
        ) from None
    if len(parts) > 3 or any(p < 0 for p in parts) or sum(parts) <= 0:
        raise ValueError(f"split={split!r}: up to three non-negative numbers with a positive sum")
    parts += [0.0] * (3 - len(parts))
    return [p / sum(parts) for p in parts]


def split_ranges(num: int, fractions: list[float]) -> list[tuple[int, int]]:
    """Megatron's split of ``num`` elements: cumulative rounding, the error taken off the end."""
    bounds = [0]
    for f in fractions:
        bounds.append(bounds[-1] + int(round(f * float(num))))
    diff = bounds[-1] - num
    bounds = [0] + [max(0, b - diff) for b in bounds[1:]]
    return [(bounds[i], bounds[i + 1]) for i in range(len(fractions))]


def apportion(weights, total: int) -> np.ndarray:
    """Largest-remainder integer counts proportional to ``weights`` summing to ``total``."""
    w = np.asarray(weights, np.float64)
    share = w / w.sum() * total
    counts = np.floor(share).astype(np.int64)
    rest = total - int(counts.sum())
    if rest:
        order = np.argsort(-(share - counts), kind="stable")
        counts[order[:rest]] += 1
    return counts


def blend_indices(counts, block: int = _BLOCK) -> tuple[np.ndarray, np.ndarray]:
    """(dataset_index, dataset_sample_index) interleaving ``counts[d]`` samples of each dataset.

    Merged in blocks of ``block`` time-ordered samples, so memory stays bounded by the block.
    """
    counts = np.asarray(counts, np.int64)
    total = int(counts.sum())
    d_type = np.uint8 if len(counts) <= 255 else np.int16
    dataset_index = np.empty(total, d_type)
    sample_index = np.empty(total, np.int64)
    live = np.flatnonzero(counts)
    nblocks = max(1, -(-total // block))
    done = np.zeros(len(counts), np.int64)
    pos = 0
    for b in range(nblocks):
        hi_t = (b + 1) / nblocks
        # k-th sample of d has time (k + 0.5) / c_d; those with time < hi_t are k < hi_t*c_d - 0.5
        upto = np.minimum(counts, np.ceil(hi_t * counts - 0.5).astype(np.int64))
        if b == nblocks - 1:
            upto = counts
        ks = [np.arange(done[d], upto[d], dtype=np.int64) for d in live]
        ds = np.concatenate([np.full(len(k), d, d_type) for d, k in zip(live, ks)])
        ks_all = np.concatenate(ks)
        times = (ks_all + 0.5) / counts[ds.astype(np.int64)]
        order = np.lexsort((ds, times))
        n = len(order)
        dataset_index[pos : pos + n] = ds[order]
        sample_index[pos : pos + n] = ks_all[order]
        pos += n
        done = upto
    return dataset_index, sample_index


class BlendedDataset:
    """A fixed-length weighted mixture of datasets: ``ds[i]`` = ``datasets[d][k]`` per the index."""

    def __init__(self, datasets: list, counts, cache_dir: str | None = None, name: str = "train"):
        self.datasets, self.name = datasets, name
        self.counts = np.asarray(counts, np.int64)
        for d, (ds, c) in enumerate(zip(datasets, self.counts)):
            if c and (ds is None or len(ds) < c):
                raise ValueError(
                    f"{name}: blend part {d} needs {c} samples, has {0 if ds is None else len(ds)}"
                )
        desc = {"class": "BlendedDataset", "counts": self.counts.tolist(), "name": name}
        key = hashlib.blake2b(json.dumps(desc, sort_keys=True).encode(), digest_size=16).hexdigest()

        def build():
            di, si = blend_indices(self.counts)
            return {"dataset_index": di, "dataset_sample_index": si}

        arrays = cached_arrays(
            cache_dir, f"{key}-{name}-blend", ("dataset_index", "dataset_sample_index"), build, desc
        )
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]
