"""Streaming JSONL input: file discovery, decompression with checks, blocks of whole lines, and
per-line validation that names ``file:line`` and what was expected.

Inputs are ``.jsonl``, ``.jsonl.gz`` and ``.jsonl.zst`` files (``.json`` is read as JSONL too),
given as files, globs or directories. A file whose bytes are compressed but whose name says
otherwise (or the reverse) is an error: the suffix is never second-guessed.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
from typing import NamedTuple

SUFFIXES = (".jsonl", ".jsonl.gz", ".jsonl.zst", ".json", ".json.gz", ".json.zst")
_MAGICS = {"gzip": b"\x1f\x8b", "zstd": b"\x28\xb5\x2f\xfd", "bzip2": b"BZh", "xz": b"\xfd7zXZ"}
_SUFFIX_OF = {"gzip": ".gz", "zstd": ".zst"}
_RAW_READ = 1 << 20


class InputError(ValueError):
    """Bad input, with the location (``file:line``) in the message."""


class BadLine(NamedTuple):
    path: str
    line: int
    reason: str

    def __str__(self) -> str:
        return f"{self.path}:{self.line}: {self.reason}"


def expand_inputs(specs, suffixes=SUFFIXES) -> list[str]:
    """Files named by ``specs`` (paths, globs, directories searched recursively), sorted, unique."""
    if isinstance(specs, str):
        specs = [specs]
    found: list[str] = []
    for spec in specs:
        if os.path.isdir(spec):
            hits = [
                os.path.join(root, f)
                for root, _, names in os.walk(spec)
                for f in names
                if f.endswith(suffixes)
            ]
            if not hits:
                raise InputError(f"{spec}: directory holds no {'/'.join(suffixes)} file")
        elif os.path.isfile(spec):
            hits = [spec]
        else:
            hits = [p for p in glob.glob(spec, recursive=True) if os.path.isfile(p)]
            if not hits:
                raise InputError(f"{spec}: no such file, directory or glob match")
        found.extend(sorted(hits))
    seen: set[str] = set()
    return [p for p in found if not (p in seen or seen.add(p))]


def compression_of(path: str) -> str | None:
    """'gzip', 'zstd' or None, from the file name; raise InputError if the bytes disagree."""
    named = "gzip" if path.endswith(".gz") else "zstd" if path.endswith(".zst") else None
    with open(path, "rb") as f:
        head = f.read(6)
    actual = next((k for k, m in _MAGICS.items() if head.startswith(m)), None)
    if actual == named:
        return named
    if named is None:
        hint = f"; rename it to end in {_SUFFIX_OF[actual]}" if actual in _SUFFIX_OF else ""
        raise InputError(
            f"{path}:1: holds {actual}-compressed data but its name has no compression suffix{hint}"
        )
    what = f"{actual}-compressed data" if actual else "uncompressed bytes"
    raise InputError(f"{path}:1: named as {named} ({_SUFFIX_OF[named]}) but holds {what}")


class _ZstdReader:
    """Read a (multi-frame) zstd file; a stream that stops mid-frame raises InputError."""

    def __init__(self, path: str):
        import zstandard

        self.path, self._z = path, zstandard
        self._f = open(path, "rb")
        self._d = zstandard.ZstdDecompressor().decompressobj()
        self._pending = b""

    def read(self, n: int) -> bytes:
        out = [self._pending]
        have = len(self._pending)
        while have < n:
            raw = self._f.read(_RAW_READ)
            if not raw:
                if not self._d.eof:
                    raise InputError(f"{self.path}: zstd stream ends mid-frame (truncated file?)")
                break
            try:
                chunk = self._d.decompress(raw)
                while self._d.eof and self._d.unused_data:
                    rest = self._d.unused_data
                    self._d = self._z.ZstdDecompressor().decompressobj()
                    chunk += self._d.decompress(rest)
            except self._z.ZstdError as exc:
                raise InputError(f"{self.path}: corrupt zstd data ({exc})") from exc
            out.append(chunk)
            have += len(chunk)
        data = b"".join(out)
        self._pending = data[n:]
        return data[:n]

    def tell_raw(self) -> int:
        return self._f.tell()

    def close(self) -> None:
        self._f.close()


class _Reader:
    """Uniform ``read(n)`` / ``tell_raw()`` (compressed bytes consumed) over the three formats."""

    def __init__(self, path: str):
        self.path = path
        kind = compression_of(path)
        if kind == "zstd":
            self._r = _ZstdReader(path)
            self._raw = None
        else:
            self._raw = open(path, "rb")
            self._r = gzip.GzipFile(fileobj=self._raw) if kind == "gzip" else self._raw

    def read(self, n: int) -> bytes:
        try:
            return self._r.read(n)
        except (EOFError, gzip.BadGzipFile, OSError) as exc:
            raise InputError(f"{self.path}: bad gzip stream ({exc})") from exc

    def tell_raw(self) -> int:
        return self._raw.tell() if self._raw is not None else self._r.tell_raw()

    def close(self) -> None:
        self._r.close()
        if self._raw is not None:
            self._raw.close()


def iter_blocks(path: str, block_bytes: int = 1 << 20):
    """Yield ``(first_line_number, block, raw_bytes_so_far)``: blocks of whole lines (a final
    line without a newline is completed), decompressed, never holding more than one block plus
    the longest line in memory."""
    reader = _Reader(path)
    line, rest = 1, b""
    try:
        while True:
            data = reader.read(block_bytes)
            if not data:
                if rest:
                    yield line, rest + b"\n", reader.tell_raw()
                return
            data = rest + data
            cut = data.rfind(b"\n") + 1
            if cut == 0:
                rest = data
                continue
            block, rest = data[:cut], data[cut:]
            yield line, block, reader.tell_raw()
            line += block.count(b"\n")
    finally:
        reader.close()


def _json_type(value) -> str:
    return {
        dict: "object",
        list: "array",
        str: "string",
        bool: "boolean",
        int: "number",
        float: "number",
        type(None): "null",
    }.get(type(value), type(value).__name__)


def parse_line(raw: bytes, keys) -> tuple[list[list[str]] | None, str | None]:
    """``(texts per key, None)`` or ``(None, reason)``; a key's value is a string or a list of
    strings (sentences, as Megatron accepts), returned as a list of strings."""
    try:
        text = raw.decode("utf-8")
    except UnicodeDecodeError as exc:
        return None, f"invalid UTF-8 at byte {exc.start} of the line (expected UTF-8 JSON)"
    if not text.strip():
        return None, "empty line (expected a JSON object)"
    try:
        obj = json.loads(text)
    except json.JSONDecodeError as exc:
        return None, f"malformed JSON: {exc.msg} at column {exc.colno}"
    if not isinstance(obj, dict):
        return None, f"expected a JSON object, got a JSON {_json_type(obj)}"
    out = []
    for key in keys:
        if key not in obj:
            present = ", ".join(repr(k) for k in list(obj)[:6]) or "none"
            return None, f"missing key {key!r} (keys present: {present})"
        value = obj[key]
        if isinstance(value, str):
            value = [value]
        elif not (isinstance(value, list) and all(isinstance(v, str) for v in value)):
            return None, (
                f"key {key!r} must be a string (or a list of strings), got a JSON "
                f"{_json_type(value)}"
            )
        if b"\\u" in raw or b"\\U" in raw:  # escapes can smuggle lone surrogates into the text
            for v in value:
                try:
                    v.encode("utf-8")
                except UnicodeEncodeError:
                    return None, f"key {key!r} holds a lone UTF-16 surrogate escape (not text)"
        out.append(value)
    return out, None


def parse_block(path: str, first_line: int, block: bytes, keys):
    """Parse every line of a block: ``(docs, bad)`` with docs a list of per-key text lists and
    bad a list of ``BadLine`` (their lines are left out of docs)."""
    docs, bad = [], []
    lines = block.split(b"\n")
    if lines and lines[-1] == b"":
        lines.pop()
    for i, raw in enumerate(lines):
        parsed, reason = parse_line(raw, keys)
        if reason is None:
            docs.append(parsed)
        else:
            bad.append(BadLine(path, first_line + i, reason))
    return docs, bad


def iter_texts(paths, keys, skip_bad: bool = False, bad_out: list | None = None):
    """Yield each document's text for each key (list values joined by newlines), streaming.

    A bad line raises InputError unless ``skip_bad``; skipped lines are appended to ``bad_out``.
    """
    for path in paths:
        for first, block, _ in iter_blocks(path):
            docs, bad = parse_block(path, first, block, keys)
            if bad and not skip_bad:
                raise InputError(str(bad[0]))
            if bad_out is not None:
                bad_out.extend(bad)
            for doc in docs:
                for value in doc:
                    yield "\n".join(value)
