"""What Megatron's run flags ask of the loop between iterations, kept out of ``train.py``:

- ``--manual-gc`` (``--manual-gc-interval N``): Python's collector is off during training (its
  pauses land at random points on random ranks and stall the collectives); it runs every N
  iterations (0: never), and before each evaluation and checkpoint.
- ``--empty-unused-memory-level``: 1 releases the allocator's cached GPU memory after each
  optimizer step, 2 also after each micro-batch.
- ``--profile --profile-step-start S --profile-step-end E``: a torch.profiler trace (CPU and CUDA)
  of iterations S..E-1 on rank 0, written as a Chrome trace to the TensorBoard directory (else the
  save directory, else the working directory).
- SIGTERM or SIGUSR1 (Slurm's pre-emption warning), through ``Signals``: save after this
  iteration and exit.
- ``--exit-duration-in-mins M``: once the run has lasted M minutes, ``deadline_passed`` turns True
  and the loop saves and exits (every rank agrees through the same all-reduce as the signals).
"""

from __future__ import annotations

import gc
import logging
import os
import signal
import time

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


class RunHooks:
    def __init__(self, cfg, rank: int, start_time: float | None = None):
        t, lg = cfg.train, cfg.logging
        self.t, self.rank = t, rank
        self.start = time.monotonic() if start_time is None else start_time
        self.cuda = torch.cuda.is_available()
        self.profiler = None
        self.trace_dir = lg.tensorboard_dir or t.save or "."
        if t.manual_gc:
            gc.disable()
            gc.collect()

    def before_step(self, iteration: int) -> None:
        """``iteration``: the number of the iteration about to run (1-based, Megatron's)."""
        if self.t.profile and self.rank == 0 and iteration == self.t.profile_step_start:
            acts = [torch.profiler.ProfilerActivity.CPU]
            if self.cuda:
                acts.append(torch.profiler.ProfilerActivity.CUDA)
            self.profiler = torch.profiler.profile(activities=acts, record_shapes=True)
            self.profiler.__enter__()

    def after_microbatch(self) -> None:
        if self.cuda and self.t.empty_unused_memory_level >= 2:
            torch.cuda.empty_cache()

    def after_step(self, iteration: int) -> None:
        """``iteration``: the number of the iteration just finished."""
        if self.cuda and self.t.empty_unused_memory_level >= 1:
            torch.cuda.empty_cache()
        if (
            self.t.manual_gc
            and self.t.manual_gc_interval
            and iteration % self.t.manual_gc_interval == 0
        ):
            gc.collect()
        if self.profiler is not None and iteration + 1 >= self.t.profile_step_end:
            self.stop_profiler()

    def before_eval_or_save(self) -> None:
        if self.t.manual_gc:
            gc.collect()

    def deadline_passed(self) -> bool:
        m = self.t.exit_duration_in_mins
        return m is not None and (time.monotonic() - self.start) / 60.0 >= m

    def stop_profiler(self) -> None:
        if self.profiler is None:
            return
        if self.cuda:
            torch.cuda.synchronize()
        self.profiler.__exit__(None, None, None)
        os.makedirs(self.trace_dir, exist_ok=True)
        path = os.path.join(self.trace_dir, f"profile_rank{self.rank}.json")
        self.profiler.export_chrome_trace(path)
        log.info("profile of iterations %d..%d written to %s", self.t.profile_step_start,
                 self.t.profile_step_end - 1, path)  # fmt: skip
        self.profiler = None

    def close(self) -> None:
        self.stop_profiler()
        if self.t.manual_gc:
            gc.enable()


class Signals:
    """SIGTERM/SIGUSR1 (SLURM's pre-emption warning): save after this iteration, exit."""

    def __init__(self):
        self.hit = False
        for s in (signal.SIGTERM, signal.SIGUSR1):
            try:
                signal.signal(s, self._on)
            except ValueError:  # not the main thread
                pass

    def _on(self, *_):
        self.hit = True

    def any(self, device, local: bool = False) -> bool:
        """Whether any rank was signalled (or has ``local`` set): every rank calls it."""
        flag = torch.tensor(float(self.hit or local), device=device)
        if dist.is_initialized():
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return bool(flag.item())
