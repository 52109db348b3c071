"""Weighted blends (``--data-path 0.7 A 0.3 B``) and train/valid/test splits (``--split 969,30,1``).

Split: each dataset's sequences are cut into three contiguous ranges, with Megatron-LM's rounding.
Blend: the counts are apportioned exactly (largest remainder: dataset ``d`` gets ``N * w_d``
rounded so the counts sum to ``N``), then interleaved smoothly: dataset ``d``'s ``k``-th sample
sits at time ``(k + 0.5) / c_d`` and all samples are merged by time (ties by dataset order). Every
prefix of the blend therefore holds each dataset within about one sample of its share.
"""

from __future__ import annotations

import hashlib
import json

import numpy as np

from megafp8.config_values import parse_data_path, parse_split  # noqa: F401  (the grammar lives there)
from megafp8.data.gpt_dataset import cached_arrays

_BLOCK = 1 << 22  # samples merged per block (bounded memory for huge blends)


def split_ranges(num: int, fractions: list[float]) -> list[tuple[int, int]]:
    """Megatron-LM's split of ``num`` elements: split ``i`` runs from ``round(c_i * num)`` to
    ``round(c_{i+1} * num)``, where ``c`` are the cumulative sums of the (normalized) fractions
    starting at 0, added left to right in float64 and rounded half to even, as Python's ``round``
    (a zero fraction gives an empty range)."""
    bounds, cum = [0], 0.0
    for f in fractions:
        cum += f
        bounds.append(int(round(cum * float(num))))
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
        ds = np.concatenate([np.full(len(k), d, d_type) for d, k in zip(live, ks, strict=True)])
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
        for d, (ds, c) in enumerate(zip(datasets, self.counts, strict=True)):
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
