#!/usr/bin/env python3
"""The first optimizer update of a training run, tensor by tensor, in megafp8 or in the Megatron-LM
peer: run the stack's own ``pretrain_gpt.py`` with its flags, copy every parameter before the
first iteration and, after it, write per tensor the share of elements that changed, the mean
``|delta| / lr``, the share that moved by more than 1.5 x lr, and the mean ``|w|`` before.

Adam's first step is ``lr x sign(g)`` wherever ``|g|`` is well above eps, so a textbook update
reads ``|delta| / lr`` near 1 (bf16 weights round it: a move under half a bf16 ulp is lost,
one above it becomes a whole ulp). Two stacks given the same flags and data should agree.

    python bench/first_update.py --json ours.json -- <pretrain_gpt.py flags>
    (cd /tmp/megatron-lm && torchrun --nproc_per_node 1 $REPO/bench/first_update.py --stack peer \\
        --json $PWD/peer.json -- <the same flags>)          # the peer, from its own directory
    python bench/first_update.py --compare ours.json peer.json     # per kind of tensor

``--lr`` is the learning rate of the first update (the flag's ``--lr``: both stacks start their
schedule there when there is no warmup).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import runpy
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SHARES = ("changed", "abs_delta_over_lr", "over_1.5_lr", "abs_w")  # per-element means


def snapshot(named) -> dict:
    return {k: p.detach().clone() for k, p in named}


def update_stats(named, before: dict, lr: float) -> dict:
    out = {}
    for k, p in named:
        w0 = before[k].float()
        d = p.detach().float() - w0
        out[k] = {
            "numel": p.numel(),
            "dtype": str(p.dtype).replace("torch.", ""),
            "changed": (d != 0).float().mean().item(),
            "abs_delta_over_lr": (d.abs().mean() / lr).item(),
            "over_1.5_lr": (d.abs() > 1.5 * lr).float().mean().item(),
            "abs_w": w0.abs().mean().item(),
        }
    return out


def kind(name: str) -> str:
    """One name for the same tensor in every layer: ``layers.<i>.`` -> ``L.``, the peer's
    ``decoder.`` / ``module.`` prefixes dropped."""
    name = re.sub(r"^(module\.)+", "", name).replace("decoder.", "")
    return re.sub(r"layers\.\d+\.", "L.", name)


def by_kind(stats: dict) -> dict:
    """Element-weighted means over the tensors of each kind."""
    agg: dict[str, dict] = {}
    for name, s in stats.items():
        a = agg.setdefault(kind(name), {"numel": 0, "dtype": s["dtype"]})
        n = s["numel"]
        a["numel"] += n
        for f in SHARES:
            a[f] = a.get(f, 0.0) + s[f] * n
    for a in agg.values():
        for f in SHARES:
            a[f] /= a["numel"]
    return agg


def table(path: str) -> str:
    rows = [f"== {path}", f"{'tensor':48s} {'elements':>12s} changed |d|/lr >1.5lr  |w|  dtype"]
    for k, a in by_kind(json.load(open(path))).items():
        rows.append(
            f"{k:48s} {a['numel']:12d} {a['changed']:7.3f} {a['abs_delta_over_lr']:6.3f} "
            f"{a['over_1.5_lr']:6.3f} {a['abs_w']:.4f} {a['dtype']}"
        )
    return "\n".join(rows)


def wrap(module, model_of, path: str, lr: float) -> None:
    """Replace ``module.train_step`` so its first call is measured."""
    orig, calls = module.train_step, [0]

    def step(*a, **k):
        first = calls[0] == 0
        calls[0] += 1
        if not first:
            return orig(*a, **k)
        model = model_of(a, k)
        before = snapshot(model.named_parameters())
        out = orig(*a, **k)
        stats = update_stats(model.named_parameters(), before, lr)
        if int(os.environ.get("RANK", "0")) == 0:
            tmp = path + ".tmp"
            with open(tmp, "w") as f:
                json.dump(stats, f)
            os.replace(tmp, path)
        return out

    module.train_step = step


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--stack", choices=["megafp8", "peer"], default="megafp8")
    ap.add_argument("--json", help="where the per-tensor figures go")
    ap.add_argument("--lr", type=float, help="the first update's lr (default: the run's --lr)")
    ap.add_argument("--compare", nargs="+", metavar="JSON", help="print tables of these, then stop")
    ap.add_argument("flags", nargs=argparse.REMAINDER, help="-- then the stack's own flags")
    a = ap.parse_args(argv)
    if a.compare:
        print("\n".join(table(p) for p in a.compare))
        return 0
    flags = a.flags[1:] if a.flags[:1] == ["--"] else a.flags
    if not a.json:
        ap.error("--json is required to run a stack")
    lr = a.lr
    if lr is None:
        if "--lr" not in flags:
            ap.error("give --lr (the run's flags name none)")
        lr = float(flags[flags.index("--lr") + 1])
    path = os.path.abspath(a.json)
    if a.stack == "megafp8":
        sys.path.insert(0, ROOT)
        import megafp8.train as T

        wrap(T, lambda args, kw: args[0].model, path, lr)
        return T.main(flags)
    sys.path.insert(0, os.getcwd())  # the peer's checkout
    import megatron.training.training as T  # noqa: E402

    wrap(T, lambda args, kw: (args[2] if len(args) > 2 else kw["model"])[0], path, lr)
    sys.argv = ["pretrain_gpt.py", *flags]
    runpy.run_path("pretrain_gpt.py", run_name="__main__")
    return 0


if __name__ == "__main__":
    sys.exit(main())
