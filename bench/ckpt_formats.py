#!/usr/bin/env python3
"""What ``--ckpt-format torch_dist`` costs against ``torch``, and what a resharding load costs,
on the CPU (gloo processes).

A GPT (default: 8 layers, h 512, 8 heads, vocab 32000, seq 256: 44 M parameters) trains 2
iterations at the source layout (default tp 2 x dp 2, ZeRO-1, 4 processes), then saves in each
format (``megafp8.train.save``, every rank, timed from a barrier to a barrier, 3 times: the
median), and the bytes on disk of each checkpoint are counted (DeepSpeed's shards, the expert and
dist files). Then a fresh run loads each: the torch_dist checkpoint at the same layout (DeepSpeed's
path) and at another layout (default tp 1 x dp 4, ZeRO-3: assembled from the dist files), timed
the same way.

    python bench/ckpt_formats.py
    python bench/ckpt_formats.py --layers 4 --hidden 256 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _cfg(a, tp, zero, **train):
    from megafp8.config import Config

    return Config().replace(
        model=dict(num_layers=a.layers, hidden_size=a.hidden, num_attention_heads=a.heads,
                   seq_length=a.seq, vocab_size=a.vocab),
        data=dict(mock_data=True),
        parallel=dict(tensor_model_parallel_size=tp),
        optim=dict(zero_stage=zero, lr=1e-4, lr_warmup_iters=0),
        train={"micro_batch_size": 1, "global_batch_size": 4, "train_iters": 2, "seed": 1, **train},
        logging=dict(log_interval=100, log_memory=False),
    )  # fmt: skip


def _timed(fn) -> float:
    import torch.distributed as dist

    dist.barrier()
    t0 = time.perf_counter()
    fn()
    dist.barrier()
    return time.perf_counter() - t0


def _save_side(a, root):
    from megafp8.train import build_run, init_distributed, save, train

    out = {}
    for fmt in ("torch", "torch_dist"):
        cfg = _cfg(a, a.tp, a.zero, save=os.path.join(root, fmt), ckpt_format=fmt)
        groups, device = init_distributed(cfg)
        run = build_run(cfg, groups, device)
        train(cfg, run)  # ends with a save
        out[fmt] = statistics.median(_timed(lambda run=run: save(run)) for _ in range(3))
    return out


def _load_side(a, root, tp, zero):
    from megafp8.train import build_run, init_distributed, resume

    cfg = _cfg(a, tp, zero, load=os.path.join(root, "torch_dist"))
    groups, device = init_distributed(cfg)
    run = build_run(cfg, groups, device)
    return _timed(lambda: resume(run))


def _du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--layers", type=int, default=8)
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--vocab", type=int, default=32000)
    ap.add_argument("--tp", type=int, default=2, help="source TP (x DP 4/tp, 4 processes)")
    ap.add_argument("--zero", type=int, default=1, help="source ZeRO stage")
    ap.add_argument("--to", default="1,3", help="target tp,zero for the resharding load")
    ap.add_argument("--json")
    a = ap.parse_args()
    from tests.helpers.dist import run_distributed

    root = tempfile.mkdtemp(prefix="ckpt-formats-")
    save = run_distributed(_save_side, 4, a, root)[0]
    tag = "iter_0000002"
    size = {f: _du(os.path.join(root, f, tag)) for f in ("torch", "torch_dist")}
    same = run_distributed(_load_side, 4, a, root, a.tp, a.zero)[0]
    ttp, tz = (int(x) for x in a.to.split(","))
    moved = run_distributed(_load_side, 4, a, root, ttp, tz)[0]
    rows = {"save_s": save, "bytes": size, "load_same_layout_s": same, "load_resharded_s": moved,
            "source": f"tp {a.tp} x dp {4 // a.tp}, ZeRO-{a.zero}",
            "target": f"tp {ttp} x dp {4 // ttp}, ZeRO-{tz}"}  # fmt: skip
    print(f"source {rows['source']}, target {rows['target']}, 4 gloo processes")
    print("| format | save (s) | checkpoint (MB) |")
    print("|---|---|---|")
    for f in ("torch", "torch_dist"):
        print(f"| {f} | {save[f]:.2f} | {size[f] / 1e6:.1f} |")
    print(f"load torch_dist, same layout (DeepSpeed's shards): {same:.2f} s")
    print(f"load torch_dist, resharded into {rows['target']}: {moved:.2f} s")
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 0


if __name__ == "__main__":
    from megafp8.run_hooks import end_process

    end_process(main())
