"""Weighted blends (``--data-path 0.7 A 0.3 B``) and train/valid/test splits (``--split 969,30,1``),
as Megatron-LM main builds them.

Split: each dataset's sequences are cut into three contiguous ranges, with Megatron-LM's rounding.
Blend: with normalized weights ``w`` and ``N`` samples wanted, dataset ``d`` is asked for
``t_d = ceil(N w_d)`` samples and built ``MID_LEVEL_SURPLUS`` larger (``ceil(t_d * 1.005)``: its
own shuffles depend on that count); the blend holds ``sum(t_d)`` samples, each taken from the
dataset furthest behind its share (``blend_order.py``). Every prefix of the blend therefore holds
each dataset within about one sample of its share.
"""

from __future__ import annotations

import hashlib
import json
import math

import numpy as np

from megafp8.config_values import parse_data_path, parse_split  # noqa: F401  (the grammar lives there)
from megafp8.data.blend_order import blend_order
from megafp8.data.gpt_dataset import cached_arrays

MID_LEVEL_SURPLUS = 0.005  # Megatron-LM's margin on each blended dataset's sample count


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


def normalized(weights) -> list[float]:
    """``w / sum(w)`` in float64, the sum taken by numpy (Megatron-LM's rounding)."""
    w = np.asarray(weights, np.float64)
    return (w / np.sum(w)).tolist()


def blend_sizes(weights, total: int) -> tuple[list[int], list[int]]:
    """(samples asked of each dataset, samples each is built with) for ``total`` samples."""
    asked = [math.ceil(total * w) for w in weights]
    return asked, [math.ceil(t * (1 + MID_LEVEL_SURPLUS)) for t in asked]


class BlendedDataset:
    """``size`` samples of ``datasets`` mixed by ``weights`` (re-normalized here, as Megatron-LM
    does): ``ds[i]`` = ``datasets[d][k]`` per the index. ``counts``: the samples taken of each."""

    def __init__(
        self, datasets: list, weights, size: int, cache_dir: str | None = None, name: str = "train"
    ):
        self.datasets, self.name = datasets, name
        self.weights = normalized(weights)
        desc = {
            "class": "BlendedDataset",
            "version": 2,
            "weights": [float(w).hex() for w in self.weights],
            "size": int(size),
            "name": name,
        }
        key = hashlib.blake2b(json.dumps(desc, sort_keys=True).encode(), digest_size=16).hexdigest()

        def build():
            di, si = blend_order(self.weights, int(size))
            return {"dataset_index": di, "dataset_sample_index": si}

        arrays = cached_arrays(
            cache_dir, f"{key}-{name}-blend", ("dataset_index", "dataset_sample_index"), build, desc
        )
        self.dataset_index = arrays["dataset_index"]
        self.dataset_sample_index = arrays["dataset_sample_index"]
        self.counts = np.bincount(self.dataset_index, minlength=len(datasets)).astype(np.int64)
        for d, (ds, c) in enumerate(zip(datasets, self.counts, strict=True)):
            if c and (ds is None or len(ds) < c):
                raise ValueError(
                    f"{name}: blend part {d} needs {c} samples, has {0 if ds is None else len(ds)}"
                )

    def __len__(self) -> int:
        return len(self.dataset_index)

    def __getitem__(self, i: int) -> np.ndarray:
        return self.datasets[int(self.dataset_index[i])][int(self.dataset_sample_index[i])]
