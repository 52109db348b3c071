"""Tokenizers behind one small interface, named as Megatron-LM names them.

Every tokenizer has ``.vocab_size``, ``.eod`` (the end-of-document id), ``.pad`` (an id or None),
``.tokenize(str) -> list[int]``, ``.detokenize(list[int]) -> str`` and
``.tokenize_batch(list[str]) -> list[list[int]]``.

Types (``--tokenizer-type``):

- ``SentencePieceTokenizer``: Megatron's. The vocab is the model's pieces plus, appended in this
  order when the model lacks them, ``<CLS> <SEP> <EOD> <MASK>`` and the pad/bos/eos pieces
  (``<PAD>``/``<BOS>``/``<EOS>`` when the model has none); ``eod`` is the id of ``<EOD>``. Special
  tokens written literally in the text map to their ids, as in Megatron. Models trained by
  ``data_tools/train_tokenizer.py`` use ``<EOD>`` as their eos piece, so their EOD is in-vocab.
- ``GPTSentencePieceTokenizer``: the model's own vocab; ``eod`` is the model's eos id.
- ``HuggingFaceTokenizer``: a ``tokenizer.json`` read with the optional ``tokenizers`` package.
- ``NullTokenizer``: text is space-separated ids. ``NullTokenizer(V)`` has ``vocab_size == V`` and
  ``eod == V - 1``. (Megatron's ``--vocab-size V`` means ids ``0..V-1`` plus EOD ``V``, so the CLI
  of ``preprocess_data.py`` passes ``V + 1`` to match Megatron's ids.)
"""

from __future__ import annotations

import os

TOKENIZER_TYPES = (
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "NullTokenizer",
)
DEFAULT_MOCK_VOCAB_SIZE = 512  # NullTokenizer size for mock data when no vocab size is given
_HF_EOD_CANDIDATES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<EOD>", "<eos>", "<|eot_id|>")


class _Base:
    vocab_size: int
    eod: int
    pad: int | None = None

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [self.tokenize(t) for t in texts]

    def __repr__(self) -> str:
        name = type(self).__name__
        return f"{name}(vocab_size={self.vocab_size}, eod={self.eod}, pad={self.pad})"


class NullTokenizer(_Base):
    """Ids written as text: ``"3 1 4"`` -> ``[3, 1, 4]``; EOD is the last id of the vocab."""

    def __init__(self, vocab_size: int):
        if vocab_size is None or int(vocab_size) < 2:
            raise ValueError(f"NullTokenizer needs vocab_size >= 2, got {vocab_size!r}")
        self.vocab_size = int(vocab_size)
        self.eod = self.vocab_size - 1

    def tokenize(self, text: str) -> list[int]:
        ids = [int(x) for x in text.split()]
        bad = [i for i in ids if not 0 <= i < self.vocab_size]
        if bad:
            raise ValueError(f"NullTokenizer: id {bad[0]} outside [0, {self.vocab_size})")
        return ids

    def detokenize(self, ids) -> str:
        return " ".join(str(int(i)) for i in ids)


def _load_sentencepiece(model_path: str):
    import sentencepiece as spm

    if not model_path or not os.path.isfile(model_path):
        raise ValueError(f"tokenizer model {model_path!r} does not exist (--tokenizer-model)")
    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(model_path)
    except (OSError, RuntimeError) as exc:
        raise ValueError(f"{model_path}: not a sentencepiece model ({exc})") from exc
    return sp


class GPTSentencePieceTokenizer(_Base):
    """A sentencepiece model used as is: EOD is the model's eos id, pad its pad id (or None)."""

    def __init__(self, model_path: str):
        self.model_path = model_path
        self.sp = _load_sentencepiece(model_path)
        self.vocab_size = self.sp.GetPieceSize()
        self.eod = self.sp.eos_id()
        if self.eod < 0:
            raise ValueError(
                f"{model_path}: the model has no eos piece, which "
                "GPTSentencePieceTokenizer uses as EOD; use SentencePieceTokenizer"
            )
        self.pad = self.sp.pad_id() if self.sp.pad_id() >= 0 else None

    def tokenize(self, text: str) -> list[int]:
        return self.sp.EncodeAsIds(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        # One thread: parallelism comes from processes (preprocess_data.py --workers).
        return self.sp.Encode(texts, out_type=int, num_threads=1)

    def detokenize(self, ids) -> str:
        return self.sp.DecodeIds([int(i) for i in ids])


class SentencePieceTokenizer(_Base):
    """Megatron's SentencePieceTokenizer: model pieces plus appended specials (see module doc)."""

    def __init__(self, model_path: str):
        self.model_path = model_path
        self.sp = _load_sentencepiece(model_path)
        n = self.sp.GetPieceSize()
        self._vocab = {self.sp.IdToPiece(i): i for i in range(n)}
        self._inv = {i: p for p, i in self._vocab.items()}
        self.special: dict[str, int] = {}

        def add(piece: str) -> int:
            if piece not in self._vocab:
                self._vocab[piece] = len(self._vocab)
                self._inv[self._vocab[piece]] = piece
            self.special[piece] = self._vocab[piece]
            return self._vocab[piece]

        for piece in ("<CLS>", "<SEP>", "<EOD>", "<MASK>"):
            add(piece)
        ids = {}
        for name, sid, default in (
            ("pad", self.sp.pad_id(), "<PAD>"),
            ("bos", self.sp.bos_id(), "<BOS>"),
            ("eos", self.sp.eos_id(), "<EOS>"),
        ):
            ids[name] = add(self.sp.IdToPiece(sid) if 0 <= sid < n else default)
        self.vocab_size = len(self._vocab)
        self.eod = self.special["<EOD>"]
        self.pad = ids["pad"]
        self.bos, self.eos = ids["bos"], ids["eos"]

    def _has_special(self, text: str) -> bool:
        return any(s in text for s in self.special)

    def tokenize(self, text: str) -> list[int]:
        """Encode, mapping special tokens written in the text to their ids (as Megatron does)."""
        out: list[int] = []
        idx = 0
        while self._has_special(text[idx:]):
            rest = text[idx:]
            found = {s: rest.index(s) for s in self.special if s in rest}
            tok = min(found, key=lambda s: (found[s], -len(s)))
            out.extend(self.sp.EncodeAsIds(rest[: found[tok]]))
            out.append(self.special[tok])
            idx += found[tok] + len(tok)
        out.extend(self.sp.EncodeAsIds(text[idx:]))
        return out

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        plain = [i for i, t in enumerate(texts) if not self._has_special(t)]
        out: list[list[int] | None] = [None] * len(texts)
        encoded = self.sp.Encode([texts[i] for i in plain], out_type=int, num_threads=1)
        for i, ids in zip(plain, encoded):
            out[i] = ids
        for i, t in enumerate(texts):
            if out[i] is None:
                out[i] = self.tokenize(t)
        return out  # type: ignore[return-value]

    def detokenize(self, ids) -> str:
        text, run = [], []
        for i in (int(x) for x in ids):
            if i in self._inv and self._inv[i] in self.special and i >= self.sp.GetPieceSize():
                text.append(self.sp.DecodeIds(run))
                text.append(self._inv[i])
                run = []
            else:
                run.append(i)
        text.append(self.sp.DecodeIds(run))
        return "".join(text)


class HuggingFaceTokenizer(_Base):
    """A ``tokenizer.json`` (HF ``tokenizers``); EOD: the first usual end token it holds."""

    def __init__(self, path: str):
        try:
            from tokenizers import Tokenizer
        except ImportError as exc:
            raise ValueError(
                "HuggingFaceTokenizer needs the 'tokenizers' package (pip install tokenizers)"
            ) from exc
        if os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(path):
            raise ValueError(f"tokenizer file {path!r} does not exist (--tokenizer-model)")
        self.tok = Tokenizer.from_file(path)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        vocab = self.tok.get_vocab(with_added_tokens=True)
        eods = [vocab[t] for t in _HF_EOD_CANDIDATES if t in vocab]
        if not eods:
            raise ValueError(f"{path}: no end-of-document token among {list(_HF_EOD_CANDIDATES)}")
        self.eod = eods[0]
        self.pad = next(
            (vocab[t] for t in ("<pad>", "<|pad|>", "[PAD]", "<PAD>") if t in vocab), None
        )

    def tokenize(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def detokenize(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def make_tokenizer(
    tokenizer_type: str | None, tokenizer_model: str | None = None, vocab_size: int | None = None
):
    """Build a tokenizer by Megatron type name; None picks SentencePiece with a model, else Null."""
    if tokenizer_type is None:
        tokenizer_type = "SentencePieceTokenizer" if tokenizer_model else "NullTokenizer"
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(
            f"tokenizer_type={tokenizer_type!r} must be one of {list(TOKENIZER_TYPES)}"
        )
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("NullTokenizer needs a vocab size (--vocab-size)")
        return NullTokenizer(vocab_size)
    if not tokenizer_model:
        raise ValueError(f"{tokenizer_type} needs a model file (--tokenizer-model)")
    cls = {
        "SentencePieceTokenizer": SentencePieceTokenizer,
        "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer,
        "HuggingFaceTokenizer": HuggingFaceTokenizer,
    }[tokenizer_type]
    return cls(tokenizer_model)


def build_tokenizer(data_cfg, vocab_size: int | None = None):
    """The tokenizer a run uses, from ``DataConfig`` (``tokenizer_type``, ``tokenizer_model``).

    ``vocab_size`` is only read by NullTokenizer; with mock data and no size given it is
    ``DEFAULT_MOCK_VOCAB_SIZE``.
    """
    if vocab_size is None and data_cfg.mock_data and not data_cfg.tokenizer_model:
        vocab_size = DEFAULT_MOCK_VOCAB_SIZE
    return make_tokenizer(data_cfg.tokenizer_type, data_cfg.tokenizer_model, vocab_size)
