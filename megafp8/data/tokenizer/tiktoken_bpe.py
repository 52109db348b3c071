"""Megatron-LM's ``TikTokenizer``: a byte-level BPE vocab in tiktoken's JSON form, encoded by the
optional ``tiktoken`` package (``pip install 'megafp8[tiktoken]'``).

``--tokenizer-model vocab.json`` is a JSON list whose entry ``i`` is ``{"rank": i, "token_bytes":
base64, "token_str": ...}``; entries 0-255 are the 256 single bytes in order. The ids are laid out
as Megatron-LM lays them out:

- ids ``0 .. N-1`` are special tokens, ``N`` = ``--tiktoken-num-special-tokens`` (1000): first
  ``--tokenizer-special-tokens`` (default ``<unk> <s> </s> <mask> <pad> <cls> <sep>``; a list of
  its own must hold those seven, each once), then ``<SPECIAL_k>`` fillers up to ``N``;
- id ``N + r`` is the vocab entry of rank ``r``;
- ``--vocab-size V`` (default 131072 = 2^17) is the whole id range: the first ``V - N`` entries
  of the file are used, and the file must hold that many.

EOD is ``</s>`` (id 2 with the default list), pad ``<pad>``. The text is split by one of
Megatron's two patterns (``--tiktoken-pattern v1`` or ``v2``, the default) and merged by rank.
One difference from Megatron-LM, on purpose, as for the other types: special tokens written in
the text are encoded as text (tiktoken's ``encode_ordinary``), never as their ids (Megatron
passes ``allowed_special="all"``), so a document cannot hold an EOD it did not end with. Text
without them gets Megatron's ids (``tests/unit/test_tokenizer_tiktoken.py`` holds ids written by
Megatron-LM's own TikTokenizer).
"""

from __future__ import annotations

import base64
import binascii
import json

from megafp8.data.tokenizer.base import TokenizerBase, require_file

PATTERNS = {
    "v1": r"[^\r\n\p{L}\p{N}]?+\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]++[\r\n]*|\s*[\r\n]|\s+(?!\S)|\s+",
    "v2": (
        r"[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+"
        r"|[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*"
        r"|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n/]*|\s*[\r\n]+|\s+(?!\S)|\s+"
    ),
}
DEFAULT_VOCAB_SIZE = 2**17
DEFAULT_NUM_SPECIAL = 1000
REQUIRED_SPECIALS = ("<unk>", "<s>", "</s>", "<mask>", "<pad>", "<cls>", "<sep>")


def _tiktoken():
    try:
        import tiktoken
    except ImportError as exc:
        raise ValueError(
            "TikTokenizer needs the 'tiktoken' package (pip install 'megafp8[tiktoken]' or "
            "pip install tiktoken)"
        ) from exc
    return tiktoken


def special_tokens(given, num_special: int) -> list[str]:
    """The ``num_special`` special tokens: ``given`` (or the seven), then ``<SPECIAL_k>``."""
    given = list(given) if given else list(REQUIRED_SPECIALS)
    if len(set(given)) != len(given):
        dup = next(t for t in given if given.count(t) > 1)
        raise ValueError(f"--tokenizer-special-tokens names {dup!r} more than once")
    missing = [t for t in REQUIRED_SPECIALS if t not in given]
    if missing:
        raise ValueError(
            f"--tokenizer-special-tokens must include {list(REQUIRED_SPECIALS)}; missing {missing}"
        )
    if len(given) > num_special:
        raise ValueError(
            f"{len(given)} special tokens do not fit --tiktoken-num-special-tokens {num_special}"
        )
    fillers = [f"<SPECIAL_{k}>" for k in range(len(given), num_special)]
    clash = set(fillers) & set(given)
    if clash:
        raise ValueError(f"--tokenizer-special-tokens holds filler name(s) {sorted(clash)}")
    return given + fillers


def read_ranks(path: str, count: int) -> dict[bytes, int]:
    """The first ``count`` entries of a tiktoken JSON vocab as ``{token bytes: rank}``, checked
    entry by entry (one-line errors naming the entry)."""
    try:
        with open(path, encoding="utf-8") as f:
            vocab = json.load(f)
    except (OSError, ValueError) as exc:
        raise ValueError(f"{path}: not a tiktoken JSON vocab ({exc})") from exc
    if not isinstance(vocab, list):
        raise ValueError(f"{path}: expected a JSON list of {{rank, token_bytes, token_str}}")
    if len(vocab) < count:
        raise ValueError(
            f"{path}: holds {len(vocab)} tokens, but the vocab size and special tokens ask for "
            f"{count} (--vocab-size minus --tiktoken-num-special-tokens)"
        )
    ranks: dict[bytes, int] = {}
    for i, entry in enumerate(vocab[:count]):
        if not isinstance(entry, dict) or entry.keys() != {"rank", "token_bytes", "token_str"}:
            raise ValueError(f"{path}: entry {i} is not {{rank, token_bytes, token_str}}")
        if entry["rank"] != i:
            raise ValueError(f"{path}: entry {i} has rank {entry['rank']!r}, expected {i}")
        try:
            token = base64.b64decode(entry["token_bytes"], validate=True)
        except (binascii.Error, TypeError, ValueError) as exc:
            raise ValueError(f"{path}: entry {i}: token_bytes is not base64 ({exc})") from exc
        if i < 256 and token != bytes([i]):
            raise ValueError(f"{path}: entry {i} must be the single byte {i}, got {token!r}")
        if not token or token in ranks:
            raise ValueError(f"{path}: entry {i}: token {token!r} is empty or repeats")
        ranks[token] = i
    return ranks


class TikTokenizer(TokenizerBase):
    """A tiktoken JSON vocab with Megatron-LM's id layout (module doc)."""

    type_name = "TikTokenizer"

    def __init__(
        self,
        path: str,
        vocab_size: int | None = None,
        *,
        num_special_tokens: int | None = None,
        special: list[str] | tuple[str, ...] | None = None,
        pattern: str | None = None,
    ):
        tiktoken = _tiktoken()
        require_file(path, "--tokenizer-model", self.type_name)
        vocab_size = DEFAULT_VOCAB_SIZE if vocab_size is None else int(vocab_size)
        n = DEFAULT_NUM_SPECIAL if num_special_tokens is None else int(num_special_tokens)
        pattern = pattern or "v2"
        if pattern not in PATTERNS:
            raise ValueError(f"--tiktoken-pattern must be v1 or v2, got {pattern!r}")
        if not 0 < n < vocab_size - 256:
            raise ValueError(
                f"--tiktoken-num-special-tokens {n} must be in (0, --vocab-size {vocab_size} "
                "- 256): the 256 byte tokens follow the special ones"
            )
        self.special_tokens = special_tokens(special, n)
        self._given = len(special) if special else len(REQUIRED_SPECIALS)
        inner = read_ranks(path, vocab_size - n)
        self.files = (path,)
        self.vocab_size, self.num_special_tokens, self.pattern = vocab_size, n, pattern
        self.eod = self.special_tokens.index("</s>")
        self.pad = self.special_tokens.index("<pad>")
        self.enc = tiktoken.Encoding(
            name=f"megafp8-tiktoken-{pattern}",
            pat_str=PATTERNS[pattern],
            mergeable_ranks={t: r + n for t, r in inner.items()},
            special_tokens={t: i for i, t in enumerate(self.special_tokens)},
        )

    def fingerprint(self) -> dict:
        """The base fingerprint plus what else decides the ids: the pattern and the specials."""
        fp = super().fingerprint()
        fp.setdefault("options", {
            "tiktoken_pattern": self.pattern,
            "num_special_tokens": self.num_special_tokens,
            "special_tokens": self.special_tokens[: self._given],
        })  # fmt: skip
        return fp

    def tokenize(self, text: str) -> list[int]:
        return self.enc.encode_ordinary(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return self.enc.encode_ordinary_batch(texts, num_threads=1)

    def detokenize(self, ids) -> str:
        return self.enc.decode([int(i) for i in ids], errors="replace")
