"""run_distributed(fn, world_size, *args): spawn gloo processes over a file store; return each
rank's result (rank order). An exception in any rank fails the call with that rank's traceback."""

from __future__ import annotations

import os
import pickle
import tempfile
import traceback

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _worker(rank, world_size, store_path, out_dir, fn, args, kwargs):
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


def run_distributed(fn, world_size: int, *args, **kwargs):
    with tempfile.TemporaryDirectory() as d:
        store = os.path.join(d, "store")
        ctx = mp.get_context("spawn")
        procs = [
            ctx.Process(target=_worker, args=(r, world_size, store, d, fn, args, kwargs))
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
