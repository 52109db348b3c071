#!/usr/bin/env python3
"""Make a checkpoint saved with ``--ckpt-format torch`` loadable by any layout (torch_dist).

    python3 data_tools/convert_checkpoint.py --load ck                  # CPU processes
    torchrun --nproc_per_node 8 data_tools/convert_checkpoint.py --load ck   # on GPUs

The checkpoint's own layout loads it (as ``--load`` would: DeepSpeed's shards, any ZeRO stage),
then each (tp, pp) position writes its ``dist_mp_rank_NN.pt`` (megafp8/reshard.py) into the
checkpoint directory, and only when all are written does the record (``megafp8.json``) say
torch_dist and list them: a conversion that dies halfway leaves the checkpoint as it was. Without
a launcher it starts the checkpoint's world size of CPU processes itself (gloo; parameters as
saved, so a te-backend checkpoint converts on GPUs, under torchrun with that world size). After
it, ``pretrain_gpt.py --load ck`` in another TP/PP/DP layout or ZeRO stage continues the run.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _record(load: str, iteration: int | None) -> tuple[str, dict]:
    from megafp8.checkpoint import latest_tag, tag_for

    tag = tag_for(iteration) if iteration is not None else latest_tag(load)
    if tag is None:
        raise SystemExit(f"error: {load} holds no checkpoint ('latest' missing); give --iteration")
    path = os.path.join(load, tag)
    try:
        with open(os.path.join(path, "megafp8.json")) as f:
            return path, json.load(f)
    except (OSError, ValueError) as exc:
        raise SystemExit(f"error: {path}/megafp8.json: not a megafp8 checkpoint ({exc})") from None


def convert(load: str, iteration: int | None) -> None:
    """Every rank of the checkpoint's layout calls this."""
    import torch
    import torch.distributed as dist

    from megafp8 import checkpoint, reshard
    from megafp8.config import Config
    from megafp8.train import build_run, init_distributed, resume

    path, rec = _record(load, iteration)
    cfg = Config.from_dict(rec["config"])
    # no data is read: mock batches keep the run buildable where the corpus is not
    cfg = cfg.replace(train=dict(load=load, save=None, ckpt_format="torch_dist"),
                      data=dict(mock_data=True))  # fmt: skip
    groups, device = init_distributed(cfg)
    run = build_run(cfg, groups, device)
    if not resume(run):
        raise SystemExit(f"error: {load}: nothing to convert")
    for name, obj in reshard.files(run).items():
        tmp = os.path.join(path, f".{name}.tmp")
        torch.save(obj, tmp)
        os.replace(tmp, os.path.join(path, name))
    dist.barrier()
    if groups.rank == 0:
        rec["config"]["train"]["ckpt_format"] = "torch_dist"
        rec["files"] = checkpoint.file_sizes(path)
        rec["files"].pop("megafp8.json", None)
        checkpoint.write_atomic(os.path.join(path, "megafp8.json"), json.dumps(rec, indent=1))
        print(f"{path}: torch_dist ({len(rec['files'])} files); any layout may --load it")


def _spawned(rank: int, world: int, port: int, load: str, iteration: int | None) -> None:
    env = dict(RANK=rank, WORLD_SIZE=world, LOCAL_RANK=rank, MASTER_PORT=port)
    os.environ.update({k: str(v) for k, v in env.items()})
    os.environ.update(MASTER_ADDR="127.0.0.1", DS_ACCELERATOR="cpu")
    import torch

    torch.set_num_threads(1)
    convert(load, iteration)
    from megafp8.run_hooks import end_process

    end_process(0)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--load", required=True, help="the checkpoint directory (holds 'latest')")
    ap.add_argument("--iteration", type=int, help="this iteration's checkpoint, not 'latest'")
    a = ap.parse_args(argv)
    path, rec = _record(a.load, a.iteration)
    if rec.get("config", {}).get("train", {}).get("ckpt_format") == "torch_dist":
        print(f"{path} is torch_dist already")
        return 0
    world = rec.get("world_size")
    if "RANK" in os.environ:  # under torchrun / srun: this process is one rank
        if world is not None and int(os.environ["WORLD_SIZE"]) != world:
            raise SystemExit(f"error: {path} was saved by {world} ranks; run with that many")
        convert(a.load, a.iteration)
        return 0
    if world is None:
        raise SystemExit(f"error: {path} does not record its world size: run under torchrun "
                         "with the number of ranks that saved it")  # fmt: skip
    import torch.multiprocessing as mp

    port = 29400 + os.getpid() % 500
    mp.spawn(_spawned, args=(world, port, a.load, a.iteration), nprocs=world)
    return 0


if __name__ == "__main__":
    from megafp8.run_hooks import end_process

    end_process(main())
