#!/usr/bin/env python3
"""Preprocessing throughput and memory: preprocess_data.py at 1 and 2 workers on a JSONL of at
least 50 MB with a 32k BPE sentencepiece model, beside the same tokenizer's raw encode rate.

    python3 bench/preprocess.py                    # inputs under /tmp/megafp8-bench (reused)
    python3 bench/preprocess.py --size-mb 200 --workers 1 2

The corpus is the demo corpus (Python's own docs) re-assembled into new documents of 1-8 random
paragraphs (seeded) until the size is reached. Raw encode: the bench process itself encodes the
same texts (already parsed, in the same batches) with one thread. End to end: wall time of the
whole ``preprocess_data.py`` run (start-up, reading, JSON, tokenizing, writing). Peak memory: the
largest sum of resident memory over the process tree, sampled every 50 ms. Prints Markdown rows.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import random
import subprocess
import sys
import threading
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "data_tools")
sys.path.insert(0, ROOT)
sys.path.insert(0, TOOLS)


def make_corpus(path: str, size_mb: int, seed: int = 0) -> None:
    """A JSONL of ``size_mb`` MB of documents re-assembled from demo-corpus paragraphs."""
    if os.path.isfile(path) and os.path.getsize(path) >= size_mb * 1e6:
        return
    import build_demo_corpus

    base = path + ".base.jsonl"
    build_demo_corpus.build(base)
    paragraphs = [
        p
        for line in open(base, encoding="utf-8")
        for p in json.loads(line)["text"].split("\n\n")
        if p.strip()
    ]
    rng, written, tmp = random.Random(seed), 0, path + ".tmp"
    with open(tmp, "w", encoding="utf-8") as f:
        while written < size_mb * 1e6:
            text = "\n\n".join(rng.choice(paragraphs) for _ in range(rng.randint(1, 8)))
            line = json.dumps({"text": text}, ensure_ascii=False) + "\n"
            f.write(line)
            written += len(line.encode())
    os.replace(tmp, path)
    os.remove(base)


def make_tokenizer_model(corpus: str, prefix: str, vocab: int) -> str:
    if not os.path.isfile(prefix + ".model"):
        subprocess.run(
            [
                sys.executable,
                os.path.join(TOOLS, "train_tokenizer.py"),
                "--input",
                corpus,
                "--output-prefix",
                prefix,
                "--vocab-size",
                str(vocab),
                "--model-type",
                "bpe",
                "--byte-fallback",
                "--max-sentences",
                "300000",
            ],
            check=True,
        )
    return prefix + ".model"


def raw_encode_rate(corpus: str, model: str, block_bytes: int = 1 << 20) -> dict:
    """Tokens/s of the tokenizer alone, one thread, on the same texts in the same batches."""
    import sentencepiece as spm

    sp = spm.SentencePieceProcessor(model_file=model)
    batches, batch, size = [], [], 0
    for line in open(corpus, encoding="utf-8"):
        batch.append(json.loads(line)["text"])
        size += len(line)
        if size >= block_bytes:
            batches.append(batch)
            batch, size = [], 0
    batches.append(batch)
    t0 = time.perf_counter()
    tokens = sum(len(ids) for b in batches for ids in sp.Encode(b, out_type=int, num_threads=1))
    dt = time.perf_counter() - t0
    return {
        "tokens": tokens,
        "seconds": dt,
        "tokens_per_s": tokens / dt,
        "mb_per_s": os.path.getsize(corpus) / dt / 1e6,
    }


def _tree_rss(root: int) -> int:
    """Summed resident bytes of ``root`` and all its descendants."""
    parent, rss = {}, {}
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
            parent[int(pid)], rss[int(pid)] = (
                int(fields[1]),
                int(fields[21]) * os.sysconf("SC_PAGE_SIZE"),
            )
        except (OSError, IndexError, ValueError):
            continue
    tree, frontier = {root}, [root]
    while frontier:
        kids = [p for p, pp in parent.items() if pp in frontier and p not in tree]
        tree.update(kids)
        frontier = kids
    return sum(rss.get(p, 0) for p in tree)


def run_preprocess(corpus: str, model: str, out: str, workers: int) -> dict:
    cmd = [
        sys.executable,
        os.path.join(TOOLS, "preprocess_data.py"),
        "--input",
        corpus,
        "--output-prefix",
        out,
        "--tokenizer-type",
        "SentencePieceTokenizer",
        "--tokenizer-model",
        model,
        "--append-eod",
        "--workers",
        str(workers),
    ]
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, stderr=subprocess.PIPE, text=True)
    peak, done = [0], threading.Event()

    def sample():
        while not done.is_set():
            peak[0] = max(peak[0], _tree_rss(proc.pid))
            time.sleep(0.05)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    _, err = proc.communicate()
    dt = time.perf_counter() - t0
    done.set()
    sampler.join()
    if proc.returncode:
        raise SystemExit(f"preprocess failed:\n{err}")
    line = next(x for x in err.splitlines() if x.startswith("done:"))
    docs, tokens = (int(x.replace(",", "")) for x in (line.split()[1], line.split()[3]))
    return {
        "workers": workers,
        "seconds": dt,
        "docs_per_s": docs / dt,
        "tokens": tokens,
        "tokens_per_s": tokens / dt,
        "mb_per_s": os.path.getsize(corpus) / dt / 1e6,
        "peak_rss_mb": peak[0] / 2**20,
    }


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--workdir", default="/tmp/megafp8-bench")
    p.add_argument("--size-mb", type=int, default=64)
    p.add_argument("--vocab-size", type=int, default=32000)
    p.add_argument("--workers", type=int, nargs="+", default=[1, 2])
    a = p.parse_args(argv)
    os.makedirs(a.workdir, exist_ok=True)
    corpus = os.path.join(a.workdir, f"bench_{a.size_mb}mb.jsonl")
    make_corpus(corpus, a.size_mb)
    model = make_tokenizer_model(
        corpus, os.path.join(a.workdir, f"bpe{a.vocab_size}"), a.vocab_size
    )
    raw = raw_encode_rate(corpus, model)
    rows = [
        run_preprocess(corpus, model, os.path.join(a.workdir, f"out_w{w}"), w) for w in a.workers
    ]
    same = (
        len(
            {
                open(os.path.join(a.workdir, f"out_w{w}_text_document.bin"), "rb").read()
                for w in a.workers
            }
        )
        == 1
    )
    print(
        f"\n{time.strftime('%Y-%m-%d')}, {platform.processor() or platform.machine()}, "
        f"{os.cpu_count()} CPUs; input {os.path.getsize(corpus) / 1e6:.1f} MB, "
        f"{raw['tokens']:,} tokens, BPE {a.vocab_size}; outputs identical across workers: {same}"
    )
    print(f"raw encode (1 thread): {raw['tokens_per_s']:,.0f} tokens/s, {raw['mb_per_s']:.2f} MB/s")
    print(
        "| workers | wall s | docs/s | tokens/s | MB/s | tokens/s per worker vs raw | "
        "peak RSS (tree) |"
    )
    print("|---|---|---|---|---|---|---|")
    for r in rows:
        ratio = r["tokens_per_s"] / r["workers"] / raw["tokens_per_s"]
        print(
            f"| {r['workers']} | {r['seconds']:.1f} | {r['docs_per_s']:,.0f} | "
            f"{r['tokens_per_s']:,.0f} | {r['mb_per_s']:.2f} | {ratio:.0%} | "
            f"{r['peak_rss_mb']:.0f} MiB |"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
