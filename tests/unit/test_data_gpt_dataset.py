"""Sample/document/shuffle indices against naive pure-Python references; sample contents."""

import numpy as np
import pytest

from megafp8.data.gpt_dataset import (
    GPTDataset,
    MockIndexedDataset,
    build_document_index,
    build_sample_index,
    build_shuffle_index,
    epochs_needed,
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


def test_document_index_shuffles_each_epoch_whole():
    rng = np.random.default_rng(0)
    docs = np.arange(10, 60)
    di = build_document_index(docs, 4, rng)
    assert di.dtype == np.int32 and len(di) == 200
    epochs = di.reshape(4, 50)
    for e in epochs:
        assert sorted(e.tolist()) == docs.tolist()
    assert not np.array_equal(epochs[0], epochs[1])


def test_shuffle_index_keeps_epochs_in_order():
    rng = np.random.default_rng(1)
    sh = build_shuffle_index(1000, 8, 2000, rng)  # 250 samples per epoch
    epoch_of = sh.astype(np.int64) * 8 // 2000
    assert np.all(np.diff(epoch_of) >= 0)
    assert sorted(sh.tolist()) == list(range(1000))


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
