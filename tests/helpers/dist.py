"""run_distributed(fn, world_size, *args): start gloo processes over a file store; return each
rank's result (rank order). An exception in any rank fails the call with that rank's traceback.

Without a GPU the ranks are forked from a multiprocessing fork server that imported torch,
DeepSpeed and megafp8 once for the whole test session: a spawned rank spends seconds importing
them, for every rank of every call. The server started clean (it imports and does nothing
else: no thread pool, no process group, no CUDA), so a forked rank starts as a spawned one
would: multiprocessing gives it this process's working directory and ``sys.path``, and
``_worker`` this process's current environment. With a GPU, or with ``MEGAFP8_TEST_SPAWN=1``,
the ranks are spawned.
"""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world_size, store_path, out_dir, fn, args, kwargs, environ):
    os.environ.clear()
    os.environ.update(environ)  # the caller's now, not the fork server's at its start
    os.environ.update(
        {
            "RANK": str(rank),
            "WORLD_SIZE": str(world_size),
            "LOCAL_RANK": str(rank),
            "DS_ACCELERATOR": "cpu",
            "MASTER_ADDR": "127.0.0.1",
        }
    )
    torch.set_num_threads(1)
    result = None
    try:
        store = dist.FileStore(store_path, world_size)
        dist.init_process_group("gloo", store=store, rank=rank, world_size=world_size)
        result = ("ok", fn(*args, **kwargs))
    except BaseException:  # report everything, including assertion errors
        result = ("error", traceback.format_exc())
    finally:
        with open(os.path.join(out_dir, f"{rank}.pkl"), "wb") as f:
            pickle.dump(result, f)
        if dist.is_initialized():
            try:
                dist.destroy_process_group()
            except Exception:
                pass


# imported once by the fork server (a module that fails to import is skipped by it)
_PRELOAD = ["torch", "numpy", "deepspeed", "megafp8.train", "tests.helpers.dist"]
_context = None


def _start_context():
    """The fork server's context (started on first use, with DeepSpeed's accelerator set to the
    CPU before it imports DeepSpeed); spawn with a GPU or ``MEGAFP8_TEST_SPAWN=1``."""
    global _context
    if _context is None:
        if torch.cuda.is_available() or os.environ.get("MEGAFP8_TEST_SPAWN") == "1":
            _context = mp.get_context("spawn")
        else:
            ctx = mp.get_context("forkserver")
            ctx.set_forkserver_preload(_PRELOAD)
            from multiprocessing import forkserver
            from unittest import mock

            with mock.patch.dict(os.environ, DS_ACCELERATOR="cpu"):  # for the server alone
                forkserver.ensure_running()
            _context = ctx
    return _context


def run_distributed(fn, world_size: int, *args, **kwargs):
    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")
        ctx = _start_context()
        env = dict(os.environ)
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, store, d, fn, args, kwargs, env))
            for r in range(world_size)
        ]
        for p in procs:
            p.start()
        for p in procs:
            p.join(timeout=600)
        results = []
        for r, p in enumerate(procs):
            if p.is_alive():
                p.kill()
                raise RuntimeError(f"rank {r} timed out")
            path = os.path.join(d, f"{r}.pkl")
            if not os.path.exists(path):
                raise RuntimeError(f"rank {r} died with exit code {p.exitcode}")
            with open(path, "rb") as f:
                status, value = pickle.load(f)
            if status == "error":
                raise AssertionError(f"rank {r} failed:\n{value}")
            results.append(value)
        return results
