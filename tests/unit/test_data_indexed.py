"""MMIDIDX format: golden bytes, round trip, validation of every invariant, atomic writes, int64."""

import os
import subprocess
import sys

import numpy as np
import pytest

from megafp8.data import indexed
from megafp8.data.indexed import IndexedDataset, IndexedDatasetWriter, IndexFormatError

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# Written by hand from the format: uint16 tokens, 3 sequences [1 2 3] [4] [5 6] in 2 documents
# (sequences 0-1, then 2).
GOLDEN_IDX = (
    b"MMIDIDX\x00\x00"  # magic
    b"\x01\x00\x00\x00\x00\x00\x00\x00"  # version 1
    b"\x08"  # dtype code 8 = uint16
    b"\x03\x00\x00\x00\x00\x00\x00\x00"  # N = 3 sequences
    b"\x03\x00\x00\x00\x00\x00\x00\x00"  # M = 3 document-index entries
    b"\x03\x00\x00\x00"
    b"\x01\x00\x00\x00"
    b"\x02\x00\x00\x00"  # lengths int32
    b"\x00\x00\x00\x00\x00\x00\x00\x00"  # pointers int64: 0
    b"\x06\x00\x00\x00\x00\x00\x00\x00"  # 6 = 3 tokens x 2 bytes
    b"\x08\x00\x00\x00\x00\x00\x00\x00"  # 8
    b"\x00\x00\x00\x00\x00\x00\x00\x00"  # document index int64: 0
    b"\x02\x00\x00\x00\x00\x00\x00\x00"  # 2
    b"\x03\x00\x00\x00\x00\x00\x00\x00"  # 3
)
GOLDEN_BIN = b"\x01\x00\x02\x00\x03\x00\x04\x00\x05\x00\x06\x00"


def write_golden(prefix):
    with IndexedDatasetWriter(str(prefix), np.uint16) as w:
        w.add_document([1, 2, 3, 4], lengths=[3, 1])
        w.add_document(np.array([5, 6]))


def test_writer_matches_golden_bytes(tmp_path):
    write_golden(tmp_path / "g")
    assert (tmp_path / "g.idx").read_bytes() == GOLDEN_IDX
    assert (tmp_path / "g.bin").read_bytes() == GOLDEN_BIN
    assert sorted(os.listdir(tmp_path)) == ["g.bin", "g.idx"]  # no temporaries left


def test_reader_reads_golden_bytes(tmp_path):
    (tmp_path / "h.idx").write_bytes(GOLDEN_IDX)
    (tmp_path / "h.bin").write_bytes(GOLDEN_BIN)
    ds = IndexedDataset(str(tmp_path / "h"))
    assert ds.dtype == np.uint16 and len(ds) == 3 and ds.num_documents == 2
    assert [ds[i].tolist() for i in range(3)] == [[1, 2, 3], [4], [5, 6]]
    assert ds.document_indices.tolist() == [0, 2, 3] and ds.num_tokens == 6
    assert ds.get(0, 1, 2).tolist() == [2, 3]
    assert not ds[0].flags.writeable  # zero-copy view of the mapped file
    with pytest.raises(IndexError):
        ds.get(0, 2, 2)


@pytest.mark.parametrize("dtype", [np.uint16, np.int32, np.int64, np.uint8, np.float32])
def test_round_trip_with_spooled_index(tmp_path, monkeypatch, dtype):
    monkeypatch.setattr(indexed, "_SPOOL_ITEMS", 7)  # many spool chunks and pointer carries
    rng = np.random.default_rng(0)
    docs = []
    with IndexedDatasetWriter(str(tmp_path / "r"), dtype) as w:
        for _ in range(60):
            lens = rng.integers(0, 9, rng.integers(0, 4))  # empty docs and empty sequences
            toks = rng.integers(0, 120, int(lens.sum())).astype(dtype)
            w.add_document(toks, lens)
            docs.append(np.split(toks, np.cumsum(lens)[:-1]) if len(lens) else [])
    ds = IndexedDataset(str(tmp_path / "r"))
    seqs = [s for d in docs for s in d]
    assert len(ds) == len(seqs) and ds.num_documents == 60 and ds.dtype == dtype
    for i, s in enumerate(seqs):
        np.testing.assert_array_equal(ds[i], s)
    np.testing.assert_array_equal(np.diff(ds.document_indices), [len(d) for d in docs])


def test_best_dtype():
    assert indexed.best_dtype(65499) == np.uint16
    assert indexed.best_dtype(65500) == np.int32


def _corrupt(tmp_path, name, idx=None, bin_=None):
    write_golden(tmp_path / name)
    if idx is not None:
        (tmp_path / f"{name}.idx").write_bytes(idx)
    if bin_ is not None:
        (tmp_path / f"{name}.bin").write_bytes(bin_)
    return str(tmp_path / name)


@pytest.mark.parametrize(
    "name,idx,bin_,match",
    [
        ("legacy", b"TNTIDX\x00\x00" + GOLDEN_IDX[8:], None, "legacy Megatron 'TNTIDX'"),
        ("foreign", b"PK\x03\x04" + GOLDEN_IDX[4:], None, "not a Megatron MMIDIDX"),
        ("short_header", GOLDEN_IDX[:20], None, "truncated header"),
        ("truncated", GOLDEN_IDX[:-5], None, "truncated"),
        ("trailing", GOLDEN_IDX + b"\x00", None, "trailing bytes"),
        ("version", GOLDEN_IDX[:9] + b"\x02" + GOLDEN_IDX[10:], None, "version 2"),
        ("dtype", GOLDEN_IDX[:17] + b"\x09" + GOLDEN_IDX[18:], None, "unknown dtype code 9"),
        ("pointer", GOLDEN_IDX[:54] + b"\x07" + GOLDEN_IDX[55:], None, "pointer of sequence 1"),
        ("negative", GOLDEN_IDX[:34] + b"\xff\xff\xff\xff" + GOLDEN_IDX[38:], None, "negative"),
        ("docs_end", GOLDEN_IDX[:-8] + b"\x02" + b"\x00" * 7, None, "run from 0 to N=3"),
        (
            "docs_order",
            GOLDEN_IDX[:-16] + b"\x05" + b"\x00" * 7 + GOLDEN_IDX[-8:],
            None,
            "decreases",
        ),
        ("bin_short", None, GOLDEN_BIN[:-2], "describes 12"),
    ],
)
def test_validation_errors(tmp_path, name, idx, bin_, match):
    prefix = _corrupt(tmp_path, name, idx, bin_)
    with pytest.raises(IndexFormatError, match=match) as e:
        IndexedDataset(prefix)
    assert name in str(e.value)  # the message names the file


def test_missing_bin(tmp_path):
    write_golden(tmp_path / "m")
    os.remove(tmp_path / "m.bin")
    with pytest.raises(FileNotFoundError, match=r"m\.bin"):
        IndexedDataset(str(tmp_path / "m"))


def test_failed_write_leaves_nothing_and_keeps_old_dataset(tmp_path):
    write_golden(tmp_path / "a")
    with pytest.raises(RuntimeError):
        with IndexedDatasetWriter(str(tmp_path / "a"), np.uint16) as w:
            w.add_document([9, 9, 9])
            raise RuntimeError("crash mid-write")
    assert sorted(os.listdir(tmp_path)) == ["a.bin", "a.idx"]
    assert IndexedDataset(str(tmp_path / "a"))[0].tolist() == [1, 2, 3]


def _sparse_dataset(prefix, lengths, dtype=np.uint16):
    """A valid dataset whose .bin is one big hole (no disk used): tests int64 arithmetic."""
    w = IndexedDatasetWriter(str(prefix), dtype)
    nbytes = int(np.sum(lengths, dtype=np.int64)) * np.dtype(dtype).itemsize
    w._bin.truncate(nbytes)
    w._bin.seek(nbytes)
    w._lengths.extend(lengths)
    w._docs.extend(np.arange(1, len(lengths) + 1))
    w.finalize()


def test_int64_pointers_and_merge_past_4g_tokens(tmp_path, monkeypatch):
    monkeypatch.setattr(indexed, "_SPOOL_ITEMS", 2)
    big = [2**31 - 1] * 3  # 3 x 2^31 tokens: pointers pass 2^32 and 2^33 bytes
    _sparse_dataset(tmp_path / "a", big)
    _sparse_dataset(tmp_path / "b", [5] + big)
    a = IndexedDataset(str(tmp_path / "a"))
    assert a.sequence_pointers.tolist() == [0, 2 * (2**31 - 1), 4 * (2**31 - 1)]
    rc = subprocess.run(
        [
            sys.executable,
            os.path.join(ROOT, "data_tools", "merge_datasets.py"),
            "--input",
            str(tmp_path / "a"),
            str(tmp_path / "b"),
            "--output-prefix",
            str(tmp_path / "ab"),
        ],
        capture_output=True,
        text=True,
    )
    assert rc.returncode == 0, rc.stderr
    ab = IndexedDataset(str(tmp_path / "ab"))
    assert ab.num_tokens == 6 * (2**31 - 1) + 5 > 2**32
    assert ab.document_indices.tolist() == list(range(8))
    assert int(ab.sequence_pointers[-1]) == 2 * (5 * (2**31 - 1) + 5)
    assert os.stat(tmp_path / "ab.bin").st_blocks * 512 < 1 << 24  # the holes stayed holes
