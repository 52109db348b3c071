#!/usr/bin/env python3
"""The ``make demo`` driver: demo corpus -> tokenizer -> .bin/.idx -> a tiny FP8 GPT on the CPU.

    python3 data_tools/demo.py --out demo

Steps whose outputs are already complete are skipped (every step writes atomically, so an output
that exists is whole): ``corpus.jsonl``, ``tokenizer.model``, ``data/demo_text_document.{bin,idx}``,
then ``checkpoints/latest``. TensorBoard logs go to ``tensorboard/``.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TOOLS = os.path.join(ROOT, "data_tools")


def model_flags(a) -> list[str]:
    """The tiny model and schedule: 2 layers, hidden 128, 4 heads, seq 128, FP8 hybrid GEMMs."""
    return [
        "--num-layers",
        "2",
        "--hidden-size",
        "128",
        "--num-attention-heads",
        "4",
        "--seq-length",
        "128",
        "--max-position-embeddings",
        "128",
        "--micro-batch-size",
        "8",
        "--global-batch-size",
        "16",
        "--train-iters",
        str(a.train_iters),
        "--lr",
        "1e-3",
        "--min-lr",
        "1e-4",
        "--lr-warmup-iters",
        "10",
        "--lr-decay-style",
        "cosine",
        "--fp8-format",
        "hybrid",
        "--log-interval",
        "10",
        "--eval-interval",
        str(max(1, a.train_iters // 2)),
        "--eval-iters",
        "2",
        "--seed",
        "1234",
    ]


def step(name: str, done: bool, cmd: list[str]) -> None:
    if done:
        print(f"[demo] {name}: already complete, skipped", flush=True)
        return
    print(f"[demo] {name}: {' '.join(cmd)}", flush=True)
    t0 = time.perf_counter()
    rc = subprocess.call(cmd, cwd=ROOT)
    if rc:
        raise SystemExit(f"[demo] {name} failed (exit status {rc})")
    print(f"[demo] {name}: done in {time.perf_counter() - t0:.1f}s", flush=True)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", required=True, help="demo directory")
    p.add_argument("--vocab-size", type=int, default=4096)
    p.add_argument("--train-iters", type=int, default=100)
    p.add_argument("--workers", type=int, default=max(1, (os.cpu_count() or 2) - 1))
    p.add_argument("--skip-train", action="store_true", help="stop after preprocessing")
    a = p.parse_args(argv)
    out = os.path.abspath(a.out)
    corpus, tok = os.path.join(out, "corpus.jsonl"), os.path.join(out, "tokenizer")
    data = os.path.join(out, "data", "demo")
    doc = data + "_text_document"
    py = sys.executable
    os.makedirs(out, exist_ok=True)
    step(
        "corpus",
        os.path.isfile(corpus),
        [py, os.path.join(TOOLS, "build_demo_corpus.py"), "--out", corpus],
    )
    step(
        "tokenizer",
        os.path.isfile(tok + ".model") and os.path.isfile(tok + ".json"),
        [
            py,
            os.path.join(TOOLS, "train_tokenizer.py"),
            "--input",
            corpus,
            "--output-prefix",
            tok,
            "--vocab-size",
            str(a.vocab_size),
            "--model-type",
            "bpe",
            "--byte-fallback",
            "--max-sentences",
            "300000",
        ],
    )
    step(
        "preprocess",
        os.path.isfile(doc + ".bin") and os.path.isfile(doc + ".idx"),
        [
            py,
            os.path.join(TOOLS, "preprocess_data.py"),
            "--input",
            corpus,
            "--output-prefix",
            data,
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            tok + ".model",
            "--append-eod",
            "--workers",
            str(a.workers),
        ],
    )
    if a.skip_train:
        return 0
    save = os.path.join(out, "checkpoints")
    pretrain = os.path.join(ROOT, "pretrain_gpt.py")
    if not os.path.isfile(pretrain):
        raise SystemExit(f"[demo] {pretrain} is missing; cannot train")
    step(
        "train",
        os.path.isfile(os.path.join(save, "latest")),
        [
            py,
            pretrain,
            *model_flags(a),
            "--data-path",
            doc,
            "--split",
            "969,30,1",
            "--tokenizer-type",
            "SentencePieceTokenizer",
            "--tokenizer-model",
            tok + ".model",
            "--save",
            save,
            "--save-interval",
            str(a.train_iters),
            "--tensorboard-dir",
            os.path.join(out, "tensorboard"),
        ],
    )
    print(
        f"[demo] done: checkpoint in {save}, TensorBoard logs in {out}/tensorboard "
        f"(tensorboard --logdir {out}/tensorboard)",
        flush=True,
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
