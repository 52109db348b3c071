"""GPT samples: windows of ``seq_length + 1`` tokens cut from a stream of shuffled documents,
in Megatron-LM's order (the same sample ids give the same tokens as its ``GPTDataset``).

Three indices, built with numpy (no per-document or per-token Python loop), their shuffles drawn
from one ``numpy.random.RandomState(seed)`` in Megatron's sequence:

- document index: the split's documents repeated once per epoch, then shuffled as one array.
  When the final epoch is needed for fewer than 80 % of an epoch's samples it is shuffled on its
  own after the others (Megatron's "separate final epoch"), so the samples of the earlier epochs
  are not diluted by a scrap of the last one.
- sample index ``[n + 1, 2]`` int64: sample ``i`` covers stream positions ``[i*L, i*L + L]``
  (``L + 1`` tokens: the last token of one sample is the first of the next, as in Megatron), and
  row ``i`` holds (position in the document index, offset) of its first token.
- shuffle index: a permutation of all ``n`` samples (with a separate final epoch: of the samples
  before it, then of the rest); the first ``num_samples`` entries are used.

Here a "document" is one sequence of the indexed dataset (Megatron's GPT dataset does the same).
Indices over real data are cached under ``cache_dir`` keyed by a hash of everything that shapes
them (the sequence lengths themselves, the document range, seq_length, num_samples, seed): built
once per node by LOCAL_RANK 0, written atomically, while other ranks wait on a barrier.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from collections.abc import Callable

import numpy as np

log = logging.getLogger(__name__)

INDEX_VERSION = 2  # bump when the index construction changes (2: Megatron-LM's order)


def epochs_needed(tokens_per_epoch: int, seq_length: int, num_samples: int) -> int:
    """Smallest number of epochs whose token stream yields ``num_samples`` samples."""
    if tokens_per_epoch <= 0:
        raise ValueError("the documents hold no tokens; cannot cut samples from them")
    return max(1, -(-(num_samples * seq_length + 1) // tokens_per_epoch))


def samples_before_final_epoch(
    tokens_per_epoch: int, seq_length: int, num_samples: int, epochs: int
) -> int | None:
    """Megatron's separate final epoch: the number of samples the epochs before the last one
    hold, when the run needs fewer than ``int(0.8 * samples per epoch)`` samples of the last one
    (that epoch's documents and samples are then shuffled on their own); else None."""
    if epochs == 1:
        return None
    before = ((epochs - 1) * tokens_per_epoch - 1) // seq_length
    per_epoch = (tokens_per_epoch - 1) // seq_length
    return before if num_samples - before < int(0.8 * per_epoch) else None


def build_document_index(
    documents: np.ndarray, epochs: int, rs: np.random.RandomState, separate_final: bool = False
) -> np.ndarray:
    """``documents`` repeated ``epochs`` times and shuffled as one array by ``rs``; with
    ``separate_final``, the first ``epochs - 1`` repeats shuffled together, then the last one
    alone. int32 while ids fit, else int64 (the shuffle draws the same either way)."""
    documents = np.asarray(documents)
    dtype = np.int32 if len(documents) == 0 or documents.max() < 2**31 - 1 else np.int64
    if separate_final and epochs > 1:
        head = build_document_index(documents, epochs - 1, rs)
        return np.concatenate([head, build_document_index(documents, 1, rs)])
    index = np.tile(documents.astype(dtype), epochs)
    rs.shuffle(index)
    return index


def samples_in(tokens: int, seq_length: int) -> int:
    """Samples of ``seq_length`` (+1 label token, shared with the next sample) that ``tokens``
    hold: ``(tokens - 1) // seq_length``, never below 0."""
    return max(0, (tokens - 1) // seq_length)


def build_sample_index(sizes: np.ndarray, document_index: np.ndarray, seq_length: int):
    """``[n + 1, 2]`` int64 (document-index position, offset) of every sample start.

    ``sizes[d]`` is the token count of document ``d``; ``n = (total - 1) // seq_length``. Position
    ``p`` belongs to the document whose cumulative span contains it (empty documents never do).
    """
    lengths = np.asarray(sizes, np.int64)[document_index]
    ends = np.cumsum(lengths, dtype=np.int64)
    total = int(ends[-1]) if len(ends) else 0
    n = samples_in(total, seq_length)
    starts = np.arange(n + 1, dtype=np.int64) * seq_length
    pos = np.searchsorted(ends, starts, side="right")
    out = np.empty((n + 1, 2), np.int64)
    out[:, 0] = pos
    out[:, 1] = starts - (ends[pos] - lengths[pos])
    out[0] = 0  # as Megatron: the first sample starts at (0, 0) even if document 0 is empty
    return out


def build_shuffle_index(
    num_samples_total: int, before_final: int | None, rs: np.random.RandomState
) -> np.ndarray:
    """A permutation of ``range(num_samples_total)`` drawn by ``rs``; with ``before_final`` (a
    separate final epoch), ``range(before_final)`` permuted, then the rest. uint32 while it
    fits, else int64."""
    dtype = np.uint32 if num_samples_total < 2**32 - 2 else np.int64
    cut = num_samples_total if before_final is None else before_final
    head = np.arange(cut, dtype=dtype)
    rs.shuffle(head)
    if cut == num_samples_total:
        return head
    tail = np.arange(cut, num_samples_total, dtype=dtype)
    rs.shuffle(tail)
    return np.concatenate([head, tail])


def _barrier() -> None:
    try:
        import torch.distributed as dist
    except ImportError:  # pragma: no cover - torch is a dependency
        return
    if dist.is_available() and dist.is_initialized():
        dist.barrier()


def _save_atomic(path: str, array: np.ndarray) -> None:
    tmp = f"{path}.tmp-{os.getpid()}.npy"
    np.save(tmp, array, allow_pickle=False)
    os.replace(tmp, path)


def cached_arrays(
    cache_dir: str | None,
    key: str,
    names: tuple[str, ...],
    build: Callable[[], dict[str, np.ndarray]],
    description: dict,
):
    """Load ``names`` from ``cache_dir/key-*.npy`` (mmap), building them once per node if absent.

    LOCAL_RANK 0 builds and writes (each array atomically, the description last, which marks the
    set complete); every rank then meets at a barrier when torch.distributed is initialized. With
    no cache_dir, or a rank that finds no cache after the barrier, the arrays are built in memory.
    """
    if cache_dir is None:
        return build()
    paths = {n: os.path.join(cache_dir, f"{key}-{n}.npy") for n in names}
    done = os.path.join(cache_dir, f"{key}-description.json")
    built = None
    if not os.path.isfile(done) and int(os.environ.get("LOCAL_RANK", "0")) == 0:
        t0 = time.perf_counter()
        built = build()
        try:
            os.makedirs(cache_dir, exist_ok=True)
            for n in names:
                _save_atomic(paths[n], built[n])
            tmp = f"{done}.tmp-{os.getpid()}"
            with open(tmp, "w") as f:
                json.dump(description, f, indent=2, sort_keys=True)
            os.replace(tmp, done)
            log.info("built %s in %.2fs under %s", key, time.perf_counter() - t0, cache_dir)
        except OSError as exc:  # a read-only data directory: every rank builds in memory
            log.warning(
                "cannot write the index cache under %s (%s); set data_cache_path to "
                "a writable directory to reuse it",
                cache_dir,
                exc,
            )
    _barrier()
    if built is not None:
        return built
    if not os.path.isfile(done):
        log.warning("no index cache %s after the barrier; building in memory", done)
        return build()
    return {n: np.load(paths[n], mmap_mode="r", allow_pickle=False) for n in names}


class MockIndexedDataset:
    """Megatron-LM's mock documents, the same bytes: document ``i`` of length ``n`` is
    ``[1, 2, ..., n-1] % vocab_size`` then EOD; the lengths are drawn from
    ``numpy.random.default_rng(seed)`` as int32 integers in ``[1, max_length]``. Megatron-LM main
    fixes 100000 documents, seed 0 and lengths up to 4095 (``loader.MOCK_*``), whatever the run's
    ``--seed`` (which still shuffles the documents into samples)."""

    def __init__(self, num_sequences: int, vocab_size: int, eod: int, seed: int, max_length: int):
        if max_length < 1 or vocab_size < 2 or not 0 <= eod < vocab_size:
            raise ValueError(
                f"mock data needs vocab_size >= 2, 0 <= eod < vocab and max_length >= 1 "
                f"(vocab_size={vocab_size}, eod={eod}, max_length={max_length})"
            )
        rng = np.random.default_rng(seed)
        self.sequence_lengths = rng.integers(1, max_length + 1, num_sequences, dtype=np.int32)
        self.eod, self.vocab_size = eod, vocab_size
        self.dtype = np.dtype(np.int64)

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        size = int(self.sequence_lengths[i])
        length = size - offset if length is None else length
        tokens = np.arange(offset + 1, offset + length + 1, dtype=np.int64) % self.vocab_size
        if offset + length == size and length:
            tokens[-1] = self.eod
        return tokens


class GPTDataset:
    """``ds[i]`` -> int64 array of ``seq_length + 1`` tokens, for ``i < num_samples``.

    ``low`` is an ``IndexedDataset`` or ``MockIndexedDataset``; ``documents`` the sequence ids of
    this split. ``num_samples=None`` is one epoch: every sample its documents hold (Megatron-LM's
    dataset built without a sample count, as its unweighted blends are). ``cache_dir=None``
    builds the indices in memory.
    """

    def __init__(
        self,
        low,
        documents: np.ndarray,
        seq_length: int,
        num_samples: int | None,
        seed: int,
        cache_dir: str | None = None,
        name: str = "train",
    ):
        if num_samples is not None and num_samples < 1:
            raise ValueError(f"{name}: num_samples={num_samples} must be >= 1")
        self.low, self.seq_length, self.name = low, seq_length, name
        documents = np.asarray(documents, np.int64)
        sizes = np.asarray(low.sequence_lengths)
        tokens_per_epoch = int(sizes[documents].sum(dtype=np.int64))
        if num_samples is None:
            epochs = 1
        else:
            epochs = epochs_needed(tokens_per_epoch, seq_length, num_samples)
        desc = {
            "class": "GPTDataset",
            "version": INDEX_VERSION,
            "seq_length": seq_length,
            "num_samples": num_samples,
            "seed": seed,
            "name": name,
            "documents": [int(documents[0]), int(documents[-1]) + 1, len(documents)],
            "dataset": getattr(low, "prefix", "mock"),
            "epochs": epochs,
            "tokens_per_epoch": tokens_per_epoch,
        }
        h = hashlib.blake2b(
            json.dumps({k: v for k, v in desc.items() if k != "dataset"}, sort_keys=True).encode(),
            digest_size=16,
        )
        h.update(np.ascontiguousarray(sizes[documents]).tobytes())
        h.update(np.ascontiguousarray(documents).tobytes())
        key = f"{h.hexdigest()}-{name}"

        def build():
            rs = np.random.RandomState(seed)
            before = None
            if num_samples is not None:
                before = samples_before_final_epoch(
                    tokens_per_epoch, seq_length, num_samples, epochs
                )
            doc_index = build_document_index(documents, epochs, rs, before is not None)
            sample_index = build_sample_index(sizes, doc_index, seq_length)
            shuffle = build_shuffle_index(len(sample_index) - 1, before, rs)
            return {
                "document_index": doc_index,
                "sample_index": sample_index,
                "shuffle_index": shuffle,
            }

        arrays = cached_arrays(
            cache_dir, key, ("document_index", "sample_index", "shuffle_index"), build, desc
        )
        self.document_index = arrays["document_index"]
        self.sample_index = arrays["sample_index"]
        self.shuffle_index = arrays["shuffle_index"]
        self.epochs = epochs
        self.num_samples = len(self.shuffle_index) if num_samples is None else num_samples
        if len(self.shuffle_index) < self.num_samples:
            raise RuntimeError(
                f"{name}: index holds {len(self.shuffle_index)} samples, "
                f"fewer than the {num_samples} asked for"
            )

    def __len__(self) -> int:
        return self.num_samples

    def __getitem__(self, i: int) -> np.ndarray:
        if not 0 <= i < self.num_samples:
            raise IndexError(f"{self.name}: sample {i} outside [0, {self.num_samples})")
        j = int(self.shuffle_index[i])
        (d0, o0), (d1, o1) = self.sample_index[j], self.sample_index[j + 1]
        d0, o0, d1, o1 = int(d0), int(o0), int(d1), int(o1)
        docs = self.document_index
        if d0 == d1:
            return np.asarray(self.low.get(int(docs[d0]), o0, o1 - o0 + 1), np.int64)
        parts = [self.low.get(int(docs[d0]), o0)]
        parts += [self.low.get(int(docs[d])) for d in range(d0 + 1, d1)]
        parts.append(self.low.get(int(docs[d1]), 0, o1 + 1))
        return np.concatenate(parts).astype(np.int64, copy=False)
