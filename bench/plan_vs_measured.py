#!/usr/bin/env python3
"""The planner's predictions (``megafp8/plan/model.py``) beside every single-GPU measurement of
BENCHMARKS.md: peak memory and seconds per iteration, one H200, the flag lists of
``bench/side_by_side.py``.

    python bench/plan_vs_measured.py
"""

from __future__ import annotations

import os
import sys

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.dirname(HERE))
sys.path.insert(0, HERE)

FULL = "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
# Measured before the optimizer groups were bounded and the MLP fused by default: the code of
# those runs is these flags today.
OLD = "--optimizer-group-max-numel 0 --no-te-fused-mlp"
# BF16 measured before ``auto`` picked the te backend without FP8: the plain modules
NONE = " --fp8-backend none"
# (shape, precision, extra flags): (peak GiB, s/iter) on one H200 (BENCHMARKS.md: gpu_step runs
# 3-4 for 1.3B and 7B; side_by_side for the Llama shape and recompute; the rows without OLD are
# the fused-MLP runs at f1aaf74). None: out of memory.
MEASURED = {
    ("gpt1.3b", "fp8", OLD): (45.1, 1.5753),
    ("gpt1.3b", "bf16", OLD + NONE): (46.6, 2.1176),
    ("gpt7b", "fp8", OLD): (40.5, 0.9005),
    ("gpt7b", "bf16", OLD + NONE): (37.6, 1.2950),
    ("llama8b-16", "fp8", OLD): (99.7, 2.460),
    ("llama8b-16", "bf16", OLD + NONE): (93.6, 3.462),
    ("llama8b-16", "fp8", "--recompute-granularity selective " + OLD): (99.7, 2.874),
    ("llama8b-16", "fp8", FULL + " " + OLD): (99.7, 3.498),
    ("llama8b", "fp8", FULL + " " + OLD): (None, None),
    ("llama8b-16", "fp8", ""): (93.6, 2.369),
    ("llama8b-16", "bf16", NONE.strip()): (93.6, 3.553),
    ("gpt7b", "fp8", "--micro-batch-size 8"): (47.5, 0.877),
    # 2026-12-03, later: BF16 on the te backend (auto), the QKV split through SplitAlongDim
    ("llama8b-16", "bf16", ""): (88.85, 3.189),
    ("gpt7b", "fp8", ""): (39.6, 0.900),
    ("gpt7b", "bf16", ""): (37.59, 1.305),
}


def predict(shape: str, precision: str, extra: str) -> dict:
    import side_by_side as sbs

    from megafp8.cli import parse_args
    from megafp8.plan import evaluate
    from megafp8.plan.model import GPUS, Layout

    cfg = parse_args(sbs.flags(shape, precision, 10, extra), [])
    rc = cfg.model.recompute_granularity
    lay = Layout(1, 1, 1, zero=1, micro=cfg.train.micro_batch_size, recompute=rc)
    return evaluate(cfg, lay, GPUS["h200"], 1)


def main() -> int:
    print("| shape | precision | flags | peak GiB measured | predicted | s/iter measured | "
          "predicted |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for (shape, prec, extra), (mem, sec) in MEASURED.items():
        r = predict(shape, prec, extra)
        rc = extra.replace(OLD, "").replace(FULL, "full recompute").strip() or "-"
        rc += " (code before f1aaf74)" if OLD in extra else ""
        pm, ps = r["memory"]["peak"], r["seconds"]["total"]
        mcell = f"{mem} | {pm:.1f} ({pm / mem - 1:+.1%})" if mem else f"OOM | {pm:.1f}"
        scell = f"{sec} | {ps:.3f} ({ps / sec - 1:+.1%})" if sec else f"- | {ps:.3f}"
        print(f"| {shape} | {prec} | {rc} | {mcell} | {scell} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
