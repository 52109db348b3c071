#!/usr/bin/env python3
"""The pipeline bubble, measured on the real schedules (1F1B and interleaved), against the formula.

Every (pp, m, v) case runs the library's schedule (``one_f_one_b`` or ``interleaved_one_f_one_b``)
over pp gloo processes, each with its real DeepSpeed engine (ZeRO 1, dp 1), on a tiny GPT. To make
compute dominate over gloo and Python overheads on a small CPU, every decoder layer is given a fixed
cost, injected from this script only: a forward hook sleeps ``d`` after the layer's forward and
wraps its output in an identity autograd function whose backward sleeps ``2 d`` (t_b = 2 t_f).
Sleeping processes use no CPU, so pp processes fit on 2 cores.

Timestamps (``time.perf_counter``, CLOCK_MONOTONIC: one clock for all processes of a machine):
the engine is wrapped so that each forward (``engine(...)``) and backward (``engine.backward``) call
is an event with its start and end; the schedule's own ``record`` gives its (F|B, chunk,
micro-batch). Receives (``p2p.Pipe._recv``) are timed too. For one iteration:

    span      = last event end (any rank) - first event start (any rank)
    busy_k    = sum of stage k's F and B event durations
    bubble_k  = 1 - busy_k / span        measured = mean over stages k

i.e. the bubble is *idle time / total time*, which for 1F1B is (pp - 1) / (m + pp - 1) and,
interleaved with v chunks per rank, (pp - 1) / (v m + pp - 1) (the idle time (pp - 1)(t_f + t_b) / v
against m (t_f + t_b) of work per stage). "incl. step" uses each rank's whole call (after a barrier,
until the loss is broadcast: optimizer step, receive waits and gloo overheads included); "gap" is
(span / (v m + pp - 1) - t_F - t_B) / 2, what each F or B adds to the critical path beyond its
own time. Results are the mean over ``--iters`` iterations after ``--warmup``; --json also keeps
every event and each ``engine.step`` duration.

    python bench/pipeline_bubble.py                      # pp 2, 4; m = pp, 2 pp, 4 pp; v = 1, 2
    python bench/pipeline_bubble.py --pp 2 --mult 1 --sleep-ms 5 --json out.json
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import sys
import time

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def bench_config(pp: int, v: int, m: int, layers_per_stage: int = 2, hidden: int = 64):
    """A tiny GPT with ``layers_per_stage`` layers per pipeline rank (v chunks of
    layers_per_stage / v each), m micro-batches of 2 sequences of 32 tokens per iteration."""
    from megafp8.config import Config

    return Config().replace(
        model=dict(
            num_layers=layers_per_stage * pp,
            hidden_size=hidden,
            num_attention_heads=4,
            seq_length=32,
            vocab_size=256,
            make_vocab_size_divisible_by=64,
        ),
        data=dict(mock_data=True),
        parallel=dict(
            pipeline_model_parallel_size=pp,
            virtual_pipeline_model_parallel_size=v if v > 1 else None,
        ),
        train=dict(micro_batch_size=2, global_batch_size=2 * m, train_iters=64, seed=7),
        optim=dict(lr=1e-4, min_lr=1e-5, lr_warmup_iters=1, zero_stage=1),
        logging=dict(log_interval=1, log_memory=False),
    )


def formula(pp: int, m: int, v: int = 1) -> float:
    """Idle time / total time of the schedule with t_b = 2 t_f and free communication."""
    return (pp - 1) / (v * m + pp - 1)


class _SleepInBackward(torch.autograd.Function):
    """Identity; its backward sleeps ``seconds`` before passing the gradient on."""

    @staticmethod
    def forward(ctx, x, seconds):
        ctx.seconds = seconds
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        time.sleep(ctx.seconds)
        return grad, None


def add_layer_cost(model, seconds: float) -> int:
    """Every ``TransformerBlock`` of ``model`` sleeps ``seconds`` in forward, 2x in backward.
    Returns the number of layers hooked."""
    from megafp8.model.block import TransformerBlock

    def hook(module, args, out):
        time.sleep(seconds)
        return _SleepInBackward.apply(out, 2 * seconds)

    blocks = [mod for mod in model.modules() if isinstance(mod, TransformerBlock)]
    for b in blocks:
        b.register_forward_hook(hook)
    return len(blocks)


class TimedEngine:
    """The DeepSpeed engine, with each forward and backward call's (kind, start, end) logged."""

    def __init__(self, engine):
        self._engine, self.spans, self.steps = engine, [], []

    def _timed(self, kind, fn, *args, **kwargs):
        t0 = time.perf_counter()
        out = fn(*args, **kwargs)
        self.spans.append((kind, t0, time.perf_counter()))
        return out

    def __call__(self, *args, **kwargs):
        return self._timed("F", self._engine, *args, **kwargs)

    def backward(self, *args, **kwargs):
        return self._timed("B", self._engine.backward, *args, **kwargs)

    def step(self, *args, **kwargs):  # after every backward; DeepSpeed steps at the m-th
        t0 = time.perf_counter()
        out = self._engine.step(*args, **kwargs)
        self.steps.append(time.perf_counter() - t0)
        return out

    def __getattr__(self, name):
        return getattr(self._engine, name)


def _time_receives(waits: list) -> None:
    """Log the seconds each pipeline receive blocks (this process only)."""
    from megafp8.parallel.pipeline import p2p

    if getattr(p2p.Pipe._recv, "_timed", False):
        return
    recv = p2p.Pipe._recv

    def timed(self, src, tag):
        t0 = time.perf_counter()
        out = recv(self, src, tag)
        waits.append(time.perf_counter() - t0)
        return out

    timed._timed = True
    p2p.Pipe._recv = timed


_WAITS: list = []


def measure_case(groups, pp, v, m, sleep_s, warmup, iters, layers_per_stage=2) -> dict:
    """On this pipeline rank: ``warmup + iters`` iterations of the case; events with times."""
    from megafp8.parallel.pipeline.interleaved import interleaved_one_f_one_b
    from megafp8.parallel.pipeline.schedules import one_f_one_b
    from megafp8.train import build_run
    from megafp8.validate import validate

    cfg = bench_config(pp, v, m, layers_per_stage)
    validate(cfg, dist.get_world_size())
    gc.collect()  # the previous cases' engines
    run = build_run(cfg, groups, torch.device("cpu"))
    n_layers = add_layer_cost(run.model, sleep_s)
    engine = run.engine = TimedEngine(run.engine)
    schedule = interleaved_one_f_one_b if v > 1 else one_f_one_b
    train_iter, out = iter(run.data.train), []
    _time_receives(_WAITS)
    for i in range(warmup + iters):
        record = {}
        engine.spans.clear()
        engine.steps.clear()
        _WAITS.clear()
        dist.barrier()
        t0 = time.perf_counter()
        schedule(run, train_iter, record=record)
        t1 = time.perf_counter()
        events = [(e[0], e[1] if v > 1 else 0, e[-1]) for e in record["events"]]
        assert [e[0] for e in events] == [s[0] for s in engine.spans], "events vs engine calls"
        if i >= warmup:
            out.append(
                dict(
                    events=[(*e, s[1], s[2]) for e, s in zip(events, engine.spans, strict=True)],
                    call=(t0, t1),
                    recv_wait=sum(_WAITS),
                    steps=list(engine.steps),
                )
            )
    return dict(rank=groups.coords.pp, layers=n_layers, iterations=out)


def _rank(cases, sleep_s, warmup, iters, layers_per_stage):
    from megafp8.parallel.groups import ParallelGroups

    pp = dist.get_world_size()
    groups = ParallelGroups.build(1, pp)
    return [
        measure_case(groups, pp, v, m, sleep_s, warmup, iters, layers_per_stage) for v, m in cases
    ]


def analyze(per_rank: list[dict]) -> dict:
    """Bubble figures of one case from every rank's measurement (rank order)."""
    n_iter = len(per_rank[0]["iterations"])
    bubbles, whole, spans, waits, stage_b, fwd, bwd = [], [], [], [], [], [], []
    for i in range(n_iter):
        its = [r["iterations"][i] for r in per_rank]
        start = min(e[3] for it in its for e in it["events"])
        end = max(e[4] for it in its for e in it["events"])
        span = end - start
        busy = [sum(e[4] - e[3] for e in it["events"]) for it in its]
        per_stage = [1 - b / span for b in busy]
        c0, c1 = min(it["call"][0] for it in its), max(it["call"][1] for it in its)
        spans.append(span)
        bubbles.append(sum(per_stage) / len(per_stage))
        stage_b.append(per_stage)
        whole.append(sum(1 - b / (c1 - c0) for b in busy) / len(busy))
        waits.append(sum(it["recv_wait"] for it in its) / len(its) / span)
        for it in its:
            fwd += [e[4] - e[3] for e in it["events"] if e[0] == "F"]
            bwd += [e[4] - e[3] for e in it["events"] if e[0] == "B"]
    k = len(per_rank)
    mean = lambda xs: sum(xs) / len(xs)
    n_f = sum(e[0] == "F" for e in per_rank[0]["iterations"][0]["events"])  # v m
    # the ideal span is (v m + pp - 1)(t_F + t_B): what each F or B adds to it beyond its time
    gap = (mean(spans) / (n_f + k - 1) - mean(fwd) - mean(bwd)) / 2
    return dict(
        gap_s=gap,
        measured=mean(bubbles),
        stages=[mean([s[j] for s in stage_b]) for j in range(k)],
        whole=mean(whole),
        recv_wait=mean(waits),
        span_s=mean(spans),
        t_f=mean(fwd),
        t_b=mean(bwd),
        spread=max(bubbles) - min(bubbles),
    )


def measure(pps, mults, vs, sleep_s, warmup, iters, layers_per_stage=2) -> list[dict]:
    """Every case; one set of pp processes per pp (each case its own engine)."""
    from tests.helpers.dist import run_distributed

    rows = []
    for pp in pps:
        cases = [(v, mult * pp) for v in vs for mult in mults]
        per_rank = run_distributed(_rank, pp, cases, sleep_s, warmup, iters, layers_per_stage)
        for i, (v, m) in enumerate(cases):
            res = [r[i] for r in per_rank]
            rows.append(
                dict(
                    pp=pp,
                    m=m,
                    v=v,
                    formula=formula(pp, m, v),
                    **analyze(res),
                    raw=res,
                )
            )
    return rows


def table(rows) -> str:
    out = [
        "| schedule | pp | m | v | formula | measured | per stage | incl. step | in recv "
        "| F/B span ms | t_F / t_B ms | gap ms |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        name = "interleaved" if r["v"] > 1 else "1F1B"
        stages = " ".join(f"{b:.3f}" for b in r["stages"])
        out.append(
            f"| {name} | {r['pp']} | {r['m']} | {r['v']} | {r['formula']:.3f} "
            f"| {r['measured']:.3f} ±{r['spread'] / 2:.3f} | {stages} | {r['whole']:.3f} "
            f"| {r['recv_wait']:.3f} "
            f"| {r['span_s'] * 1e3:.0f} | {r['t_f'] * 1e3:.1f} / {r['t_b'] * 1e3:.1f} "
            f"| {r['gap_s'] * 1e3:.1f} |"
        )
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 2)[2],
    )
    ap.add_argument("--pp", default="2,4", help="pipeline sizes (comma-separated)")
    ap.add_argument("--mult", default="1,2,4", help="micro-batches per iteration, as m / pp")
    ap.add_argument("--v", default="1,2", help="virtual stages (1: 1F1B)")
    ap.add_argument("--sleep-ms", type=float, default=20.0, help="per-layer forward cost")
    ap.add_argument("--layers-per-stage", type=int, default=2)
    ap.add_argument("--warmup", type=int, default=1)
    ap.add_argument("--iters", type=int, default=3)
    ap.add_argument("--json", help="also write the rows (every event) here")
    a = ap.parse_args(argv)
    pps = [int(x) for x in a.pp.split(",")]
    mults = [int(x) for x in a.mult.split(",")]
    vs = [int(x) for x in a.v.split(",")]
    t0 = time.time()
    rows = measure(pps, mults, vs, a.sleep_ms / 1e3, a.warmup, a.iters, a.layers_per_stage)
    print(
        f"Pipeline bubble, tiny GPT ({a.layers_per_stage} layers per pipeline rank, each with a "
        f"{a.sleep_ms:g} ms sleep in forward and {2 * a.sleep_ms:g} ms in backward), DeepSpeed "
        f"ZeRO 1, dp 1, gloo on {os.cpu_count()} CPU cores; mean of {a.iters} iterations after "
        f"{a.warmup} warm-up; {time.time() - t0:.0f} s.\n"
    )
    print(table(rows))
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
