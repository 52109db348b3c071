"""Sample/document/shuffle indices against naive pure-Python references and Megatron-LM's own;
sample contents."""

import numpy as np
import pytest

from megafp8.data.gpt_dataset import (
    GPTDataset,
    MockIndexedDataset,
    build_document_index,
    build_sample_index,
    build_shuffle_index,
    epochs_needed,
    samples_before_final_epoch,
)


def naive_sample_index(sizes, doc_index, seq_length):
    """Megatron's helper loop: walk documents consuming seq_length + 1 tokens per sample."""
    total = sum(sizes[d] for d in doc_index)
    num_samples = (total - 1) // seq_length
    out = [(0, 0)]
    pos, off = 0, 0
    for _ in range(num_samples):
        remaining = seq_length + 1
        while remaining:
            left = sizes[doc_index[pos]] - off
            remaining -= left
            if remaining <= 0:
                off += remaining + left - 1
                remaining = 0
            else:
                pos, off = pos + 1, 0
        out.append((pos, off))
    return np.array(out, np.int64)


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("seq_length", [1, 7, 64])
def test_sample_index_matches_naive(seed, seq_length):
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, 40, 200)
    sizes[rng.integers(0, 200, 20)] = 0  # empty documents are skipped
    sizes[0] = 5
    doc_index = rng.permutation(np.tile(np.arange(200), 3))
    fast = build_sample_index(sizes, doc_index, seq_length)
    slow = naive_sample_index(sizes.tolist(), doc_index.tolist(), seq_length)
    np.testing.assert_array_equal(fast, slow)
    assert fast.dtype == np.int64


def naive_window(sizes, doc_index, seq_length, i):
    stream = [t for d in doc_index for t in range(sizes[d])]
    return stream[i * seq_length : i * seq_length + seq_length + 1]


def test_sample_index_positions_are_token_windows():
    rng = np.random.default_rng(3)
    sizes = rng.integers(1, 9, 30)
    doc_index = np.arange(30)
    idx = build_sample_index(sizes, doc_index, 5)
    starts = np.concatenate([[0], np.cumsum(sizes)[:-1]])
    for i, (p, o) in enumerate(idx):
        assert starts[doc_index[p]] + o == i * 5


def test_document_index_repeats_the_documents_per_epoch():
    docs = np.arange(10, 60)
    di = build_document_index(docs, 4, np.random.RandomState(0))
    assert di.dtype == np.int32 and len(di) == 200
    assert np.array_equal(np.bincount(di, minlength=60)[10:], np.full(50, 4))
    assert sorted(di[:50].tolist()) != docs.tolist()  # shuffled as one array, not per epoch
    di = build_document_index(docs, 4, np.random.RandomState(0), separate_final=True)
    assert sorted(di[150:].tolist()) == docs.tolist()  # the final epoch on its own


def test_shuffle_index_is_a_permutation():
    sh = build_shuffle_index(1000, None, np.random.RandomState(1))
    assert sh.dtype == np.uint32 and sorted(sh.tolist()) == list(range(1000))
    sh = build_shuffle_index(1000, 700, np.random.RandomState(1))
    assert sorted(sh[:700].tolist()) == list(range(700))
    assert sorted(sh[700:].tolist()) == list(range(700, 1000))


class SmallDocs:
    """Documents of lengths ``(7 i) % 23 + 1``; token ``j`` of document ``i`` is ``1000 i + j``."""

    sequence_lengths = (np.arange(50, dtype=np.int32) * 7) % 23 + 1

    def get(self, i, offset=0, length=None):
        n = int(self.sequence_lengths[i])
        length = n - offset if length is None else length
        return np.arange(offset, offset + length, dtype=np.int64) + 1000 * i


# Megatron-LM d98e8a64's GPTDataset on SmallDocs, documents 10..49 (480 tokens an epoch),
# seq_length 16, seed 3: (num_samples, epochs, samples before a separate final epoch, the first
# 12 entries of its document index, the first 12 and last 4 of its shuffle index)
MEGATRON_INDICES = [
    (20, 1, None, [39, 26, 19, 37, 14, 28, 38, 48, 25, 36, 35, 21],
     [13, 10, 2, 25, 11, 6, 26, 8, 3, 4, 21, 12], [22, 23, 20, 14]),
    (100, 4, 89, [33, 25, 15, 41, 31, 16, 29, 35, 42, 27, 47, 17],
     [16, 75, 1, 54, 24, 42, 6, 23, 14, 18, 70, 27], [116, 95, 91, 107]),
    (111, 4, 89, [33, 25, 15, 41, 31, 16, 29, 35, 42, 27, 47, 17],
     [16, 75, 1, 54, 24, 42, 6, 23, 14, 18, 70, 27], [116, 95, 91, 107]),
    (112, 4, None, [40, 29, 16, 13, 17, 30, 46, 20, 48, 10, 25, 24],
     [117, 76, 1, 16, 25, 109, 64, 31, 80, 48, 86, 78], [51, 85, 33, 88]),
    (115, 4, None, [40, 29, 16, 13, 17, 30, 46, 20, 48, 10, 25, 24],
     [117, 76, 1, 16, 25, 109, 64, 31, 80, 48, 86, 78], [51, 85, 33, 88]),
    (130, 5, 119, [40, 29, 16, 13, 17, 30, 46, 20, 48, 10, 25, 24],
     [85, 38, 10, 51, 17, 61, 48, 68, 2, 77, 111, 16], [142, 131, 145, 140]),
]  # fmt: skip


@pytest.mark.parametrize("case", MEGATRON_INDICES, ids=lambda c: f"n{c[0]}")
def test_indices_are_megatrons(case):
    """One epoch, a separate final epoch (fewer than int(0.8 x 29) = 23 of the final epoch's
    samples needed: 11 and 22 of 29 at 4 epochs, 11 at 5) and a final epoch shuffled with the
    others (23 and 26 of 29: the threshold itself is not separate)."""
    n, epochs, before, doc_head, shuffle_head, shuffle_tail = case
    ds = GPTDataset(SmallDocs(), np.arange(10, 50), 16, n, seed=3)
    assert ds.epochs == epochs
    assert samples_before_final_epoch(480, 16, n, epochs) == before
    assert ds.document_index[:12].tolist() == doc_head
    assert ds.shuffle_index[:12].tolist() == shuffle_head
    assert ds.shuffle_index[-4:].tolist() == shuffle_tail
    assert len(ds.shuffle_index) == (epochs * 480 - 1) // 16


def test_epochs_needed():
    assert epochs_needed(100, 10, 9) == 1
    assert epochs_needed(100, 10, 10) == 2  # 100 tokens give (100 - 1) // 10 = 9 samples
    with pytest.raises(ValueError, match="no tokens"):
        epochs_needed(0, 10, 1)


def test_gpt_dataset_samples_follow_the_document_stream(tmp_path):
    low = MockIndexedDataset(50, 200, 199, seed=4, max_length=30)
    ds = GPTDataset(low, np.arange(50), 16, 300, seed=5, cache_dir=str(tmp_path))
    stream = np.concatenate([low.get(int(d)) for d in ds.document_index])
    for i in range(len(ds)):
        j = int(ds.shuffle_index[i])
        np.testing.assert_array_equal(ds[i], stream[j * 16 : j * 16 + 17])
    # A second build is a cache hit (memory-mapped) with identical indices.
    again = GPTDataset(low, np.arange(50), 16, 300, seed=5, cache_dir=str(tmp_path))
    assert isinstance(again.sample_index, np.memmap)
    np.testing.assert_array_equal(again.shuffle_index, ds.shuffle_index)
    other = GPTDataset(low, np.arange(50), 16, 300, seed=6, cache_dir=str(tmp_path))
    assert not np.array_equal(other.shuffle_index, ds.shuffle_index)
    assert len(list(tmp_path.glob("*-description.json"))) == 2
    with pytest.raises(IndexError):
        ds[300]


def test_unwritable_cache_falls_back_to_memory(tmp_path, caplog):
    (tmp_path / "file").write_text("not a directory")
    low = MockIndexedDataset(20, 100, 99, seed=1, max_length=20)
    ds = GPTDataset(low, np.arange(20), 8, 30, seed=2, cache_dir=str(tmp_path / "file" / "c"))
    ref = GPTDataset(low, np.arange(20), 8, 30, seed=2, cache_dir=None)
    np.testing.assert_array_equal(ds.shuffle_index, ref.shuffle_index)
    assert "cannot write the index cache" in caplog.text


def test_mock_documents_are_megatrons():
    """Megatron-LM main's mock documents: 100000 of them, int32 lengths drawn by
    ``default_rng(0)`` in [1, 4095] whatever the run's seed, document i = [1 .. L-1] modulo the
    vocab, then EOD."""
    from megafp8.data.loader import MOCK_MAX_LENGTH, MOCK_NUM_SEQUENCES, MOCK_SEED, _mock_low
    from tests.helpers.tiny import tiny_config

    assert (MOCK_NUM_SEQUENCES, MOCK_SEED, MOCK_MAX_LENGTH) == (100_000, 0, 4095)
    low = _mock_low(tiny_config(model=dict(vocab_size=1024), train=dict(seed=7)), None)
    want = np.random.default_rng(0).integers(1, 4096, 100_000, dtype=np.int32)
    np.testing.assert_array_equal(low.sequence_lengths, want)
    i = int(np.argmax(want > 2100))  # a document longer than two vocabs: its ids wrap
    n = int(want[i])
    doc = low.get(i)
    np.testing.assert_array_equal(doc[:-1], np.arange(1, n) % 1024)
    assert doc[-1] == 1023 and len(doc) == n
    np.testing.assert_array_equal(low.get(i, 1020, 8), np.arange(1021, 1029) % 1024)
    assert list(low.get(int(np.argmax(want == 1)))) == [1023]  # length 1: EOD alone
