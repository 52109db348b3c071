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


# The settings a case may vary (config field: default); a case's name tags every one off default.
VARIANT = {
    "te_fused_norm": True,
    "te_fused_mlp": True,
    "te_weight_cache": True,
    "cross_entropy_loss_fusion": True,
    "zero_stage": 1,
}
TAGS = {
    "cross_entropy_loss_fusion": "unfused-ce",
    "te_fused_norm": "unfused-norm",
    "te_fused_mlp": "unfused-mlp",
    "te_weight_cache": "no-weight-cache",
}


def case_config(shape, precision, recipe="delayed", **variant):
    from megafp8.config import Config

    v = {**VARIANT, **variant}

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
            cross_entropy_loss_fusion=v["cross_entropy_loss_fusion"],
            **s,
        ),
        fp8=dict(
            fp8_backend="te",
            te_fused_norm=v["te_fused_norm"],
            te_fused_mlp=v["te_fused_mlp"],
            te_weight_cache=v["te_weight_cache"],
            **fp8,
        ),
        train=dict(micro_batch_size=micro, global_batch_size=gbs, train_iters=10**6, bf16=True),
        optim=dict(lr=1e-4, min_lr=1e-5, lr_warmup_iters=10, zero_stage=v["zero_stage"]),
        data=dict(mock_data=True),
        logging=dict(log_memory=True),
    )


def run_case(shape, precision, warmup: int, iters: int, recipe: str, **variant) -> dict:
    import torch

    from megafp8 import metrics
    from megafp8.train import build_run, init_distributed, train_step

    cfg = case_config(shape, precision, recipe, **variant)
    groups, device = init_distributed(cfg)
    run = build_run(cfg, groups, device)
    it = iter(run.data.train)
    losses = []
    for _ in range(warmup):
        losses.append(train_step(run, it)[0])
        run.iteration += 1  # the lr schedule counts consumed samples
        run.consumed += cfg.train.global_batch_size
    torch.cuda.synchronize()
    torch.cuda.reset_peak_memory_stats()
    t0 = time.perf_counter()
    for _ in range(iters):
        losses.append(train_step(run, it)[0])
        run.iteration += 1
        run.consumed += cfg.train.global_batch_size
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
        "case": f"{shape}-{precision}" + _tags(variant),
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


def _tags(variant: dict) -> str:
    """The case name's suffix for every setting off its default."""
    v = {**VARIANT, **variant}
    tags = [t for k, t in TAGS.items() if v[k] != VARIANT[k]]
    tags += [f"zero{v['zero_stage']}"] if v["zero_stage"] != VARIANT["zero_stage"] else []
    return "".join("-" + t for t in tags)


def _profile(run, it, rows: int) -> None:
    """One more iteration under torch.profiler: the kernels that took the most GPU time, and the
    GPU's idle time, by what the CPU was doing when it launched the kernel after each gap."""
    import tempfile

    import torch
    from torch.profiler import ProfilerActivity, profile, record_function

    from megafp8.train import train_step

    eng = run.engine
    saved = {n: getattr(eng, n) for n in ("forward", "backward", "step")}

    def labelled(name, fn):
        def call(*a, **k):
            with record_function(name):
                return fn(*a, **k)

        return call

    def data():
        while True:
            with record_function("data"):
                b = next(it)
            yield b

    for n, fn in saved.items():
        setattr(eng, n, labelled(f"engine.{n}", fn))
    acts = [ProfilerActivity.CPU, ProfilerActivity.CUDA]
    try:
        with profile(activities=acts) as prof:
            with record_function("train_step"):
                train_step(run, data())
            torch.cuda.synchronize()
    finally:
        for n in saved:
            delattr(eng, n)
    print(
        prof.key_averages().table(
            sort_by="cuda_time_total", row_limit=rows, max_name_column_width=110
        ),
        file=sys.stderr,
    )
    with tempfile.NamedTemporaryFile(suffix=".json") as f:
        prof.export_chrome_trace(f.name)
        trace = json.load(open(f.name))
    print(_idle_report(trace.get("traceEvents", trace)), file=sys.stderr)


def _idle_report(events: list) -> str:
    """GPU idle gaps of a chrome trace, attributed to the innermost labelled CPU range (``data``,
    ``engine.forward``/``backward``/``step``, ``train_step``) around the next kernel's launch."""
    gpu = sorted(
        (
            e
            for e in events
            if e.get("ph") == "X" and e.get("cat") in ("kernel", "gpu_memcpy", "gpu_memset")
        ),
        key=lambda e: e["ts"],
    )
    launch = {
        e["args"]["correlation"]: e["ts"]
        for e in events
        if e.get("cat") == "cuda_runtime" and "correlation" in e.get("args", {})
    }
    labels = [
        e
        for e in events
        if e.get("cat") == "user_annotation"
        and (e["name"] in ("data", "train_step") or e["name"].startswith("engine."))
    ]
    if not gpu:
        return "no GPU events"
    idle, end, by = 0.0, gpu[0]["ts"] + gpu[0]["dur"], {}
    for e in gpu[1:]:
        gap = e["ts"] - end
        if gap > 5.0:  # microseconds
            idle += gap
            t = launch.get(e.get("args", {}).get("correlation"), e["ts"])
            inner = [x for x in labels if x["ts"] <= t <= x["ts"] + x["dur"]]
            name = min(inner, key=lambda x: x["dur"])["name"] if inner else "outside"
            n, tot = by.get(name, (0, 0.0))
            by[name] = (n + 1, tot + gap)
        end = max(end, e["ts"] + e["dur"])
    span = end - gpu[0]["ts"]
    lines = [f"GPU span {span / 1e3:.1f} ms, idle {idle / 1e3:.1f} ms ({100 * idle / span:.1f}%)"]
    for name, (n, tot) in sorted(by.items(), key=lambda kv: -kv[1][1]):
        lines.append(f"  idle before kernels launched in {name}: {tot / 1e3:.1f} ms over {n} gaps")
    return "\n".join(lines)


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
    ap.add_argument(
        "--no-te-fused-mlp",
        dest="te_fused_mlp",
        action="store_false",
        help="the MLP as norm + fc1, activation, fc2 (default: one te.LayerNormMLP)",
    )
    ap.add_argument(
        "--no-te-weight-cache",
        dest="te_weight_cache",
        action="store_false",
        help="cast the weights to FP8 at every micro-batch (no is_first_microbatch cache)",
    )
    ap.add_argument(
        "--no-cross-entropy-loss-fusion",
        dest="ce_fusion",
        action="store_false",
        help="the loss in torch ops instead of the Triton kernels",
    )
    ap.add_argument("--zero-stage", type=int, default=1, choices=(0, 1, 2, 3))
    # internal: run one case, with the parent's variant (JSON), in this process
    ap.add_argument("--one", help=argparse.SUPPRESS)
    ap.add_argument("--variant", help=argparse.SUPPRESS)
    a = ap.parse_args()
    variant = dict(
        te_fused_norm=a.fused_norm,
        te_fused_mlp=a.te_fused_mlp,
        te_weight_cache=a.te_weight_cache,
        cross_entropy_loss_fusion=a.ce_fusion,
        zero_stage=a.zero_stage,
    )
    if a.variant:
        variant = json.loads(a.variant)
    if a.one:
        shape, prec = a.one.split("-")
        row = run_case(shape, prec, a.warmup, a.iters, a.recipe, **variant)
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
            "--variant",
            json.dumps(variant),
        ]
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
    from megafp8.run_hooks import end_process

    end_process(main())
