"""Golden ids per tokenizer type, on hand-built models (tests/unit/tiny_tokenizers.py).

Each expected list was worked out by hand from the model's pieces/merges (the comments show the
pieces) and is what Megatron-LM writes for the same flags: SentencePiece current = sp.encode(text)
with EOD = eos id; legacy = Megatron's old wrapper (specials appended and split out of the text).
No current type lets a literal ``</s>``, ``<s>``, ``<EOD>`` or ``<|endoftext|>`` become EOD.
"""

import pytest

from megafp8.data.tokenizer import make_tokenizer
from tests.unit.tiny_tokenizers import (
    GPT2_EOD,
    SP_SIZE,
    gpt2_byte,
    sp_byte,
    write_gpt2_files,
    write_hf_tokenizer,
    write_sp_model,
)

LITERALS = ["</s>", "<s>", "<EOD>", "<|endoftext|>", "x</s>y<EOD>z<|endoftext|>", "<CLS><MASK>"]
TEXTS = ["hello world", "hello</s>world", "héllo", "", " hello  world\n", "<EOD>"]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    return write_sp_model(str(tmp_path_factory.mktemp("sp") / "tiny.model"))


def _b(text: str) -> list[int]:
    return [sp_byte(b) for b in text.encode()]


# "▁" 259, "h" 260, "▁hello" 271, "▁world" 276, "w" 264, "or" 272, "ld" 275, "llo" 269
SP_CURRENT = {
    "hello world": [271, 276],  # ▁hello ▁world
    "hello</s>world": [271, *_b("</s>"), 264, 272, 275],  # ▁hello < / s > w or ld
    "héllo": [259, 260, *_b("é"), 269],  # ▁ h <0xC3> <0xA9> llo
    "": [],
    " hello  world\n": [259, 271, 259, 276, *_b("\n")],  # ▁ ▁hello ▁ ▁world <0x0A>
    "<EOD>": [259, *_b("<EOD>")],
}


def test_sentencepiece_current_golden(sp_model):
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=sp_model)
    for kind in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer"):
        tok = make_tokenizer(kind, sp_model)
        assert (tok.vocab_size, tok.eod, tok.pad, tok.legacy) == (SP_SIZE, 2, None, False)
        for text in TEXTS:
            assert tok.tokenize(text) == SP_CURRENT[text] == sp.encode(text), (kind, text)
        assert tok.tokenize_batch(TEXTS) == [SP_CURRENT[t] for t in TEXTS]
        assert tok.detokenize(SP_CURRENT["héllo"]) == "héllo"


def test_sentencepiece_legacy_golden(sp_model):
    tok = make_tokenizer("SentencePieceTokenizer", sp_model, legacy=True)
    # appended: <CLS> 277, <SEP> 278, <EOD> 279, <MASK> 280, <PAD> 281 (no pad piece);
    # <s> 1 and </s> 2 are the model's own.
    assert (tok.vocab_size, tok.eod, tok.pad, tok.bos, tok.eos) == (282, 279, 281, 1, 2)
    golden = {
        "hello world": [271, 276],
        "hello</s>world": [271, 2, 276],  # each piece between specials gets its own "▁"
        "héllo": [259, 260, *_b("é"), 269],
        "": [],
        " hello  world\n": [259, 271, 259, 276, *_b("\n")],
        "<EOD>": [279],  # legacy: the text injects EOD, as Megatron's old wrapper does
    }
    for text in TEXTS:
        assert tok.tokenize(text) == golden[text], text
    assert tok.tokenize_batch(TEXTS) == [golden[t] for t in TEXTS]
    assert tok.tokenize("<s>hello<MASK><SEP>") == [1, 271, 280, 278]
    assert tok.detokenize([271, 279, 276]) == "hello<EOD>world"
    gpt = make_tokenizer("GPTSentencePieceTokenizer", sp_model, legacy=True)
    assert (gpt.vocab_size, gpt.eod, gpt.tokenize("<EOD>")) == (SP_SIZE, 2, SP_CURRENT["<EOD>"])


def test_llama2_bos_only_in_legacy(sp_model):
    current = make_tokenizer("Llama2Tokenizer", sp_model)
    legacy = make_tokenizer("Llama2Tokenizer", sp_model, legacy=True)
    assert current.tokenize("hello") == [271] and current.tokenize("") == []
    assert legacy.tokenize("hello") == [1, 271] and legacy.tokenize("") == [1]
    assert legacy.tokenize_batch(["hello", ""]) == [[1, 271], [1]]
    assert (legacy.vocab_size, legacy.eod) == (SP_SIZE, 2)


def test_sentencepiece_needs_a_control_eos(tmp_path):
    model = write_sp_model(str(tmp_path / "noeos.model"), with_eos=False)
    with pytest.raises(ValueError, match="no eos piece.*--tokenizer-sentencepiece-legacy"):
        make_tokenizer("SentencePieceTokenizer", model)
    legacy = make_tokenizer("SentencePieceTokenizer", model, legacy=True)
    assert legacy.eod == SP_SIZE + 2  # <CLS> <SEP> <EOD>: the appended <EOD>


def _g(text: str) -> list[int]:
    return [gpt2_byte(b) for b in text.encode()]


# merges: he 256, ll 257, hell 258, hello 259, Ġw 260, or 261, Ġwor 262, ld 263, Ġworld 264
GPT2_GOLDEN = {
    "hello world": [259, 264],
    "hello</s>world": [259, *_g("</s>"), _g("w")[0], 261, 263],  # hello </ s > w or ld
    "héllo": [*_g("h"), *_g("é"), 257, *_g("o")],  # h Ã © ll o
    "": [],
    " hello  world\n": [220, 259, 220, 264, 198],  # Ġ hello Ġ Ġworld Ċ
    "<EOD>": _g("<EOD>"),
    "<|endoftext|>": _g("<|endoftext|>"),  # <| e n d o f t e x t |>: no merges apply
}


def test_gpt2_bpe_golden(tmp_path):
    pytest.importorskip("tokenizers", reason="GPT2BPETokenizer needs the optional 'tokenizers'")
    vocab, merges = write_gpt2_files(str(tmp_path))
    tok = make_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    assert (tok.vocab_size, tok.eod, tok.pad) == (266, GPT2_EOD, None)
    assert (_g(" ")[0], _g("\n")[0], _g("<")[0], _g("中")) == (220, 198, 27, [160, 116, 255])
    for text, ids in GPT2_GOLDEN.items():
        assert tok.tokenize(text) == ids, text
        assert tok.detokenize(ids) == text
    assert tok.tokenize_batch(list(GPT2_GOLDEN)) == list(GPT2_GOLDEN.values())


def _reference_gpt2(vocab: dict, merges: list, text: str) -> list[int]:
    """OpenAI's encoder.py, written out: regex split, byte map, lowest-rank merge first."""
    regex = pytest.importorskip("regex", reason="the reference needs the 'regex' module")
    from megafp8.data.tokenizer.bpe import bytes_to_unicode

    pat = regex.compile(
        r"""'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+"""
    )
    ranks, b2u, out = {m: i for i, m in enumerate(merges)}, bytes_to_unicode(), []
    for piece in pat.findall(text):
        word = [b2u[b] for b in piece.encode()]
        while len(word) > 1:
            rank = min(ranks.get(pair, 1 << 30) for pair in zip(word, word[1:], strict=False))
            if rank == 1 << 30:
                break
            first, second = merges[rank]
            merged, i = [], 0
            while i < len(word):
                if i + 1 < len(word) and (word[i], word[i + 1]) == (first, second):
                    merged.append(first + second)
                    i += 2
                else:
                    merged.append(word[i])
                    i += 1
            word = merged
        out += [vocab[w] for w in word]
    return out


def test_gpt2_bpe_matches_reference_encoder(tmp_path):
    pytest.importorskip("tokenizers", reason="GPT2BPETokenizer needs the optional 'tokenizers'")
    from tests.unit.tiny_tokenizers import GPT2_MERGES, gpt2_vocab

    vocab, merges = write_gpt2_files(str(tmp_path))
    tok = make_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges)
    texts = [*GPT2_GOLDEN, "it's 42 hellos, worlds!\t\r\n  ", "héllo wörld ☃ 中文 🙂", "'ll'd ''"]
    for text in texts:
        assert tok.tokenize(text) == _reference_gpt2(gpt2_vocab(), GPT2_MERGES, text), text


def test_huggingface_golden(tmp_path):
    pytest.importorskip("tokenizers", reason="HuggingFaceTokenizer needs the optional 'tokenizers'")
    plain = make_tokenizer("HuggingFaceTokenizer", write_hf_tokenizer(str(tmp_path / "a")))
    assert (plain.vocab_size, plain.eod) == (266, GPT2_EOD)
    for text, ids in GPT2_GOLDEN.items():  # the same BPE: the same ids
        assert plain.tokenize(text) == ids, text
    # The post-processor runs, as in Megatron's tokenizer(text).input_ids: "<s> $A" adds 266.
    bos = make_tokenizer("HuggingFaceTokenizer", write_hf_tokenizer(str(tmp_path / "b"), True))
    assert (bos.vocab_size, bos.eod) == (267, GPT2_EOD)
    assert bos.tokenize("hello world") == [266, 259, 264] and bos.tokenize("") == [266]
    assert bos.tokenize("<s>") == [266, *_g("<s>")]  # the literal special token is text
    assert bos.tokenize_batch(["hello world", ""]) == [[266, 259, 264], [266]]
    # Without tokenizer_config.json the end token is found among the usual names.
    bare = make_tokenizer(
        "HuggingFaceTokenizer", write_hf_tokenizer(str(tmp_path / "c"), config=False)
    )
    assert bare.eod == GPT2_EOD and len(bare.files) == 1


def test_null_tokenizer_golden():
    tok = make_tokenizer("NullTokenizer", vocab_size=10)  # Megatron-LM main's --vocab-size 10
    assert (tok.vocab_size, tok.eod) == (10, 9)
    assert tok.tokenize("3 1 4\n1  5") == [3, 1, 4, 1, 5] and tok.tokenize("") == []
    with pytest.raises(ValueError, match="EOD 9 may not appear in text"):
        tok.tokenize("1 9")
    with pytest.raises(ValueError, match="text must be ids"):
        tok.tokenize("</s>")


def _all_current(tmp_path, sp_model):
    toks = [
        make_tokenizer(k, sp_model)
        for k in ("SentencePieceTokenizer", "GPTSentencePieceTokenizer", "Llama2Tokenizer")
    ]
    try:
        import tokenizers  # noqa: F401
    except ImportError:
        return toks
    vocab, merges = write_gpt2_files(str(tmp_path))
    toks.append(make_tokenizer("GPT2BPETokenizer", vocab_file=vocab, merge_file=merges))
    toks.append(make_tokenizer("HuggingFaceTokenizer", write_hf_tokenizer(str(tmp_path / "h"))))
    return toks


def test_text_never_injects_eod(tmp_path, sp_model):
    # The same check with a model whose eos piece is named <EOD> (train_tokenizer.py's naming).
    eod_named = write_sp_model(str(tmp_path / "eodnamed.model"), eos_piece="<EOD>")
    toks = _all_current(tmp_path, sp_model) + [make_tokenizer("SentencePieceTokenizer", eod_named)]
    for tok in toks:
        for text in LITERALS:
            assert tok.eod not in tok.tokenize(text), (tok, text)
            assert all(tok.eod not in ids for ids in tok.tokenize_batch([text, "a" + text]))
