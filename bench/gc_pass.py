#!/usr/bin/env python3
"""One full pass of Python's garbage collector in a built run, before and after ``gc.freeze``
(what the training loop does before its first iteration: ``megafp8/run_hooks.py``).

A full (generation 2) pass walks every tracked object: the imported modules, the model, the
DeepSpeed engine. It runs when enough objects have survived since the last one, inside whatever
iteration is running then. This builds a run from the flags given (default: a tiny CPU model
with mock data; any ``pretrain_gpt.py`` flags work, a GPU run's too), counts the tracked
objects and times ``gc.collect()`` three times, then freezes and times it again.

    python bench/gc_pass.py
    python bench/gc_pass.py <pretrain_gpt.py flags>
"""

from __future__ import annotations

import gc
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 64 "
    "--max-position-embeddings 64 --micro-batch-size 2 --global-batch-size 4 --vocab-size 512 "
    "--mock-data --tokenizer-type NullTokenizer --train-iters 1 --eval-iters 0 "
    "--eval-interval 1000 --lr 1e-4 --use-distributed-optimizer"
)


def full_pass_ms(n: int = 3) -> list[float]:
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        gc.collect()
        out.append((time.perf_counter() - t0) * 1e3)
    return out


def main(argv: list[str]) -> int:
    import torch

    if not torch.cuda.is_available():
        os.environ.setdefault("DS_ACCELERATOR", "cpu")
    from megafp8.build import build_run, init_distributed
    from megafp8.cli import parse_args

    cfg = parse_args(argv or TINY.split())
    groups, device = init_distributed(cfg)
    run = build_run(cfg, groups, device)
    tracked = len(gc.get_objects())
    before = full_pass_ms()
    gc.freeze()
    after = full_pass_ms()
    print(f"tracked objects after the build: {tracked}; frozen: {gc.get_freeze_count()}")
    print("full pass (ms), before freeze: " + " ".join(f"{x:.2f}" for x in before))
    print("full pass (ms), after freeze:  " + " ".join(f"{x:.2f}" for x in after))
    gc.unfreeze()
    del run
    return 0


if __name__ == "__main__":
    from megafp8.run_hooks import end_process

    end_process(main(sys.argv[1:]))
