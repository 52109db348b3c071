"""Run ``train(cfg)`` as a world of fresh processes and collect each rank's (loss, grad norm).

Each job (a config and a world size) gets its own processes (``spawn``: DeepSpeed keeps global
state, so every run starts clean), its own file store and process group: gloo on the CPU, or nccl
with one GPU per rank when the machine has enough GPUs (``cfg.parallel.distributed_backend``
overrides). A rank's stdout and stderr (DeepSpeed's banners, our log lines) go to a file, quoted
when the run fails. When one rank fails, the rest of its world is killed (they would wait on a
collective until the timeout).
"""

from __future__ import annotations

import datetime
import os
import pickle
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass

import torch
import torch.multiprocessing as mp

from megafp8.run_hooks import end_process

JOB_TIMEOUT_S = 3600.0


@dataclass
class Job:
    name: str
    cfg: object  # megafp8.config.Config
    world: int


class RunFailed(RuntimeError):
    """A rank of a job raised or died; the message names the job, the rank and why."""


def device_for(world: int) -> str:
    """``cuda`` when this machine has a GPU per rank of the largest world, else ``cpu``."""
    if torch.cuda.is_available() and torch.cuda.device_count() >= world:
        return "cuda"
    return "cpu"


def _records(cfg) -> list[tuple[float, float | None]]:
    from megafp8.train import setup_logging, train

    setup_logging(int(os.environ["RANK"]))
    return [(r["lm loss"], r["grad norm"]) for r in train(cfg)]


def _worker(rank, world, store, out, device, threads, cfg, timeout_min):
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    if device == "cpu":
        os.environ.update(DS_ACCELERATOR="cpu", CUDA_VISIBLE_DEVICES="")
    with open(f"{out}.{rank}.log", "w") as log:  # DeepSpeed and our logging print to stdout
        sys.stdout.flush(), sys.stderr.flush()
        os.dup2(log.fileno(), 1)
        os.dup2(log.fileno(), 2)
    torch.set_num_threads(threads)
    try:
        if device == "cuda":
            torch.cuda.set_device(rank)
        backend = cfg.parallel.distributed_backend or ("nccl" if device == "cuda" else "gloo")
        dist.init_process_group(
            backend,
            store=dist.FileStore(store, world),
            rank=rank,
            world_size=world,
            timeout=datetime.timedelta(minutes=timeout_min),
        )
        result = ("ok", _records(cfg))
    except BaseException:  # everything, so the parent can say what went wrong
        result = ("error", traceback.format_exc())
    with open(f"{out}.{rank}.tmp", "wb") as f:
        pickle.dump(result, f)
    os.replace(f"{out}.{rank}.tmp", f"{out}.{rank}.pkl")
    if dist.is_initialized():
        try:
            dist.destroy_process_group()
        except Exception:
            pass
    end_process(0)  # the result is written; exit without the interpreter's finalization


def _read(path: str):
    if not os.path.exists(path):
        return None
    with open(path, "rb") as f:
        return pickle.load(f)


def _tail(path: str, lines: int = 15) -> str:
    try:
        with open(path, errors="replace") as f:
            return "".join(f.readlines()[-lines:])
    except OSError:
        return ""


def _wait(job: Job, procs, out: str, deadline: float) -> list:
    """Wait for a job's ranks; kill the rest of the world as soon as one fails."""
    failed = None
    while any(p.is_alive() for p in procs) and failed is None:
        for r, p in enumerate(procs):
            res = _read(f"{out}.{r}.pkl")
            if (res is not None and res[0] == "error") or (p.exitcode not in (None, 0)):
                failed = r
                break
        if time.monotonic() > deadline:
            failed = -1
        time.sleep(0.1)
    for p in procs:
        if p.is_alive():
            p.kill()
        p.join()
    results = [_read(f"{out}.{r}.pkl") for r in range(job.world)]
    for r, res in enumerate(results):
        if res is None or res[0] == "error":
            why = res[1] if res else f"exited with status {procs[r].exitcode}"
            if failed == -1:
                why = f"timed out after {JOB_TIMEOUT_S:.0f} s"
            raise RunFailed(
                f"{job.name}: rank {r} of {job.world} failed: {why.strip()}\n"
                f"last lines of its output:\n{_tail(f'{out}.{r}.log')}"
            )
    return [res[1] for res in results]


def _procs(jobs: list[Job]) -> int:
    return sum(j.world for j in jobs)


def run_jobs(jobs: list[Job], device: str) -> dict[str, list]:
    """Run the jobs (on the CPU, as many at once as there are cores for their ranks; on GPUs
    one at a time); returns ``{job name: [rank 0's records, rank 1's, ...]}``."""
    cores = os.cpu_count() or 1
    ctx = mp.get_context("spawn")
    results: dict[str, list] = {}
    pending = list(jobs)
    with tempfile.TemporaryDirectory(prefix="megafp8-verify-") as tmp:
        while pending:
            batch = [pending.pop(0)]
            while device == "cpu" and pending and _procs(batch) + pending[0].world <= cores:
                batch.append(pending.pop(0))
            threads = max(1, cores // _procs(batch)) if device == "cpu" else 1
            started = []
            for k, job in enumerate(batch):
                out = os.path.join(tmp, f"job{len(results) + k}")
                store = out + ".store"
                timeout_min = job.cfg.train.distributed_timeout_minutes
                procs = [
                    ctx.Process(
                        target=_worker,
                        args=(r, job.world, store, out, device, threads, job.cfg, timeout_min),
                    )
                    for r in range(job.world)
                ]
                for p in procs:
                    p.start()
                started.append((job, procs, out))
            deadline = time.monotonic() + JOB_TIMEOUT_S
            try:
                for job, procs, out in started:
                    results[job.name] = _wait(job, procs, out, deadline)
            finally:  # a failed job leaves the others of its batch running: end them
                for _, procs, _ in started:
                    for p in procs:
                        if p.is_alive():
                            p.kill()
                            p.join()
    return results
