"""Megatron's tokenizer flags for the data tools (as its ``_add_tokenizer_args``), and the
picklable spec a tool hands its worker processes.

``--vocab-size V`` is Megatron-LM (main)'s: NullTokenizer holds ``V`` ids, EOD ``V - 1``.
"""

from __future__ import annotations

from megafp8.data.tokenizer import TOKENIZER_TYPES, TokenizerBase, make_tokenizer


def add_tokenizer_args(group) -> None:
    """``--tokenizer-type``, ``--tokenizer-model``, ``--vocab-file``, ``--merge-file``,
    ``--vocab-size`` and ``--tokenizer-sentencepiece-legacy`` on an argparse (group)."""
    group.add_argument(
        "--tokenizer-type",
        choices=TOKENIZER_TYPES,
        default=None,
        help="default: SentencePieceTokenizer given a model, else NullTokenizer",
    )
    group.add_argument(
        "--tokenizer-model", default=None, help=".model (sentencepiece) or tokenizer.json (or dir)"
    )
    group.add_argument("--vocab-file", default=None, help="GPT2BPETokenizer: vocab.json")
    group.add_argument("--merge-file", default=None, help="GPT2BPETokenizer: merges.txt")
    group.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="NullTokenizer: V ids in all, EOD = V - 1 (Megatron-LM main's meaning)",
    )
    group.add_argument(
        "--tokenizer-sentencepiece-legacy",
        action="store_true",
        help="Megatron's legacy SentencePiece wrappers: <CLS> <SEP> <EOD> <MASK> appended, "
        "EOD = <EOD>, special tokens split out of the text; Llama2Tokenizer prepends bos",
    )


def tokenizer_spec(args) -> dict:
    """The tokenizer flags as ``make_tokenizer`` keywords (picklable, for worker processes)."""
    return {
        "tokenizer_type": args.tokenizer_type,
        "tokenizer_model": args.tokenizer_model,
        "vocab_size": args.vocab_size,
        "legacy": args.tokenizer_sentencepiece_legacy,
        "vocab_file": args.vocab_file,
        "merge_file": args.merge_file,
    }


def tokenizer_from_spec(spec: dict) -> TokenizerBase:
    return make_tokenizer(**spec)
