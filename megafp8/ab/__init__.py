"""``megafp8-ab``: does FP8 train like BF16 on this run?

It takes a run file and flags exactly as ``pretrain_gpt.py`` does, plus its own options, and
trains the same run twice for N steps through ``pretrain_gpt.py`` (``runs.py``): once with FP8
off (BF16 on GPUs; fp32 on the CPU, where bf16 matmuls are 30-50x slower than fp32) and once
with FP8 on (the run's FP8 flags, or ``--fp8-format hybrid`` when it has none); same seed, same
data order, same everything else. On the CPU the model is shrunk as ``megafp8-verify`` shrinks
it (``--no-shrink`` keeps it). Then it writes and prints the per-step comparison and PASS or
FAIL against a threshold (``report.py``). Exit status: 0 PASS, 1 FAIL, 2 bad input (one line,
before any run starts).
"""

from __future__ import annotations

import argparse
import math
import os
import shutil
import sys
import textwrap
from dataclasses import dataclass

from megafp8.ab import report
from megafp8.ab.runs import Arm, command, mean_tokens_per_second, run_arms, tail
from megafp8.cli import dump_yaml, parse_args
from megafp8.config import Config
from megafp8.config_values import global_batch_size
from megafp8.validate import validate
from megafp8.verify.shrink import shrink

__all__ = ["main"]

WIDTH = 100  # the report's lines wrap here (the table does not)
DEFAULT_STEPS = 50
SKIP_SHARE = 0.1  # warm-up left out when the run has no lr warm-up: 10 % of the steps
OUTPUTS = ("report.md", "ab.json", "loss.png", "bf16.yaml", "fp8.yaml", "bf16.log", "fp8.log")
CPU_BASELINE = (
    "the BF16 arm runs in fp32 on the CPU (bf16 matmuls are 30-50x slower than fp32 there): "
    "the FP8 arm's parameters are fp32 too, so FP8 GEMMs are the only difference"
)


class _Parser(argparse.ArgumentParser):
    def error(self, message):  # one line and status 2, as pretrain_gpt.py
        self.exit(2, f"error: {message}\n")


def _option_parser() -> argparse.ArgumentParser:
    p = _Parser(
        prog="megafp8-ab",
        allow_abbrev=False,
        description="Train the same run N steps with FP8 off (BF16; fp32 on the CPU) and on, "
        "through pretrain_gpt.py, and compare the loss per step.",
        epilog=f"Every pretrain_gpt.py flag and --config RUN.yaml is accepted (pretrain_gpt.py "
        f"--help). Verdict: {report.RULE}. Why {report.THRESHOLD_REASON}. Exit status: 0 PASS, "
        "1 FAIL, 2 bad input.",
    )
    p.add_argument("--out", required=True, metavar="DIR", help="where the report goes")
    p.add_argument(
        "--steps", type=int, default=DEFAULT_STEPS,
        help=f"optimizer steps per arm (default {DEFAULT_STEPS}, at least 2)",
    )  # fmt: skip
    p.add_argument(
        "--threshold", type=float, default=report.DEFAULT_THRESHOLD,
        help=f"bound on the mean |relative gap| after warm-up (default "
        f"{report.DEFAULT_THRESHOLD}: FP8 loss within ~1 %% of BF16)",
    )  # fmt: skip
    p.add_argument(
        "--skip", type=int,
        help="steps of warm-up left out of the verdict (default: the run's lr warm-up "
        "iterations in the A/B, else 10 %% of the steps)",
    )  # fmt: skip
    p.add_argument("--nproc", type=int, help="processes per arm (default: tp x pp of the run)")
    p.add_argument(
        "--device", choices=("auto", "cpu", "cuda"), default="auto",
        help="auto: GPUs when there is one per process, else the CPU",
    )  # fmt: skip
    shrinking = p.add_mutually_exclusive_group()
    shrinking.add_argument(
        "--no-shrink", dest="shrink", action="store_false", default=None,
        help="keep the model as configured (default on GPUs)",
    )  # fmt: skip
    shrinking.add_argument(
        "--shrink", dest="shrink", action="store_true",
        help="shrink it as megafp8-verify does (default on the CPU)",
    )  # fmt: skip
    p.add_argument(
        "--script", metavar="PATH",
        help="pretrain_gpt.py to run (default: ./pretrain_gpt.py, else the one beside megafp8)",
    )  # fmt: skip
    p.add_argument(
        "--overwrite", action="store_true", help="replace an earlier A/B report in --out"
    )
    return p


@dataclass
class Plan:
    bf16: Config
    fp8: Config
    device: str
    nproc: int
    steps: int
    skip: int
    skip_source: str
    threshold: float
    out: str
    script: str
    notes: list[str]
    changes: list[str]

    @property
    def baseline(self) -> str:
        return "bf16" if self.device == "cuda" else "fp32"


def _device(want: str, nproc: int) -> str:
    import torch

    gpus = torch.cuda.device_count() if torch.cuda.is_available() else 0
    if want == "cuda" and gpus < nproc:
        raise ValueError(f"--device cuda: {nproc} processes per arm, {gpus} GPUs here")
    if want == "auto":
        return "cuda" if gpus >= nproc else "cpu"
    return want


def _script(path: str | None) -> str:
    if path is not None:
        if not os.path.isfile(path):
            raise ValueError(f"--script {path} does not exist")
        return path
    here = os.path.join(os.getcwd(), "pretrain_gpt.py")
    beside = os.path.join(os.path.dirname(os.path.dirname(__file__)), "..", "pretrain_gpt.py")
    for p in (here, os.path.normpath(beside)):
        if os.path.isfile(p):
            return p
    raise ValueError("no pretrain_gpt.py here or beside the megafp8 package: give --script PATH")


def _schedule(cfg: Config, steps: int) -> tuple[Config, list[str]]:
    """train_iters -> steps; a longer run's lr schedule compressed into the steps (warm-up,
    decay and WSD anneal scaled by steps / train_iters), so the A/B sees its whole shape."""
    o, n = cfg.optim, cfg.train.train_iters
    cfg = cfg.replace(train=dict(train_iters=steps))
    if n <= steps:
        return cfg, [f"train_iters {n} -> {steps}"] if n != steps else []
    k = steps / n
    scale = lambda v: v if not v else max(1, round(v * k))
    new = {
        name: scale(getattr(o, name))
        for name in ("lr_warmup_iters", "lr_decay_iters", "lr_wsd_decay_iters")
    }
    moved = [f"{a} {getattr(o, a)} -> {v}" for a, v in new.items() if getattr(o, a) != v]
    note = f"train_iters {n} -> {steps}"
    if moved:
        note = f"the lr schedule of the run's {n} iterations compressed into the {steps} steps "
        note += f"({', '.join(moved)})"
    return cfg.replace(optim=new), [note]


def _arms_config(user: Config, steps: int, device: str) -> tuple[Config, list[str]]:
    """The FP8 arm's config before shrinking, with a note for each change that matters."""
    f, t, d = user.fp8, user.train, user.data
    notes = []
    if device == "cpu" and f.fp8_recipe == "mxfp8":
        raise ValueError("fp8_recipe='mxfp8' needs Transformer Engine on a GPU")
    backend = f.fp8_backend
    if device == "cpu" and backend in ("auto", "te"):  # auto picks torch on the CPU anyway
        backend = "torch"
        if f.fp8_backend == "te":
            notes.append("fp8_backend te -> torch (CPU: our recipe, emulated GEMMs)")
    if not f.enabled:
        notes.append("the run has no FP8 flags: the FP8 arm uses --fp8-format hybrid")
    bf16 = device == "cuda"
    if bf16 and not t.bf16:
        notes.append("bf16 on in both arms (--bf16): the A/B compares FP8 with BF16")
    if not bf16:
        notes.append(CPU_BASELINE)
    mock = d.mock_data or not (d.data_path or d.train_data_path)
    if mock and not d.mock_data:
        notes.append("mock data (no --data-path given)")
    off = [k for k in ("save", "load", "eval_interval", "exit_duration_in_mins") if getattr(t, k)]
    if off:
        notes.append(f"off in the A/B: {', '.join(off)} (checkpoints and evaluation)")
    cfg, sched = _schedule(user, steps)
    cfg = cfg.replace(
        fp8=dict(fp8_format=f.fp8_format or "hybrid", fp8_backend=backend),
        optim=dict(grad_reduce_in_bf16=user.optim.grad_reduce_in_bf16 and bf16),
        data=dict(mock_data=mock),
        train=dict(
            bf16=bf16, save=None, load=None, save_interval=None, eval_interval=None,
            exit_duration_in_mins=None, profile=False,
        ),
        logging=dict(log_interval=1),
    )  # fmt: skip
    return cfg, notes + sched


def _default_skip(cfg: Config, steps: int, skip: int | None) -> tuple[int, str]:
    if skip is not None:
        if not 0 <= skip < steps:
            raise ValueError(f"--skip={skip} must be >= 0 and < --steps={steps}")
        return skip, "--skip"
    w = cfg.optim.lr_warmup_iters
    if w:
        if w >= steps:
            raise ValueError(
                f"the lr warm-up ({w} iterations) covers all --steps={steps}: give more "
                "--steps or a --skip"
            )
        return w, "the lr warm-up iterations of the A/B; --skip changes it"
    return math.ceil(SKIP_SHARE * steps), "no lr warm-up: 10 % of the steps; --skip changes it"


def _check_out(out: str, overwrite: bool) -> None:
    if os.path.exists(out) and not os.path.isdir(out):
        raise ValueError(f"--out {out} is not a directory")
    ours = [p for p in (*OUTPUTS, "tb") if os.path.exists(os.path.join(out, p))]
    if ours and not overwrite:
        raise ValueError(f"--out {out} already holds {', '.join(ours)}: give --overwrite")


def plan(argv: list[str]) -> Plan:
    """Options and flags -> the two arms; ValueError (with the values) on bad input."""
    opts, rest = _option_parser().parse_known_args(argv)
    if opts.steps < 2:
        raise ValueError(f"--steps={opts.steps} must be >= 2")
    if not opts.threshold > 0:
        raise ValueError(f"--threshold={opts.threshold} must be > 0")
    notices: list[str] = []
    try:
        user = parse_args(rest, notices=notices)
    except FileNotFoundError as e:
        raise ValueError(f"{e.filename} does not exist") from None
    p = user.parallel
    nproc = opts.nproc
    if nproc is None:
        nproc = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    if nproc < 1:
        raise ValueError(f"--nproc={nproc} must be >= 1")
    device = _device(opts.device, nproc)
    script = _script(opts.script)
    _check_out(opts.out, opts.overwrite)
    cfg, notes = _arms_config(user, opts.steps, device)
    dp = validate(cfg, nproc)  # the run's model, FP8 on, on nproc processes
    changes: list[str] = []
    if opts.shrink if opts.shrink is not None else device == "cpu":
        tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
        cfg, changes = shrink(cfg, tp, pp, dp)
        try:
            validate(cfg, nproc)
        except ValueError as e:
            raise ValueError(f"the shrunk model: {e} (--no-shrink keeps yours)") from None
    skip, source = _default_skip(cfg, opts.steps, opts.skip)
    from megafp8.train import check_inputs  # data files and tokenizer, before any process

    check_inputs(cfg)
    out = os.path.abspath(opts.out)
    tb = lambda arm: dict(tensorboard_dir=os.path.join(out, "tb", arm))
    fp8 = cfg.replace(logging=tb("fp8"))
    bf16 = cfg.replace(fp8=dict(fp8_format=None), logging=tb("bf16"))
    validate(bf16, nproc)
    notes = [f"notice: {n}" for n in notices] + [f"note: {n}" for n in notes]
    return Plan(
        bf16, fp8, device, nproc, opts.steps, skip, source, opts.threshold, out, script,
        notes, changes,
    )  # fmt: skip


def _header(p: Plan) -> list[str]:
    m, c, f = p.fp8.model, p.fp8, p.fp8.fp8
    par = c.parallel
    dp = p.nproc // (par.tensor_model_parallel_size * par.pipeline_model_parallel_size)
    where = "CPU" if p.device == "cpu" else "GPU"
    lines = [
        f"{p.steps} steps, {p.baseline} against FP8 {f.fp8_format} ({f.fp8_recipe}, "
        f"{f.fp8_backend} backend), {p.nproc} process{'es' * (p.nproc > 1)} per arm, {where}, "
        f"seed {c.train.seed}",
        f"model: {m.num_layers} layers, hidden {m.hidden_size}, {m.num_attention_heads} heads, "
        f"ffn {m.ffn}, seq {m.seq_length}, micro batch {c.train.micro_batch_size}, global "
        f"batch {global_batch_size(c, dp)}, lr {c.optim.lr:g} (warm-up "
        f"{c.optim.lr_warmup_iters}, {c.optim.lr_decay_style})",
    ]
    if p.changes:
        lines.append("shrunk (--no-shrink keeps the model): " + "; ".join(p.changes))
    return lines + p.notes


def _wrap(lines: list[str]) -> list[str]:
    return [textwrap.fill(ln, WIDTH, subsequent_indent="  ") for ln in lines]


def _prepare(p: Plan) -> list[Arm]:
    os.makedirs(p.out, exist_ok=True)
    for name in OUTPUTS:
        if os.path.exists(os.path.join(p.out, name)):
            os.remove(os.path.join(p.out, name))
    shutil.rmtree(os.path.join(p.out, "tb"), ignore_errors=True)
    arms = []
    for name, cfg in (("bf16", p.bf16), ("fp8", p.fp8)):
        run_file = os.path.join(p.out, f"{name}.yaml")
        report.write_atomic(run_file, dump_yaml(cfg))
        arm = Arm(name, cfg, run_file, os.path.join(p.out, f"{name}.log"),
                  cfg.logging.tensorboard_dir)  # fmt: skip
        arm.command = command(p.script, run_file, p.nproc)
        arms.append(arm)
    return arms


def _failures(arms: list[Arm]) -> list[str]:
    return [
        f"the {a.name} arm exited with status {a.status} (its log: {a.log})"
        for a in arms
        if a.status != 0
    ]


def main(argv: list[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    try:
        p = plan(argv)
    except (ValueError, OSError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    except SystemExit as e:  # argparse: --help (0) or a one-line error (2), already printed
        return e.code if isinstance(e.code, int) else 2
    head = _header(p)
    title = f"megafp8-ab: {p.baseline} vs FP8 {p.fp8.fp8.fp8_format}"
    print(f"# {title}\n")
    for line in _wrap([f"- {ln}" for ln in head]):
        print(line, flush=True)
    arms = _prepare(p)
    print()
    run_arms(arms, p.device, p.nproc, lambda s: print(textwrap.fill(s, WIDTH), flush=True))
    failures = _failures(arms)
    for a in arms:
        if a.status != 0:
            print(f"\nlast lines of the {a.name} arm's log:\n{tail(a.log)}", flush=True)
    bf16, fp8 = arms[0].losses, arms[1].losses
    s = report.summarize(bf16, fp8, p.skip, p.threshold)
    verdict = report.verdict_line(s, failures)
    if failures:
        s.verdict = "FAIL"
    tps = {a.name: _throughput(a, p.skip) for a in arms}
    runs = [
        f"{a.name} arm: `{a.shell}` (log {a.log}, TensorBoard {a.tensorboard}; exit status "
        f"{a.status}, {a.seconds:.0f} s; {_tps(tps[a.name])} after warm-up)"
        for a in arms
    ]
    body = (
        [f"# {title}, {p.steps} steps: {s.verdict}", ""]
        + _wrap([f"- {ln}" for ln in head + runs])
        + [""]
        + report.table(bf16, fp8, s, p.baseline)
        + [""]
        + _wrap([f"- {ln}" for ln in report.findings(s, p.skip_source)])
        + ["", f"**{verdict}**"]
    )
    text = "\n".join(body) + "\n"
    png = report.write_png(os.path.join(p.out, "loss.png"), bf16, fp8, s, p.baseline, title)
    if not png:
        text += "\nnote: matplotlib is not installed: no loss.png (pip install matplotlib)\n"
    report.write_tensorboard(os.path.join(p.out, "tb", "gap"), s, verdict)
    extra = {
        "baseline_precision": p.baseline,
        "fp8": {k: getattr(p.fp8.fp8, f"fp8_{k}") for k in ("format", "recipe", "backend")},
        "device": p.device,
        "nproc": p.nproc,
        "skip_source": p.skip_source,
        "threshold_reason": report.THRESHOLD_REASON,
        "notes": p.notes,
        "shrunk": p.changes,
        "failures": failures,
        "runs": {
            a.name: {
                "command": a.command, "exit_status": a.status, "seconds": round(a.seconds, 1),
                "log": a.log, "tensorboard": a.tensorboard, "run_file": a.run_file,
                "tokens_per_second": tps[a.name],
            }
            for a in arms
        },
    }  # fmt: skip
    report.write_json(os.path.join(p.out, "ab.json"), s, bf16, fp8, extra)
    report.write_atomic(os.path.join(p.out, "report.md"), text)
    print("\n" + text, end="", flush=True)
    print(f"report: {os.path.join(p.out, 'report.md')}, ab.json, loss.png, tb/ (bf16, fp8, gap)")
    return 0 if s.verdict == "PASS" else 1


def _throughput(arm, skip: int) -> float | None:
    try:
        with open(arm.log) as f:
            return mean_tokens_per_second(f.read(), skip)
    except OSError:
        return None


def _tps(v: float | None) -> str:
    return "no throughput logged" if v is None else f"{v:,.0f} tokens/s"
