"""SentencePiece tokenizers as Megatron-LM names them: current behaviour and the legacy one.

Current (Megatron-LM main, ``megatron/core/tokenizers``; the default here): the three types wrap
the model as it is. ``tokenize`` is ``sp.encode(text)`` (a literal ``</s>``, ``<s>`` or ``<EOD>``
in a document is ordinary text: sentencepiece never emits a control id from text), the vocab is
the model's pieces, and EOD is the model's eos id.

Legacy (``--tokenizer-sentencepiece-legacy``; Megatron's ``megatron/training/tokenizer``
classes, used with ``--legacy-tokenizer`` and by every release before the core tokenizers):

- ``SentencePieceTokenizer`` appends ``<CLS> <SEP> <EOD> <MASK>`` past the model's pieces, then
  the pad/bos/eos pieces (``<PAD>``/``<BOS>``/``<EOS>`` where the model has none), each only when
  missing; EOD is the id of ``<EOD>`` (``n + 2`` for an ``n``-piece model without one). Any of
  these written literally in the text is split out and becomes its id, as Megatron does.
- ``Llama2Tokenizer`` prepends the bos id to every text (``tokenize(s, bos=True, eos=False)``).
- ``GPTSentencePieceTokenizer`` is the same in both modes.
"""

from __future__ import annotations

from megafp8.data.tokenizer.base import TokenizerBase, require_file

_LEGACY_SPECIALS = ("<CLS>", "<SEP>", "<EOD>", "<MASK>")


def _load_sentencepiece(model_path: str, tokenizer_type: str):
    import sentencepiece as spm

    require_file(model_path, "--tokenizer-model", tokenizer_type)
    sp = spm.SentencePieceProcessor()
    try:
        sp.Load(model_path)
    except (OSError, RuntimeError) as exc:
        raise ValueError(f"{model_path}: not a sentencepiece model ({exc})") from exc
    return sp


class GPTSentencePieceTokenizer(TokenizerBase):
    """The model as it is: ``sp.encode(text)``, vocab = its pieces, EOD = its eos id."""

    type_name = "GPTSentencePieceTokenizer"
    _legacy_appends_eod = False  # legacy SentencePieceTokenizer: EOD is an appended <EOD>

    def __init__(self, model_path: str, legacy: bool = False):
        self.model_path, self.legacy, self.files = model_path, bool(legacy), (model_path,)
        self.sp = _load_sentencepiece(model_path, self.type_name)
        self.vocab_size = self.sp.GetPieceSize()
        self.bos = self.sp.bos_id() if self.sp.bos_id() >= 0 else None
        self.pad = self.sp.pad_id() if self.sp.pad_id() >= 0 else None
        self.eod = self.sp.eos_id()
        if not (self.legacy and self._legacy_appends_eod):
            self._check_eos()

    def _check_eos(self) -> None:
        if self.eod < 0:
            raise ValueError(
                f"{self.model_path}: the model has no eos piece, which {self.type_name} uses as "
                "EOD (use --tokenizer-sentencepiece-legacy to append <EOD> past the vocab)"
            )
        if not self.sp.IsControl(self.eod):
            raise ValueError(
                f"{self.model_path}: eos piece {self.sp.IdToPiece(self.eod)!r} (id {self.eod}) "
                "is not a control symbol, so text could produce the EOD id"
            )

    def tokenize(self, text: str) -> list[int]:
        return self.sp.EncodeAsIds(text)

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        # One thread: parallelism comes from processes (preprocess_data.py --workers).
        return self.sp.Encode(texts, out_type=int, num_threads=1)

    def detokenize(self, ids) -> str:
        return self.sp.DecodeIds([int(i) for i in ids])


class Llama2Tokenizer(GPTSentencePieceTokenizer):
    """Megatron's ``Llama2Tokenizer``: vocab = the model's pieces, EOD = its eos id.

    Current (Megatron-LM main routes it to the same sentencepiece wrapper as the other two
    types): ``tokenize`` is ``sp.encode(text)``, no bos. Legacy: ``[bos] + sp.encode(text)``
    (``_Llama2Tokenizer.tokenize(s, bos=True, eos=False)``), so even an empty text gives
    ``[bos]``.
    """

    type_name = "Llama2Tokenizer"

    def __init__(self, model_path: str, legacy: bool = False):
        super().__init__(model_path, legacy)
        if self.legacy and self.bos is None:
            raise ValueError(f"{model_path}: legacy Llama2Tokenizer needs a bos piece")

    def tokenize(self, text: str) -> list[int]:
        ids = self.sp.EncodeAsIds(text)
        return [self.bos, *ids] if self.legacy else ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        out = super().tokenize_batch(texts)
        return [[self.bos, *ids] for ids in out] if self.legacy else out


class SentencePieceTokenizer(GPTSentencePieceTokenizer):
    """Megatron's ``SentencePieceTokenizer``; current or legacy behaviour (module doc)."""

    type_name = "SentencePieceTokenizer"
    _legacy_appends_eod = True

    def __init__(self, model_path: str, legacy: bool = False):
        super().__init__(model_path, legacy)
        self.special: dict[str, int] = {}
        if self.legacy:
            self._add_legacy_specials()

    def _add_legacy_specials(self) -> None:
        n = self.sp.GetPieceSize()
        vocab = {self.sp.IdToPiece(i): i for i in range(n)}
        self._inv = {i: p for p, i in vocab.items()}

        def add(piece: str) -> int:
            if piece not in vocab:
                vocab[piece] = len(vocab)
                self._inv[vocab[piece]] = piece
            self.special[piece] = vocab[piece]
            return vocab[piece]

        for piece in _LEGACY_SPECIALS:
            add(piece)
        ids = {
            name: add(self.sp.IdToPiece(sid) if 0 <= sid < n else default)
            for name, sid, default in (
                ("pad", self.sp.pad_id(), "<PAD>"),
                ("bos", self.sp.bos_id(), "<BOS>"),
                ("eos", self.sp.eos_id(), "<EOS>"),
            )
        }
        self.vocab_size = len(vocab)
        self.eod = self.special["<EOD>"]
        self.pad, self.bos, self.eos = ids["pad"], ids["bos"], ids["eos"]

    def _has_special(self, text: str) -> bool:
        return any(s in text for s in self.special)

    def tokenize(self, text: str) -> list[int]:
        """Current: ``sp.encode(text)``. Legacy: special tokens in the text become their ids.

        Legacy splitting is Megatron's loop: the earliest special token wins, ties going to the
        first in the order ``<CLS> <SEP> <EOD> <MASK>``, pad, bos, eos.
        """
        if not self.legacy:
            return self.sp.EncodeAsIds(text)
        out: list[int] = []
        idx = 0
        while True:
            found = {s: text.find(s, idx) for s in self.special}
            found = {s: at for s, at in found.items() if at >= 0}
            if not found:
                break
            tok = min(found, key=found.get)  # dict order breaks ties, as in Megatron
            out.extend(self.sp.EncodeAsIds(text[idx : found[tok]]))
            out.append(self.special[tok])
            idx = found[tok] + len(tok)
        out.extend(self.sp.EncodeAsIds(text[idx:]))
        return out

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        if not self.legacy:
            return super().tokenize_batch(texts)
        plain = [i for i, t in enumerate(texts) if not self._has_special(t)]
        out: list[list[int] | None] = [None] * len(texts)
        encoded = self.sp.Encode([texts[i] for i in plain], out_type=int, num_threads=1)
        for i, ids in zip(plain, encoded, strict=True):
            out[i] = ids
        for i, t in enumerate(texts):
            if out[i] is None:
                out[i] = self.tokenize(t)
        return out  # type: ignore[return-value]

    def detokenize(self, ids) -> str:
        if not self.legacy:
            return super().detokenize(ids)
        text, run, n = [], [], self.sp.GetPieceSize()
        for i in (int(x) for x in ids):
            if i >= n and i in self._inv:  # an appended special: no piece to decode
                text.append(self.sp.DecodeIds(run))
                text.append(self._inv[i])
                run = []
            else:
                run.append(i)
        text.append(self.sp.DecodeIds(run))
        return "".join(text)
