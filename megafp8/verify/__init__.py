"""``megafp8-verify``: does this parallel layout train as one process does, on the user's config?

It takes a run file and flags exactly as ``pretrain_gpt.py`` does, plus its own options; shrinks
the model to CPU size keeping what matters for parallel correctness (``shrink.py``); trains N steps
as one process and in the requested layout (fresh processes, gloo on the CPU or nccl on enough
GPUs: ``spawn.py``), and under FP8 a one-process fp32 twin as the yardstick of FP8 noise; then
prints the per-step losses and gradient norms side by side and PASS or FAIL against a tolerance it
states and justifies (``report.py``). Exit status: 0 PASS, 1 FAIL, 2 bad input (one line).
"""

from __future__ import annotations

import argparse
import sys
import textwrap
import time
from dataclasses import dataclass

from megafp8.cli import parse_args
from megafp8.config import Config
from megafp8.config_values import global_batch_size
from megafp8.validate import validate
from megafp8.verify import report
from megafp8.verify.shrink import comparable, fp32, reference, shrink
from megafp8.verify.spawn import Job, RunFailed, device_for, run_jobs

__all__ = ["main"]

WIDTH = 100  # the report's lines wrap here (the table does not)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and status 2, as pretrain_gpt.py
        self.exit(2, f"error: {message}\n")


def _option_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="megafp8-verify",
        allow_abbrev=False,
        description="Train a few steps as one process and in a parallel layout (the user's "
        "config, shrunk to CPU size) and compare the losses and gradient norms.",
        epilog="Every pretrain_gpt.py flag and --config RUN.yaml is accepted (pretrain_gpt.py "
        "--help). Exit status: 0 PASS, 1 FAIL, 2 bad input.",
    )
    p.add_argument("--steps", type=int, default=5, help="optimizer steps to compare (default 5)")
    p.add_argument("--no-shrink", action="store_true", help="keep the model as configured")
    p.add_argument("--processes", type=int, help="processes of the layout (default: tp x pp x dp)")
    p.add_argument("--data-parallel-size", type=int, help="dp of the layout (default 1)")
    p.add_argument(
        "--tolerance", type=float, help="relative bound per step, replacing the computed one"
    )
    # test-only: a reference that is not the same run, to prove that a difference FAILs
    p.add_argument("--reference-seed", type=int, help=argparse.SUPPRESS)
    return p


@dataclass
class Plan:
    layout: Config
    ref: Config
    ref32: Config | None  # the fp32 twin under FP8 (None: fp32 run, or --tolerance given)
    tp: int
    pp: int
    dp: int
    device: str
    notes: list[str]
    changes: list[str]

    @property
    def world(self) -> int:
        return self.tp * self.pp * self.dp


def _layout(cfg: Config, processes: int | None, dp: int | None) -> tuple[int, int, int]:
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    if dp is not None and dp < 1:
        raise ValueError(f"--data-parallel-size={dp} must be >= 1")
    if processes is not None:
        if processes < 1 or processes % (tp * pp):
            raise ValueError(
                f"--processes={processes} must be a positive multiple of "
                f"tensor_model_parallel_size={tp} x pipeline_model_parallel_size={pp}"
            )
        if dp is not None and dp * tp * pp != processes:
            raise ValueError(
                f"--processes={processes} != tp={tp} x pp={pp} x --data-parallel-size={dp}"
            )
        dp = processes // (tp * pp)
    dp = dp or 1
    if tp * pp * dp == 1:
        raise ValueError(
            "the layout is one process: give --tensor-model-parallel-size, "
            "--pipeline-model-parallel-size, --data-parallel-size or --processes"
        )
    return tp, pp, dp


MIN_FP8_STEPS = 3  # below this the FP8 yardstick can be too small (a false FAIL was seen at 2)


def plan(argv: list[str]) -> tuple[Plan, argparse.Namespace]:
    """Options and flags -> the runs to make; ValueError (with the values) on bad input."""
    opts, rest = _option_parser().parse_known_args(argv)
    if opts.tolerance is not None and not opts.tolerance > 0:
        raise ValueError(f"--tolerance={opts.tolerance} must be > 0")
    notices: list[str] = []
    user = parse_args(rest, notices=notices)
    if user.fp8.enabled and opts.tolerance is None and 1 <= opts.steps < MIN_FP8_STEPS:
        raise ValueError(
            f"--steps={opts.steps} under FP8: the bound is the one-process FP8-vs-fp32 gap, a "
            f"signed loss difference that can nearly cancel at one step; give --steps "
            f">= {MIN_FP8_STEPS} (or a --tolerance of your own)"
        )
    tp, pp, dp = _layout(user, opts.processes, opts.data_parallel_size)
    device = device_for(tp * pp * dp)
    cfg, notes = comparable(user, opts.steps, on_cpu=device == "cpu")
    validate(cfg, tp * pp * dp)  # the user's model on the user's layout
    changes: list[str] = []
    if not opts.no_shrink:
        cfg, changes = shrink(cfg, tp, pp, dp)
        try:
            validate(cfg, tp * pp * dp)
        except ValueError as e:
            raise ValueError(f"the shrunk model: {e} (--no-shrink keeps yours)") from None
    ref = reference(cfg, dp, seed=opts.reference_seed)
    validate(ref, 1)
    from megafp8.train import check_inputs  # data files and tokenizer, before any process

    check_inputs(cfg)
    twin = fp32(ref) if cfg.fp8.enabled and opts.tolerance is None else None
    notes = [f"notice: {n}" for n in notices] + [f"note: {n}" for n in notes]
    return Plan(cfg, ref, twin, tp, pp, dp, device, notes, changes), opts


def _header(p: Plan, steps: int) -> list[str]:
    m, c = p.layout.model, p.layout
    gbs = global_batch_size(c, p.dp)
    precision = f"FP8 {c.fp8.fp8_format} ({c.fp8.fp8_recipe}, {c.fp8.fp8_backend})"
    where = "CPU, gloo" if p.device == "cpu" else f"{p.world} GPUs, nccl"
    sp = " (SP)" if c.parallel.sequence_parallel else ""
    lines = [
        f"megafp8-verify: tp {p.tp}{sp} x pp {p.pp} x dp {p.dp} = {p.world} processes against "
        f"1 process, {steps} steps, {precision if c.fp8.enabled else 'fp32'}, {where}",
        f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads "
        f"({m.kv_heads} kv), ffn {m.ffn}, seq {m.seq_length}, micro batch "
        f"{c.train.micro_batch_size}, global batch {gbs} "
        f"({gbs // (c.train.micro_batch_size * p.dp)} micro-batches per DP rank), "
        f"ZeRO {c.optim.zero_stage}",
    ]
    if p.changes:
        lines.append("shrunk (--no-shrink keeps the model): " + "; ".join(p.changes))
    return lines + p.notes


def _agree(results: list) -> list[str]:
    """Every rank of the layout must report the same records (the loss is broadcast)."""
    return [
        f"FAIL: rank {r} reports {recs}, rank 0 {results[0]}"
        for r, recs in enumerate(results)
        if recs != results[0]
    ]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        p, opts = plan(argv)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    for line in _header(p, opts.steps):
        print(textwrap.fill(line, WIDTH, subsequent_indent="  "), flush=True)
    jobs = [Job("one process", p.ref, 1), Job("layout", p.layout, p.world)]
    if p.ref32 is not None:
        jobs.insert(1, Job("one process, fp32", p.ref32, 1))
    start = time.monotonic()
    try:
        res = run_jobs(jobs, p.device)
    except RunFailed as e:
        print(f"{e}\nFAIL: a run did not finish", flush=True)
        return 1
    ref, got = res["one process"][0], res["layout"][0]
    ref32 = res["one process, fp32"][0] if p.ref32 is not None else None
    print(f"ran in {time.monotonic() - start:.0f} s\n")
    print("\n".join(report.table(ref, got)) + "\n")
    limits, why = report.bounds(ref, ref32, opts.tolerance)
    v = report.verdict(ref, got, limits)
    disagree = _agree(res["layout"])
    lines = v.lines[:-1] + why + (disagree or []) + [v.lines[-1]]
    if disagree and v.ok:
        lines[-1] = "FAIL: the ranks of the layout disagree"
    for line in lines:
        print(textwrap.fill(line, WIDTH, subsequent_indent="  "))
    return 0 if v.ok and not disagree else 1
