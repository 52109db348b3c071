#!/usr/bin/env python3
"""Full training steps on one GPU: tokens/s, TFLOP/s/GPU, MFU and peak memory.

Each case (model shape x precision) runs in a fresh process: warm-up iterations, then timed
iterations of the real loop (``megafp8.train.train_step``: forward, backward and DeepSpeed ZeRO-1
optimizer step over the whole global batch, gradient accumulation included), on mock data.
TFLOP/s use Megatron's formula with causal attention (``megafp8.metrics``).

    python bench/gpu_step.py                       # the four cases, a markdown table on stdout
    python bench/gpu_step.py --cases 7b-fp8 --iters 10 --json out.json
    MEGAFP8_BENCH_PROFILE=25 python bench/gpu_step.py --cases 7b-fp8   # + the top 25 kernels
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SHAPES = {
    # GPT 1.3B: 24 layers, hidden 2048, 16 heads; micro 8, global 64.
    "1.3b": dict(num_layers=24, hidden_size=2048, num_attention_heads=16, micro=8, gbs=64),
    # 7B shape, 8 layers: hidden 4096, 32 heads, ffn 16384; micro 4, global 32.
    "7b": dict(
        num_layers=8,
        hidden_size=4096,
        num_attention_heads=32,
        ffn_hidden_size=16384,
        micro=4,
        gbs=32,
    ),
}
PRECISIONS = ("bf16", "fp8")


def case_config(shape, precision, recipe="delayed", fused_norm=True, zero_stage=1, fused_mlp=False):
    from megafp8.config import Config

    s = dict(SHAPES[shape])
    micro, gbs = s.pop("micro"), s.pop("gbs")
    fp8 = {}
    if precision == "fp8":
        fp8 = dict(
            fp8_format="hybrid",
            fp8_recipe=recipe,
            fp8_amax_history_len=16,
            fp8_amax_compute_algo="max",
        )
    return Config().replace(
        model=dict(
            seq_length=2048,
            max_position_embeddings=2048,
            vocab_size=50257,
            position_embedding_type="learned_absolute",
            normalization="LayerNorm",
            **s,
        ),
        fp8=dict(fp8_backend="te", te_fused_norm=fused_norm, te_fused_mlp=fused_mlp, **fp8),
        train=dict(micro_batch_size=micro, global_batch_size=gbs, train_iters=10**6, bf16=True),
        optim=dict(lr=1e-4, min_lr=1e-5, lr_warmup_iters=10, zero_stage=zero_stage),
        data=dict(mock_data=True),
        logging=dict(log_memory=True),
    )


def run_case(
    shape,
    precision,
    warmup: int,
    iters: int,
    recipe: str,
    fused_norm: bool,
    zero_stage: int,
    fused_mlp: bool = False,
) -> dict:
    import torch

    from megafp8 import metrics
    from megafp8.train import build_run, init_distributed, train_step

    cfg = case_config(shape, precision, recipe, fused_norm, zero_stage, fused_mlp)
    groups, device = init_distributed(cfg)
    run = build_run(cfg, groups, device)
    it = iter(run.data.train)
    losses = []
    for _ in range(warmup):
        losses.append(train_step(run, it)[0])
        run.iteration += 1
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(iters):
        losses.append(train_step(run, it)[0])
        run.iteration += 1
    torch.cuda.synchronize()
    dt = (time.perf_counter() - t0) / iters
    if os.environ.get("MEGAFP8_BENCH_PROFILE"):
        _profile(run, it, int(os.environ["MEGAFP8_BENCH_PROFILE"]))
    t = cfg.train
    tokens = t.global_batch_size * cfg.model.seq_length
    flops = metrics.flops_per_iteration(cfg.model, t.global_batch_size, run.model.padded_vocab)
    tflops = flops / dt / 1e12
    params = sum(p.numel() for p in run.model.parameters())
    return {
        "case": f"{shape}-{precision}" + _tags(fused_norm, zero_stage, fused_mlp),
        "recipe": recipe if precision == "fp8" else "-",
        "params_M": round(params / 1e6, 1),
        "s_per_iter": round(dt, 4),
        "tokens_per_s": round(tokens / dt, 1),
        "tflops_per_gpu": round(tflops, 1),
        "mfu_bf16_peak_pct": round(100 * tflops / 989.0, 1),
        "peak_mem_GiB": round(torch.cuda.max_memory_allocated() / 2**30, 1),
        "losses": [round(x, 4) for x in losses],
        "gpu": torch.cuda.get_device_name(),
    }


def _tags(fused_norm: bool, zero_stage: int, fused_mlp: bool) -> str:
    """The case name's suffix for every setting off its default."""
    tags = "" if fused_norm else "-unfused-norm"
    tags += f"-zero{zero_stage}" if zero_stage != 1 else ""
    return tags + ("-fused-mlp" if fused_mlp else "")


def _profile(run, it, rows: int) -> None:
    """One more iteration under torch.profiler: the kernels that took the most GPU time."""
    import torch
    from torch.profiler import ProfilerActivity, profile

    from megafp8.train import train_step

    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        train_step(run, it)
        torch.cuda.synchronize()
    print(
        prof.key_averages().table(
            sort_by="cuda_time_total", row_limit=rows, max_name_column_width=70
        ),
        file=sys.stderr,
    )


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--cases", nargs="+", default=[f"{s}-{p}" for s in SHAPES for p in PRECISIONS])
    ap.add_argument("--warmup", type=int, default=3)
    ap.add_argument("--iters", type=int, default=5)
    ap.add_argument("--recipe", default="delayed", choices=("delayed", "tensorwise"))
    ap.add_argument("--json", help="write all rows here")
    ap.add_argument(
        "--no-te-fused-norm",
        dest="fused_norm",
        action="store_false",
        help="norms as separate kernels instead of TE's LayerNormLinear",
    )
    ap.add_argument("--te-fused-mlp", action="store_true", help="the MLP as one te.LayerNormMLP")
    ap.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2, 3))
    ap.add_argument("--one", help=argparse.SUPPRESS)  # internal: run one case in this process
    a = ap.parse_args()
    if a.one:
        shape, prec = a.one.split("-")
        row = run_case(
            shape, prec, a.warmup, a.iters, a.recipe, a.fused_norm, a.zero_stage, a.te_fused_mlp
        )
        print("RESULT " + json.dumps(row), flush=True)
        return 0
    rows = []
    for case in a.cases:
        cmd = [
            sys.executable,
            __file__,
            "--one",
            case,
            "--warmup",
            str(a.warmup),
            "--iters",
            str(a.iters),
            "--recipe",
            a.recipe,
            "--zero-stage",
            str(a.zero_stage),
        ]
        cmd += [] if a.fused_norm else ["--no-te-fused-norm"]
        cmd += ["--te-fused-mlp"] if a.te_fused_mlp else []
        p = subprocess.run(cmd, capture_output=True, text=True)
        if os.environ.get("MEGAFP8_BENCH_PROFILE"):
            print(p.stderr[-12000:], file=sys.stderr)
        got = [ln for ln in p.stdout.splitlines() if ln.startswith("RESULT ")]
        if p.returncode or not got:
            rows.append({"case": case, "error": (p.stderr or p.stdout)[-3000:]})
            print(f"{case}: FAILED\n{rows[-1]['error']}", file=sys.stderr)
            continue
        rows.append(json.loads(got[-1][7:]))
        print(json.dumps(rows[-1]), flush=True)
    print(
        "\n| case | recipe | params (M) | s/iter | tokens/s | TFLOP/s/GPU | MFU vs 989 | peak GiB |"
    )
    print("|---|---|---|---|---|---|---|---|")
    for r in rows:
        if "error" in r:
            print(f"| {r['case']} | failed | | | | | | |")
            continue
        print(
            f"| {r['case']} | {r['recipe']} | {r['params_M']} | {r['s_per_iter']} | "
            f"{r['tokens_per_s']:.0f} | {r['tflops_per_gpu']} | {r['mfu_bf16_peak_pct']}% | "
            f"{r['peak_mem_GiB']} |"
        )
    if a.json:
        with open(a.json, "w") as f:
            json.dump(rows, f, indent=1)
    return 1 if any("error" in r for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
