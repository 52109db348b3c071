"""Megatron's MMIDIDX v1 token datasets: a ``.bin`` of raw tokens and a ``.idx`` describing it.

``.idx`` layout (little-endian, no padding)::

    magic      9 bytes  b"MMIDIDX\\x00\\x00"
    version    uint64   1
    dtype      uint8    1 uint8, 2 int8, 3 int16, 4 int32, 5 int64, 6 float64, 7 float32, 8 uint16
    N          uint64   number of sequences
    M          uint64   length of the document index (documents + 1)
    lengths    int32[N]   tokens per sequence
    pointers   int64[N]   byte offset of each sequence in the .bin
    doc_index  int64[M]   sequence index where each document starts: 0 ... N

A document is a run of sequences (one per document unless sentences were split); an empty
document is two equal consecutive ``doc_index`` entries. The reader maps both files and hands out
zero-copy numpy views; the writer streams tokens and keeps its index on disk (memory stays bounded
however many documents there are), writes under temporary names and renames only complete files.
"""

from __future__ import annotations

import errno
import logging
import os
import shutil
import struct

import numpy as np

log = logging.getLogger(__name__)

MAGIC = b"MMIDIDX\x00\x00"
LEGACY_MAGIC = b"TNTIDX\x00\x00"
VERSION = 1
HEADER_SIZE = len(MAGIC) + 8 + 1 + 8 + 8  # 34 bytes
DTYPES = {
    1: np.uint8,
    2: np.int8,
    3: np.int16,
    4: np.int32,
    5: np.int64,
    6: np.float64,
    7: np.float32,
    8: np.uint16,
}
DTYPE_CODES = {np.dtype(v): k for k, v in DTYPES.items()}
_SPOOL_ITEMS = 1 << 20  # entries buffered in memory before the index spools them to disk


class IndexFormatError(ValueError):
    """A ``.idx``/``.bin`` pair that is truncated, foreign or inconsistent."""


def best_dtype(vocab_size: int) -> np.dtype:
    """Megatron's choice: uint16 tokens when the vocab is below 65500, else int32."""
    return np.dtype(np.uint16 if vocab_size is not None and vocab_size < 65500 else np.int32)


def data_file_path(prefix: str) -> str:
    return prefix + ".bin"


def index_file_path(prefix: str) -> str:
    return prefix + ".idx"


def dataset_exists(prefix: str) -> bool:
    return os.path.isfile(index_file_path(prefix)) and os.path.isfile(data_file_path(prefix))


def read_header(idx_path: str) -> tuple[np.dtype, int, int]:
    """Read and check the fixed header; return (token dtype, N sequences, M doc-index length)."""
    with open(idx_path, "rb") as f:
        head = f.read(HEADER_SIZE)
    if head[: len(LEGACY_MAGIC)] == LEGACY_MAGIC:
        raise IndexFormatError(
            f"{idx_path}: legacy Megatron 'TNTIDX' (lazy/cached IndexedDataset) index; only the "
            "MMIDIDX format is read: re-run preprocess_data.py on the text"
        )
    if head[: len(MAGIC)] != MAGIC:
        raise IndexFormatError(
            f"{idx_path}: not a Megatron MMIDIDX index (magic "
            f"{head[: len(MAGIC)]!r}, expected {MAGIC!r})"
        )
    if len(head) < HEADER_SIZE:
        raise IndexFormatError(f"{idx_path}: truncated header ({len(head)} of {HEADER_SIZE} bytes)")
    version, code, n, m = struct.unpack("<QBQQ", head[len(MAGIC) :])
    if version != VERSION:
        raise IndexFormatError(f"{idx_path}: index version {version}, expected {VERSION}")
    if code not in DTYPES:
        raise IndexFormatError(f"{idx_path}: unknown dtype code {code} (known: {sorted(DTYPES)})")
    return np.dtype(DTYPES[code]), n, m


class IndexedDataset:
    """Memory-mapped reader of ``prefix.bin``/``prefix.idx``; ``ds[i]`` is sequence i (a view).

    ``validate=True`` checks every invariant (sizes, pointer chain, document index) with
    vectorized numpy passes and raises ``IndexFormatError`` naming the file and the fault.
    """

    def __init__(self, prefix: str, validate: bool = True):
        self.prefix = prefix
        idx_path, bin_path = index_file_path(prefix), data_file_path(prefix)
        for p in (idx_path, bin_path):
            if not os.path.isfile(p):
                raise FileNotFoundError(f"{p}: missing (dataset prefix {prefix!r})")
        self.dtype, n, m = read_header(idx_path)
        expected = HEADER_SIZE + 4 * n + 8 * n + 8 * m
        size = os.path.getsize(idx_path)
        if size != expected:
            raise IndexFormatError(
                f"{idx_path}: {size} bytes, but its header (N={n} sequences, "
                f"M={m} document entries) needs {expected}: "
                f"{'truncated' if size < expected else 'trailing bytes'}"
            )
        self._idx = np.memmap(idx_path, dtype=np.uint8, mode="r")
        off = HEADER_SIZE
        self.sequence_lengths = np.frombuffer(self._idx, np.int32, n, off)
        self.sequence_pointers = np.frombuffer(self._idx, np.int64, n, off + 4 * n)
        self.document_indices = np.frombuffer(self._idx, np.int64, m, off + 12 * n)
        bin_size = os.path.getsize(bin_path)
        self._bin = (
            np.memmap(bin_path, dtype=np.uint8, mode="r") if bin_size else np.empty(0, np.uint8)
        )
        if validate:
            self.validate()

    def validate(self) -> None:
        """Raise IndexFormatError unless lengths, pointers, doc index and .bin size agree."""
        idx, lengths, ptrs, docs = (
            index_file_path(self.prefix),
            self.sequence_lengths,
            self.sequence_pointers,
            self.document_indices,
        )
        n, item = len(lengths), self.dtype.itemsize
        if n and lengths.min() < 0:
            i = int(np.argmin(lengths))
            raise IndexFormatError(f"{idx}: sequence {i} has negative length {lengths[i]}")
        expect = np.zeros(n, np.int64)
        if n:
            np.cumsum(lengths[:-1].astype(np.int64) * item, out=expect[1:])
        bad = np.flatnonzero(ptrs != expect)
        if bad.size:
            i = int(bad[0])
            raise IndexFormatError(
                f"{idx}: pointer of sequence {i} is {ptrs[i]}, expected "
                f"{expect[i]} (sum of the previous lengths x {item} bytes)"
            )
        need = int(expect[-1]) + int(lengths[-1]) * item if n else 0
        bin_size = len(self._bin)
        if bin_size != need:
            raise IndexFormatError(
                f"{data_file_path(self.prefix)}: {bin_size} bytes, the index "
                f"describes {need} ({n} sequences of {self.dtype.name})"
            )
        if len(docs) == 0 or docs[0] != 0 or docs[-1] != n:
            raise IndexFormatError(
                f"{idx}: document index must run from 0 to N={n}, got "
                f"{docs[:1].tolist()}...{docs[-1:].tolist()}"
            )
        step = np.flatnonzero(np.diff(docs) < 0)
        if step.size:
            raise IndexFormatError(f"{idx}: document index decreases at entry {int(step[0]) + 1}")

    def __len__(self) -> int:
        return len(self.sequence_lengths)

    @property
    def num_documents(self) -> int:
        return len(self.document_indices) - 1

    @property
    def num_tokens(self) -> int:
        return int(self.sequence_lengths.sum(dtype=np.int64))

    def all_tokens(self) -> np.ndarray:
        """Every token of the ``.bin`` as one read-only view."""
        return np.frombuffer(self._bin, self.dtype) if len(self._bin) else np.empty(0, self.dtype)

    def get(self, i: int, offset: int = 0, length: int | None = None) -> np.ndarray:
        """Tokens ``[offset, offset + length)`` of sequence ``i`` as a read-only view."""
        size = int(self.sequence_lengths[i])
        length = size - offset if length is None else length
        if offset < 0 or length < 0 or offset + length > size:
            raise IndexError(f"sequence {i} has {size} tokens; asked [{offset}, {offset + length})")
        start = int(self.sequence_pointers[i]) + offset * self.dtype.itemsize
        return (
            np.frombuffer(self._bin, self.dtype, length, start)
            if length
            else np.empty(0, self.dtype)
        )

    def __getitem__(self, i: int) -> np.ndarray:
        return self.get(int(i))


class _Spool:
    """An append-only array kept in a temporary file, buffered in memory in bounded chunks."""

    def __init__(self, path: str, dtype):
        self.path, self.dtype = path, np.dtype(dtype)
        self._f = open(path, "wb")
        self._buf: list[np.ndarray] = []
        self._buffered = 0
        self.count = 0

    def extend(self, values) -> None:
        a = np.asarray(values, self.dtype)
        self._buf.append(a)
        self._buffered += a.size
        self.count += a.size
        if self._buffered >= _SPOOL_ITEMS:
            self.flush()

    def flush(self) -> None:
        for a in self._buf:
            self._f.write(a.tobytes())
        self._buf, self._buffered = [], 0

    def chunks(self):
        """Yield the whole array in bounded chunks (closes the writer)."""
        self.flush()
        self._f.close()
        step = _SPOOL_ITEMS * self.dtype.itemsize
        with open(self.path, "rb") as f:
            while block := f.read(step):
                yield np.frombuffer(block, self.dtype)

    def discard(self) -> None:
        if not self._f.closed:
            self._f.close()
        if os.path.exists(self.path):
            os.remove(self.path)


def _append_file(src_path: str, dst) -> None:
    """Append ``src_path`` to the open file ``dst`` in 16 MiB blocks, keeping holes of a sparse
    source as holes (``SEEK_DATA``/``SEEK_HOLE`` where the OS has them)."""
    dst.flush()
    base = dst.tell()
    size = os.path.getsize(src_path)
    with open(src_path, "rb") as src:
        fd, pos = src.fileno(), 0
        while pos < size:
            try:
                pos = os.lseek(fd, pos, os.SEEK_DATA)
                end = os.lseek(fd, pos, os.SEEK_HOLE)
            except OSError as exc:
                if exc.errno == errno.ENXIO:
                    break  # only a hole remains: the truncate below extends the file
                end = size  # the file system cannot tell holes: copy the rest
            except AttributeError:
                end = size
            src.seek(pos)
            dst.seek(base + pos)
            for lo in range(pos, end, 16 << 20):
                dst.write(src.read(min(16 << 20, end - lo)))
            pos = end
    dst.truncate(base + size)
    dst.seek(base + size)


class IndexedDatasetWriter:
    """Streaming writer of ``prefix.bin``/``prefix.idx`` (Megatron's builder, with atomic output).

    ``add_document(tokens, lengths)`` appends one document made of sequences of the given lengths
    (default: one sequence); ``finalize()`` writes the index and renames both temporaries into
    place, the ``.idx`` last; ``abort()`` (or leaving a ``with`` block by an exception) removes
    them. A crash never leaves a ``.bin``/``.idx`` pair that reads as complete but is not.
    """

    def __init__(self, prefix: str, dtype):
        self.prefix, self.dtype = prefix, np.dtype(dtype)
        if self.dtype not in DTYPE_CODES:
            raise ValueError(f"token dtype {self.dtype} has no MMIDIDX code")
        tag = f".tmp-{os.getpid()}"
        self._bin_tmp = data_file_path(prefix) + tag
        self._idx_tmp = index_file_path(prefix) + tag
        self._bin = open(self._bin_tmp, "wb")
        self._lengths = _Spool(self._idx_tmp + ".lengths", np.int32)
        self._docs = _Spool(self._idx_tmp + ".docs", np.int64)
        self._docs.extend([0])
        self.num_tokens = 0

    def add_document(self, tokens, lengths=None) -> None:
        tokens = np.asarray(tokens)
        if lengths is None:
            lengths = [tokens.size] if tokens.size else []
        self.add_documents(tokens, np.asarray(lengths, np.int64), np.array([len(lengths)]))

    def add_documents(self, tokens: np.ndarray, lengths: np.ndarray, seqs_per_doc: np.ndarray):
        """Append many documents at once: concatenated tokens, sequence lengths, sequences/doc."""
        tokens = np.asarray(tokens)
        if tokens.size and (tokens.dtype.kind == "f") != (self.dtype.kind == "f"):
            raise ValueError(f"tokens of dtype {tokens.dtype} for a {self.dtype} dataset")
        if int(np.sum(lengths, dtype=np.int64)) != tokens.size:
            raise ValueError(f"lengths sum to {int(np.sum(lengths))}, tokens hold {tokens.size}")
        if lengths.size and lengths.max() > np.iinfo(np.int32).max:
            raise ValueError("a sequence longer than 2^31-1 tokens cannot be indexed (int32)")
        self._bin.write(np.ascontiguousarray(tokens, self.dtype).tobytes())
        self.num_tokens += tokens.size
        start = self._lengths.count
        self._lengths.extend(lengths)
        self._docs.extend(start + np.cumsum(seqs_per_doc, dtype=np.int64))

    def add_index(self, prefix: str) -> None:
        """Append a whole existing dataset (same dtype), copying its .bin in bounded blocks."""
        other = IndexedDataset(prefix)
        if other.dtype != self.dtype:
            raise ValueError(f"{prefix}: dtype {other.dtype}, this dataset is {self.dtype}")
        start = self._lengths.count
        for lo in range(0, len(other), _SPOOL_ITEMS):
            self._lengths.extend(other.sequence_lengths[lo : lo + _SPOOL_ITEMS])
        docs = other.document_indices
        for lo in range(1, len(docs), _SPOOL_ITEMS):
            self._docs.extend(docs[lo : lo + _SPOOL_ITEMS] + start)
        _append_file(data_file_path(prefix), self._bin)
        self.num_tokens += other.num_tokens

    def finalize(self) -> None:
        """Write the index, fsync, and rename ``.bin`` then ``.idx`` into place."""
        self._bin.flush()
        os.fsync(self._bin.fileno())
        self._bin.close()
        n, m = self._lengths.count, self._docs.count
        with open(self._idx_tmp, "wb") as f:
            f.write(MAGIC + struct.pack("<QBQQ", VERSION, DTYPE_CODES[self.dtype], n, m))
            pointer_path = self._idx_tmp + ".ptrs"
            with open(pointer_path, "wb") as pf:
                carry = 0
                for chunk in self._lengths.chunks():
                    f.write(chunk.tobytes())
                    nbytes = chunk.astype(np.int64) * self.dtype.itemsize
                    ptr = np.empty_like(nbytes)
                    ptr[0] = carry
                    np.cumsum(nbytes[:-1], out=ptr[1:])
                    ptr[1:] += carry
                    carry += int(nbytes.sum())
                    pf.write(ptr.tobytes())
            with open(pointer_path, "rb") as pf:
                shutil.copyfileobj(pf, f, 16 << 20)
            os.remove(pointer_path)
            for chunk in self._docs.chunks():
                f.write(chunk.tobytes())
            f.flush()
            os.fsync(f.fileno())
        self._lengths.discard()
        self._docs.discard()
        final_idx = index_file_path(self.prefix)
        if os.path.exists(final_idx):
            os.remove(final_idx)  # never pair the new .bin with an old .idx
        os.replace(self._bin_tmp, data_file_path(self.prefix))
        os.replace(self._idx_tmp, final_idx)
        log.info(
            "wrote %s.{bin,idx}: %d sequences, %d documents, %d tokens",
            self.prefix,
            n,
            m - 1,
            self.num_tokens,
        )

    def abort(self) -> None:
        """Remove every temporary file; the final names are left untouched."""
        if not self._bin.closed:
            self._bin.close()
        self._lengths.discard()
        self._docs.discard()
        for p in (self._bin_tmp, self._idx_tmp, self._idx_tmp + ".ptrs"):
            if os.path.exists(p):
                os.remove(p)

    def __enter__(self):
        return self

    def __exit__(self, exc_type, exc, tb):
        if exc_type is None:
            self.finalize()
        else:
            self.abort()
        return False
