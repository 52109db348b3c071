#!/usr/bin/env python3
"""TFLOP/s at scale: short mock-data runs of ``pretrain_gpt.py`` for model shapes x layouts x node
counts, one table (tokens/s/GPU, TFLOP/s/GPU, MFU, peak memory, scaling efficiency against the
same shape and layout on the fewest nodes) as Markdown and JSON.

Weak scaling: each run keeps the shape's micro-batch and its micro-batches per iteration, so the
global batch grows with the data-parallel size and the work per GPU stays the same; scaling
efficiency = tokens/s/GPU on N nodes / tokens/s/GPU on the fewest nodes listed. Figures are the
console line's (Megatron's layout), averaged over the iterations after ``--skip``.

    # inside an allocation (launch/bench.sbatch does this): srun, one task per GPU
    python bench/scale.py --launcher srun --nodes 1 2 4 --gpus-per-node 8 \\
        --shapes gpt7b llama8b-16 --layouts 1,1 2,1 --out bench-results
    # one GPU, no Slurm: the same code
    python bench/scale.py --launcher local --gpus-per-node 1 --shapes gpt7b --out results
"""

from __future__ import annotations

import argparse
import json
import os
import re
import shlex
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(HERE, "bench"))

import side_by_side as sbs  # noqa: E402

TFLOPS = re.compile(r"throughput per GPU \(TFLOP/s/GPU\): ([0-9.]+)")
MFU = re.compile(r"MFU \(%\): ([0-9.]+)")


def case_flags(base: str, tp: int, pp: int, dp: int, iters: int) -> list[str]:
    """The shape's flags with the layout, and the global batch scaled to this many DP ranks."""
    argv = shlex.split(base)
    val = {argv[i]: argv[i + 1] for i in range(len(argv) - 1) if argv[i].startswith("--")}
    micro, gbs = int(val["--micro-batch-size"]), int(val["--global-batch-size"])
    per_rank = max(1, gbs // micro)  # micro-batches per iteration, kept per DP rank
    argv = _without(argv, ("--global-batch-size", "--train-iters"))
    layout = ["--tensor-model-parallel-size", str(tp), "--pipeline-model-parallel-size", str(pp)]
    if tp > 1:
        layout.append("--sequence-parallel")
    gb = micro * dp * per_rank
    return argv + layout + ["--global-batch-size", str(gb), "--train-iters", str(iters)]


def _without(argv: list[str], names: tuple[str, ...]) -> list[str]:
    """argv without the flags ``names`` and their values."""
    out, i = [], 0
    while i < len(argv):
        if argv[i] in names:
            i += 2
            continue
        out.append(argv[i])
        i += 1
    return out


def command(launcher: str, nodes: int, gpus: int, argv: list[str]) -> list[str]:
    script = os.path.join(HERE, "pretrain_gpt.py")
    if launcher == "srun":
        return ["srun", f"--nodes={nodes}", f"--ntasks={nodes * gpus}", f"--ntasks-per-node={gpus}",
                "--kill-on-bad-exit=1",
                "bash", os.path.join(HERE, "launch/srun_task.sh"), "srun", sys.executable,
                script, *argv]  # fmt: skip
    if gpus > 1:
        return [sys.executable, "-m", "torch.distributed.run", "--standalone",
                f"--nproc_per_node={gpus}", script, *argv]  # fmt: skip
    return [sys.executable, script, *argv]


def mean_after(pattern, text: str, skip: int) -> float | None:
    vals = [float(x) for x in pattern.findall(text)][skip:]
    return sum(vals) / len(vals) if vals else None


def run_case(launcher, nodes, gpus, argv, skip, log_path) -> dict:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if launcher == "srun" and "SLURM_JOB_NODELIST" in os.environ:
        first = subprocess.run(["scontrol", "show", "hostnames", os.environ["SLURM_JOB_NODELIST"]],
                               capture_output=True, text=True).stdout.split()  # fmt: skip
        env.setdefault("MASTER_ADDR", first[0] if first else "127.0.0.1")
        env["MASTER_PORT"] = str(20000 + (int(os.environ.get("SLURM_JOB_ID", 0)) + nodes) % 20000)
    cmd = command(launcher, nodes, gpus, argv)
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE)
    text = p.stdout + p.stderr
    with open(log_path, "w") as f:
        f.write(" ".join(shlex.quote(c) for c in cmd) + "\n" + text)
    res = sbs.parse(text, skip, peer=False)
    res.update(rc=p.returncode, wall_s=round(time.time() - t0, 1))
    res.update(tflops_per_gpu=mean_after(TFLOPS, text, skip), mfu_pct=mean_after(MFU, text, skip))
    return res


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--launcher", choices=("srun", "local"), default="local")
    ap.add_argument("--nodes", type=int, nargs="+", default=[1])
    ap.add_argument("--gpus-per-node", type=int, default=1)
    ap.add_argument("--shapes", nargs="+", default=["gpt7b"], choices=list(sbs.SHAPES))
    ap.add_argument("--flags", help="a shape of your own: Megatron flags (instead of --shapes)")
    ap.add_argument("--precision", default="fp8", choices=list(sbs.PRECISION))
    ap.add_argument("--layouts", nargs="+", default=["1,1"], help="tp,pp (dp follows)")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--skip", type=int, default=3, help="iterations left out of the means")
    ap.add_argument("--extra", default="", help="more flags for every run")
    ap.add_argument("--out", required=True, help="directory: scale.md, scale.json, logs/")
    a = ap.parse_args(argv)
    shapes = {"custom": a.flags} if a.flags else {s: "" for s in a.shapes}
    bad = [lay for lay in a.layouts if not re.fullmatch(r"\d+,\d+", lay)]
    if bad or a.skip >= a.iters:
        ap.error(f"--layouts must be tp,pp (got {bad}); --skip {a.skip} < --iters {a.iters}")
    os.makedirs(os.path.join(a.out, "logs"), exist_ok=True)
    rows = []
    for shape, custom in shapes.items():
        if custom:
            base = f"{custom} {sbs.COMMON} {sbs.PRECISION[a.precision]} {a.extra}"
        else:
            base = " ".join(sbs.flags(shape, a.precision, 1, a.extra))
        for lay in a.layouts:
            tp, pp = (int(x) for x in lay.split(","))
            for n in sorted(a.nodes):
                world = n * a.gpus_per_node
                if world % (tp * pp):
                    continue
                dp = world // (tp * pp)
                flags = case_flags(base, tp, pp, dp, a.iters)
                log = os.path.join(a.out, "logs", f"{shape}-tp{tp}-pp{pp}-n{n}.log")
                res = run_case(a.launcher, n, a.gpus_per_node, flags, a.skip, log)
                gbs, seq = sbs.gbs_seq(flags)
                if "ms_per_iter" in res:
                    res["tokens_per_s_per_gpu"] = gbs * seq / (res["ms_per_iter"] / 1e3) / world
                rows.append(dict(shape=shape, tp=tp, pp=pp, dp=dp, nodes=n, gpus=world,
                                 global_batch=gbs, **res))  # fmt: skip
                print(json.dumps(rows[-1]), flush=True)
    _efficiency(rows)
    md = _markdown(rows, a)
    with open(os.path.join(a.out, "scale.md"), "w") as f:
        f.write(md)
    with open(os.path.join(a.out, "scale.json"), "w") as f:
        json.dump({"args": vars(a), "rows": rows}, f, indent=1)
    print(md)
    return 0 if all(r["rc"] == 0 for r in rows) else 1


def _efficiency(rows: list[dict]) -> None:
    for r in rows:
        same = [x for x in rows if (x["shape"], x["tp"], x["pp"]) == (r["shape"], r["tp"], r["pp"])
                and "tokens_per_s_per_gpu" in x]  # fmt: skip
        base = min(same, key=lambda x: x["nodes"]) if same else None
        if base and "tokens_per_s_per_gpu" in r:
            r["scaling_efficiency"] = r["tokens_per_s_per_gpu"] / base["tokens_per_s_per_gpu"]


def _markdown(rows: list[dict], a) -> str:
    lines = [
        f"{a.precision.upper()}, {a.gpus_per_node} GPU(s) per node, {a.launcher}, mean of "
        f"iterations {a.skip + 1}-{a.iters}\n",
        "| shape | tp | pp | dp | nodes | global batch | tokens/s/GPU | TFLOP/s/GPU | MFU % | "
        "peak GiB | scaling eff. |",
        "|---|---|---|---|---|---|---|---|---|---|---|",
    ]

    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    for r in rows:
        tps = f(r.get("tokens_per_s_per_gpu"), ",.0f") if r["rc"] == 0 else f"failed ({r['rc']})"
        lines.append(
            f"| {r['shape']} | {r['tp']} | {r['pp']} | {r['dp']} | {r['nodes']} | "
            f"{r['global_batch']} | {tps} | {f(r.get('tflops_per_gpu'), '.1f')} | "
            f"{f(r.get('mfu_pct'), '.1f')} | {f(r.get('peak_GiB'), '.1f')} | "
            f"{f(r.get('scaling_efficiency'), '.3f')} |"
        )
    return "\n".join(lines) + "\n"


if __name__ == "__main__":
    sys.exit(main())
