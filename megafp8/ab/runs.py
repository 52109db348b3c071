"""The two arms of ``megafp8-ab`` as ``pretrain_gpt.py`` processes, and their console lines.

Each arm is the resolved config written as a run file (``DIR/bf16.yaml``, ``DIR/fp8.yaml``) and
one command: ``python pretrain_gpt.py --config DIR/ARM.yaml``, under
``torchrun --standalone --nproc_per_node N`` when N > 1. Its stdout and stderr go to
``DIR/ARM.log``; the per-iteration ``lm loss`` is read back from the console lines there
(``metrics.format_line``'s layout, Megatron's), so any log of the same layout parses too.

On the CPU the arms run side by side when there are cores for both (the cores split evenly
between their processes, so both arms get the same thread count and hence the same fp32
summation order); on GPUs one after the other.
"""

from __future__ import annotations

import os
import re
import shlex
import subprocess
import sys
import time
from dataclasses import dataclass, field

# ` iteration       10/     100 | consumed samples: ... | lm loss: 7.123456E+00 | ...`
_ITERATION = re.compile(r"\biteration\s+(\d+)\s*/\s*(\d+)\s*\|(.*)$")
_LM_LOSS = re.compile(r"\|\s*lm loss:\s*([^\s|]+)")
_TOKENS = re.compile(r"\|\s*tokens per second:\s*([0-9.]+)")


def mean_tokens_per_second(text: str, skip: int) -> float | None:
    """Mean "tokens per second" of the console lines after iteration ``skip`` (None if none)."""
    got = []
    for line in text.splitlines():
        m = _ITERATION.search(line)
        t = _TOKENS.search("|" + m.group(3)) if m else None
        if t is not None and int(m.group(1)) > skip:
            got.append(float(t.group(1)))
    return sum(got) / len(got) if got else None


def parse_losses(text: str) -> dict[int, float]:
    """``{iteration: lm loss}`` from console lines (a later line for the same iteration wins;
    ``nan``/``inf`` parse as such; lines without an lm loss, e.g. validation, are skipped)."""
    out: dict[int, float] = {}
    for line in text.splitlines():
        m = _ITERATION.search(line)
        if m is None:
            continue
        loss = _LM_LOSS.search("|" + m.group(3))
        if loss is None:
            continue
        try:
            out[int(m.group(1))] = float(loss.group(1))
        except ValueError:
            continue
    return out


def losses_per_step(found: dict[int, float], steps: int) -> list[float | None]:
    """Steps 1..N in order; None where an iteration has no line."""
    return [found.get(i) for i in range(1, steps + 1)]


@dataclass
class Arm:
    name: str  # "bf16" or "fp8"
    cfg: object  # megafp8.config.Config
    run_file: str
    log: str
    tensorboard: str
    command: list[str] = field(default_factory=list)
    status: int | None = None
    seconds: float = 0.0
    losses: list = field(default_factory=list)

    @property
    def shell(self) -> str:
        return " ".join(shlex.quote(c) for c in self.command)


def command(script: str, run_file: str, nproc: int) -> list[str]:
    """The arm's command line (this interpreter, so the same environment)."""
    if nproc > 1:
        launcher = [sys.executable, "-m", "torch.distributed.run", "--standalone"]
        return launcher + ["--nproc_per_node", str(nproc), script, "--config", run_file]
    return [sys.executable, script, "--config", run_file]


def _env(device: str, threads: int) -> dict[str, str]:
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    if device == "cpu":
        env.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="", OMP_NUM_THREADS=str(threads))
    return env


def plan_threads(device: str, nproc: int) -> tuple[bool, int]:
    """(side by side?, threads per process)."""
    cores = os.cpu_count() or 1
    if device == "cpu" and cores >= 2 * nproc:
        return True, max(1, cores // (2 * nproc))
    return False, max(1, cores // nproc)


def run_arms(arms: list[Arm], device: str, nproc: int, say) -> None:
    """Start the arms (side by side or in turn), wait, and fill in status, time and losses."""
    together, threads = plan_threads(device, nproc)
    env = _env(device, threads)
    groups = [arms] if together else [[a] for a in arms]
    for group in groups:
        procs = []
        try:
            for arm in group:
                log = open(arm.log, "w")  # noqa: SIM115 (closed below, after the process)
                say(f"running the {arm.name} arm: {arm.shell}")
                start = time.monotonic()
                p = subprocess.Popen(arm.command, stdout=log, stderr=subprocess.STDOUT, env=env)
                procs.append((arm, p, log, start))
            for arm, p, log, start in procs:
                arm.status = p.wait()
                arm.seconds = time.monotonic() - start
                log.close()
        finally:  # interrupted: end the arms started here
            for _, p, log, _ in procs:
                if p.poll() is None:
                    p.terminate()
                    p.wait()
                log.close()
    for arm in arms:
        with open(arm.log, errors="replace") as f:
            arm.losses = losses_per_step(parse_losses(f.read()), arm.cfg.train.train_iters)
        done = sum(v is not None for v in arm.losses)
        say(
            f"{arm.name} arm: exit status {arm.status}, {done}/{len(arm.losses)} steps logged, "
            f"{arm.seconds:.0f} s"
        )


def tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""
