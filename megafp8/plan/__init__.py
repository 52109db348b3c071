"""``megafp8-plan``: which layouts of a run fit a cluster, how fast each is predicted to be, and the
sbatch line for the best.

    megafp8-plan --config launch/configs/llama-8b.yaml --nodes 1 --gpus-per-node 8 --gpu h200
    megafp8-plan --config run.yaml --num-layers 80 --hidden-size 8192 ... --nodes 16
    megafp8-plan --config run.yaml --nodes 1 --layout 2,1,4 --recompute full   # one layout, by part

The run file and flags are ``pretrain_gpt.py``'s. Every TP (dividing the GPUs of a node, the
heads, kv heads and ffn) x PP (dividing the layers) x DP layout of ``nodes x gpus-per-node`` GPUs
whose global batch splits into micro-batches, for an MoE model with each expert parallelism (EP
dividing DP and the experts; ZeRO 1/2), is tried with sequence parallelism on under TP and
each recompute setting (none, selective, full; or ``--recompute``); those whose predicted peak
memory fits ``--mem-margin`` of the GPU are ranked by predicted tokens/s per GPU. The figures come
from ``plan/model.py`` (its assumptions are in its docstring): a model fitted to single-GPU
measurements, not a measurement of the layouts it ranks.
"""

from __future__ import annotations

import argparse
import sys

from megafp8.plan.model import GPUS, Layout, memory_gib, step_seconds

RECOMPUTE = {None: "", "selective": " --recompute-granularity selective",
             "full": " --recompute-granularity full --recompute-method uniform "
                     "--recompute-num-layers 1"}  # fmt: skip


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def layouts(cfg, world: int, per_node: int, recompute=None) -> list[Layout]:
    m, t = cfg.model, cfg.train
    gbs = t.global_batch_size or t.micro_batch_size * world
    out = []
    for tp in _divisors(per_node):
        if m.num_attention_heads % tp or m.ffn % tp or (m.kv_heads % tp and tp % m.kv_heads):
            continue
        for pp in _divisors(world // tp):
            if m.num_layers % pp:
                continue
            dp = world // (tp * pp)
            if gbs % (t.micro_batch_size * dp):
                continue
            zero = min(cfg.optim.zero_stage, 2) if pp > 1 else cfg.optim.zero_stage
            eps = [1]  # expert parallelism inside DP: ZeRO 1/2, experts divisible by ep
            if m.num_experts and zero in (1, 2):
                eps = [e for e in _divisors(dp) if m.num_experts % e == 0]
            for ep in eps:
                for rc in [recompute] if recompute != "any" else [None, "selective", "full"]:
                    out.append(Layout(tp, pp, dp, zero=zero, micro=t.micro_batch_size,
                                      recompute=rc, sp=tp > 1, ep=ep))  # fmt: skip
    return out


def evaluate(cfg, lay: Layout, gpu, nodes: int) -> dict:
    from megafp8.config_values import padded_vocab_size
    from megafp8.metrics import flops_per_iteration

    m, t = cfg.model, cfg.train
    gbs = t.global_batch_size or t.micro_batch_size * lay.dp
    v = padded_vocab_size(m.vocab_size or 50257, m.make_vocab_size_divisible_by, lay.tp)
    m_batches = gbs // (lay.micro * lay.dp)
    mem = memory_gib(m, v, lay, cfg.fp8.enabled, t.bf16, m_batches,
                     cfg.optim.optimizer_group_max_numel)  # fmt: skip
    sec = step_seconds(m, v, lay, gpu, cfg.fp8.enabled, gbs, nodes)
    tokens = gbs * m.seq_length / sec["total"] / lay.gpus
    tflops = flops_per_iteration(m, gbs, v) / sec["total"] / lay.gpus / 1e12
    return {"layout": lay, "memory": mem, "seconds": sec, "tokens_per_gpu": tokens,
            "tflops": tflops, "fits": None}  # fmt: skip


def plan(cfg, nodes: int, per_node: int, gpu, recompute="any", margin=0.95) -> list[dict]:
    rows = [evaluate(cfg, lay, gpu, nodes) for lay in layouts(cfg, nodes * per_node, per_node,
                                                               recompute)]  # fmt: skip
    for r in rows:
        r["fits"] = r["memory"]["peak"] <= margin * gpu.mem_gib
    return sorted(rows, key=lambda r: (not r["fits"], -r["tokens_per_gpu"]))


def sbatch_line(run_file: str | None, lay: Layout, nodes: int, per_node: int) -> str:
    """``launch/pretrain.sbatch`` reads the run file and flags from RUN_FILE / EXTRA_FLAGS."""
    run = f"RUN_FILE={run_file} " if run_file else "RUN_FILE=<your run file> "
    sp = " --sequence-parallel" if lay.sp else ""
    ep = f" --expert-model-parallel-size {lay.ep}" if lay.ep > 1 else ""
    flags = (f"--tensor-model-parallel-size {lay.tp} --pipeline-model-parallel-size {lay.pp}{sp}"
             f"{ep} --zero-stage {lay.zero}{RECOMPUTE[lay.recompute]}")  # fmt: skip
    return (f'{run}EXTRA_FLAGS="{flags}" sbatch --nodes={nodes} --ntasks-per-node={per_node} '
            f"--gpus-per-node={per_node} launch/pretrain.sbatch")  # fmt: skip


def _row(r: dict) -> str:
    lay, mem = r["layout"], r["memory"]
    cells = [
        lay.tp, lay.pp, lay.dp, lay.ep, lay.recompute or "-",
        f"{mem['peak']:.1f} ({mem['peak at']})",
        "yes" if r["fits"] else "no", f"{r['seconds']['total']:.3f}",
        f"{r['tokens_per_gpu']:,.0f}", f"{r['tflops']:.0f}",
    ]  # fmt: skip
    return "| " + " | ".join(str(c) for c in cells) + " |"


def main(argv=None) -> int:
    from megafp8.cli import parse_args
    from megafp8.validate import validate

    ap = argparse.ArgumentParser(prog="megafp8-plan", description=__doc__,
                                 formatter_class=argparse.RawDescriptionHelpFormatter)  # fmt: skip
    ap.add_argument("--nodes", type=int, default=1)
    ap.add_argument("--gpus-per-node", type=int, default=8)
    ap.add_argument("--gpu", default="h200", choices=sorted(GPUS))
    ap.add_argument("--layout", help="tp,pp,dp[,ep]: this layout only, with its parts")
    ap.add_argument("--recompute", default="any", choices=["any", "none", "selective", "full"])
    ap.add_argument("--top", type=int, default=10, help="layouts listed")
    ap.add_argument("--mem-margin", type=float, default=0.95, help="share of the GPU's memory")
    argv = list(sys.argv[1:] if argv is None else argv)
    a, rest = ap.parse_known_args(argv)
    a.run_file = argv[argv.index("--config") + 1] if "--config" in argv[:-1] else None
    try:
        if a.nodes < 1 or a.gpus_per_node < 1:
            raise ValueError(
                f"--nodes {a.nodes} and --gpus-per-node {a.gpus_per_node} must be >= 1"
            )
        cfg = parse_args(rest + ([] if "--mock-data" in rest else ["--mock-data"]), [])
        world = a.nodes * a.gpus_per_node
        rc = None if a.recompute == "none" else a.recompute
        gpu = GPUS[a.gpu]
        if a.layout:
            parts = [int(x) for x in a.layout.split(",")]
            if len(parts) not in (3, 4):
                raise ValueError(f"--layout {a.layout}: give tp,pp,dp or tp,pp,dp,ep")
            tp, pp, dp, ep = (*parts, 1)[:4]
            if tp * pp * dp != world:
                raise ValueError(f"--layout {a.layout}: tp x pp x dp = {tp * pp * dp} is not "
                                 f"--nodes x --gpus-per-node = {world}")  # fmt: skip
            par = dict(tensor_model_parallel_size=tp, pipeline_model_parallel_size=pp,
                       sequence_parallel=tp > 1, expert_model_parallel_size=ep)  # fmt: skip
            c = cfg.replace(parallel=par)
            validate(c, world)
            lay = Layout(tp, pp, dp, zero=c.optim.zero_stage, micro=c.train.micro_batch_size,
                         recompute=None if rc == "any" else rc, sp=tp > 1, ep=ep)  # fmt: skip
            r = evaluate(c, lay, gpu, a.nodes)
            r["fits"] = r["memory"]["peak"] <= a.mem_margin * gpu.mem_gib
            _print([r], a, cfg, detail=True)
            return 0
        rows = plan(cfg, a.nodes, a.gpus_per_node, gpu, rc, a.mem_margin)
    except ValueError as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    if not rows:
        print(f"error: no TP x PP x DP layout of {world} GPUs divides this model and batch",
              file=sys.stderr)  # fmt: skip
        return 2
    _print(rows[: a.top], a, cfg)
    return 0 if rows[0]["fits"] else 1


def _print(rows, a, cfg, detail=False) -> None:
    m = cfg.model
    print(f"{a.nodes} node(s) x {a.gpus_per_node} {a.gpu.upper()} ({GPUS[a.gpu].mem_gib} GiB), "
          f"{m.num_layers} layers h {m.hidden_size}, seq {m.seq_length}, global batch "
          f"{cfg.train.global_batch_size}, {'FP8' if cfg.fp8.enabled else 'BF16'}, "
          f"ZeRO-{cfg.optim.zero_stage}: predictions (megafp8/plan/model.py)\n")  # fmt: skip
    print("| tp | pp | dp | ep | recompute | peak GiB | fits | s/iter | tokens/s/GPU | "
          "TFLOP/s/GPU |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|---|")
    for r in rows:
        print(_row(r))
    best = rows[0]
    if detail:
        print("\nmemory GiB: " + ", ".join(f"{k} {v:.1f}" for k, v in best["memory"].items()
                                           if isinstance(v, float)))  # fmt: skip
        print("seconds: " + ", ".join(f"{k} {v:.3f}" for k, v in best["seconds"].items()))
    if best["fits"]:
        print("\n" + sbatch_line(a.run_file, best["layout"], a.nodes, a.gpus_per_node))
    else:
        need = min(r["memory"]["peak"] for r in rows)
        print(
            f"\nnothing fits: the smallest predicted peak is {need:.1f} GiB of "
            f"{GPUS[a.gpu].mem_gib} x {a.mem_margin}; more GPUs (ZeRO shards the optimizer "
            "state over DP) or a smaller micro-batch"
        )
