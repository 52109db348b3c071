"""train_tokenizer.py and the tokenizer types: special ids, Megatron's SentencePiece vocab,
identity normalization, bounded sampling, HF tokenizers when installed."""

import importlib.util
import json
import os
import random
import subprocess
import sys

import pytest

from megafp8.config import DataConfig
from megafp8.data.tokenizer import build_tokenizer, make_tokenizer

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
            f.write(json.dumps({"body": f"Line {i}: the  quick brown fox jumps over ＡＢＣ\nnext"})
                    + "\n")
    (d / "extra.txt").write_text("plain text file with words\n" * 50)
    r = subprocess.run([sys.executable, TOOL, "--input", str(d / "in.jsonl"), str(d / "extra.txt"),
                        "--json-keys", "body", "--output-prefix", str(d / "out" / "tok"),
                        "--vocab-size", "300", "--byte-fallback", "--max-sentences", "200"],
                       capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    return d / "out" / "tok"


def test_manifest_and_special_ids(trained):
    manifest = json.loads(open(f"{trained}.json").read())
    assert manifest["special_ids"] == {"unk": 0, "bos": 1, "eod": 2, "pad": 3}
    assert manifest["vocab_size"] == 300 and manifest["byte_fallback"] is True
    assert manifest["lines_seen"] == 650 and manifest["lines_sampled"] == 200
    assert sorted(os.listdir(os.path.dirname(trained))) == ["tok.json", "tok.model", "tok.vocab"]


def test_tokenizer_types_over_the_model(trained):
    model = f"{trained}.model"
    gpt = make_tokenizer("GPTSentencePieceTokenizer", model)
    meg = make_tokenizer("SentencePieceTokenizer", model)
    assert (gpt.vocab_size, gpt.eod, gpt.pad) == (300, 2, 3)
    # Megatron appends <CLS> <SEP> <MASK> (the model already has <EOD>, <pad>, <s>).
    assert meg.vocab_size == 303 and meg.eod == 2 and meg.pad == 3
    assert build_tokenizer(DataConfig(tokenizer_model=model)).vocab_size == 303
    text = "the  quick ＡＢＣ fox"
    assert gpt.tokenize(text) == meg.tokenize(text)
    assert gpt.detokenize(gpt.tokenize(text)) == text  # identity normalization keeps "  ", "Ａ"
    assert meg.tokenize("fox<EOD>fox") == meg.tokenize("fox") + [2] + meg.tokenize("fox")
    assert meg.tokenize_batch(["fox<SEP>", "fox"]) == [meg.tokenize("fox<SEP>"),
                                                        meg.tokenize("fox")]
    assert meg.tokenize("<SEP>")[-1] == 301
    assert "中" in gpt.detokenize(gpt.tokenize("中"))  # unseen text survives via byte pieces


def test_reservoir_is_uniform_and_bounded():
    tool = load_tool("train_tokenizer")
    sample, n = tool.reservoir(iter(range(10_000)), 100, seed=3)
    assert n == 10_000 and len(sample) == 100 and len(set(sample)) == 100
    assert 3_000 < sum(sample) / 100 < 7_000  # drawn across the stream, not its head
    assert tool.reservoir(iter(range(5)), 100, seed=3) == (list(range(5)), 5)


def test_train_tokenizer_errors(tmp_path):
    (tmp_path / "bad.jsonl").write_text('{"body": 1}\n')
    r = subprocess.run([sys.executable, TOOL, "--input", str(tmp_path / "bad.jsonl"),
                        "--json-keys", "body", "--output-prefix", str(tmp_path / "t")],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "bad.jsonl:1: key 'body' must be a string" in r.stderr
    (tmp_path / "small.txt").write_text("ab\n")
    r = subprocess.run([sys.executable, TOOL, "--input", str(tmp_path / "small.txt"),
                        "--output-prefix", str(tmp_path / "t"), "--vocab-size", "5000"],
                       capture_output=True, text=True)
    assert r.returncode == 1 and "smaller --vocab-size" in r.stderr
    assert not [f for f in os.listdir(tmp_path) if f.startswith("t.")]


def test_unknown_type_and_missing_model():
    with pytest.raises(ValueError, match="must be one of"):
        make_tokenizer("GPT2BPETokenizer", "x")
    with pytest.raises(ValueError, match="does not exist"):
        make_tokenizer("SentencePieceTokenizer", "/nonexistent.model")
    with pytest.raises(ValueError, match="needs a vocab size"):
        make_tokenizer("NullTokenizer")


def test_huggingface_tokenizer_json(tmp_path):
    tokenizers = pytest.importorskip("tokenizers")
    from tokenizers import models, pre_tokenizers, trainers

    tok = tokenizers.Tokenizer(models.BPE(unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.train_from_iterator(["hello world"] * 20, trainers.BpeTrainer(
        vocab_size=40, special_tokens=["<unk>", "<|endoftext|>"]))
    tok.save(str(tmp_path / "tokenizer.json"))
    hf = make_tokenizer("HuggingFaceTokenizer", str(tmp_path))
    assert hf.eod == 1 and hf.detokenize(hf.tokenize("hello")) == "hello"


def test_unigram_with_identity_normalization(tmp_path):
    rng = random.Random(0)
    words = ["".join(rng.choices("abcdefghijklmnop", k=rng.randint(2, 7))) for _ in range(300)]
    (tmp_path / "t.txt").write_text("".join(" ".join(rng.choices(words, k=12)) + "\n"
                                            for _ in range(400)))
    r = subprocess.run([sys.executable, TOOL, "--input", str(tmp_path / "t.txt"), "--output-prefix",
                        str(tmp_path / "u"), "--vocab-size", "120", "--model-type", "unigram",
                        "--no-pad"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    manifest = json.loads((tmp_path / "u.json").read_text())
    assert manifest["model_type"] == "unigram" and manifest["special_ids"]["pad"] == -1
    tok = make_tokenizer("GPTSentencePieceTokenizer", str(tmp_path / "u.model"))
    assert tok.pad is None and tok.detokenize(tok.tokenize(words[3] + "  ab")) == words[3] + "  ab"
