"""What Megatron's run flags ask of the loop between iterations, kept out of ``train.py``:

- Python's collector, always: before the first iteration every object that exists then (the
  imported modules, the model, the engine: ~0.4 M objects) is collected once and frozen
  (``gc.freeze``), so the collector's full passes during training walk only what training made
  (a full pass over the build's objects took ~200 ms and landed inside one iteration);
  ``close`` unfreezes them.
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

Launch (the ``launch/*.sbatch`` scripts rely on these):

- ``EXIT_REQUEUE`` (75, sysexits' EX_TEMPFAIL): the exit status of a run that stopped on a signal
  after saving a checkpoint, on every rank; ``launch/pretrain.sbatch`` answers it with
  ``scontrol requeue`` and the requeued job resumes from ``latest``. Where a launcher hides the
  status (torchrun exits 1 when a worker exits non-zero), rank 0 also creates the file named by
  ``$MEGAFP8_REQUEUE_FILE``, when that is set.
- ``launch_env``: rank, world size and local rank from torchrun's variables (``RANK``,
  ``WORLD_SIZE``, ``LOCAL_RANK``), else from an srun task's (``SLURM_PROCID``,
  ``SLURM_STEP_NUM_TASKS``, ``SLURM_LOCALID``), else one process; a process that sits in a
  multi-task Slurm allocation but was not started by srun is refused (it would wait for ranks
  that never come). ``check_launch``: tasks vs the layout, tasks per node vs visible GPUs.
- ``preflight``: on more than one rank, one small all-reduce with a timeout right after the
  process group starts (on GPUs also: no two ranks of a host on one device), so a missing rank or
  a blocked network is a one-line error naming the host and rank, not a silent hang.
- ``end_process``: how every entry point that starts a process group exits once its work is
  done: Python's exit without the interpreter's finalization (see its docstring).
"""

from __future__ import annotations

import atexit
import dataclasses
import datetime
import gc
import logging
import os
import re
import signal
import socket
import sys
import threading
import time
from typing import NoReturn

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)

EXIT_REQUEUE = 75  # stopped on a signal after saving: please requeue (EX_TEMPFAIL)
PREFLIGHT_TIMEOUT_S = 300  # first collective (NCCL sets up its communicator): generous
_STOP_SIGNAL, _STOP_LOCAL = 2.0, 1.0  # Signals.any's codes; MAX over ranks: a signal wins
_stopped_on_signal = False  # set by Signals.any when all ranks agreed to stop because of a signal


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
        gc.freeze()  # the build's objects leave every later pass (module docstring)

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
        gc.unfreeze()
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
        """Whether any rank was signalled (or has ``local`` set): every rank calls it. When a
        signal is the reason, ``stopped_on_signal()`` turns True on every rank."""
        global _stopped_on_signal
        code = _STOP_SIGNAL if self.hit else _STOP_LOCAL if local else 0.0
        if dist.is_initialized() and dist.get_world_size() > 1:
            flag = torch.tensor(code, device=device)
            dist.all_reduce(flag, op=dist.ReduceOp.MAX)
            got = flag.item()  # a wait for the GPU's queue (the optimizer update) on GPU ranks
        else:  # one process: nothing to agree on, and no wait for the GPU
            got = code
        _stopped_on_signal = _stopped_on_signal or got == _STOP_SIGNAL
        return got > 0


def stopped_on_signal() -> bool:
    """Whether the loop stopped because some rank got SIGTERM/SIGUSR1 (the same on every rank)."""
    return _stopped_on_signal


def exit_status(cfg, iteration: int, rank: int) -> int:
    """The process's exit status once training returned at ``iteration``: ``EXIT_REQUEUE`` when
    it stopped on a signal before ``train_iters`` and saved, else 0 (rank 0 also creates
    ``$MEGAFP8_REQUEUE_FILE`` for launchers that hide the status)."""
    if not (stopped_on_signal() and iteration < cfg.train.train_iters):
        return 0
    if not cfg.train.save:
        log.warning("stopped on a signal at iteration %d with no --save: nothing to resume from",
                    iteration)  # fmt: skip
        return 1
    marker = os.environ.get("MEGAFP8_REQUEUE_FILE")
    if marker and rank == 0:
        try:
            with open(marker, "w") as f:
                f.write(f"{iteration}\n")
        except OSError as exc:  # the exit status still says it
            log.warning("MEGAFP8_REQUEUE_FILE: cannot write %s: %s", marker, exc)
    return EXIT_REQUEUE


def end_process(status: int | None) -> NoReturn:
    """End the process with ``status`` as Python's own exit does (non-daemon threads joined,
    atexit handlers run: logging, multiprocessing, torch's compile workers; standard streams
    flushed), then ``os._exit``: everything but the interpreter's finalization.

    Why: the collective libraries keep C++ threads (gloo's workers, NCCL's watchdog) that may
    still hold a finished collective, and with it a tensor Python made, a moment after the main
    thread has moved on. When such a thread needs the GIL while Python 3.11-3.13 finalizes, it
    is ended with ``pthread_exit``, which C++ turns into ``std::terminate``: a rank whose run
    completed dies of SIGABRT ("terminate called without an active exception") and the
    launcher reports the job failed. Skipping finalization leaves no such window; what it would
    have done (freeing memory, closing sockets) the operating system does at exit."""
    code = 0 if status is None else int(status)
    try:
        main = threading.main_thread()
        for t in threading.enumerate():
            if t is not main and t is not threading.current_thread() and not t.daemon:
                t.join()
        atexit._run_exitfuncs()
    finally:
        for stream in (sys.stdout, sys.stderr):
            try:
                stream.flush()
            except Exception:  # a closed or broken stream: nothing more to say on it
                pass
        os._exit(code)


@dataclasses.dataclass(frozen=True)
class LaunchEnv:
    """Where this process sits: from torchrun, from an srun task, or alone."""

    rank: int
    world: int
    local_rank: int
    local_world: int  # processes on this node
    source: str  # "torchrun", "slurm" or "single"

    def export(self) -> None:
        """Set RANK/WORLD_SIZE/LOCAL_RANK, which ``init_distributed`` reads."""
        os.environ["RANK"], os.environ["WORLD_SIZE"] = str(self.rank), str(self.world)
        os.environ["LOCAL_RANK"] = str(self.local_rank)


def _tasks_per_node(spec: str) -> list[int]:
    """Slurm's ``2(x3),1`` -> [2, 2, 2, 1]."""
    out = []
    for part in spec.split(","):
        m = re.fullmatch(r"(\d+)(?:\(x(\d+)\))?", part.strip())
        if m:
            out += [int(m.group(1))] * int(m.group(2) or 1)
    return out


def launch_env(env=None) -> LaunchEnv:
    """torchrun's variables first, then an srun task's, else one process; raises ValueError
    for a process in a multi-task Slurm allocation that srun did not start."""
    e = os.environ if env is None else env
    if "RANK" in e and "WORLD_SIZE" in e:
        world = int(e["WORLD_SIZE"])
        local_world = int(e.get("LOCAL_WORLD_SIZE", world))
        rank, local = int(e["RANK"]), int(e.get("LOCAL_RANK", 0))
        return LaunchEnv(rank, world, local, local_world, "torchrun")
    if "SLURM_STEP_ID" in e and "SLURM_PROCID" in e:  # an srun task
        world = int(e.get("SLURM_STEP_NUM_TASKS") or e.get("SLURM_NTASKS", "1"))
        per_node = _tasks_per_node(e.get("SLURM_STEP_TASKS_PER_NODE", "")) or [world]
        node = int(e.get("SLURM_NODEID", 0))
        local_world = per_node[node] if node < len(per_node) else max(per_node)
        rank, local = int(e["SLURM_PROCID"]), int(e.get("SLURM_LOCALID", 0))
        return LaunchEnv(rank, world, local, local_world, "slurm")
    ntasks = int(e.get("SLURM_NTASKS", "1"))
    if ntasks > 1:
        raise ValueError(
            f"SLURM_NTASKS={ntasks} but this process was not started by srun (no SLURM_STEP_ID): "
            "start one task per GPU with srun (launch/pretrain.sbatch), or use torchrun"
        )
    return LaunchEnv(0, 1, 0, 1, "single")


def check_launch(cfg, env: LaunchEnv, gpus: int | None = None) -> None:
    """Tasks vs the layout (tasks = tp x pp x dp) and, on GPUs, tasks per node vs the GPUs this
    process sees; ``gpus`` defaults to ``torch.cuda.device_count()`` (0: no check)."""
    tp = cfg.parallel.tensor_model_parallel_size
    pp = cfg.parallel.pipeline_model_parallel_size
    if tp >= 1 and pp >= 1 and env.world % (tp * pp):
        raise ValueError(
            f"{env.world} processes ({env.source}) cannot be laid out as tp={tp} x pp={pp} x dp: "
            f"start a multiple of {tp * pp} tasks"
        )
    gpus = torch.cuda.device_count() if gpus is None else gpus
    if gpus > 1 and env.local_world > gpus:
        raise ValueError(
            f"{env.local_world} tasks on node {socket.gethostname()} but {gpus} GPUs visible: "
            "start at most one task per GPU (--ntasks-per-node = GPUs per node)"
        )


def reach_master(addr: str, port: int, rank: int, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> None:
    """Before a process group: the rendezvous host resolves and, from a rank other than 0 (rank 0
    hosts the store), accepts a TCP connection within ``timeout_s`` (the store may start late:
    retried every second). Raises ValueError with one line naming the host, port and rank."""
    where = f"rank {rank} on {socket.gethostname()}"
    try:
        socket.getaddrinfo(addr, port)
    except OSError as exc:
        raise ValueError(f"MASTER_ADDR={addr} does not resolve from {where} ({exc})") from None
    if rank == 0:
        return
    deadline, last = time.monotonic() + timeout_s, None
    while time.monotonic() < deadline:
        try:
            with socket.create_connection((addr, port), timeout=5):
                return
        except OSError as exc:
            last = exc
            time.sleep(1.0)
    raise ValueError(
        f"MASTER_ADDR={addr}:{port} is not reachable from {where} within {timeout_s:.0f} s "
        f"({last}): is rank 0 running, and is the address one every node reaches?"
    )


def preflight(device, rank: int, world: int, timeout_s: float = PREFLIGHT_TIMEOUT_S) -> None:
    """One all-reduce of ones over every rank, waited on for ``timeout_s``; on GPUs, also no two
    ranks of a host on the same device. Raises RuntimeError with one line naming this rank."""
    host = socket.gethostname()
    where = f"rank {rank} on {host}"
    t = torch.ones(1, device=device)
    try:
        work = dist.all_reduce(t, async_op=True)
        done = work.wait(timeout=datetime.timedelta(seconds=timeout_s))
        if done is False:
            raise TimeoutError("timed out")
        if device.type == "cuda":
            torch.cuda.synchronize(device)
    except Exception as exc:
        msg = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise RuntimeError(
            f"preflight: {where}: an all-reduce over {world} ranks did not complete in "
            f"{timeout_s:.0f} s ({msg}); check that every task started and that the nodes reach "
            f"MASTER_ADDR={os.environ.get('MASTER_ADDR')}:{os.environ.get('MASTER_PORT')}"
        ) from None
    if int(t.item()) != world:
        raise RuntimeError(f"preflight: {where}: all-reduce of ones gave {t.item()}, not {world}")
    if device.type == "cuda":
        mine = (host, str(torch.cuda.get_device_properties(device).uuid))
        every = [None] * world
        dist.all_gather_object(every, mine)
        shared = [r for r, x in enumerate(every) if x == mine]
        if len(shared) > 1:
            raise RuntimeError(
                f"preflight: {where}: ranks {shared} share one GPU ({mine[1]}): start one task "
                "per GPU (--ntasks-per-node = GPUs per node, each task its own device)"
            )
