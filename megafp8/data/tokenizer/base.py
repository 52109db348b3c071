"""The interface every tokenizer has, its fingerprint, and Megatron's NullTokenizer."""

from __future__ import annotations

import hashlib
import os


def file_sha256(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def require_file(path: str | None, flag: str, tokenizer_type: str) -> str:
    """``path`` if it is a file, else a one-line ValueError naming the flag."""
    if not path:
        raise ValueError(f"{tokenizer_type} needs {flag}")
    if not os.path.isfile(path):
        raise ValueError(f"{flag} {path!r} does not exist ({tokenizer_type})")
    return path


class TokenizerBase:
    """``vocab_size`` (ids ``0..vocab_size-1``; the model pads it), ``eod`` (the end-of-document
    id written by ``--append-eod`` and used by the training side), ``pad`` (id or None),
    ``tokenize(str) -> list[int]``, ``tokenize_batch``, ``detokenize`` and ``fingerprint()``.

    ``files`` are the files whose bytes define what the ids mean; their sha256 go in the
    fingerprint that ``preprocess_data.py`` writes beside each dataset.
    """

    type_name = ""  # Megatron's --tokenizer-type
    vocab_size: int
    eod: int
    pad: int | None = None
    legacy: bool = False
    files: tuple[str, ...] = ()

    def tokenize(self, text: str) -> list[int]:
        raise NotImplementedError

    def detokenize(self, ids) -> str:
        raise NotImplementedError

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def fingerprint(self) -> dict:
        """What identifies the ids: type, legacy flag, vocab size, EOD, sha256 of the files."""
        if not hasattr(self, "_fingerprint"):
            self._fingerprint = {
                "tokenizer_type": self.type_name,
                "legacy": bool(self.legacy),
                "vocab_size": int(self.vocab_size),
                "eod": int(self.eod),
                "files": {os.path.basename(p): file_sha256(p) for p in self.files},
            }
        return self._fingerprint

    def _check_text_cannot_make_eod(self, eod_text: str, where: str) -> None:
        """Refuse a tokenizer that turns the literal text of its EOD piece into the EOD id."""
        if eod_text and self.eod in self.tokenize(eod_text):
            raise ValueError(
                f"{where}: the text {eod_text!r} encodes to the EOD id {self.eod}, so documents "
                "could end mid-text; make the EOD token special (control) in the tokenizer"
            )

    def __repr__(self) -> str:
        legacy = ", legacy" if self.legacy else ""
        return (
            f"{self.type_name}(vocab_size={self.vocab_size}, eod={self.eod}, pad={self.pad}"
            f"{legacy})"
        )


class NullTokenizer(TokenizerBase):
    """Ids written as text: ``"3 1 4"`` -> ``[3, 1, 4]``.

    ``NullTokenizer(n)`` holds ``n`` ids: ``0..n-2`` for text and EOD ``n-1``. Megatron-LM
    (main)'s ``--vocab-size V`` is ``n = V``, in ``preprocess_data.py`` and on the training side
    alike. The EOD id written in the text is an error, so text cannot end a document (Megatron
    would write it).
    """

    type_name = "NullTokenizer"

    def __init__(self, vocab_size: int):
        if vocab_size is None or int(vocab_size) < 2:
            raise ValueError(f"NullTokenizer needs vocab_size >= 2, got {vocab_size!r}")
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1

    def tokenize(self, text: str) -> list[int]:
        try:
            ids = [int(x) for x in text.split()]
        except ValueError:
            raise ValueError(f"NullTokenizer: text must be ids, got {text[:40]!r}") from None
        bad = [i for i in ids if not 0 <= i < self.eod]
        if bad:
            raise ValueError(
                f"NullTokenizer: id {bad[0]} outside [0, {self.eod}) "
                f"(EOD {self.eod} may not appear in text)"
            )
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)
