#!/usr/bin/env python3
"""Where the GPU time of a ``--profile`` run went: the kernels that took the most of it, grouped
by name, and how long the GPU sat idle.

``pretrain_gpt.py --profile --profile-step-start S --profile-step-end E`` writes
``profile_rank0.json`` (a Chrome trace) under ``--tensorboard-dir`` (else ``--save``, else the
working directory). This reads its kernel, memcpy and memset events:

    python bench/trace_summary.py /tmp/tb/profile_rank0.json --top 30 --iters 2

prints the GPU span, the busy and idle time (the union of the kernel intervals against the span),
then one row per kernel name: ms per iteration (``--iters``: how many iterations the trace holds),
calls per iteration and the share of busy time. ``--json F`` writes the same as JSON.
"""

from __future__ import annotations

import argparse
import collections
import json

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def summarize(trace: dict, iters: int = 1) -> dict:
    events = [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in GPU_CATS and "dur" in e
    ]
    if not events:
        raise ValueError("no GPU kernel events in the trace (was it taken on a GPU?)")
    spans = sorted((float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events)
    busy, cur_s, cur_e = 0.0, *spans[0]
    for s, e in spans[1:]:
        if s > cur_e:
            busy, cur_s, cur_e = busy + (cur_e - cur_s), s, e
        else:
            cur_e = max(cur_e, e)
    busy += cur_e - cur_s
    span = spans[-1][1] - spans[0][0]
    by_name: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for e in events:
        row = by_name[e["name"]]
        row[0] += float(e["dur"])
        row[1] += 1
    total = sum(r[0] for r in by_name.values())
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    return {
        "iters": iters,
        "span_ms": span / 1e3 / iters,
        "busy_ms": busy / 1e3 / iters,
        "idle_share": 1.0 - busy / span if span else 0.0,
        "kernels": [
            {
                "name": name,
                "ms_per_iter": dur / 1e3 / iters,
                "calls_per_iter": calls / iters,
                "share": dur / total,
            }
            for name, (dur, calls) in rows
        ],
    }


def main(argv=None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("trace", help="profile_rank0.json of a --profile run")
    ap.add_argument("--iters", type=int, default=1, help="iterations the trace holds")
    ap.add_argument("--top", type=int, default=25, help="kernel rows to print")
    ap.add_argument("--json", help="write the summary here too")
    a = ap.parse_args(argv)
    if a.iters < 1:
        ap.error(f"--iters {a.iters}: at least 1")
    with open(a.trace) as f:
        s = summarize(json.load(f), a.iters)
    print(
        f"per iteration: GPU span {s['span_ms']:.1f} ms, busy {s['busy_ms']:.1f} ms, "
        f"idle {100 * s['idle_share']:.1f} %"
    )
    print(f"{'ms/iter':>9} {'calls':>7} {'share':>6}  kernel")
    for k in s["kernels"][: a.top]:
        print(
            f"{k['ms_per_iter']:9.2f} {k['calls_per_iter']:7.0f} {100 * k['share']:5.1f}%  "
            f"{k['name'][:140]}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)


if __name__ == "__main__":
    main()
