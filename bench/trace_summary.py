#!/usr/bin/env python3
"""Where the GPU time of a ``--profile`` run went: the kernels that took the most of it, grouped
by name, and how long the GPU sat idle.

``pretrain_gpt.py --profile --profile-step-start S --profile-step-end E`` writes
``profile_rank0.json`` (a Chrome trace) under ``--tensorboard-dir`` (else ``--save``, else the
working directory). This reads its kernel, memcpy and memset events:

    python bench/trace_summary.py /tmp/tb/profile_rank0.json --top 30 --iters 2

prints the GPU span, the busy and idle time (the union of the kernel intervals against the span),
the kernel time each phase launched (``--phase megafp8.step`` lists that phase's top kernels),
then one row per kernel name: ms per iteration (``--iters``: how many iterations the trace holds),
calls per iteration and the share of busy time. ``--json F`` writes the same as JSON.

Where the GPU waited: each idle gap is charged to the phase whose CPU code launched the kernel
that ended it (the innermost ``record_function`` range around that launch: the training loop
marks ``megafp8.data``, ``megafp8.forward``, ``megafp8.backward``, ``megafp8.fp8-update`` and
``megafp8.step``; ``(none)`` outside them).
Idle time per phase, and the ``--gaps N`` longest gaps with their place in the span and the
kernels on either side.

Who launched a kernel: ``--who SUBSTR ...`` lists, for the kernels whose name holds one of the
substrings, the CPU operators that launched them (the chain of ``cpu_op`` ranges around the
launch on its thread, innermost first, with the innermost one's input shapes, which
``--profile`` records), their calls and time per iteration.
"""

from __future__ import annotations

import argparse
import collections
import json

GPU_CATS = ("kernel", "gpu_memcpy", "gpu_memset")


def _launches_and_ranges(trace: dict, cat: str):
    """``{correlation: (tid, ts)}`` of every kernel launch on the CPU, and per thread the
    ``(start, end, name, args)`` of the CPU ranges of category ``cat``."""
    launch, ranges = {}, collections.defaultdict(list)
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or "dur" not in e:
            continue
        if e.get("cat") in ("cuda_runtime", "cuda_driver"):
            corr = e.get("args", {}).get("correlation")
            if corr is not None:
                launch[corr] = (e.get("tid"), float(e["ts"]))
        elif e.get("cat") == cat:
            t0 = float(e["ts"])
            ranges[e.get("tid")].append((t0, t0 + float(e["dur"]), e["name"], e.get("args", {})))
    return launch, ranges


def _phases(trace: dict):
    """kernel event -> the name of the innermost ``user_annotation`` range around the CPU call
    (matched by ``args.correlation``) that launched it, on the launching thread, else on any
    thread; ``(none)`` where there is none."""
    launch, ranges = _launches_and_ranges(trace, "user_annotation")

    def phase(kernel: dict) -> str:
        at = launch.get(kernel.get("args", {}).get("correlation"))
        if at is None:
            return "(none)"
        inside = [r for r in ranges.get(at[0], ()) if r[0] <= at[1] <= r[1]]
        if not inside:  # autograd launches the backward's kernels from its own thread
            inside = [r for rs in ranges.values() for r in rs if r[0] <= at[1] <= r[1]]
        return min(inside, key=lambda r: r[1] - r[0])[2] if inside else "(none)"

    return phase


def launchers(trace: dict, substrings: list[str], iters: int = 1, depth: int = 3) -> list[dict]:
    """For kernels whose name holds one of ``substrings``: the CPU operators that launched them,
    grouped by the chain of ``cpu_op`` ranges around the launch (innermost first, ``depth`` of
    them) and the innermost one's input shapes; calls and ms per iteration, most time first."""
    launch, ops = _launches_and_ranges(trace, "cpu_op")
    rows: dict[tuple, list] = collections.defaultdict(lambda: [0.0, 0])
    for e in trace.get("traceEvents", []):
        if e.get("ph") != "X" or e.get("cat") not in GPU_CATS or "dur" not in e:
            continue
        if not any(sub in e["name"] for sub in substrings):
            continue
        at = launch.get(e.get("args", {}).get("correlation"))
        inside = [] if at is None else [o for o in ops.get(at[0], ()) if o[0] <= at[1] <= o[1]]
        inside.sort(key=lambda o: o[1] - o[0])  # innermost first
        chain = " < ".join(o[2] for o in inside[:depth]) or "(no cpu op)"
        dims = inside[0][3].get("Input Dims") if inside else None
        dims = "" if dims is None else json.dumps(dims)
        row = rows[(e["name"], chain, dims)]
        row[0] += float(e["dur"])
        row[1] += 1
    return [
        {
            "kernel": k,
            "ops": c,
            "dims": d,
            "ms_per_iter": v[0] / 1e3 / iters,
            "calls_per_iter": v[1] / iters,
        }
        for (k, c, d), v in sorted(rows.items(), key=lambda kv: -kv[1][0])
    ]


def summarize(trace: dict, iters: int = 1) -> dict:
    events = [
        e
        for e in trace.get("traceEvents", [])
        if e.get("ph") == "X" and e.get("cat") in GPU_CATS and "dur" in e
    ]
    if not events:
        raise ValueError("no GPU kernel events in the trace (was it taken on a GPU?)")
    order = sorted(events, key=lambda e: float(e["ts"]))
    spans = [(float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in order]
    busy, cur_s, cur_e, last = 0.0, *spans[0], order[0]
    gaps = []  # (start, length, kernel before, kernel after)
    for ev, (s, e) in zip(order[1:], spans[1:], strict=True):
        if s > cur_e:
            busy, cur_s = busy + (cur_e - cur_s), s
            gaps.append((cur_e, s - cur_e, last, ev))
        if e >= cur_e:
            cur_e, last = e, ev
    busy += cur_e - cur_s
    span = spans[-1][1] - spans[0][0]
    phase = _phases(trace)
    by_phase: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    for g in gaps:
        row = by_phase[phase(g[3])]
        row[0] += g[1]
        row[1] += 1
    by_name: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])
    work: dict[str, list] = collections.defaultdict(lambda: [0.0, 0])  # kernel time per phase
    per_phase: dict[str, dict] = collections.defaultdict(lambda: collections.defaultdict(float))
    for e in events:
        row = by_name[e["name"]]
        row[0] += float(e["dur"])
        row[1] += 1
        ph = phase(e)
        work[ph][0] += float(e["dur"])
        work[ph][1] += 1
        per_phase[ph][e["name"]] += float(e["dur"])
    total = sum(r[0] for r in by_name.values())
    rows = sorted(by_name.items(), key=lambda kv: -kv[1][0])
    return {
        "iters": iters,
        "span_ms": span / 1e3 / iters,
        "busy_ms": busy / 1e3 / iters,
        "idle_share": 1.0 - busy / span if span else 0.0,
        "idle_by_phase": {
            k: {"ms_per_iter": v[0] / 1e3 / iters, "gaps_per_iter": v[1] / iters}
            for k, v in sorted(by_phase.items(), key=lambda kv: -kv[1][0])
        },
        "work_by_phase": {
            k: {
                "ms_per_iter": v[0] / 1e3 / iters,
                "kernels_per_iter": v[1] / iters,
                "top": [
                    {"name": n, "ms_per_iter": d / 1e3 / iters}
                    for n, d in sorted(per_phase[k].items(), key=lambda kv: -kv[1])[:10]
                ],
            }
            for k, v in sorted(work.items(), key=lambda kv: -kv[1][0])
        },
        "gaps": [
            {
                "at_ms": (start - spans[0][0]) / 1e3,
                "ms": length / 1e3,
                "phase": phase(after),
                "before": before["name"],
                "after": after["name"],
            }
            for start, length, before, after in sorted(gaps, key=lambda g: -g[1])[:100]
        ],
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
    ap.add_argument("--gaps", type=int, default=10, help="longest idle gaps to print")
    ap.add_argument("--json", help="write the summary here too")
    ap.add_argument(
        "--phase", nargs="*", default=[], help="phases whose top kernels to print (megafp8.step)"
    )
    ap.add_argument(
        "--who", nargs="*", default=[], help="kernel name substrings: list what launched them"
    )
    a = ap.parse_args(argv)
    if a.iters < 1:
        ap.error(f"--iters {a.iters}: at least 1")
    with open(a.trace) as f:
        trace = json.load(f)
    s = summarize(trace, a.iters)
    if a.who:
        s["who"] = launchers(trace, a.who, a.iters)
    print(
        f"per iteration: GPU span {s['span_ms']:.1f} ms, busy {s['busy_ms']:.1f} ms, "
        f"idle {100 * s['idle_share']:.1f} %"
    )
    for name, v in s["idle_by_phase"].items():
        print(f"  idle {v['ms_per_iter']:7.2f} ms/iter in {v['gaps_per_iter']:6.0f} gaps: {name}")
    for name, v in s["work_by_phase"].items():
        ms, n = v["ms_per_iter"], v["kernels_per_iter"]
        print(f"  kernels {ms:7.2f} ms/iter, {n:6.0f} launched: {name}")
        if name in a.phase:
            for k in v["top"]:
                print(f"      {k['ms_per_iter']:8.2f} ms  {k['name'][:110]}")
    for g in s["gaps"][: a.gaps]:
        print(
            f"  gap {g['ms']:7.3f} ms at {g['at_ms']:8.2f} ms ({g['phase']}): "
            f"{g['before'][:50]} -> {g['after'][:50]}"
        )
    print(f"{'ms/iter':>9} {'calls':>7} {'share':>6}  kernel")
    for k in s["kernels"][: a.top]:
        print(
            f"{k['ms_per_iter']:9.2f} {k['calls_per_iter']:7.0f} {100 * k['share']:5.1f}%  "
            f"{k['name'][:140]}"
        )
    if a.who:
        print(f"{'ms/iter':>9} {'calls':>7}  kernel <- CPU ops, innermost first [shapes]")
    for w in s.get("who", [])[:60]:
        print(
            f"{w['ms_per_iter']:9.2f} {w['calls_per_iter']:7.0f}  {w['kernel'][:60]} <- "
            f"{w['ops'][:120]} {w['dims'][:160]}"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(s, f, indent=1)


if __name__ == "__main__":
    main()
