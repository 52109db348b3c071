#!/usr/bin/env python3
"""megafp8 and the Megatron-LM peer on the same shapes, with the same flags, in one GPU call.

Both stacks take Megatron's flags, so one flag list drives both: ``pretrain_gpt.py`` of this
checkout (the user's path: parse, validate, DeepSpeed engine, the training loop) and the peer's
``pretrain_gpt.py`` through ``megatron.sh`` (``--peer``). The runs alternate (ours, peer, ours,
peer, ...) so drift of the machine hits both. From each run's console lines: the mean "elapsed
time per iteration (ms)" over the iterations after ``--skip`` (warm-up, first-iteration
compilation), tokens/s = global batch x seq / that time, and the peak memory each reports (ours:
"peak memory (GB)", GiB of torch's max allocated; the peer: "max allocated" MB of its memory
line). Then the ratio ours / peer in tokens/s, and where one shape ran in both precisions
each stack's FP8/BF16 (tokens/s).

    python bench/side_by_side.py --shapes llama8b-16 --precisions fp8 bf16
    python bench/side_by_side.py --shapes llama8b-16 --precisions fp8 \\
        --extra "--recompute-granularity full --recompute-method uniform --recompute-num-layers 1"
    python bench/side_by_side.py --shapes gpt7b --ours-only --json out.json
    python bench/side_by_side.py --shapes llama8b --nproc 8 \
        --extra "--tensor-model-parallel-size 2 --sequence-parallel"   # 8 GPUs, both stacks

Standing set: ``gpt7b`` (8 layers of the GPT 7B shape), ``llama8b-16`` (Llama-3-8B cut to 16
layers), ``gpt1.3b``, ``mixtral-4`` (Mixtral-8x7B cut to 4 layers: 8 experts, top-2, aux loss,
seq 4096, vocab 32000); ``llama8b`` is the whole 32-layer Llama-3-8B.
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

COMMON = (
    "--bf16 --use-distributed-optimizer --no-gradient-accumulation-fusion --mock-data "
    "--tokenizer-type NullTokenizer --split 99,1,0 --no-create-attention-mask-in-dataloader "
    "--log-interval 1 --log-throughput --eval-iters 0 --eval-interval 100000 --lr 1e-4 "
    "--min-lr 1e-5 --lr-decay-style cosine --weight-decay 0.1 --clip-grad 1.0 --seed 1234 "
    # named for both stacks: without them Megatron-LM's dataclass defaults (0.1) would apply to
    # the peer alone before megafp8 took Megatron's defaults; 0 is what LLM pretraining uses
    "--hidden-dropout 0.0 --attention-dropout 0.0"
)
LLAMA = (
    "--hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
    "--num-query-groups 8 --seq-length 8192 --max-position-embeddings 8192 "
    "--position-embedding-type rope --rotary-base 500000 --normalization RMSNorm --swiglu "
    "--untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 128256 "
    "--micro-batch-size 1 --global-batch-size 8"
)
MIXTRAL = (  # Mixtral-8x7B's layer; at 4 layers (6.07 B params) the peer peaked at 121 GB
    "--hidden-size 4096 --ffn-hidden-size 14336 --num-attention-heads 32 --group-query-attention "
    "--num-query-groups 8 --seq-length 4096 --max-position-embeddings 4096 "
    "--position-embedding-type rope --rotary-base 1000000 --normalization RMSNorm --swiglu "
    "--untie-embeddings-and-output-weights --disable-bias-linear --vocab-size 32000 "
    "--micro-batch-size 1 --global-batch-size 8 --num-experts 8 --moe-router-topk 2 "
    "--moe-router-load-balancing-type aux_loss --moe-aux-loss-coeff 1e-2 "
    "--moe-token-dispatcher-type alltoall --moe-grouped-gemm"
)
SHAPES = {
    "gpt7b": "--num-layers 8 --hidden-size 4096 --num-attention-heads 32 --seq-length 2048 "
    "--max-position-embeddings 2048 --micro-batch-size 4 --global-batch-size 32 "
    "--vocab-size 50304",
    "gpt1.3b": "--num-layers 24 --hidden-size 2048 --num-attention-heads 16 --seq-length 2048 "
    "--max-position-embeddings 2048 --micro-batch-size 8 --global-batch-size 64 "
    "--vocab-size 50304",
    "llama8b-16": "--num-layers 16 " + LLAMA,
    "llama8b": "--num-layers 32 " + LLAMA,
    "mixtral-4": "--num-layers 4 " + MIXTRAL,
}
PRECISION = {
    "bf16": "",
    "fp8": "--fp8-format hybrid --fp8-amax-history-len 16 --fp8-amax-compute-algo max",
}

ITER = re.compile(r"elapsed time per iteration \(ms\): ([0-9.]+)")
OURS_MEM = re.compile(r"peak memory \(GB\): ([0-9.]+)")
PEER_MEM = re.compile(r"max allocated: ([0-9.]+)")
OOM = re.compile(r"OutOfMemoryError|CUDA out of memory")
# both stacks print Megatron's line (the peer adds a "gtp_remat" coordinate): the first rank's
PARAMS = re.compile(
    r"number of parameters on \([a-z_, ]+\) model parallel rank \([0-9, ]+\): (\d+)"
)


def flags(shape: str, precision: str, iters: int, extra: str) -> list[str]:
    return shlex.split(f"{SHAPES[shape]} {COMMON} {PRECISION[precision]} --train-iters {iters} "
                       f"{extra}")  # fmt: skip


def gbs_seq(argv: list[str]) -> tuple[int, int]:
    val = {argv[i]: argv[i + 1] for i in range(len(argv) - 1)}
    return int(val["--global-batch-size"]), int(val["--seq-length"])


def parse(text: str, skip: int, peer: bool) -> dict:
    """Mean ms/iter after ``skip`` iterations and the peak memory, from console output."""
    ms = [float(x) for x in ITER.findall(text)]
    mem = (PEER_MEM if peer else OURS_MEM).findall(text)
    out = {"iters_logged": len(ms), "oom": bool(OOM.search(text))}
    params = PARAMS.search(text)
    if params:
        out["params"] = int(params.group(1))
    if len(ms) > skip:
        out["ms_per_iter"] = sum(ms[skip:]) / len(ms[skip:])
    if mem:  # ours: GiB; the peer: MB (2^20 bytes)
        out["peak_GiB"] = max(float(x) for x in mem) / (1024.0 if peer else 1.0)
    return out


def run_one(
    argv: list[str], peer: str | None, skip: int, log_path: str | None, nproc: int = 1
) -> dict:
    """One run on ``nproc`` GPUs (torchrun for ours, ``NPROC`` for the peer's script)."""
    script = os.path.join(HERE, "pretrain_gpt.py")
    if peer:
        cmd = ["bash", peer, *argv]
    elif nproc > 1:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone",
               f"--nproc_per_node={nproc}", script, *argv]  # fmt: skip
    else:
        cmd = [sys.executable, script, *argv]
    env = dict(os.environ, PYTHONUNBUFFERED="1", CUDA_DEVICE_MAX_CONNECTIONS="1",
               NPROC=str(nproc))  # fmt: skip
    t0 = time.time()
    p = subprocess.run(cmd, capture_output=True, text=True, env=env, cwd=HERE)
    text = p.stdout + p.stderr
    if log_path:
        with open(log_path, "w") as f:
            f.write(" ".join(shlex.quote(c) for c in cmd) + "\n" + text)
    res = parse(text, skip, bool(peer))
    res.update(rc=p.returncode, wall_s=round(time.time() - t0, 1))
    if p.returncode and "ms_per_iter" not in res:
        res["tail"] = text[-600:]
    return res


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--shapes", nargs="+", default=["gpt7b", "llama8b-16"], choices=list(SHAPES))
    ap.add_argument("--precisions", nargs="+", default=["fp8"], choices=list(PRECISION))
    ap.add_argument("--iters", type=int, default=10, help="iterations per run")
    ap.add_argument("--skip", type=int, default=3, help="iterations left out of the mean")
    ap.add_argument("--rounds", type=int, default=1, help="alternations of ours and the peer")
    ap.add_argument("--extra", default="", help="more flags, given to both stacks")
    ap.add_argument("--ours-extra", default="", help="flags for megafp8 only")
    ap.add_argument("--peer", default=os.path.join(HERE, ".shared/peers/megatron.sh"))
    ap.add_argument("--ours-only", action="store_true", help="no peer runs")
    ap.add_argument("--nproc", type=int, default=1, help="GPUs per run (tokens/s is per GPU)")
    ap.add_argument("--logs", help="directory for each run's full console output")
    ap.add_argument("--json", help="write every row here")
    a = ap.parse_args()
    if not a.ours_only and not os.path.isfile(a.peer):
        ap.error(f"--peer {a.peer} does not exist (or pass --ours-only)")
    if a.logs:
        os.makedirs(a.logs, exist_ok=True)
    rows = []
    for shape in a.shapes:
        for prec in a.precisions:
            argv = flags(shape, prec, a.iters, a.extra)
            gbs, seq = gbs_seq(argv)
            for r in range(a.rounds):
                for who in ["megafp8"] + ([] if a.ours_only else ["megatron-lm"]):
                    peer = a.peer if who == "megatron-lm" else None
                    run_argv = argv if peer else argv + shlex.split(a.ours_extra)
                    log = os.path.join(a.logs, f"{shape}-{prec}-{who}-{r}.log") if a.logs else None
                    res = run_one(run_argv, peer, a.skip, log, a.nproc)
                    if "ms_per_iter" in res:  # per GPU
                        res["tokens_per_s"] = gbs * seq / (res["ms_per_iter"] / 1e3) / a.nproc
                    rows.append(dict(shape=shape, precision=prec, stack=who, round=r, **res))
                    print(json.dumps(rows[-1]), flush=True)
    _table(rows, a)
    for line in fp8_over_bf16(rows):
        print(line)
    if a.json:
        with open(a.json, "w") as f:
            json.dump({"extra": a.extra, "ours_extra": a.ours_extra, "rows": rows}, f, indent=1)
    for problem in unequal_models(rows):
        print(f"error: {problem}: the ratio compares different models", file=sys.stderr)
        return 1
    return 0


def fp8_over_bf16(rows: list[dict]) -> list[str]:
    """Each stack's FP8 speed-up over its own BF16 on a shape (tokens/s, the mean over rounds),
    where both precisions ran: the figure the 1.5x goal of the 7B shape is about."""
    tps: dict = {}
    for r in rows:
        if "tokens_per_s" in r:
            tps.setdefault((r["shape"], r["stack"], r["precision"]), []).append(r["tokens_per_s"])
    out = []
    for shape, stack in dict.fromkeys((k[0], k[1]) for k in tps):
        fp8, bf16 = tps.get((shape, stack, "fp8")), tps.get((shape, stack, "bf16"))
        if fp8 and bf16:
            ratio = (sum(fp8) / len(fp8)) / (sum(bf16) / len(bf16))
            out.append(f"{stack} {shape}: FP8/BF16 {ratio:.3f}x (tokens/s)")
    return out


def unequal_models(rows: list[dict]) -> list[str]:
    """Each shape and precision whose two stacks reported different parameter counts (a
    different padded vocab, a layer the other lacks): a ratio there compares unequal work."""
    out = []
    for key in dict.fromkeys((r["shape"], r["precision"]) for r in rows):
        counts = {}
        for r in rows:
            if (r["shape"], r["precision"]) == key and "params" in r:
                counts.setdefault(r["stack"], set()).add(r["params"])
        if len(counts) == 2 and counts["megafp8"] != counts["megatron-lm"]:
            ours, peer = sorted(counts["megafp8"]), sorted(counts["megatron-lm"])
            out.append(f"{key[0]} {key[1]}: megafp8 built {ours} parameters, Megatron-LM {peer}")
    return out


def _table(rows: list[dict], a) -> None:
    print(f"\nextra flags (both): {a.extra or '-'}; megafp8 only: {a.ours_extra or '-'}; "
          f"{a.nproc} GPU(s) per run, tokens/s per GPU")  # fmt: skip
    print("| shape | precision | megafp8 ms/iter | tokens/s | peak GiB | Megatron-LM ms/iter | "
          "tokens/s | peak GiB | ratio |")  # fmt: skip
    print("|---|---|---|---|---|---|---|---|---|")
    for shape in a.shapes:
        for prec in a.precisions:
            sel = [r for r in rows if r["shape"] == shape and r["precision"] == prec]
            cells = []
            tps = {}
            for who in ("megafp8", "megatron-lm"):
                got = [r for r in sel if r["stack"] == who and "tokens_per_s" in r]
                if not got:
                    failed = [r for r in sel if r["stack"] == who]
                    why = "OOM" if any(r.get("oom") for r in failed) else "failed"
                    cells += [why if failed else "-", "-", "-"]
                    continue
                ms = sum(r["ms_per_iter"] for r in got) / len(got)
                tps[who] = sum(r["tokens_per_s"] for r in got) / len(got)
                mem = max((r.get("peak_GiB") or 0.0) for r in got)
                cells += [f"{ms:.0f}", f"{tps[who]:.0f}", f"{mem:.1f}"]
            ratio = f"{tps['megafp8'] / tps['megatron-lm']:.3f}" if len(tps) == 2 else "-"
            print(f"| {shape} | {prec} | " + " | ".join(cells) + f" | {ratio} |")


if __name__ == "__main__":
    sys.exit(main())
