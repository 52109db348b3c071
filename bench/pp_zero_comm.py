#!/usr/bin/env python3
"""ZeRO-1 vs ZeRO-2 data-parallel communication under pipeline parallelism, per micro-batch (gloo).

A tiny GPT trains at pp x dp (default 2 x 2: 4 gloo processes) through the library's 1F1B schedule
and its DeepSpeed engine on every stage (``megafp8.train.build_run``), for ZeRO 1 and 2 and m
micro-batches per iteration (default 2, 4, 8). Before DeepSpeed is imported, this process wraps
``torch.distributed`` collectives (all_reduce, reduce, broadcast, all_gather,
all_gather_into_tensor, reduce_scatter, reduce_scatter_tensor, all_reduce_coalesced; in
``torch.distributed`` and ``distributed_c10d``, nested calls counted once) and
``batch_isend_irecv`` (the pipeline's point-to-point transfers). Each call is logged with its
group (matched by its ranks against ``ParallelGroups``: dp, pp, mp, emb, world), who issued it
(DeepSpeed when a DeepSpeed frame is on the stack, else megafp8), and its logical size N: the
all-reduce, reduce or broadcast buffer, the all-gather output, the reduce-scatter input; for p2p
the bytes this rank sends. The engine is wrapped so each call is also tagged with where in the
iteration it came: in the micro-batches before the last backward, or from the last backward on
(DeepSpeed's accumulation boundary: the optimizer step and its all-gather).

Counted: the second of two iterations (the first warms up), on every rank; the figures are those
of DP rank 0 of each pipeline stage (both DP ranks are checked to issue the same calls). ZeRO-1
reduces the accumulated gradients once, at the boundary; ZeRO-2 reduces each micro-batch's
gradients in that micro-batch's backward (its hooks partition the gradients as they come), so its
DP traffic grows with m while ZeRO-1's does not.

    python bench/pp_zero_comm.py                        # pp 2 x dp 2, m = 2, 4, 8, ZeRO 1 and 2
    python bench/pp_zero_comm.py --pp 1 --m 4 --json out.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import warnings

import torch
import torch.distributed as dist
import torch.distributed.distributed_c10d as c10d

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

MiB = 2.0**20
COLLECTIVES = (
    "all_reduce",
    "reduce",
    "broadcast",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter",
    "reduce_scatter_tensor",
    "all_reduce_coalesced",
)


def _nbytes(t) -> int:
    if isinstance(t, list | tuple):
        return sum(_nbytes(x) for x in t)
    return t.numel() * t.element_size() if isinstance(t, torch.Tensor) else 0


def logical_bytes(op: str, args, kwargs) -> int:
    """N of one call: the buffer, the all-gather output or the reduce-scatter input."""
    names = {
        "all_gather": ("tensor_list", 0),
        "all_gather_into_tensor": ("output_tensor", 0),
        "reduce_scatter": ("input_list", 1),
        "reduce_scatter_tensor": ("input", 1),
        "all_reduce_coalesced": ("tensors", 0),
    }
    key, pos = names.get(op, ("tensor", 0))
    return _nbytes(kwargs[key] if key in kwargs else args[pos])


def _issuer() -> tuple[str, str]:
    """("deepspeed", its first function outside deepspeed.comm) when a DeepSpeed frame is on
    the stack, else ("megafp8", the innermost megafp8 function)."""
    f, ds, mine = sys._getframe(2), None, None
    while f is not None:
        path, name = f.f_code.co_filename.replace(os.sep, "/"), f.f_code.co_qualname
        if "/deepspeed/" in path and (ds is None or ds[0]):
            ds = ("/deepspeed/comm/" in path, name)  # (still in deepspeed.comm, function)
        elif mine is None and "/megafp8/" in path:
            mine = name
        f = f.f_back
    return ("deepspeed", ds[1]) if ds else ("megafp8", mine or "?")


class CommLog:
    """Every collective and p2p transfer issued while ``phase`` is set, with group and issuer."""

    def __init__(self):
        self.events: list[dict] = []
        self.phase: str | None = None
        self.depth = 0

    def _log(self, op, group, nbytes):
        if self.phase is None:
            return
        ranks = dist.get_process_group_ranks(group) if group is not None else None
        who, fn = _issuer()
        self.events.append(dict(phase=self.phase, op=op, ranks=ranks, bytes=nbytes, who=who, fn=fn))

    def _wrap(self, op, fn):
        def wrapper(*args, **kwargs):
            if self.depth == 0:
                group = kwargs.get("group")
                if group is None and op == "batch_isend_irecv":  # the ops carry their group
                    for p in args[0]:
                        if p.op.__name__ == "isend":
                            self._log("p2p_send", p.group, _nbytes(p.tensor))
                elif op != "batch_isend_irecv":
                    self._log(op, group, logical_bytes(op, args, kwargs))
            self.depth += 1
            try:
                return fn(*args, **kwargs)
            finally:
                self.depth -= 1

        return wrapper

    def install(self) -> None:
        """Wrap for the rest of this process: before DeepSpeed is imported, since its comm
        backend keeps references to some of these functions."""
        for op in (*COLLECTIVES, "batch_isend_irecv"):
            fn = getattr(c10d, op)
            w = self._wrap(op, fn)
            setattr(c10d, op, w)
            if getattr(dist, op, None) is fn:
                setattr(dist, op, w)


class PhasedEngine:
    """The engine, setting ``log.phase``: "micro-batch" until the last backward of the
    iteration starts, then "boundary" (its reduction, the optimizer step)."""

    def __init__(self, engine, log: CommLog, m: int):
        self._engine, self._log, self._m, self.n_backward = engine, log, m, 0

    def __call__(self, *args, **kwargs):
        return self._engine(*args, **kwargs)

    def backward(self, *args, **kwargs):
        self.n_backward += 1
        if self.n_backward == self._m and self._log.phase is not None:
            self._log.phase = "boundary"
        return self._engine.backward(*args, **kwargs)

    def __getattr__(self, name):
        return getattr(self._engine, name)


LOG = CommLog()


def bench_config(pp: int, m: int, zero: int, dp: int, layers: int = 4, hidden: int = 128):
    from megafp8.config import Config

    return Config().replace(
        model=dict(
            num_layers=layers,
            hidden_size=hidden,
            num_attention_heads=4,
            seq_length=32,
            vocab_size=256,
            make_vocab_size_divisible_by=64,
        ),
        data=dict(mock_data=True),
        parallel=dict(pipeline_model_parallel_size=pp),
        train=dict(micro_batch_size=2, global_batch_size=2 * dp * m, train_iters=8, seed=7),
        optim=dict(lr=1e-4, min_lr=1e-5, lr_warmup_iters=1, zero_stage=zero),
        logging=dict(log_interval=1, log_memory=False),
    )


def _kind(ranks, groups) -> str:
    """The names of this rank's groups with exactly these ranks ("pp/mp/emb" when they
    coincide), else "world" or "other"."""
    ranks = ranks or list(range(dist.get_world_size()))
    names = [k for k in ("dp", "pp", "mp", "emb") if groups.ranks.get(k) == ranks]
    return "/".join(names) or ("world" if len(ranks) == dist.get_world_size() else "other")


def measure_case(groups, pp, dp, m, zero, layers, hidden) -> dict:
    """Two iterations of the case on this rank; the second's calls, classified."""
    from megafp8.parallel.pipeline.schedules import train_iteration
    from megafp8.train import build_run
    from megafp8.validate import validate

    cfg = bench_config(pp, m, zero, dp, layers, hidden)
    validate(cfg, dist.get_world_size())
    run = build_run(cfg, groups, torch.device("cpu"))
    engine = run.engine
    train_iter = iter(run.data.train)
    for i in range(2):
        LOG.events.clear()
        run.engine = PhasedEngine(engine, LOG, m)
        dist.barrier()
        LOG.phase = "micro-batch" if i == 1 else None
        train_iteration(run, train_iter)
        LOG.phase = None
    world = dist.get_world_size()
    events = [
        {**e, "group": _kind(e["ranks"], groups), "n": len(e["ranks"] or range(world))}
        for e in LOG.events
    ]
    n_params = sum(p.numel() for p in engine.module.parameters() if p.requires_grad)
    return dict(stage=groups.coords.pp, dp_rank=groups.coords.dp, events=events, params=n_params)


def _rank(cases, pp, layers, hidden):
    warnings.filterwarnings("ignore", message=".*all_gather_into_tensor.* is deprecated")
    LOG.install()  # before deepspeed is imported (build_run imports it)
    from megafp8.parallel.groups import ParallelGroups

    groups = ParallelGroups.build(1, pp)
    dp = groups.dp
    return [measure_case(groups, pp, dp, m, zero, layers, hidden) for zero, m in cases]


def ring_sent(op: str, nbytes: int, n: int) -> float:
    """Bytes one rank sends for ``op`` on N logical bytes in a ring: all-reduce 2 (n-1)/n N,
    all-gather, reduce-scatter, reduce and broadcast (n-1)/n N."""
    return (2 if op.startswith("all_reduce") else 1) * (n - 1) / n * nbytes


def summarize(res: dict) -> dict:
    """One rank's events -> calls and bytes by (group, issuer) and where in the iteration."""
    ev = res["events"]
    dp_ds = [e for e in ev if "dp" in e["group"].split("/") and e["who"] == "deepspeed"]
    before = [e for e in dp_ds if e["phase"] == "micro-batch"]
    p2p = [e for e in ev if e["op"] == "p2p_send"]
    rest = [e for e in ev if e not in dp_ds and e["op"] != "p2p_send"]
    fns: dict[str, list[int]] = {}
    for e in dp_ds:
        c = fns.setdefault(f"{e['op']} ({e['fn']})", [0, 0])
        c[0], c[1] = c[0] + 1, c[1] + e["bytes"]
    return dict(
        dp_calls=len(dp_ds),
        dp_bytes=sum(e["bytes"] for e in dp_ds),
        dp_ring=sum(ring_sent(e["op"], e["bytes"], e["n"]) for e in dp_ds),
        before_boundary_bytes=sum(e["bytes"] for e in before),
        before_boundary_calls=len(before),
        p2p_bytes=sum(e["bytes"] for e in p2p),
        p2p_calls=len(p2p),
        other=[(e["group"], e["who"], e["op"], e["fn"], e["bytes"]) for e in rest],
        by_function=fns,
        grad_bytes=4 * res["params"],
    )


def measure(pp, dp, ms, zeros, layers=4, hidden=128) -> list[dict]:
    """Every (ZeRO stage, m) case in one set of pp x dp processes; a row per case and stage."""
    from tests.helpers.dist import run_distributed

    cases = [(z, m) for z in zeros for m in ms]
    per_rank = run_distributed(_rank, pp * dp, cases, pp, layers, hidden)
    rows = []
    for i, (zero, m) in enumerate(cases):
        for stage in range(pp):
            mine = [r[i] for r in per_rank if r[i]["stage"] == stage]
            sums = [summarize(r) for r in mine]
            same = all(
                [(e["op"], e["group"], e["bytes"]) for e in r["events"]]
                == [(e["op"], e["group"], e["bytes"]) for e in mine[0]["events"]]
                for r in mine
            )
            rows.append(dict(zero=zero, m=m, stage=stage, dp_ranks_agree=same, **sums[0]))
    return rows


def table(rows) -> str:
    base = {(r["m"], r["stage"]): r["dp_bytes"] for r in rows if r["zero"] == 1}
    out = [
        "| ZeRO | m | stage | grads MiB | DP calls | DP MiB / iter | DP MiB / micro-batch "
        "| before the last backward | x ZeRO-1 | ring sent / rank MiB | p2p sent MiB / iter "
        "| other calls |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        ratio = r["dp_bytes"] / base[(r["m"], r["stage"])] if base.get((r["m"], r["stage"])) else 0
        out.append(
            f"| {r['zero']} | {r['m']} | {r['stage']} | {r['grad_bytes'] / MiB:.3f} "
            f"| {r['dp_calls']} | {r['dp_bytes'] / MiB:.3f} | {r['dp_bytes'] / r['m'] / MiB:.3f} "
            f"| {r['before_boundary_bytes'] / MiB:.3f} ({r['before_boundary_calls']} calls) "
            f"| {ratio:.2f} | {r['dp_ring'] / MiB:.3f} "
            f"| {r['p2p_bytes'] / MiB:.3f} ({r['p2p_calls']}) "
            f"| {len(r['other'])} |"
        )
    return "\n".join(out)


def function_table(rows) -> str:
    out = ["| ZeRO | m | stage | DeepSpeed call on the DP group: count, MiB |", "|---|---|---|---|"]
    for r in rows:
        fns = "; ".join(
            f"{k}: {c} x, {b / MiB:.3f}" for k, (c, b) in sorted(r["by_function"].items())
        )
        out.append(f"| {r['zero']} | {r['m']} | {r['stage']} | {fns} |")
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(
        description=__doc__.split("\n")[0],
        formatter_class=argparse.RawDescriptionHelpFormatter,
        epilog=__doc__.split("\n", 2)[2],
    )
    ap.add_argument("--pp", type=int, default=2)
    ap.add_argument("--dp", type=int, default=2)
    ap.add_argument("--m", default="2,4,8", help="micro-batches per iteration (comma-separated)")
    ap.add_argument("--zero", default="1,2", help="ZeRO stages (comma-separated)")
    ap.add_argument("--layers", type=int, default=4)
    ap.add_argument("--hidden", type=int, default=128)
    ap.add_argument("--json", help="also write the rows here")
    a = ap.parse_args(argv)
    ms = [int(x) for x in a.m.split(",")]
    zeros = [int(x) for x in a.zero.split(",")]
    t0 = time.time()
    rows = measure(a.pp, a.dp, ms, zeros, a.layers, a.hidden)
    print(
        f"ZeRO communication under pp {a.pp} x dp {a.dp}: tiny GPT ({a.layers} layers, hidden "
        f"{a.hidden}, fp32), 1F1B (pp 1: accumulation), m micro-batches of 2 x 32 tokens; the "
        f"second of two iterations, DP rank 0 of each stage; gloo on {os.cpu_count()} CPU cores; "
        f"{time.time() - t0:.0f} s.\n"
    )
    print(table(rows))
    print("\nDeepSpeed's calls on the data-parallel group, by the function that issued them:\n")
    print(function_table(rows))
    others = sorted({(g, w, op, fn) for r in rows for (g, w, op, fn, _) in r["other"]})
    print("\nOther collectives (not DeepSpeed on the DP group):", others)
    if not all(r["dp_ranks_agree"] for r in rows):
        print("\nwarning: the DP ranks of a stage issued different calls")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(rows, fh, indent=1)


if __name__ == "__main__":
    main()
