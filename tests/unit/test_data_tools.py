"""Demo corpus, merge and inspect tools, the demo driver, and the once-per-node index build."""

import importlib.util
import json
import os
import subprocess
import sys
from unittest.mock import ANY

import numpy as np
import pytest

from megafp8.data.gpt_dataset import GPTDataset
from megafp8.data.indexed import IndexedDataset, IndexedDatasetWriter
from tests.helpers.dist import run_distributed

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOLS = os.path.join(ROOT, "data_tools")


def tool(name, *args):
    return subprocess.run(
        [sys.executable, os.path.join(TOOLS, f"{name}.py"), *map(str, args)],
        capture_output=True,
        text=True,
        cwd=ROOT,
    )


def test_demo_corpus_is_deterministic_and_python_only(tmp_path):
    spec = importlib.util.spec_from_file_location(
        "bdc", os.path.join(TOOLS, "build_demo_corpus.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    a, b = tmp_path / "a.jsonl", tmp_path / "b.jsonl"
    assert mod.build(str(a), max_docs=600) == mod.build(str(b), max_docs=600) == (600, ANY)
    assert a.read_bytes() == b.read_bytes()
    rows = [json.loads(line) for line in a.read_text().splitlines()]
    sources = {r["source"] for r in rows}
    assert "pydoc_data:assert" in sources  # reference-manual topics, then stdlib docstrings
    assert "argparse" in sources and "abc.ABC" in sources
    assert all(len(r["text"]) >= 80 for r in rows)


def _small(prefix, docs, dtype=np.uint16):
    with IndexedDatasetWriter(str(prefix), dtype) as w:
        for d in docs:
            w.add_document(np.asarray(d, dtype))


def test_merge_concatenates_in_order(tmp_path):
    (tmp_path / "shards").mkdir()
    _small(tmp_path / "shards" / "s1", [[1, 2], [], [3]])
    _small(tmp_path / "shards" / "s0", [[7, 7, 7]])
    r = tool("merge_datasets", "--input", tmp_path / "shards", "--output-prefix", tmp_path / "m")
    assert r.returncode == 0, r.stderr
    m = IndexedDataset(str(tmp_path / "m"))
    assert [m[i].tolist() for i in range(len(m))] == [[7, 7, 7], [1, 2], [3]]
    assert m.document_indices.tolist() == [0, 1, 2, 2, 3]
    _small(tmp_path / "wide", [[1]], np.int32)
    r = tool(
        "merge_datasets",
        "--input",
        tmp_path / "m",
        tmp_path / "wide",
        "--output-prefix",
        tmp_path / "bad",
    )
    assert r.returncode == 1 and "different token dtypes" in r.stderr
    assert not list(tmp_path.glob("bad*"))


def test_inspect_reports_counts_histogram_and_samples(tmp_path):
    _small(tmp_path / "d", [[5, 5, 6], [], [6, 7]])
    r = tool("inspect_dataset", tmp_path / "d", "--json", "--decode", 2, "--vocab-size", 10)
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert (s["sequences"], s["documents"], s["empty_documents"], s["tokens"]) == (2, 3, 1, 5)
    assert s["top_tokens"] == [[5, 2], [6, 2], [7, 1]]
    assert s["sequence_length"]["max"] == 3
    assert sorted(x["text"] for x in s["samples"]) == ["5 5 6", "6 7"]
    (tmp_path / "d.idx").write_bytes(b"TNTIDX\x00\x00" + b"\x00" * 40)
    r = tool("inspect_dataset", tmp_path / "d")
    assert r.returncode == 1 and "legacy" in r.stderr


@pytest.mark.slow
def test_demo_up_to_preprocessing_and_skips_done_steps(tmp_path):
    r = subprocess.run(
        [
            sys.executable,
            os.path.join(TOOLS, "demo.py"),
            "--out",
            tmp_path,
            "--skip-train",
            "--vocab-size",
            "1024",
        ],
        capture_output=True,
        text=True,
    )
    assert r.returncode == 0, r.stdout + r.stderr
    ds = IndexedDataset(str(tmp_path / "data" / "demo_text_document"))
    assert ds.num_documents > 1000 and ds.num_tokens > 100_000
    assert json.loads((tmp_path / "tokenizer.json").read_text())["vocab_size"] == 1024
    again = subprocess.run(
        [sys.executable, os.path.join(TOOLS, "demo.py"), "--out", tmp_path, "--skip-train"],
        capture_output=True,
        text=True,
    )
    assert again.stdout.count("already complete, skipped") == 3


def _build_on_rank(cache_dir, local_ranks):
    import torch.distributed as dist

    os.environ["LOCAL_RANK"] = str(local_ranks[dist.get_rank()])

    class Low:
        sequence_lengths = np.random.default_rng(0).integers(1, 50, 500).astype(np.int32)

    ds = GPTDataset(Low(), np.arange(500), 32, 400, seed=1, cache_dir=cache_dir)
    return type(ds.shuffle_index).__name__, np.asarray(ds.shuffle_index).tolist()


@pytest.mark.parametrize("local_ranks", [[0, 1], [0, 0]], ids=["one_node", "two_nodes"])
def test_index_built_once_per_node(tmp_path, local_ranks):
    results = run_distributed(_build_on_rank, 2, str(tmp_path), local_ranks)
    (kind0, a), (kind1, b) = results
    assert a == b
    if local_ranks[1]:  # one node: LOCAL_RANK 0 built it, the other waited, then loaded it
        assert (kind0, kind1) == ("ndarray", "memmap")
    else:  # two nodes sharing the cache: each builds unless the other's complete set is there
        assert "ndarray" in (kind0, kind1)
    assert len(list(tmp_path.glob("*.npy"))) == 3 and not list(tmp_path.glob("*tmp*"))


def test_inspect_decodes_with_the_preprocessing_tokenizer_flags(tmp_path):
    """inspect_dataset takes the same tokenizer flags as preprocess_data.py (GPT-2 BPE here)."""
    pytest.importorskip("tokenizers")
    from megafp8.data.tokenizer import make_tokenizer
    from tests.unit.tiny_tokenizers import write_gpt2_files

    vocab, merges = write_gpt2_files(str(tmp_path))
    tok = make_tokenizer("GPT2BPETokenizer", None, None, vocab_file=vocab, merge_file=merges)
    _small(tmp_path / "d", [tok.tokenize("hello world")])
    r = tool(
        "inspect_dataset",
        tmp_path / "d",
        "--json",
        "--decode",
        1,
        "--tokenizer-type",
        "GPT2BPETokenizer",
        "--vocab-file",
        vocab,
        "--merge-file",
        merges,
    )
    assert r.returncode == 0, r.stderr
    assert json.loads(r.stdout)["samples"][0]["text"] == "hello world"
