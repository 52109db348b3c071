#!/usr/bin/env python3
"""Describe an MMIDIDX dataset: counts, length statistics, token histogram, decoded samples.

    python3 data_tools/inspect_dataset.py data/demo_text_document \\
        --tokenizer-model demo/tokenizer.model --decode 3

Validates the files first (a truncated, foreign or legacy index is reported as such). ``--json``
prints the figures as one JSON object instead of text.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from megafp8.data.indexed import IndexedDataset, IndexFormatError  # noqa: E402
from megafp8.data.tokenizer.flags import (  # noqa: E402
    add_tokenizer_args,
    tokenizer_from_spec,
    tokenizer_spec,
)

_CHUNK = 1 << 24  # tokens per histogram pass


def token_histogram(ds: IndexedDataset) -> np.ndarray:
    """Counts of every token id, over the whole ``.bin`` in bounded chunks."""
    data = ds.all_tokens()
    if data.dtype.kind not in "iu":
        raise ValueError(f"token histogram needs integer tokens, not {data.dtype}")
    counts = np.zeros(0, np.int64)
    for lo in range(0, len(data), _CHUNK):
        c = np.bincount(data[lo : lo + _CHUNK].astype(np.int64))
        if len(c) > len(counts):
            counts = np.pad(counts, (0, len(c) - len(counts)))
        counts[: len(c)] += c
    return counts


def describe(ds: IndexedDataset, top: int = 10) -> dict:
    lengths = ds.sequence_lengths.astype(np.int64)
    per_doc = np.diff(ds.document_indices)
    hist = token_histogram(ds)
    order = np.argsort(-hist, kind="stable")[:top]
    stats = {
        "prefix": ds.prefix,
        "dtype": ds.dtype.name,
        "sequences": len(ds),
        "documents": ds.num_documents,
        "empty_documents": int((per_doc == 0).sum()),
        "tokens": ds.num_tokens,
        "distinct_tokens": int((hist > 0).sum()),
        "max_token_id": int(len(hist) - 1) if len(hist) else None,
        "top_tokens": [[int(t), int(hist[t])] for t in order if hist[t]],
    }
    if len(lengths):
        q = np.percentile(lengths, [50, 90, 99])
        stats["sequence_length"] = {
            "min": int(lengths.min()),
            "mean": float(lengths.mean()),
            "p50": float(q[0]),
            "p90": float(q[1]),
            "p99": float(q[2]),
            "max": int(lengths.max()),
        }
    return stats


def print_text(stats: dict, samples: list[tuple[int, str]]) -> None:
    print(f"{stats['prefix']}: {stats['dtype']} tokens")
    print(
        f"  sequences {stats['sequences']:,}, documents {stats['documents']:,} "
        f"({stats['empty_documents']:,} empty), tokens {stats['tokens']:,}"
    )
    if "sequence_length" in stats:
        s = stats["sequence_length"]
        print(
            f"  sequence length: min {s['min']}, mean {s['mean']:.1f}, p50 {s['p50']:.0f}, "
            f"p90 {s['p90']:.0f}, p99 {s['p99']:.0f}, max {s['max']}"
        )
    print(f"  distinct token ids {stats['distinct_tokens']:,}, largest id {stats['max_token_id']}")
    print("  most frequent: " + ", ".join(f"{t} x{c:,}" for t, c in stats["top_tokens"]))
    for i, text in samples:
        print(f"--- sequence {i} ---\n{text}")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("prefix", help="dataset prefix (PREFIX.bin / PREFIX.idx)")
    p.add_argument("--decode", type=int, default=0, help="decode this many sequences")
    p.add_argument("--seed", type=int, default=0, help="which sequences to decode (random)")
    p.add_argument("--top", type=int, default=10, help="most frequent tokens to list")
    add_tokenizer_args(p.add_argument_group("tokenizer (the flags given to preprocess_data.py)"))
    p.add_argument("--json", action="store_true", help="print one JSON object")
    a = p.parse_args(argv)
    prefix = a.prefix[:-4] if a.prefix.endswith((".bin", ".idx")) else a.prefix
    try:
        ds = IndexedDataset(prefix)
        stats = describe(ds, a.top)
        samples = []
        if a.decode and len(ds):
            spec = tokenizer_spec(a)
            if a.tokenizer_model is None and a.vocab_file is None and spec["vocab_size"] is None:
                spec["vocab_size"] = int(stats["max_token_id"] or 0) + 2  # ids shown as numbers
            tok = tokenizer_from_spec(spec)
            pick = np.random.default_rng(a.seed).choice(len(ds), min(a.decode, len(ds)), False)
            samples = [(int(i), tok.detokenize(ds[int(i)].tolist())) for i in sorted(pick)]
    except (ValueError, IndexFormatError, OSError) as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    if a.json:
        print(json.dumps({**stats, "samples": [{"sequence": i, "text": t} for i, t in samples]}))
    else:
        print_text(stats, samples)
    return 0


if __name__ == "__main__":
    sys.exit(main())
