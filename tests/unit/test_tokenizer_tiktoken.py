"""TikTokenizer: the ids Megatron-LM's own TikTokenizer gives (tests/fixtures/tiktoken/, written
by its make.py), both patterns, a special-token list of its own and a cut vocab; special tokens
in the text stay text; preprocess_data.py writes the ids and a sidecar whose pattern the
training-start check compares; one-line errors for bad flags and bad vocab files."""

import base64
import json
import os
import subprocess
import sys

import pytest

from megafp8.config import Config
from megafp8.data.indexed import IndexedDataset
from megafp8.data.tokenizer import check_run_tokenizer, make_tokenizer, read_sidecar

pytest.importorskip("tiktoken", reason="TikTokenizer needs the optional 'tiktoken'")

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FIX = os.path.join(ROOT, "tests", "fixtures", "tiktoken")
VOCAB = os.path.join(FIX, "vocab.json")
with open(os.path.join(FIX, "expected.json"), encoding="utf-8") as _f:
    EXPECTED = json.load(_f)
SPECIAL_TEXT = EXPECTED["texts"].index(
    next(t for t in EXPECTED["texts"] if t.startswith("special tokens as text"))
)


def _tok(case):
    return make_tokenizer(
        "TikTokenizer",
        VOCAB,
        case["vocab_size"],
        tiktoken_pattern=case["pattern"],
        tiktoken_num_special_tokens=case["num_special"],
        special_tokens=case["special"],
    )


def _case_id(case):
    return f"{case['pattern']}-{case['num_special']}"


@pytest.mark.parametrize("case", EXPECTED["cases"], ids=_case_id)
def test_megatrons_ids(case):
    tok = _tok(case)
    megatron = (case["megatron_vocab_size"], case["eod"], case["pad"])
    assert (tok.vocab_size, tok.eod, tok.pad) == megatron
    for i, (text, ids) in enumerate(zip(EXPECTED["texts"], case["ids"], strict=True)):
        if i != SPECIAL_TEXT:
            assert tok.tokenize(text) == ids, text
            assert tok.detokenize(ids) == text
    keep = [i for i in range(len(EXPECTED["texts"])) if i != SPECIAL_TEXT]
    batch = tok.tokenize_batch([EXPECTED["texts"][i] for i in keep])
    assert batch == [case["ids"][i] for i in keep]
    assert max(map(max, filter(None, case["ids"]))) < tok.vocab_size


def test_the_patterns_differ_where_megatrons_do():
    v1, v2 = EXPECTED["cases"][0], EXPECTED["cases"][1]
    assert (v1["pattern"], v2["pattern"]) == ("v2", "v1")
    assert v1["ids"] != v2["ids"]  # the fixture holds a text they split apart


def test_special_tokens_in_the_text_stay_text():
    """Megatron-LM encodes them as their ids (allowed_special="all"); here a document cannot
    hold an EOD it did not end with."""
    for case in EXPECTED["cases"]:
        tok, text = _tok(case), EXPECTED["texts"][SPECIAL_TEXT]
        megatron = case["ids"][SPECIAL_TEXT]
        assert tok.eod in megatron  # "</s>" became the EOD there
        ids = tok.tokenize(text)
        assert min(ids) >= case["num_special"] and tok.detokenize(ids) == text


def _write_vocab(path, entries):
    with open(path, "w") as f:
        json.dump(entries, f)
    return str(path)


def _entries(n=300):
    with open(VOCAB, encoding="utf-8") as f:
        return json.load(f)[:n]


@pytest.mark.parametrize(
    "change,kwargs,message",
    [
        (None, {"tiktoken_pattern": "v3"}, "--tiktoken-pattern must be v1 or v2, got 'v3'"),
        (None, {"special_tokens": ["<s>", "</s>"]}, "must include .*missing \\['<unk>', '<mask>'"),
        (
            None,
            {
                "special_tokens": [
                    "<unk>",
                    "<s>",
                    "</s>",
                    "<mask>",
                    "<pad>",
                    "<cls>",
                    "<sep>",
                    "<s>",
                ]
            },
            "names '<s>' more than once",
        ),  # fmt: skip
        (None, {"tiktoken_num_special_tokens": 5}, "7 special tokens do not fit .* 5"),
        (None, {"vocab_size": 1000 + 701}, "holds 700 tokens, but .* ask for 701"),
        (None, {"tiktoken_num_special_tokens": 1500}, "must be in \\(0, --vocab-size 1700 "),
        (lambda e: e[5].update(rank=6), {}, "entry 5 has rank 6, expected 5"),
        (
            lambda e: e[65].update(token_bytes=base64.b64encode(b"B").decode()),
            {},
            "entry 65 must be the single byte 65",
        ),  # fmt: skip
        (lambda e: e[290].update(token_bytes="not base64!"), {}, "entry 290: token_bytes is not"),
        (lambda e: e[291].update(token_bytes=e[290]["token_bytes"]), {}, "entry 291: .* repeats"),
        (lambda e: e[3].pop("token_str"), {}, "entry 3 is not \\{rank, token_bytes, token_str\\}"),
    ],
)
def test_bad_flags_and_vocab_files(tmp_path, change, kwargs, message):
    entries = _entries(700)
    if change is not None:
        change(entries)
    path = _write_vocab(tmp_path / "v.json", entries)
    args = {"vocab_size": 1700, **kwargs}
    vocab_size = args.pop("vocab_size")
    with pytest.raises(ValueError, match=message) as err:
        make_tokenizer("TikTokenizer", path, vocab_size, **args)
    assert "\n" not in str(err.value)


def test_not_a_vocab_and_no_file(tmp_path):
    with pytest.raises(ValueError, match="expected a JSON list"):
        make_tokenizer("TikTokenizer", _write_vocab(tmp_path / "d.json", {"a": 1}), 1300)
    (tmp_path / "bad.json").write_text("[{")
    with pytest.raises(ValueError, match="bad.json: not a tiktoken JSON vocab"):
        make_tokenizer("TikTokenizer", str(tmp_path / "bad.json"), 1300)
    with pytest.raises(ValueError, match="--tokenizer-model .*missing.json' does not exist"):
        make_tokenizer("TikTokenizer", str(tmp_path / "missing.json"), 1300)
    with pytest.raises(ValueError, match="TikTokenizer needs a model file"):
        make_tokenizer("TikTokenizer", None, 1300)


def _preprocess(tmp_path, tag, *extra):
    rows = [t for t in EXPECTED["texts"]]
    with open(tmp_path / "in.jsonl", "w", encoding="utf-8") as f:
        for t in rows:
            f.write(json.dumps({"text": t}) + "\n")
    cmd = [sys.executable, os.path.join(ROOT, "data_tools", "preprocess_data.py"),
           "--input", str(tmp_path / "in.jsonl"), "--append-eod", "--tokenizer-type",
           "TikTokenizer", "--tokenizer-model", VOCAB, "--vocab-size", "1700",
           "--output-prefix", str(tmp_path / tag), "--workers", "2", *extra]  # fmt: skip
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)
    assert r.returncode == 0, r.stderr
    return str(tmp_path / f"{tag}_text_document")


def test_preprocess_and_the_training_start_check(tmp_path):
    case = EXPECTED["cases"][1]  # v1, 1000 special tokens, vocab 1700
    prefix = _preprocess(tmp_path, "t", "--tiktoken-pattern", "v1")
    ds = IndexedDataset(prefix)
    docs = [ds[i].tolist() for i in range(len(ds))]
    tok = _tok(case)
    want = [tok.tokenize(t) + [tok.eod] for t in EXPECTED["texts"] if t]
    assert docs == want
    assert [d[:-1] for i, d in enumerate(docs) if i != SPECIAL_TEXT] == [
        ids for i, ids in enumerate(case["ids"]) if i != SPECIAL_TEXT and EXPECTED["texts"][i]
    ]
    side = read_sidecar(prefix)
    assert side["tokenizer_type"] == "TikTokenizer" and side["eod"] == 2
    assert side["options"] == {"tiktoken_pattern": "v1", "num_special_tokens": 1000,
                               "special_tokens": ["<unk>", "<s>", "</s>", "<mask>", "<pad>",
                                                  "<cls>", "<sep>"]}  # fmt: skip

    def cfg(**data):
        d = {"data_path": (prefix,), "tokenizer_type": "TikTokenizer", "tokenizer_model": VOCAB}
        return Config().replace(data={**d, **data}, model={"vocab_size": 1700})

    assert check_run_tokenizer(cfg(tiktoken_pattern="v1")).eod == 2
    with pytest.raises(ValueError, match="pattern v1.*this run uses .*tiktoken_pattern v2"):
        check_run_tokenizer(cfg())  # Megatron's default pattern, v2, is not what wrote it
    with pytest.raises(ValueError, match="num_special_tokens 1000.*num_special_tokens 1010"):
        check_run_tokenizer(cfg(tiktoken_pattern="v1", tiktoken_num_special_tokens=1010))


def test_megatron_flags_reach_the_tokenizer():
    from megafp8.cli import parse_args

    flags = ("--mock-data --tokenizer-type TikTokenizer --tokenizer-model " + VOCAB
             + " --vocab-size 616 --tiktoken-pattern v2 --tiktoken-num-special-tokens 16"
             " --tokenizer-special-tokens <s> <unk> </s> <pad> <mask> <cls> <sep>"
             " <|im_start|>")  # fmt: skip
    cfg = parse_args(flags.split(), [])
    d = cfg.data
    assert (d.tiktoken_pattern, d.tiktoken_num_special_tokens) == ("v2", 16)
    assert d.tokenizer_special_tokens[-1] == "<|im_start|>"
    tok = check_run_tokenizer(cfg)
    case = EXPECTED["cases"][2]
    assert (tok.vocab_size, tok.eod, tok.pad) == (616, case["eod"], case["pad"])
    assert tok.tokenize(EXPECTED["texts"][0]) == case["ids"][0]


def test_hf_export_leaves_the_vocab_out(tmp_path):
    """A tiktoken vocab is not a Hugging Face tokenizer.json: the export names it and copies
    nothing (it would otherwise be written as tokenizer.json)."""
    from megafp8.config import DataConfig
    from megafp8.hf.io import copy_tokenizer

    d = DataConfig(tokenizer_type="TikTokenizer", tokenizer_model=VOCAB)
    notes = copy_tokenizer(d, str(tmp_path))
    assert os.listdir(tmp_path) == [] and notes == [
        f"{VOCAB}: a TikTokenizer vocab has no Hugging Face form: not copied"
    ]
