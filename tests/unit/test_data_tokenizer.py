"""train_tokenizer.py and the tokenizer types over a trained model: special ids, current vs
legacy SentencePiece, identity normalization, bounded sampling; build_tokenizer's vocab rules
and the one-line errors. Golden ids per type: test_tokenizer_golden.py."""

import importlib.util
import json
import os
import random
import subprocess
import sys

import pytest

from megafp8.config import DataConfig
from megafp8.data.tokenizer import (
    DEFAULT_MOCK_VOCAB_SIZE,
    build_tokenizer,
    make_tokenizer,
    model_vocab_size,
)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "data_tools", "train_tokenizer.py")


def load_tool(name):
    path = os.path.join(ROOT, "data_tools", f"{name}.py")
    spec = importlib.util.spec_from_file_location(name, path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    d = tmp_path_factory.mktemp("tok")
    with open(d / "in.jsonl", "w") as f:
        for i in range(300):
            f.write(
                json.dumps({"body": f"Line {i}: the  quick brown fox jumps over ＡＢＣ\nnext"})
                + "\n"
            )
    (d / "extra.txt").write_text("plain text file with words\n" * 50)
    r = subprocess.run(
        [
            sys.executable,
            TOOL,
            "--input",
            str(d / "in.jsonl"),
            str(d / "extra.txt"),
            "--json-keys",
            "body",
            "--output-prefix",
            str(d / "out" / "tok"),
            "--vocab-size",
            "300",
            "--byte-fallback",
            "--max-sentences",
            "200",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    return d / "out" / "tok"


def test_manifest_and_special_ids(trained):
    manifest = json.loads(open(f"{trained}.json").read())
    assert manifest["special_ids"] == {"unk": 0, "bos": 1, "eod": 2, "pad": 3}
    assert manifest["megatron"]["SentencePieceTokenizer"] == {"vocab_size": 300, "eod": 2}
    legacy = manifest["megatron"]["SentencePieceTokenizer --tokenizer-sentencepiece-legacy"]
    assert legacy == {"vocab_size": 303, "eod": 2}
    assert manifest["vocab_size"] == 300 and manifest["byte_fallback"] is True
    assert manifest["lines_seen"] == 650 and manifest["lines_sampled"] == 200
    assert sorted(os.listdir(os.path.dirname(trained))) == ["tok.json", "tok.model", "tok.vocab"]


def test_tokenizer_types_over_the_model(trained):
    import sentencepiece as spm

    model = f"{trained}.model"
    sp = spm.SentencePieceProcessor(model_file=model)
    gpt = make_tokenizer("GPTSentencePieceTokenizer", model)
    cur = make_tokenizer("SentencePieceTokenizer", model)
    leg = make_tokenizer("SentencePieceTokenizer", model, legacy=True)
    # Current: the model as it is, EOD = its eos id; text is text.
    assert (gpt.vocab_size, gpt.eod, gpt.pad) == (300, 2, 3)
    assert (cur.vocab_size, cur.eod, cur.pad) == (300, 2, 3)
    assert build_tokenizer(DataConfig(tokenizer_model=model)).vocab_size == 300
    for text in ("the  quick ＡＢＣ fox", "fox<EOD>fox", "<s></s><SEP>", ""):
        assert cur.tokenize(text) == gpt.tokenize(text) == sp.encode(text)
        assert 2 not in cur.tokenize(text)
    text = "the  quick ＡＢＣ fox"
    assert gpt.detokenize(gpt.tokenize(text)) == text  # identity normalization keeps "  ", "Ａ"
    # Legacy: Megatron appends <CLS> <SEP> <MASK> (the model already has <EOD>, <pad>, <s>) and
    # splits them out of the text.
    assert (leg.vocab_size, leg.eod, leg.pad) == (303, 2, 3)
    cfg = DataConfig(tokenizer_model=model, tokenizer_sentencepiece_legacy=True)
    assert build_tokenizer(cfg).vocab_size == 303
    assert leg.tokenize("fox<EOD>fox") == leg.tokenize("fox") + [2] + leg.tokenize("fox")
    assert leg.tokenize_batch(["fox<SEP>", "fox"]) == [
        leg.tokenize("fox<SEP>"),
        leg.tokenize("fox"),
    ]
    assert leg.tokenize("<SEP>")[-1] == 301
    assert "中" in gpt.detokenize(gpt.tokenize("中"))  # unseen text survives via byte pieces


def test_reservoir_is_uniform_and_bounded():
    tool = load_tool("train_tokenizer")
    sample, n = tool.reservoir(iter(range(10_000)), 100, seed=3)
    assert n == 10_000 and len(sample) == 100 and len(set(sample)) == 100
    assert 3_000 < sum(sample) / 100 < 7_000  # drawn across the stream, not its head
    assert tool.reservoir(iter(range(5)), 100, seed=3) == (list(range(5)), 5)


def test_train_tokenizer_errors(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"body": 1}\n')
    r = subprocess.run(
        [
            sys.executable,
            TOOL,
            "--input",
            str(tmp_path / "bad.jsonl"),
            "--json-keys",
            "body",
            "--output-prefix",
            str(tmp_path / "t"),
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and "bad.jsonl:1: key 'body' must be a string" in r.stderr
    (tmp_path / "small.txt").write_text("ab\n")
    r = subprocess.run(
        [
            sys.executable,
            TOOL,
            "--input",
            str(tmp_path / "small.txt"),
            "--output-prefix",
            str(tmp_path / "t"),
            "--vocab-size",
            "5000",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 1 and "smaller --vocab-size" in r.stderr
    assert not [f for f in os.listdir(tmp_path) if f.startswith("t.")]


BAD_TOKENIZER_ARGS = [
    (("BertWordPieceCase", "x"), {}, "tokenizer_type='BertWordPieceCase' must be one of"),
    (("SentencePieceTokenizer", "/nonexistent.model"), {}, "'/nonexistent.model' does not exist"),
    (("SentencePieceTokenizer",), {}, "needs a model file"),
    (("NullTokenizer",), {}, "needs a vocab size"),
    (("NullTokenizer", None, 10), {"legacy": True}, "applies to .*not NullTokenizer"),
    (("GPT2BPETokenizer",), {"merge_file": "m"}, "GPT2BPETokenizer needs --vocab-file"),
    (
        ("GPT2BPETokenizer",),
        {"vocab_file": __file__, "merge_file": "/no/merges.txt"},
        "--merge-file '/no/merges.txt' does not exist",
    ),
]


@pytest.mark.parametrize("args,kwargs,message", BAD_TOKENIZER_ARGS)
def test_bad_tokenizer_arguments(args, kwargs, message):
    if args[0] == "GPT2BPETokenizer":
        pytest.importorskip("tokenizers")
    with pytest.raises(ValueError, match=message) as err:
        make_tokenizer(*args, **kwargs)
    assert "\n" not in str(err.value)  # one line


def test_not_a_model_or_vocab(tmp_path):
    (tmp_path / "junk.model").write_bytes(b"junk")
    with pytest.raises(ValueError, match="not a sentencepiece model"):
        make_tokenizer("SentencePieceTokenizer", str(tmp_path / "junk.model"))
    pytest.importorskip("tokenizers")
    (tmp_path / "vocab.json").write_text('{"a": 0}')
    (tmp_path / "merges.txt").write_text("#version: 0.2\n")
    with pytest.raises(ValueError, match="256 byte-level symbols are missing"):
        make_tokenizer(
            "GPT2BPETokenizer",
            vocab_file=str(tmp_path / "vocab.json"),
            merge_file=str(tmp_path / "merges.txt"),
        )
    with pytest.raises(ValueError, match="not a tokenizer.json"):
        make_tokenizer("HuggingFaceTokenizer", str(tmp_path / "vocab.json"))


def test_build_tokenizer_vocab_rules(trained):
    # Mock data, no tokenizer named: --vocab-size is the whole mock vocab (EOD V-1).
    mock = DataConfig(mock_data=True)
    assert (build_tokenizer(mock, 256).vocab_size, build_tokenizer(mock, 256).eod) == (256, 255)
    assert build_tokenizer(mock).vocab_size == DEFAULT_MOCK_VOCAB_SIZE
    # NullTokenizer (named, or real data without a model): Megatron-LM main's V ids in all,
    # EOD V - 1, as preprocess_data.py (its legacy tokenizer had V + 1).
    for cfg in (
        DataConfig(tokenizer_type="NullTokenizer", mock_data=True),
        DataConfig(data_path=("x",)),
    ):
        tok = build_tokenizer(cfg, 256)
        assert (tok.vocab_size, tok.eod) == (256, 255)
        assert model_vocab_size(256, tok) == 256  # the EOD row is inside V
    sp = build_tokenizer(DataConfig(tokenizer_model=f"{trained}.model"), 256)
    assert model_vocab_size(None, sp) == 300 and model_vocab_size(320, sp) == 320
    with pytest.raises(ValueError, match="vocab_size=256 is smaller than the vocab of"):
        model_vocab_size(256, sp)


def test_unigram_with_identity_normalization(tmp_path):
    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghijklmnop", k=rng.randint(2, 7))) for _ in range(300)]
    (tmp_path / "t.txt").write_text(
        "".join(" ".join(rng.choices(words, k=12)) + "\n" for _ in range(400))
    )
    r = subprocess.run(
        [
            sys.executable,
            TOOL,
            "--input",
            str(tmp_path / "t.txt"),
            "--output-prefix",
            str(tmp_path / "u"),
            "--vocab-size",
            "120",
            "--model-type",
            "unigram",
            "--no-pad",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "u.json").read_text())
    assert manifest["model_type"] == "unigram" and manifest["special_ids"]["pad"] == -1
    tok = make_tokenizer("GPTSentencePieceTokenizer", str(tmp_path / "u.model"))
    assert tok.pad is None and tok.detokenize(tok.tokenize(words[3] + "  ab")) == words[3] + "  ab"
