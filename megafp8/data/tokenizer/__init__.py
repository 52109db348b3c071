"""Tokenizers behind one small interface, named and behaving as Megatron-LM (main) names them.

Every tokenizer has ``.vocab_size`` (the model pads it to ``--make-vocab-size-divisible-by`` x
TP), ``.eod`` (the end-of-document id: what ``--append-eod`` writes and what the training side
takes for a document boundary), ``.pad``, ``.tokenize(str) -> list[int]``,
``.tokenize_batch(list[str])``, ``.detokenize(ids)`` and ``.fingerprint()``.

Types (``--tokenizer-type``):

- ``SentencePieceTokenizer`` / ``GPTSentencePieceTokenizer`` / ``Llama2Tokenizer``
  (``--tokenizer-model tok.model``): the model's own vocab, EOD = its eos id, text encoded as
  plain text. ``--tokenizer-sentencepiece-legacy`` restores Megatron's legacy wrappers
  (``SentencePieceTokenizer`` appends ``<CLS> <SEP> <EOD> <MASK>``, EOD = ``<EOD>``, specials
  split out of the text; ``Llama2Tokenizer`` prepends bos). See ``spm.py``.
- ``GPT2BPETokenizer`` (``--vocab-file vocab.json --merge-file merges.txt``): GPT-2 byte-level
  BPE, EOD = ``<|endoftext|>``. ``HuggingFaceTokenizer`` (``--tokenizer-model`` a
  ``tokenizer.json`` or its directory): EOD = its eos token. Both need the optional
  ``tokenizers`` package. See ``bpe.py``.
- ``TikTokenizer`` (``--tokenizer-model`` a tiktoken JSON vocab; ``--vocab-size``,
  ``--tiktoken-num-special-tokens``, ``--tokenizer-special-tokens``, ``--tiktoken-pattern``):
  Megatron-LM's id layout, special tokens first, EOD = ``</s>``. Needs the optional
  ``tiktoken`` package. See ``tiktoken_bpe.py``.
- ``NullTokenizer``: text is space-separated ids; Megatron-LM (main)'s ``--vocab-size V``
  means ``V`` ids in all, EOD ``V - 1`` (``NullTokenizer(V)``; Megatron's legacy tokenizer had
  ``V + 1``). With ``--mock-data`` and no tokenizer named, the mock vocab is the same ``V`` ids
  (``DEFAULT_MOCK_VOCAB_SIZE`` without V).

No type can let text inject a document boundary in its current behaviour: the EOD id only comes
from ``--append-eod`` (legacy SentencePiece keeps Megatron's splitting, ``<EOD>`` included).
"""

from __future__ import annotations

from megafp8.data.tokenizer.base import NullTokenizer, TokenizerBase
from megafp8.data.tokenizer.bpe import GPT2BPETokenizer, HuggingFaceTokenizer
from megafp8.data.tokenizer.sidecar import (
    check_data_tokenizer,
    check_dataset_tokenizer,
    read_sidecar,
    remove_sidecar,
    sidecar_path,
    write_sidecar,
)
from megafp8.data.tokenizer.spm import (
    GPTSentencePieceTokenizer,
    Llama2Tokenizer,
    SentencePieceTokenizer,
)
from megafp8.data.tokenizer.tiktoken_bpe import TikTokenizer

TOKENIZER_TYPES = (
    "SentencePieceTokenizer",
    "GPTSentencePieceTokenizer",
    "Llama2Tokenizer",
    "GPT2BPETokenizer",
    "HuggingFaceTokenizer",
    "TikTokenizer",
    "NullTokenizer",
)
SP_TYPES = {
    "SentencePieceTokenizer": SentencePieceTokenizer,
    "GPTSentencePieceTokenizer": GPTSentencePieceTokenizer,
    "Llama2Tokenizer": Llama2Tokenizer,
}
DEFAULT_MOCK_VOCAB_SIZE = 512  # mock-data vocab (EOD 511) when no vocab size is given

__all__ = [
    "DEFAULT_MOCK_VOCAB_SIZE",
    "GPT2BPETokenizer",
    "GPTSentencePieceTokenizer",
    "HuggingFaceTokenizer",
    "Llama2Tokenizer",
    "NullTokenizer",
    "SentencePieceTokenizer",
    "TOKENIZER_TYPES",
    "TikTokenizer",
    "TokenizerBase",
    "build_tokenizer",
    "check_data_tokenizer",
    "check_dataset_tokenizer",
    "check_run_tokenizer",
    "make_tokenizer",
    "model_vocab_size",
    "read_sidecar",
    "remove_sidecar",
    "sidecar_path",
    "write_sidecar",
]


def make_tokenizer(
    tokenizer_type: str | None,
    tokenizer_model: str | None = None,
    vocab_size: int | None = None,
    *,
    legacy: bool = False,
    vocab_file: str | None = None,
    merge_file: str | None = None,
    tiktoken_pattern: str | None = None,
    tiktoken_num_special_tokens: int | None = None,
    special_tokens: tuple[str, ...] | list[str] | None = None,
) -> TokenizerBase:
    """Build a tokenizer by Megatron type name; None picks SentencePiece with a model, else Null.

    ``vocab_size`` is Megatron's ``V``: NullTokenizer's whole size (EOD = ``V - 1``) and
    TikTokenizer's whole id range. ``legacy`` is ``--tokenizer-sentencepiece-legacy``; the
    ``tiktoken_*`` and ``special_tokens`` arguments are TikTokenizer's flags.
    """
    if tokenizer_type is None:
        tokenizer_type = "SentencePieceTokenizer" if tokenizer_model else "NullTokenizer"
    if tokenizer_type not in TOKENIZER_TYPES:
        raise ValueError(
            f"tokenizer_type={tokenizer_type!r} must be one of {list(TOKENIZER_TYPES)}"
        )
    if legacy and tokenizer_type not in SP_TYPES:
        raise ValueError(
            f"--tokenizer-sentencepiece-legacy applies to {list(SP_TYPES)}, not {tokenizer_type}"
        )
    if tokenizer_type == "NullTokenizer":
        if vocab_size is None:
            raise ValueError("NullTokenizer needs a vocab size (--vocab-size)")
        return NullTokenizer(vocab_size)
    if tokenizer_type == "GPT2BPETokenizer":
        return GPT2BPETokenizer(vocab_file, merge_file)
    if not tokenizer_model:
        raise ValueError(f"{tokenizer_type} needs a model file (--tokenizer-model)")
    if tokenizer_type == "HuggingFaceTokenizer":
        return HuggingFaceTokenizer(tokenizer_model)
    if tokenizer_type == "TikTokenizer":
        return TikTokenizer(
            tokenizer_model,
            vocab_size,
            num_special_tokens=tiktoken_num_special_tokens,
            special=special_tokens,
            pattern=tiktoken_pattern,
        )
    return SP_TYPES[tokenizer_type](tokenizer_model, legacy=legacy)


def build_tokenizer(data_cfg, vocab_size: int | None = None) -> TokenizerBase:
    """The run's tokenizer from ``DataConfig`` and the model's ``vocab_size`` (``--vocab-size``).

    NullTokenizer takes ``vocab_size`` as Megatron's ``V`` (``V`` ids, EOD ``V - 1``), as
    ``preprocess_data.py`` does, so both sides agree on EOD. Mock data with no tokenizer named
    uses a mock vocab of the same ``vocab_size`` ids (default ``DEFAULT_MOCK_VOCAB_SIZE``).
    """
    d = data_cfg
    if d.mock_data and d.tokenizer_type is None and not d.tokenizer_model:
        vocab_size = vocab_size or DEFAULT_MOCK_VOCAB_SIZE
    return make_tokenizer(
        d.tokenizer_type,
        d.tokenizer_model,
        vocab_size,
        legacy=d.tokenizer_sentencepiece_legacy,
        vocab_file=d.vocab_file,
        merge_file=d.merge_file,
        tiktoken_pattern=d.tiktoken_pattern,
        tiktoken_num_special_tokens=d.tiktoken_num_special_tokens,
        special_tokens=d.tokenizer_special_tokens,
    )


def model_vocab_size(configured: int | None, tokenizer: TokenizerBase) -> int:
    """The model's (unpadded) vocab: the tokenizer's, or ``--vocab-size`` when it holds it.

    NullTokenizer's size always wins (``--vocab-size`` was its input); for the others a
    ``--vocab-size`` smaller than the tokenizer's vocab is an error.
    """
    if configured is None or isinstance(tokenizer, NullTokenizer):
        return tokenizer.vocab_size
    if configured < tokenizer.vocab_size:
        raise ValueError(
            f"vocab_size={configured} is smaller than the vocab of {tokenizer!r}; "
            "drop --vocab-size to take the tokenizer's"
        )
    return configured


def check_run_tokenizer(cfg) -> TokenizerBase:
    """Before anything expensive: build the run's tokenizer, resolve the model vocab, and check
    every dataset of ``data_path`` against it (sidecar fingerprint or max token id)."""
    from megafp8.config_values import padded_vocab_size

    tok = build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size)
    vocab = model_vocab_size(cfg.model.vocab_size, tok)
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    padded = padded_vocab_size(vocab, m.make_vocab_size_divisible_by, tp)
    check_data_tokenizer(cfg.data, tok, padded)
    return tok
