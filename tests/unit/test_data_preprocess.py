"""preprocess_data.py end to end: identical bytes for any workers/partitions, content, every
bad-input case (file:line, exit 1, nothing left behind), --skip-bad-lines, and what each
tokenizer flag writes (golden ids, EOD, the tokenizer sidecar)."""

import gzip
import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megafp8.data.indexed import IndexedDataset
from megafp8.data.tokenizer import make_tokenizer, read_sidecar
from tests.unit.tiny_tokenizers import SP_SIZE, write_gpt2_files, write_sp_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "data_tools", "preprocess_data.py")
WORDS = "alpha beta gamma delta epsilon zeta eta theta iota kappa lambda mu nu xi omicron".split()


def texts(n, seed=0):
    rng = np.random.default_rng(seed)
    return [
        " ".join(rng.choice(WORDS, rng.integers(0, 40))) + ("\nnew line" if i % 7 else "")
        for i in range(n)
    ]


@pytest.fixture(scope="module")
def sp_model(tmp_path_factory):
    import sentencepiece as spm

    prefix = str(tmp_path_factory.mktemp("spm") / "tiny")
    spm.SentencePieceTrainer.train(
        sentence_iterator=iter(texts(400, 1)),
        model_prefix=prefix,
        vocab_size=80,
        model_type="bpe",
        byte_fallback=False,
        unk_id=0,
        bos_id=1,
        eos_id=2,
        pad_id=3,
        eos_piece="<EOD>",
        minloglevel=2,
    )
    return prefix + ".model"


def write_jsonl(path, rows, opener=open):
    with opener(path, "wt", encoding="utf-8") as f:
        for r in rows:
            f.write((r if isinstance(r, str) else json.dumps(r)) + "\n")
    return str(path)


def run_pp(*args, model=None):
    cmd = [sys.executable, TOOL, *map(str, args)]
    if model:
        cmd += ["--tokenizer-type", "SentencePieceTokenizer", "--tokenizer-model", model]
    return subprocess.run(cmd, capture_output=True, text=True, cwd=ROOT)


def outputs(d):
    return sorted(f for f in os.listdir(d) if ".bin" in f or ".idx" in f)


def test_workers_and_partitions_give_identical_bytes(tmp_path, sp_model):
    rows = [{"text": t, "title": t[:12]} for t in texts(600)]
    files = [
        write_jsonl(tmp_path / "in0.jsonl", rows[:200]),
        write_jsonl(tmp_path / "in1.jsonl.gz", rows[200:450], gzip.open),
        write_jsonl(tmp_path / "in2.jsonl", rows[450:]),
    ]
    results = {}
    for tag, extra in {
        "w1": ["--workers", 1],
        "w4": ["--workers", 4],
        "p2": ["--workers", 2, "--partitions", 2],
    }.items():
        r = run_pp(
            "--input",
            *files,
            "--json-keys",
            "text",
            "title",
            "--append-eod",
            "--block-bytes",
            2048,
            "--output-prefix",
            tmp_path / tag,
            *extra,
            model=sp_model,
        )
        assert r.returncode == 0, r.stderr
        results[tag] = {
            k: (tmp_path / f"{tag}_{k}_document.{e}").read_bytes()
            for k in ("text", "title")
            for e in ("bin", "idx")
        }
    assert results["w1"] == results["w4"] == results["p2"]
    sides = [read_sidecar(str(tmp_path / f"{t}_title_document")) for t in results]
    assert sides[0] == sides[1] == sides[2] and sides[0]["max_token_id"] >= 0
    assert outputs(tmp_path) == sorted(
        f"{t}_{k}_document.{e}" for t in results for k in ("text", "title") for e in ("bin", "idx")
    )


def test_content_eod_and_empty_documents(tmp_path, sp_model):
    docs = ["alpha beta", "", "gamma", ["delta", "", "eta theta"]]
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in docs])
    r = run_pp(
        "--input",
        path,
        "--append-eod",
        "--log-interval",
        1,
        "--output-prefix",
        tmp_path / "o",
        model=sp_model,
    )
    assert r.returncode == 0, r.stderr
    assert "processed 4 documents" in r.stderr  # progress lines when stderr is not a terminal
    assert all(unit in r.stderr for unit in ("docs/s", "tokens/s", "MB/s"))
    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    tok = make_tokenizer("SentencePieceTokenizer", sp_model)
    assert ds.dtype == np.uint16
    # Megatron: the empty document has no sequence and no EOD; list items are sequences.
    assert np.diff(ds.document_indices).tolist() == [1, 0, 1, 2]
    expected = [
        tok.tokenize("alpha beta") + [tok.eod],
        tok.tokenize("gamma") + [tok.eod],
        tok.tokenize("delta"),
        tok.tokenize("eta theta") + [tok.eod],
    ]
    assert [ds[i].tolist() for i in range(len(ds))] == expected


def test_null_tokenizer_uses_megatron_vocab_meaning(tmp_path):
    # Megatron-LM main: --vocab-size V is V ids in all, EOD V - 1 (its legacy tokenizer: V + 1)
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "1 2 98"}])
    r = run_pp(
        "--input",
        path,
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        100,
        "--append-eod",
        "--output-prefix",
        tmp_path / "n",
    )
    assert r.returncode == 0, r.stderr
    assert IndexedDataset(str(tmp_path / "n_text_document"))[0].tolist() == [1, 2, 98, 99]
    side = read_sidecar(str(tmp_path / "n_text_document"))
    assert (side["vocab_size"], side["eod"], side["max_token_id"], side["files"]) == (
        100,
        99,
        99,
        {},
    )
    # The EOD id written in the text would end a document mid-text: refused, nothing written.
    path = write_jsonl(tmp_path / "eod.jsonl", [{"text": "1 2"}, {"text": "5 99 7"}])
    r = run_pp(
        "--input",
        path,
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        100,
        "--output-prefix",
        tmp_path / "e",
    )
    assert r.returncode == 1 and f"{path}: a line from 1 on" in r.stderr
    assert "EOD 99 may not appear in text" in r.stderr
    assert not list(tmp_path.glob("e_*"))


DOCS = ["hello world", "hello</s>world", "<EOD>", "", "héllo <|endoftext|>"]


def _docs(prefix):
    ds = IndexedDataset(str(prefix))
    return [ds[i].tolist() for i in range(len(ds))], np.diff(ds.document_indices).tolist()


def test_sentencepiece_current_and_legacy_write_megatron_ids(tmp_path):
    model = write_sp_model(str(tmp_path / "tiny.model"))
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in DOCS])
    cur, leg = make_tokenizer(None, model), make_tokenizer(None, model, legacy=True)
    for tag, tok, extra in (("c", cur, []), ("l", leg, ["--tokenizer-sentencepiece-legacy"])):
        r = run_pp(
            "--input", path, "--append-eod", "--output-prefix", tmp_path / tag, *extra, model=model
        )
        assert r.returncode == 0, r.stderr
        seqs, per_doc = _docs(tmp_path / f"{tag}_text_document")
        assert per_doc == [1, 1, 1, 0, 1]  # the empty document has no sequence and no EOD
        assert seqs == [tok.tokenize(t) + [tok.eod] for t in DOCS if t]
        side = read_sidecar(str(tmp_path / f"{tag}_text_document"))
        assert (side["tokenizer_type"], side["legacy"], side["eod"]) == (
            "SentencePieceTokenizer",
            tag == "l",
            tok.eod,
        )
        assert side["max_token_id"] == max(map(max, seqs)) < side["vocab_size"]
        assert side["append_eod"] is True and side["num_tokens"] == sum(map(len, seqs))
    c, _ = _docs(tmp_path / "c_text_document")
    leg, _ = _docs(tmp_path / "l_text_document")
    # Current: EOD is the model's eos (2), only at the end; "</s>" and "<EOD>" stay text.
    assert c[0] == [271, 276, 2] and c[2] == [259, 63, 72, 82, 71, 65, 2]
    assert all(2 not in seq[:-1] for seq in c) and max(map(max, c)) < SP_SIZE
    # Legacy: EOD is the appended <EOD> (SP_SIZE + 2 = 279), and the text's "</s>"/"<EOD>"
    # become ids 2 and 279.
    assert leg[0] == [271, 276, 279] and leg[1] == [271, 2, 276, 279] and leg[2] == [279, 279]


def test_gpt2_bpe_preprocessing(tmp_path):
    pytest.importorskip("tokenizers", reason="GPT2BPETokenizer needs the optional 'tokenizers'")
    vocab, merges = write_gpt2_files(str(tmp_path))
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": t} for t in DOCS])
    r = run_pp(
        "--input",
        path,
        "--append-eod",
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        vocab,
        "--merge-file",
        merges,
        "--output-prefix",
        tmp_path / "g",
        "--workers",
        2,
    )
    assert r.returncode == 0, r.stderr
    seqs, _ = _docs(tmp_path / "g_text_document")
    assert seqs[0] == [259, 264, 265]  # hello Ġworld <|endoftext|>
    assert all(265 not in seq[:-1] and seq[-1] == 265 for seq in seqs)
    side = read_sidecar(str(tmp_path / "g_text_document"))
    assert sorted(side["files"]) == ["merges.txt", "vocab.json"] and side["eod"] == 265
    r = run_pp(
        "--input",
        path,
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        vocab,
        "--output-prefix",
        tmp_path / "x",
    )
    assert r.returncode == 1 and "GPT2BPETokenizer needs --merge-file" in r.stderr


def test_directory_glob_and_zstd_inputs(tmp_path, sp_model):
    import zstandard

    (tmp_path / "d").mkdir()
    write_jsonl(tmp_path / "d" / "a.jsonl", [{"text": "alpha"}])
    raw = (json.dumps({"text": "beta"}) + "\n").encode()
    (tmp_path / "d" / "b.jsonl.zst").write_bytes(zstandard.ZstdCompressor().compress(raw))
    for spec in [tmp_path / "d", tmp_path / "d" / "*.json*"]:
        r = run_pp("--input", spec, "--output-prefix", tmp_path / "o", model=sp_model)
        assert r.returncode == 0, r.stderr
        assert len(IndexedDataset(str(tmp_path / "o_text_document"))) == 2


def _gz(text):
    return gzip.compress(text.encode())


def _zst(text):
    import zstandard

    return zstandard.ZstdCompressor().compress(text.encode())


BAD_CASES = [
    ("malformed", "in.jsonl", '{"text": "ok"}\n{"text": "no end\n', ":2: malformed JSON"),
    (
        "not_object",
        "in.jsonl",
        '{"text": "ok"}\n["text"]\n',
        ":2: expected a JSON object, got a JSON array",
    ),
    (
        "missing_key",
        "in.jsonl",
        '{"text": "ok"}\n{"body": "x"}\n',
        ":2: missing key 'text' (keys present: 'body')",
    ),
    ("non_string", "in.jsonl", '{"text": 5}\n', ":1: key 'text' must be a string"),
    ("empty_line", "in.jsonl", '{"text": "a"}\n\n{"text": "b"}\n', ":2: empty line"),
    ("surrogate", "in.jsonl", '{"text": "a\\ud800b"}\n', ":1: key 'text' holds a lone"),
    ("utf8", "in.jsonl", b'{"text": "ok"}\n{"text": "\xff\xfe"}\n', ":2: invalid UTF-8"),
    (
        "gz_as_plain",
        "in.jsonl",
        _gz('{"text": "a"}\n'),
        ":1: holds gzip-compressed data but its name has no compression suffix",
    ),
    (
        "plain_as_gz",
        "in.jsonl.gz",
        '{"text": "a"}\n',
        ":1: named as gzip (.gz) but holds uncompressed bytes",
    ),
    (
        "zst_as_gz",
        "in.jsonl.gz",
        b"\x28\xb5\x2f\xfd" + b"\x00" * 8,
        ":1: named as gzip (.gz) but holds zstd",
    ),
    ("truncated_gz", "in.jsonl.gz", _gz('{"text": "a"}\n' * 500)[:-30], "bad gzip stream"),
    ("truncated_zst", "in.jsonl.zst", _zst('{"text": "a"}\n' * 500)[:-9], "zstd stream ends"),
]


@pytest.mark.parametrize("name,fname,content,message", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_bad_input_fails_cleanly(tmp_path, sp_model, name, fname, content, message):
    path = tmp_path / fname
    path.write_bytes(content.encode() if isinstance(content, str) else content)
    (tmp_path / "out").mkdir()
    r = run_pp(
        "--input", path, "--workers", 2, "--output-prefix", tmp_path / "out" / "o", model=sp_model
    )
    assert r.returncode == 1
    assert message in r.stderr and str(path) in r.stderr, r.stderr
    assert os.listdir(tmp_path / "out") == []  # no output, complete or partial


def test_skip_bad_lines_reports_and_keeps_the_rest(tmp_path, sp_model):
    lines = ['{"text": "alpha"}', "not json", '{"text": "beta"}', "[1]", '{"text": 3}']
    lines += ['{"text": "gamma"}'] * 20 + ['{"x": 1}'] * 12
    path = write_jsonl(tmp_path / "in.jsonl", lines)
    r = run_pp(
        "--input", path, "--skip-bad-lines", "--output-prefix", tmp_path / "o", model=sp_model
    )
    assert r.returncode == 0, r.stderr
    assert "skipped 15 bad line(s)" in r.stderr
    assert f"{path}:2: malformed JSON" in r.stderr and f"{path}:4: expected" in r.stderr
    assert f"{path}:37:" not in r.stderr  # only the first ten locations are listed
    ds = IndexedDataset(str(tmp_path / "o_text_document"))
    assert ds.num_documents == 22


def test_errors_before_work(tmp_path, sp_model):
    path = write_jsonl(tmp_path / "in.jsonl", [{"text": "a"}])
    r = run_pp(
        "--input",
        path,
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        tmp_path / "missing.model",
        "--output-prefix",
        tmp_path / "o",
    )
    assert r.returncode == 1 and "does not exist" in r.stderr
    r = run_pp(
        "--input", tmp_path / "nothing*.jsonl", "--output-prefix", tmp_path / "o", model=sp_model
    )
    assert r.returncode == 1 and "no such file" in r.stderr
    r = run_pp(
        "--input", path, "--split-sentences", "--output-prefix", tmp_path / "o", model=sp_model
    )
    assert r.returncode == 2 and "not supported" in r.stderr
    r = run_pp(
        "--input",
        path,
        "--tokenizer-type",
        "NullTokenizer",
        "--vocab-size",
        9,
        "--tokenizer-sentencepiece-legacy",
        "--output-prefix",
        tmp_path / "o",
    )
    assert r.returncode == 1 and "applies to" in r.stderr
    assert outputs(tmp_path) == []


def test_ids_outside_the_vocab_are_refused():
    import importlib.util

    spec = importlib.util.spec_from_file_location("preprocess_data", TOOL)
    tool = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(tool)

    class Bad:
        vocab_size, eod = 10, 9

        def tokenize_batch(self, texts):
            return [[3, int(t)] for t in texts]

    tokens, lengths, per_doc = tool._encode_key(Bad(), [["4"], ["8"]], True, np.dtype(np.uint16))
    assert tokens.tolist() == [3, 4, 9, 3, 8, 9] and lengths.tolist() == [3, 3]
    for text in ("10", "-1"):
        with pytest.raises(ValueError, match=r"outside \[0, 10\)"):
            tool._encode_key(Bad(), [[text]], False, np.dtype(np.uint16))
