"""Megatron's tokenizer flags for the data tools (as its ``_add_tokenizer_args``), and the
picklable spec a tool hands its worker processes.

``--vocab-size V`` is Megatron-LM (main)'s: NullTokenizer holds ``V`` ids, EOD ``V - 1``;
TikTokenizer's ids are ``0 .. V-1``.
"""

from __future__ import annotations

from megafp8.data.tokenizer import TOKENIZER_TYPES, TokenizerBase, make_tokenizer


def add_tokenizer_args(group) -> None:
    """``--tokenizer-type``, ``--tokenizer-model``, ``--vocab-file``, ``--merge-file``,
    ``--vocab-size``, TikTokenizer's three flags and ``--tokenizer-sentencepiece-legacy`` on an
    argparse (group)."""
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
        help="NullTokenizer: V ids in all, EOD = V - 1; TikTokenizer: ids 0..V-1 (default 2^17)",
    )
    group.add_argument(
        "--tiktoken-pattern",
        choices=("v1", "v2"),
        default=None,
        help="TikTokenizer: the pattern that splits the text (default v2)",
    )
    group.add_argument(
        "--tiktoken-num-special-tokens",
        type=int,
        default=1000,
        help="TikTokenizer: ids before the vocab's first token",
    )
    group.add_argument(
        "--tokenizer-special-tokens",
        nargs="+",
        default=None,
        help="TikTokenizer: the first special tokens (must hold <unk> <s> </s> <mask> <pad> "
        "<cls> <sep>; default those seven)",
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
        "tiktoken_pattern": args.tiktoken_pattern,
        "tiktoken_num_special_tokens": args.tiktoken_num_special_tokens,
        "special_tokens": args.tokenizer_special_tokens,
    }


def tokenizer_from_spec(spec: dict) -> TokenizerBase:
    return make_tokenizer(**spec)
