"""Datasets for a run and each data-parallel rank's micro-batches, resumable bit for bit.

Sample counts (Megatron-LM's): train ``train_iters * gbs`` (under a ramp-up, the sum of its
iterations' batches); valid ``(train_iters // eval_interval + 1) * eval_iters * gbs`` with an
eval interval, else ``eval_iters * gbs``; test ``eval_iters * gbs`` (``gbs`` = global batch).
The counts shape the index shuffles, so the same counts give Megatron-LM's samples.

Order (Megatron's ``MegatronPretrainingSampler``): sample ids run ``0, 1, 2, ...`` through the
shuffled dataset; each step of ``micro_batch_size * dp_size`` ids forms one micro-batch round, and
DP rank ``r`` takes ids ``[r * micro, (r + 1) * micro)`` of it. Global batch ``k`` is therefore
samples ``[k * gbs, (k + 1) * gbs)``, and a resume from ``consumed_train_samples`` continues with
exactly the batches an uninterrupted run would have produced.
"""

from __future__ import annotations

import functools
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np

from megafp8.config_values import global_batch_size, split_paths, train_samples
from megafp8.data.blend import (
    BlendedDataset,
    blend_sizes,
    normalized,
    parse_data_path,
    parse_split,
    split_ranges,
)
from megafp8.data.gpt_dataset import GPTDataset, MockIndexedDataset, samples_in
from megafp8.data.indexed import IndexedDataset
from megafp8.data.tokenizer import DEFAULT_MOCK_VOCAB_SIZE, check_data_tokenizer

log = logging.getLogger(__name__)

SPLITS = ("train", "valid", "test")
# Megatron-LM main's mock documents (MockGPTLowLevelDataset): their number, the seed of their
# lengths and the longest one, all fixed there
MOCK_NUM_SEQUENCES, MOCK_SEED, MOCK_MAX_LENGTH = 100_000, 0, 4095
MOCK_SPLIT = "1,1,1"


def split_sample_counts(cfg, dp_size: int) -> dict[str, int]:
    """Samples each split must provide for the whole run."""
    t, gbs = cfg.train, global_batch_size(cfg, dp_size)
    evals = (t.train_iters // t.eval_interval + 1) if t.eval_interval else 1
    return {
        "train": train_samples(cfg, dp_size),
        "valid": evals * t.eval_iters * gbs,
        "test": t.eval_iters * gbs,
    }


def _mock_low(cfg, tokenizer):
    if tokenizer is not None:
        vocab, eod = tokenizer.vocab_size, tokenizer.eod
    else:
        vocab = cfg.model.vocab_size or DEFAULT_MOCK_VOCAB_SIZE
        eod = vocab - 1
    return MockIndexedDataset(MOCK_NUM_SEQUENCES, vocab, eod, MOCK_SEED, MOCK_MAX_LENGTH)


def _cache_dir(cfg, prefix: str) -> str:
    if cfg.data.data_cache_path:
        return cfg.data.data_cache_path
    return os.path.join(os.path.dirname(os.path.abspath(prefix)), "cache", "GPTDataset_indices")


def _parts(cfg, blend) -> list[tuple]:
    """(weight, low-level dataset, cache dir) of each dataset of a blend (``data_path`` grammar)."""
    return [(w, IndexedDataset(p), _cache_dir(cfg, p)) for w, p in parse_data_path(blend)]


def _sources(cfg, tokenizer) -> dict[str, tuple[list, list, bool] | None]:
    """Per split: (parts, each part's document range, whether it is a blend), or None. With
    ``data_path`` (or mock data) every split cuts its range out of the same datasets (``split``);
    with the per-split blends (``--train-data-path`` ...) each split reads its own datasets
    whole."""
    d = cfg.data
    if tokenizer is not None:  # same ids and EOD as preprocess_data.py wrote
        check_data_tokenizer(d, tokenizer)
    per_split = split_paths(d)
    if per_split:
        out = {}
        for name in SPLITS:
            parts = _parts(cfg, per_split[name]) if name in per_split else None
            blended = bool(parts) and len(parts) > 1  # Megatron: one prefix is never blended
            out[name] = parts and (parts, [(0, len(low)) for _, low, _ in parts], blended)
        return out
    if d.mock_data:
        parts, blended = [(1.0, _mock_low(cfg, tokenizer), None)], False
    else:
        parts, blended = _parts(cfg, d.data_path), len(d.data_path) > 1
    # Megatron-LM cuts its mock documents in three even splits whatever --split says
    fractions = parse_split(MOCK_SPLIT if d.mock_data else d.split)
    return {
        name: (parts, [split_ranges(len(low), fractions)[s] for _, low, _ in parts], blended)
        for s, name in enumerate(SPLITS)
    }


def build_datasets(cfg, dp_size: int, tokenizer=None) -> dict[str, object | None]:
    """``{"train"|"valid"|"test": dataset or None}``; None where the split or its count is empty.
    One dataset named without a weight (or mock data) is a GPTDataset; weighted datasets (one or
    more) are a BlendedDataset, built as Megatron-LM builds them (``blend.py``); several named
    without weights are Megatron-LM's unweighted blend (``_unweighted_blend``)."""
    counts = split_sample_counts(cfg, dp_size)
    seq, seed = cfg.model.seq_length, cfg.train.seed
    out: dict[str, object | None] = {}
    for name, source in _sources(cfg, tokenizer).items():
        parts, ranges, blended = source or ([], [], False)
        weight_of = [1.0 if w is None else w for w, _, _ in parts]
        usable = [i for i, (lo, hi) in enumerate(ranges) if hi > lo and weight_of[i] > 0]
        if not counts[name] or not usable:
            out[name] = None
            continue
        if not blended:
            _, low, cache = parts[0]
            out[name] = GPTDataset(low, np.arange(*ranges[0]), seq, counts[name], seed, cache, name)
            continue
        for i in set(range(len(parts))) - set(usable):
            if weight_of[i] > 0:  # Megatron-LM cannot build this split at all
                log.warning(
                    "%s split: blend part %d has no documents in its range; "
                    "the blend goes on without it",
                    name,
                    i,
                )
        if parts[0][0] is None:
            out[name] = _unweighted_blend(parts, ranges, usable, counts[name], seq, seed, name)
            continue
        weights = [parts[i][0] for i in usable]  # normalized once (parse_data_path)
        if len(usable) < len(parts):  # a zero weight, or a dataset with no documents here
            weights = normalized(weights)
        asked, built = blend_sizes(weights, counts[name])
        datasets = [
            GPTDataset(parts[i][1], np.arange(*ranges[i]), seq, n, seed, parts[i][2], name)
            for i, n in zip(usable, built, strict=True)
        ]
        out[name] = BlendedDataset(datasets, weights, sum(asked), parts[usable[0]][2], name)
    return out


def _short_epoch(total: int, count: int, seq: int) -> str:
    return (
        f"train: data without weights is one epoch of its datasets, {total} samples of "
        f"seq_length {seq}, but the run needs {count} (train_iters x global batch): give "
        "weights ('--data-path 1 A 1 B') to repeat them, or train on fewer samples"
    )


def check_unweighted_epoch(cfg, dp_size: int) -> None:
    """Before any model is built: the train split of an unweighted blend (``--data-path A B``)
    holds the samples the run needs (one epoch of each dataset: ``samples_in`` its train
    documents' tokens, summed over the datasets), else the one-line error."""
    d = cfg.data
    blend = split_paths(d).get("train") or d.data_path
    if d.mock_data or not blend or parse_data_path(blend)[0][0] is not None:
        return
    parts, ranges, _ = _sources(cfg, None)["train"]
    seq = cfg.model.seq_length
    total = sum(
        samples_in(int(np.asarray(low.sequence_lengths)[lo:hi].sum(dtype=np.int64)), seq)
        for (_, low, _), (lo, hi) in zip(parts, ranges, strict=True)
    )
    count = split_sample_counts(cfg, dp_size)["train"]
    if total < count:
        raise ValueError(_short_epoch(total, count, seq))


def _unweighted_blend(parts, ranges, usable, count: int, seq: int, seed: int, name: str):
    """``--data-path A B ...`` without weights, as Megatron-LM builds it: one epoch of each
    dataset's split (every sample its documents hold, shuffled as always), blended in proportion
    to those sample counts, ``min(count, their sum)`` samples long. Training needs all ``count``
    samples (Megatron-LM would stop with an exhausted loader when the epoch ends); an evaluation
    split that is shorter is used as far as it goes."""
    datasets = [
        GPTDataset(parts[i][1], np.arange(*ranges[i]), seq, None, seed, parts[i][2], name)
        for i in usable
    ]
    sizes = [len(ds) for ds in datasets]
    for i, n in zip(usable, sizes, strict=True):
        if not n:
            log.warning(
                "%s split: blend part %d holds no sample of %d tokens; the blend goes on "
                "without it",
                name,
                i,
                seq + 1,
            )
    keep = [k for k, n in enumerate(sizes) if n]
    total = sum(sizes)
    if name == "train" and total < count:
        raise ValueError(_short_epoch(total, count, seq))
    if not total:
        return None
    if total < count:
        log.warning(
            "%s split: the unweighted blend holds %d of the %d samples its evaluations read",
            name,
            total,
            count,
        )
    return BlendedDataset(
        [datasets[k] for k in keep],
        [sizes[k] for k in keep],
        min(count, total),
        parts[usable[keep[0]]][2],
        name,
    )


def _collate(samples: list[np.ndarray], eod_mask_id: int | None = None) -> dict:
    """Samples of seq_length + 1 tokens -> inputs, next-token labels and the loss mask, each
    [b, s]. With ``eod_mask_id`` (``--eod-mask-loss``), positions whose input is that EOD id do not
    count (the prediction of a document's first token from the previous one's EOD)."""
    import torch

    batch = torch.from_numpy(np.stack(samples).astype(np.int64, copy=False))  # [b, s + 1]
    tokens = batch[:, :-1].contiguous()
    mask = torch.ones(tokens.shape, dtype=torch.float32)
    if eod_mask_id is not None:
        mask[tokens == eod_mask_id] = 0.0
    return {"tokens": tokens, "labels": batch[:, 1:].contiguous(), "loss_mask": mask}


def rank_sample_ids(start: int, end: int, micro: int, dp_rank: int, dp_size: int):
    """Per micro-batch, this rank's sample ids in ``[start, end)`` (Megatron's sampler order)."""
    step = micro * dp_size
    for base in range(start, end - step + 1, step):
        lo = base + dp_rank * micro
        yield list(range(lo, lo + micro))


def micro_batches(
    dataset,
    start: int,
    end: int,
    micro: int,
    dp_rank: int,
    dp_size: int,
    num_workers: int = 0,
    eod_mask_id: int | None = None,
) -> Iterator[dict]:
    """This rank's micro-batches over samples ``[start, end)`` of ``dataset``."""
    collate = functools.partial(_collate, eod_mask_id=eod_mask_id)
    if num_workers <= 0:
        for ids in rank_sample_ids(start, end, micro, dp_rank, dp_size):
            yield collate([dataset[i] for i in ids])
        return
    import torch.utils.data as tud

    batches = list(rank_sample_ids(start, end, micro, dp_rank, dp_size))
    yield from tud.DataLoader(
        _TorchView(dataset),
        batch_sampler=batches,
        num_workers=num_workers,
        collate_fn=collate,
        persistent_workers=False,
    )


class _TorchView:
    """Map-style adapter for ``torch.utils.data.DataLoader`` workers."""

    def __init__(self, dataset):
        self.dataset = dataset

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i):
        return self.dataset[i]


@dataclass
class DataIterators:
    """Iterators of one DP rank's micro-batches (None where a split is empty)."""

    train: Iterator[dict] | None
    valid: Iterator[dict] | None
    test: Iterator[dict] | None
    datasets: dict
    micro_batch_size: int
    dp_rank: int
    dp_size: int
    num_workers: int = 0
    eod_mask_id: int | None = None  # --eod-mask-loss: the EOD id whose positions do not count

    def _iterator(self, name: str, start: int = 0) -> Iterator[dict] | None:
        ds = self.datasets.get(name)
        if ds is None:
            return None
        return micro_batches(
            ds,
            start,
            len(ds),
            self.micro_batch_size,
            self.dp_rank,
            self.dp_size,
            self.num_workers,
            self.eod_mask_id,
        )

    def eval_iterator(self, split: str, start: int = 0) -> Iterator[dict] | None:
        """``split``'s micro-batches from its sample ``start`` (``train.eval_start``: each
        evaluation reads on from where the previous one stopped, as Megatron-LM's)."""
        return self._iterator(split, start)

    def valid_iterator(self, start: int = 0) -> Iterator[dict] | None:
        return self._iterator("valid", start)


def build_data_iterators(
    cfg,
    *,
    dp_rank: int,
    dp_size: int,
    consumed_train_samples: int = 0,
    tokenizer=None,
    eod_mask_id: int | None = None,
) -> DataIterators:
    """Build the run's datasets and this rank's iterators; train resumes after consumed samples.
    ``eod_mask_id``: the tokenizer's EOD when ``--eod-mask-loss`` is on (the same id
    ``preprocess_data.py`` wrote, checked against the dataset's tokenizer record)."""
    micro = cfg.train.micro_batch_size
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} outside [0, dp_size={dp_size})")
    if consumed_train_samples % (micro * dp_size):
        raise ValueError(
            f"consumed_train_samples={consumed_train_samples} is not a multiple of "
            f"micro_batch_size={micro} x dp_size={dp_size}"
        )
    datasets = build_datasets(cfg, dp_size, tokenizer)
    train = datasets["train"]
    if train is not None and consumed_train_samples > len(train):
        raise ValueError(
            f"consumed_train_samples={consumed_train_samples} exceeds the "
            f"{len(train)} training samples of this run"
        )
    it = DataIterators(
        None, None, None, datasets, micro, dp_rank, dp_size, cfg.data.num_workers, eod_mask_id
    )
    it.train = it._iterator("train", consumed_train_samples)
    it.valid = it._iterator("valid")
    it.test = it._iterator("test")
    for name in SPLITS:
        ds = datasets[name]
        log.info("%s: %s samples", name, "none" if ds is None else len(ds))
    return it
