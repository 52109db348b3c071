#!/usr/bin/env python3
"""Activation memory and tensor-parallel communication per transformer layer, per rank (CPU, gloo).

One ``TransformerBlock`` (pre-norm LayerNorm, GELU MLP, biases, multi-head attention, fp32) runs
forward and backward on every TP rank, for tp = 1, 2, 4 with sequence parallelism (SP) off and on.

Memory: every tensor autograd saves for backward passes through ``saved_tensors_hooks``; the bytes
of each *unique storage* are summed (a view saved twice, or q/k/v as views of one QKV output, count
once), parameters excluded. Each storage is charged to the module whose op saved it first: norm1,
norm2, residual (the block's own ops: dropout masks), attn.qkv / mlp.fc1 (column-parallel GEMM
inputs), attn.core (rope, SDPA), attn.proj / mlp.fc2 (row-parallel GEMM inputs), mlp.act (GELU).

Communication: ``torch.distributed.all_reduce / all_gather / all_gather_into_tensor /
reduce_scatter_tensor / reduce_scatter`` are wrapped in this process only and every call is logged
with its phase (forward/backward), the library function that issued it and its *logical* size N:
the full tensor, i.e. the all-reduce buffer, the all-gather output, the reduce-scatter input. On
gloo ``megafp8.parallel.mappings._reduce_scatter`` runs an all-reduce and keeps its chunk; that call
is counted as the reduce-scatter it stands for (what NCCL sends), and its gloo cost is shown apart.
Per-rank bytes sent use the ring convention: all-reduce 2(t-1)/t N, all-gather and reduce-scatter
(t-1)/t N each.

    python bench/tp_memory_comm.py                     # markdown tables on stdout
    python bench/tp_memory_comm.py --dropout 0.1 --json out.json
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys

import torch
import torch.distributed as dist

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from bench.tp_formulas import (  # noqa: E402, F401  (the closed forms; tests reach them here)
    comm_formula,
    korthikanti_bytes,
    korthikanti_fp32,
    ours_bytes,
    ring_sent,
)

MiB = 2.0**20
SEQ_REGIONS = ("norm1", "norm2", "residual")  # run on sequence shards under SP
COL_REGIONS = ("attn.qkv", "attn.q", "attn.kv_proj", "mlp.fc1")  # column-parallel GEMM inputs
TP_REGIONS = ("attn.core", "attn.proj", "mlp.act", "mlp.fc2")  # split by heads / ffn


def block_config(hidden, heads, seq, batch, tp, sp, dropout=0.0, ffn=None):
    from megafp8.config import Config

    return Config().replace(
        model=dict(
            num_layers=1,
            hidden_size=hidden,
            num_attention_heads=heads,
            ffn_hidden_size=ffn,
            seq_length=seq,
            vocab_size=256,
            make_vocab_size_divisible_by=64,
            hidden_dropout=dropout,
            attention_dropout=dropout,
        ),
        parallel=dict(tensor_model_parallel_size=tp, sequence_parallel=sp),
        train=dict(micro_batch_size=batch, seed=11),
    )


class SavedTensors:
    """Sum the bytes of the unique storages autograd saves, by the module that saved them."""

    def __init__(self, block):
        self.by_region: dict[str, int] = {}
        self.keep: dict[int, torch.Tensor] = {}
        self.stack: list[str] = []
        self.params = {p.untyped_storage().data_ptr() for p in block.parameters()}
        self.handles = []
        for name, mod in block.named_modules():
            parent = name.rsplit(".", 1)[0] if "." in name else ""
            if name in ("norm1", "norm2", "attn", "mlp") or (
                parent in ("attn", "mlp") and hasattr(mod, "tp_group")
            ):
                self.handles.append(mod.register_forward_pre_hook(self._enter(name)))
                self.handles.append(mod.register_forward_hook(self._leave))

    def _enter(self, name):
        def hook(mod, args):
            self.stack.append(name)

        return hook

    def _leave(self, mod, args, out):
        self.stack.pop()

    def region(self) -> str:
        top = self.stack[-1] if self.stack else "residual"
        return {"attn": "attn.core", "mlp": "mlp.act"}.get(top, top)

    def pack(self, t):
        st = t.untyped_storage()
        ptr = st.data_ptr()
        if ptr not in self.params and ptr not in self.keep:
            self.keep[ptr] = t  # held until the end, so no address is reused meanwhile
            r = self.region()
            self.by_region[r] = self.by_region.get(r, 0) + st.nbytes()
        return t

    @contextlib.contextmanager
    def hooks(self):
        with torch.autograd.graph.saved_tensors_hooks(self.pack, lambda t: t):
            yield
        for h in self.handles:
            h.remove()


_WRAPPED = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "reduce_scatter_tensor",
    "reduce_scatter",
)


def _issuer() -> str:
    """The library function behind a collective, from the calling frames."""
    f = sys._getframe(2)
    for _ in range(8):
        if f is None:
            break
        q = f.f_code.co_qualname
        if q in ("_reduce_scatter", "_all_gather", "_Copy.backward", "_Reduce.forward"):
            return q
        if q.startswith("allreduce_grad_hook"):
            return "allreduce_grad_hook"
        f = f.f_back
    return "other"


LOGICAL = {  # issuer -> the collective it stands for
    "_reduce_scatter": "reduce_scatter",
    "_all_gather": "all_gather",
    "_Copy.backward": "all_reduce",
    "_Reduce.forward": "all_reduce",
    "allreduce_grad_hook": "param_grad_all_reduce",
}


class CommCounter:
    """Log every torch.distributed collective issued while ``phase`` is set."""

    def __init__(self):
        self.events: list[dict] = []
        self.phase = None

    def _wrap(self, op, fn):
        def wrapper(*args, **kwargs):
            if self.phase is not None:
                group = kwargs.get("group")
                if op == "all_reduce":
                    n = args[0].numel() * args[0].element_size()
                elif op == "all_gather":
                    n = sum(t.numel() * t.element_size() for t in args[0])
                elif op == "all_gather_into_tensor":
                    n = args[0].numel() * args[0].element_size()
                elif op == "reduce_scatter_tensor":
                    n = args[1].numel() * args[1].element_size()
                else:  # reduce_scatter(output, input_list)
                    n = sum(t.numel() * t.element_size() for t in args[1])
                who = _issuer()
                self.events.append(
                    dict(
                        phase=self.phase,
                        op=op,
                        issuer=who,
                        logical=LOGICAL.get(who, "other:" + op),
                        bytes=n,
                        t=dist.get_world_size(group),
                    )
                )
            return fn(*args, **kwargs)

        return wrapper

    @contextlib.contextmanager
    def patched(self):
        saved = {op: getattr(dist, op) for op in _WRAPPED}
        try:
            for op, fn in saved.items():
                setattr(dist, op, self._wrap(op, fn))
            yield self
        finally:
            for op, fn in saved.items():
                setattr(dist, op, fn)


def measure_block(cfg, groups) -> dict:
    """One forward + backward of layer 0 on this rank: saved bytes by region, collectives."""
    from megafp8.fp8.backend import build_backend
    from megafp8.model.block import TransformerBlock
    from megafp8.parallel import mappings as M

    backend = build_backend(cfg.fp8, amax_group=groups.tp_dp_group, tp_group=groups.tp_group)
    block = TransformerBlock(
        cfg,
        backend=backend,
        groups=groups,
        layer=0,
        seed=cfg.train.seed,
        fp8=backend.fp8,
        dtype=torch.float32,
        device=None,
        kv_group=groups.kv_replica_group(cfg.model.kv_heads),
    )
    block.train()
    m = cfg.model
    g = torch.Generator().manual_seed(5)
    x = torch.randn(m.seq_length, cfg.train.micro_batch_size, m.hidden_size, generator=g)
    dy = torch.randn(x.shape, generator=g)
    if cfg.parallel.sequence_parallel:  # [s/tp, b, h]: this rank's sequence shard
        x, dy = M._split(x, groups.tp_group, 0), M._split(dy, groups.tp_group, 0)
    x = x.clone().requires_grad_()  # its own storage (a chunk of x would keep all of x's)
    saved, comm = SavedTensors(block), CommCounter()
    torch.manual_seed(1)
    with comm.patched():
        with saved.hooks():
            comm.phase = "forward"
            y = block(x)
        comm.phase = "backward"
        y.backward(dy)
        comm.phase = None
    return dict(saved=saved.by_region, comm=comm.events, out_shape=list(y.shape))


def _rank(cases):
    """In each TP rank: build the groups, measure every case (each a config)."""
    from megafp8.parallel.groups import ParallelGroups

    c = cases[0]
    groups = ParallelGroups.build(
        tp=c.parallel.tensor_model_parallel_size, kv_heads=c.model.kv_heads
    )
    return [measure_block(c, groups) for c in cases]


def measure(cases_by_tp: dict[int, list]) -> dict[int, list[list[dict]]]:
    """tp -> per rank -> per case results (tp=1 in this process, no process group)."""
    from megafp8.parallel.groups import ParallelGroups
    from tests.helpers.dist import run_distributed

    out = {}
    for tp, cases in cases_by_tp.items():
        if tp == 1:
            out[tp] = [[measure_block(c, ParallelGroups.single()) for c in cases]]
        else:
            out[tp] = run_distributed(_rank, tp, cases)
    return out


def summarize_comm(events) -> dict[str, dict]:
    """phase -> {logical op: bytes}, counts, ring bytes sent, gloo-executed ring bytes."""
    out = {}
    for ph in ("forward", "backward"):
        ev = [e for e in events if e["phase"] == ph]
        act = [e for e in ev if e["logical"] != "param_grad_all_reduce"]
        logical, count = {}, {}
        for e in act:
            logical[e["logical"]] = logical.get(e["logical"], 0) + e["bytes"]
            count[e["logical"]] = count.get(e["logical"], 0) + 1
        out[ph] = dict(
            logical=logical,
            count=count,
            ring=sum(ring_sent(e["logical"], e["bytes"], e["t"]) for e in act),
            gloo=sum(ring_sent(e["op"], e["bytes"], e["t"]) for e in act),  # RS ran as AR
            param_grad=sum(e["bytes"] for e in ev if e["logical"] == "param_grad_all_reduce"),
            param_grad_count=sum(1 for e in ev if e["logical"] == "param_grad_all_reduce"),
        )
    return out


def region_sums(saved: dict[str, int]) -> dict[str, int]:
    return {
        "seq": sum(saved.get(r, 0) for r in SEQ_REGIONS),
        "col": sum(saved.get(r, 0) for r in COL_REGIONS),
        "tp": sum(saved.get(r, 0) for r in TP_REGIONS),
        "total": sum(saved.values()),
    }


# ---- report -----------------------------------------------------------------------------------


def run(hidden, heads, seq, batch, tps, dropout=0.0) -> list[dict]:
    cases = {
        tp: [block_config(hidden, heads, seq, batch, tp, sp, dropout) for sp in (False, True)]
        for tp in tps
    }
    if 1 in cases:
        cases[1] = cases[1][:1]  # SP needs TP
    res = measure(cases)
    rows = []
    for tp, per_rank in res.items():
        for i, case in enumerate(cases[tp]):
            sp = case.parallel.sequence_parallel
            ranks = [r[i] for r in per_rank]
            r0 = ranks[0]
            same = all(r["saved"] == r0["saved"] for r in ranks) and all(
                [(e["logical"], e["bytes"]) for e in r["comm"]]
                == [(e["logical"], e["bytes"]) for e in r0["comm"]]
                for r in ranks
            )
            rows.append(
                dict(
                    tp=tp,
                    sp=sp,
                    ranks_agree=same,
                    saved=r0["saved"],
                    regions=region_sums(r0["saved"]),
                    comm=summarize_comm(r0["comm"]),
                    comm_events=r0["comm"],
                )
            )
    return rows


def _mib(x):
    return f"{x / MiB:.2f}"


def memory_table(rows, s, b, h, a, f, dropout) -> str:
    base = {r["tp"]: r["regions"]["total"] for r in rows if not r["sp"]}.get(1)
    out = [
        "| tp | SP | norms + residual | column-GEMM inputs | attention + MLP (TP-split) | total "
        "| total vs tp=1 | our formula | Korthikanti 16-bit | Korthikanti in fp32 |",
        "|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        g, t, sp = r["regions"], r["tp"], r["sp"]
        ours = sum(ours_bytes(s, b, h, a, f, t, sp, dropout).values())
        rel = f"{g['total'] / base:.3f}" if base else ""
        check = " (=)" if ours == g["total"] else " (differs)"
        out.append(
            f"| {t} | {'on' if sp else 'off'} | {_mib(g['seq'])} | {_mib(g['col'])} "
            f"| {_mib(g['tp'])} | {_mib(g['total'])} | {rel} "
            f"| {_mib(ours)}{check} "
            f"| {_mib(korthikanti_bytes(s, b, h, a, t, sp))} "
            f"| {_mib(korthikanti_fp32(s, b, h, a, t, sp, dropout))} |"
        )
    return "\n".join(out)


def comm_table(rows, s, b, h) -> str:
    out = [
        "| tp | SP | phase | logical collectives | logical MiB | formula MiB | ring sent/rank MiB "
        "| as run on gloo MiB | param-grad all-reduces |",
        "|---|---|---|---|---|---|---|---|---|",
    ]
    for r in rows:
        if r["tp"] == 1:
            continue
        f = comm_formula(s, b, h, r["tp"], r["sp"])
        for ph in ("forward", "backward"):
            c = r["comm"][ph]
            ops = ", ".join(f"{n} x {op}" for op, n in sorted(c["count"].items()))
            pg = (
                f"{c['param_grad_count']} x, {c['param_grad'] / 1024:.1f} KiB"
                if c["param_grad_count"]
                else "0"
            )
            out.append(
                f"| {r['tp']} | {'on' if r['sp'] else 'off'} | {ph} | {ops} "
                f"| {_mib(sum(c['logical'].values()))} | {_mib(sum(f[ph].values()))}"
                f"{' (=)' if c['logical'] == f[ph] else ' (differs)'} "
                f"| {_mib(c['ring'])} | {_mib(c['gloo'])} | {pg} |"
            )
    return "\n".join(out)


def region_table(rows) -> str:
    names = [
        n for n in (*SEQ_REGIONS, *COL_REGIONS, *TP_REGIONS) if any(n in r["saved"] for r in rows)
    ]
    out = ["| tp | SP | " + " | ".join(names) + " |", "|---|---|" + "---|" * len(names)]
    for r in rows:
        out.append(
            f"| {r['tp']} | {'on' if r['sp'] else 'off'} | "
            + " | ".join(_mib(r["saved"].get(n, 0)) for n in names)
            + " |"
        )
    return "\n".join(out)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=512)
    ap.add_argument("--heads", type=int, default=8)
    ap.add_argument("--seq", type=int, default=512)
    ap.add_argument("--batch", type=int, default=4)
    ap.add_argument("--tp", default="1,2,4")
    ap.add_argument("--dropout", type=float, default=0.0, help="hidden and attention dropout")
    ap.add_argument("--json", help="also write the rows (and every collective) here")
    a = ap.parse_args(argv)
    tps = [int(t) for t in a.tp.split(",")]
    rows = run(a.hidden, a.heads, a.seq, a.batch, tps, a.dropout)
    s, b, h, n, f = a.seq, a.batch, a.hidden, a.heads, 4 * a.hidden
    print(
        f"One transformer layer, per rank: s={s} b={b} h={h} heads={n} ffn={f}, fp32, "
        f"dropout={a.dropout}, LayerNorm, GELU, biases; gloo on {os.cpu_count()} CPU cores.\n"
    )
    print("Activation memory saved for backward (MiB, unique storages, parameters excluded):\n")
    print(memory_table(rows, s, b, h, n, f, a.dropout))
    print("\nBy region (MiB):\n")
    print(region_table(rows))
    print(f"\nCommunication per layer (N = s*b*h*4 bytes = {_mib(s * b * h * 4)} MiB):\n")
    print(comm_table(rows, s, b, h))
    if not all(r["ranks_agree"] for r in rows):
        print("\nwarning: ranks differ; the figures are rank 0's")
    if a.json:
        with open(a.json, "w") as fh:
            json.dump(
                dict(shape=dict(s=s, b=b, h=h, heads=n, ffn=f, dropout=a.dropout), rows=rows),
                fh,
                indent=1,
            )


if __name__ == "__main__":
    main()
