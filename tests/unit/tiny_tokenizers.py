"""Tiny tokenizer models written by hand, so golden ids can be worked out on paper.

- ``write_sp_model``: a sentencepiece BPE model built as a ModelProto (no trainer): ids 0-2 are
  ``<unk> <s> </s>`` (unk, bos, eos), 3-258 the byte pieces ``<0x00>..<0xFF>`` (byte fallback:
  byte ``b`` is id ``3 + b``), then the pieces of ``SP_PIECES`` from id 259, their scores the
  merge priority (higher first). Identity normalization, dummy prefix ``▁``.
- ``write_gpt2_files``: GPT-2 ``vocab.json``/``merges.txt``: ids 0-255 the byte symbols in
  GPT-2's order (``!`` 0, ``Ġ`` (space) 220, ``Ċ`` (newline) 198), 256-264 the merges of
  ``GPT2_MERGES`` in rank order, ``<|endoftext|>`` 265.
- ``write_hf_tokenizer``: the same BPE as a ``tokenizer.json`` (``<|endoftext|>`` an added
  special token), optionally with a ``<s> $A`` post-processor, plus ``tokenizer_config.json``.
"""

from __future__ import annotations

import json
import os

from megafp8.data.tokenizer.bpe import bytes_to_unicode

# (piece, score): "▁" 259, "h" 260 ... "▁world" 272
SP_PIECES = [
    ("▁", 0.0),
    ("h", -1.0),
    ("e", -1.0),
    ("l", -1.0),
    ("o", -1.0),
    ("w", -1.0),
    ("r", -1.0),
    ("d", -1.0),
    ("he", -2.0),
    ("ll", -3.0),
    ("llo", -4.0),
    ("hello", -5.0),
    ("▁hello", -6.0),
    ("or", -7.0),
    ("▁w", -8.0),
    ("▁wor", -9.0),
    ("ld", -10.0),
    ("▁world", -11.0),
]
SP_FIRST = 259
SP_ID = {p: SP_FIRST + i for i, (p, _) in enumerate(SP_PIECES)}
SP_SIZE = SP_FIRST + len(SP_PIECES)  # 277


def sp_byte(b: int) -> int:
    return 3 + b


def write_sp_model(path: str, eos_piece: str = "</s>", with_eos: bool = True) -> str:
    from sentencepiece import sentencepiece_model_pb2 as pb

    m = pb.ModelProto()
    t = m.trainer_spec
    t.model_type = pb.TrainerSpec.BPE
    t.vocab_size = SP_SIZE
    t.byte_fallback = True
    t.unk_id, t.bos_id, t.pad_id = 0, 1, -1
    t.eos_id = 2 if with_eos else -1
    t.unk_piece, t.bos_piece, t.eos_piece = "<unk>", "<s>", eos_piece
    n = m.normalizer_spec
    n.name, n.add_dummy_prefix, n.remove_extra_whitespaces, n.escape_whitespaces = (
        "identity",
        True,
        False,
        True,
    )
    S = pb.ModelProto.SentencePiece
    specials = [("<unk>", S.UNKNOWN), ("<s>", S.CONTROL), (eos_piece, S.CONTROL)]
    if not with_eos:
        specials[2] = (eos_piece, S.USER_DEFINED)
    for piece, kind in specials:
        m.pieces.add(piece=piece, score=0.0, type=kind)
    for b in range(256):
        m.pieces.add(piece=f"<0x{b:02X}>", score=0.0, type=S.BYTE)
    for piece, score in SP_PIECES:
        m.pieces.add(piece=piece, score=score, type=S.NORMAL)
    with open(path, "wb") as f:
        f.write(m.SerializeToString())
    return path


GPT2_MERGES = [
    ("h", "e"),
    ("l", "l"),
    ("he", "ll"),
    ("hell", "o"),
    ("Ġ", "w"),
    ("o", "r"),
    ("Ġw", "or"),
    ("l", "d"),
    ("Ġwor", "ld"),
]
GPT2_EOD = 265


def gpt2_byte(b: int) -> int:
    """Id of byte ``b``'s symbol (GPT-2 order: printable bytes first, then the rest)."""
    return list(bytes_to_unicode()).index(b)


def gpt2_vocab() -> dict[str, int]:
    vocab = {c: i for i, c in enumerate(bytes_to_unicode().values())}
    for a, b in GPT2_MERGES:
        vocab[a + b] = len(vocab)
    vocab["<|endoftext|>"] = len(vocab)
    return vocab


def write_gpt2_files(d: str) -> tuple[str, str]:
    vocab_file, merge_file = os.path.join(d, "vocab.json"), os.path.join(d, "merges.txt")
    with open(vocab_file, "w", encoding="utf-8") as f:
        json.dump(gpt2_vocab(), f, ensure_ascii=False)
    with open(merge_file, "w", encoding="utf-8") as f:
        f.write("#version: 0.2\n" + "".join(f"{a} {b}\n" for a, b in GPT2_MERGES))
    return vocab_file, merge_file


def write_hf_tokenizer(d: str, bos: bool = False, config: bool = True) -> str:
    """``d/tokenizer.json`` (+ ``tokenizer_config.json``); with ``bos``, ``<s>`` (266) first."""
    from tokenizers import AddedToken, Tokenizer, decoders, models, pre_tokenizers, processors

    os.makedirs(d, exist_ok=True)
    vocab = gpt2_vocab()
    tok = Tokenizer(models.BPE(vocab=vocab, merges=GPT2_MERGES))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([AddedToken("<|endoftext|>", special=True)])
    if bos:
        tok.add_special_tokens([AddedToken("<s>", special=True)])
        tok.post_processor = processors.TemplateProcessing(
            single="<s> $A", special_tokens=[("<s>", len(vocab))]
        )
    tok.save(os.path.join(d, "tokenizer.json"))
    if config:
        with open(os.path.join(d, "tokenizer_config.json"), "w") as f:
            json.dump({"eos_token": {"content": "<|endoftext|>"}, "bos_token": "<s>"}, f)
    return d
