#!/usr/bin/env python3
"""The planner's sizing table: the best predicted layout of an 8B, a 70B and an 8-expert MoE model
on 1, 8, 64 and 128 nodes of 8 H100 or H200 (FP8, global batch 1024 sequences of 4096 tokens,
micro-batch 1, ZeRO-1). Predictions of ``megafp8/plan/model.py``, not measurements.

    python bench/plan_sizing.py
"""

from __future__ import annotations

import os
import shlex
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

COMMON = (
    "--mock-data --vocab-size 128256 --seq-length 4096 --max-position-embeddings 8192 "
    "--position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --swiglu "
    "--untie-embeddings-and-output-weights --disable-bias-linear --micro-batch-size 1 "
    "--global-batch-size 1024 --bf16 --fp8-format hybrid --zero-stage 1"
)
MODELS = {
    "Llama-3 8B": "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 "
    "--num-attention-heads 32 --num-query-groups 8",
    "Llama-3 70B": "--num-layers 80 --hidden-size 8192 --ffn-hidden-size 28672 "
    "--num-attention-heads 64 --num-query-groups 8",
    "MoE 8x7B (top-2)": "--num-layers 32 --hidden-size 4096 --ffn-hidden-size 14336 "
    "--num-attention-heads 32 --num-query-groups 8 --num-experts 8 --moe-router-topk 2",
}
NODES = (1, 8, 64, 128)


def main() -> int:
    from megafp8.cli import parse_args
    from megafp8.plan import plan
    from megafp8.plan.model import GPUS

    print("| model | GPU | nodes | best layout (tp, pp, dp, ep, recompute) | peak GiB | "
          "tokens/s/GPU | TFLOP/s/GPU |")  # fmt: skip
    print("|---|---|---|---|---|---|---|")
    for name, flags in MODELS.items():
        cfg = parse_args(shlex.split(f"{flags} {COMMON}"), [])
        for gpu in ("h100", "h200"):
            for n in NODES:
                rows = plan(cfg, n, 8, GPUS[gpu])
                r = rows[0] if rows else None
                if r is None or not r["fits"]:
                    need = f"{min(x['memory']['peak'] for x in rows):.0f}" if rows else "-"
                    print(f"| {name} | {gpu.upper()} | {n} | does not fit | {need} | - | - |")
                    continue
                lay = r["layout"]
                print(f"| {name} | {gpu.upper()} | {n} | {lay.tp}, {lay.pp}, {lay.dp}, {lay.ep}, "
                      f"{lay.recompute or 'none'} | {r['memory']['peak']:.0f} | "
                      f"{r['tokens_per_gpu']:,.0f} | {r['tflops']:.0f} |")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
