"""Byte-level BPE tokenizers through the optional ``tokenizers`` package (``pip install .[hf]``).

``GPT2BPETokenizer`` (``--vocab-file vocab.json --merge-file merges.txt``) is GPT-2's byte-level
BPE: the GPT-2 split regex, bytes mapped to printable characters, then the merges in rank
order. It is built from the ``tokenizers`` package's BPE model with its ByteLevel
pre-tokenizer (the same Rust code as Hugging Face's GPT2TokenizerFast), which gives the ids of
OpenAI's ``encoder.py`` and of Megatron's ``gpt2_tokenization.py`` at Rust speed, with no BPE of
our own to keep right; the golden test checks it against a reference written from
``encoder.py``. Vocab = the entries of ``vocab.json``; EOD = the id of ``<|endoftext|>``. No
added tokens: a literal ``<|endoftext|>`` in a document is ordinary text (``<|``, ``endoftext``,
``|>``), as in Megatron's own GPT-2 tokenizer (``special_tokens=[]``).

``HuggingFaceTokenizer`` (``--tokenizer-model`` a ``tokenizer.json`` or a directory holding one)
follows Megatron-LM main's wrapper (``tokenizer(text).input_ids``): the tokenizer's
post-processor runs (a Llama-3 style tokenizer prepends its bos), the vocab counts added tokens,
and EOD is the eos token named by ``tokenizer_config.json`` beside it (else the first of
``<|endoftext|> <|end_of_text|> </s> <EOD> <eos> <|eot_id|>`` present). One difference, on
purpose: special tokens written in the text are encoded as text, never as their ids, so a
document cannot contain an EOD it did not end with.
"""

from __future__ import annotations

import json
import os

from megafp8.data.tokenizer.base import TokenizerBase, require_file

GPT2_EOD = "<|endoftext|>"
_HF_EOD_CANDIDATES = (GPT2_EOD, "<|end_of_text|>", "</s>", "<EOD>", "<eos>", "<|eot_id|>")
_HF_PAD_CANDIDATES = ("<pad>", "<|pad|>", "[PAD]", "<PAD>")


def _tokenizers(tokenizer_type: str):
    try:
        import tokenizers
    except ImportError as exc:
        raise ValueError(
            f"{tokenizer_type} needs the 'tokenizers' package (pip install 'megafp8[hf]' or "
            "pip install tokenizers)"
        ) from exc
    return tokenizers


def bytes_to_unicode() -> dict[int, str]:
    """GPT-2's map of the 256 byte values to printable characters (``encoder.py``)."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1)]
    bs += range(ord("®"), ord("ÿ") + 1)
    cs, n = list(bs), 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return dict(zip(bs, map(chr, cs), strict=True))


class GPT2BPETokenizer(TokenizerBase):
    """GPT-2 byte-level BPE from ``vocab.json`` + ``merges.txt`` (module doc)."""

    type_name = "GPT2BPETokenizer"

    def __init__(self, vocab_file: str, merge_file: str):
        tk = _tokenizers(self.type_name)
        require_file(vocab_file, "--vocab-file", self.type_name)
        require_file(merge_file, "--merge-file", self.type_name)
        self.files = (vocab_file, merge_file)
        try:
            with open(vocab_file, encoding="utf-8") as f:
                vocab = json.load(f)
            model = tk.models.BPE.from_file(vocab_file, merge_file)
        except Exception as exc:  # OSError, JSON errors, or the Rust side's plain Exception
            raise ValueError(f"{vocab_file} / {merge_file}: not a GPT-2 BPE ({exc})") from exc
        if not isinstance(vocab, dict):
            raise ValueError(f"{vocab_file}: expected a JSON object of token -> id")
        missing = [c for c in bytes_to_unicode().values() if c not in vocab]
        if missing:
            raise ValueError(
                f"{vocab_file}: {len(missing)} of the 256 byte-level symbols are missing "
                f"(e.g. {missing[0]!r}): not a GPT-2 byte-level vocab"
            )
        if GPT2_EOD not in vocab:
            raise ValueError(f"{vocab_file}: no {GPT2_EOD!r} entry, which is the EOD")
        self.tok = tk.Tokenizer(model)
        self.tok.pre_tokenizer = tk.pre_tokenizers.ByteLevel(add_prefix_space=False)
        self.tok.decoder = tk.decoders.ByteLevel()
        self.vocab_size, self.eod = len(vocab), int(vocab[GPT2_EOD])
        self._check_text_cannot_make_eod(GPT2_EOD, vocab_file)

    def tokenize(self, text: str) -> list[int]:
        return self.tok.encode(text, add_special_tokens=False).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts, add_special_tokens=False)]

    def detokenize(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)


def _token_text(value) -> str | None:
    """``"</s>"`` or ``{"content": "</s>", ...}`` (tokenizer_config.json) -> ``"</s>"``."""
    if isinstance(value, dict):
        value = value.get("content")
    return value if isinstance(value, str) and value else None


class HuggingFaceTokenizer(TokenizerBase):
    """A ``tokenizer.json`` read with ``tokenizers`` (module doc)."""

    type_name = "HuggingFaceTokenizer"

    def __init__(self, path: str):
        tk = _tokenizers(self.type_name)
        if path and os.path.isdir(path):
            path = os.path.join(path, "tokenizer.json")
        require_file(path, "--tokenizer-model", self.type_name)
        try:
            self.tok = tk.Tokenizer.from_file(path)
        except Exception as exc:  # the Rust side raises a plain Exception
            raise ValueError(f"{path}: not a tokenizer.json ({exc})") from exc
        self.tok.encode_special_tokens = True  # special tokens in the text are text
        config_path = os.path.join(os.path.dirname(path), "tokenizer_config.json")
        config = self._read_config(config_path)
        self.files = (path, config_path) if config is not None else (path,)
        vocab = self.tok.get_vocab(with_added_tokens=True)
        self.vocab_size = self.tok.get_vocab_size(with_added_tokens=True)
        eos = _token_text((config or {}).get("eos_token"))
        if eos is not None and eos not in vocab:
            raise ValueError(f"{config_path}: eos_token {eos!r} is not in {path}")
        eos = eos or next((t for t in _HF_EOD_CANDIDATES if t in vocab), None)
        if eos is None:
            raise ValueError(
                f"{path}: no eos_token in tokenizer_config.json and no end token "
                f"among {list(_HF_EOD_CANDIDATES)}"
            )
        self.eod = vocab[eos]
        pad = _token_text((config or {}).get("pad_token"))
        pad = pad if pad in vocab else next((t for t in _HF_PAD_CANDIDATES if t in vocab), None)
        self.pad = vocab[pad] if pad is not None else None
        self._check_text_cannot_make_eod(eos, path)

    @staticmethod
    def _read_config(path: str) -> dict | None:
        if not os.path.isfile(path):
            return None
        try:
            with open(path, encoding="utf-8") as f:
                config = json.load(f)
        except (OSError, ValueError) as exc:
            raise ValueError(f"{path}: unreadable ({exc})") from exc
        if not isinstance(config, dict):
            raise ValueError(f"{path}: expected a JSON object")
        return config

    def _check_text_cannot_make_eod(self, eod_text: str, where: str) -> None:
        ids = self.tok.encode(eod_text, add_special_tokens=False).ids
        if self.eod in ids:
            raise ValueError(
                f"{where}: the text {eod_text!r} encodes to the EOD id {self.eod}; mark the "
                "token special in tokenizer.json so text cannot end a document"
            )

    def tokenize(self, text: str) -> list[int]:
        return self.tok.encode(text).ids

    def tokenize_batch(self, texts: list[str]) -> list[list[int]]:
        return [e.ids for e in self.tok.encode_batch(texts)]

    def detokenize(self, ids) -> str:
        return self.tok.decode([int(i) for i in ids], skip_special_tokens=False)
