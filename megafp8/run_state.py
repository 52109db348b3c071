"""Where a run stands and how it is kept: the lr schedule's position (Megatron-LM counts the
samples of the updates that happened), and the run's checkpoint (``save``) and its return
(``resume``: the same layout through DeepSpeed's files, another layout through ``reshard``;
``--finetune`` takes the weights only)."""

from __future__ import annotations

import dataclasses
import logging
import os
from typing import TYPE_CHECKING

from megafp8 import checkpoint, reshard
from megafp8.config import Config
from megafp8.config_values import global_batch_size
from megafp8.fp8.recipe import is_expert_key
from megafp8.optim.experts import expert_files, load_experts
from megafp8.optim.schedule import learning_rate

if TYPE_CHECKING:
    from megafp8.train import Run

log = logging.getLogger("megafp8")


def schedule_steps(run: Run) -> float:
    """Where the lr schedule stands, in iterations of the full global batch: Megatron-LM's
    scheduler counts the samples of the updates that happened (a skipped update leaves it where
    it was; an iteration of a ramp-up batch moves it by that batch only)."""
    gbs = global_batch_size(run.cfg, run.groups.dp)
    return (run.consumed - run.skipped_samples) / gbs


def lrs(cfg: Config, steps: float) -> tuple[float, float | None]:
    """The lr after ``steps`` schedule steps, and the decoupled lr of the embedding and output
    layer."""
    o, n = cfg.optim, cfg.train.train_iters
    if o.decoupled_lr is None:
        return learning_rate(o, steps, n), None
    dec = dataclasses.replace(o, lr=o.decoupled_lr, min_lr=o.decoupled_min_lr or o.min_lr)
    return learning_rate(o, steps, n), learning_rate(dec, steps, n)


def save(run: Run) -> None:
    client = {
        "iteration": run.iteration,
        "consumed_samples": run.consumed,
        "skipped_samples": run.skipped_samples,
        "fp8": run.backend.state_dict(),
        "rng": run.rng.state_dict(),
        "bad_steps": run.policy.state_dict() if run.policy else {},
        "fp8_fallback": run.fp8_guard.state_dict() if run.fp8_guard else {},
    }
    meta = {"consumed_samples": run.consumed, "config": run.cfg.to_dict(),
            "world_size": run.groups.layout.world_size,
            "modules": checkpoint.module_family(run.cfg)}  # fmt: skip
    t = run.cfg.train
    files = expert_files(run.groups, run.model, run.backend)
    if t.ckpt_format == "torch_dist":  # also layout-free (reshard.py); a collective
        files.update(reshard.files(run))
    checkpoint.save(
        run.engine, t.save, run.iteration, client, meta, t.most_recent_k, t.save_retain_interval,
        rank_files=files,
    )  # fmt: skip


def resume(run: Run) -> bool:
    from megafp8.data.loader import build_data_iterators

    t = run.cfg.train
    optim = t.load_optim and not t.finetune  # --finetune: the weights only
    moved = reshard.layout_changed(run, t.load)
    got = (
        reshard.load_moved(run, *moved, optim=optim)
        if moved
        else checkpoint.load(run.engine, t.load, checkpoint.load_tag(t), optim)
    )
    if got is None:
        log.info("no checkpoint in %s: starting from scratch", run.cfg.train.load)
        return False
    client, meta = got
    saved_at = client["iteration"]
    run.iteration, run.consumed = saved_at, client["consumed_samples"]
    if t.finetune:  # a new run from these weights: its own count, data order, RNG, bad steps
        run.iteration = run.consumed = 0
        client = {"fp8": client["fp8"], "fp8_fallback": client.get("fp8_fallback", {})}
    experts = run.groups.ep > 1 and not moved  # EP rank 0's experts are in the client state
    if experts:  # so theirs come from their own files
        client["fp8"] = {k: v for k, v in client["fp8"].items() if not is_expert_key(k)}
    run.backend.load_state_dict(client["fp8"])
    if experts:
        tag_dir = os.path.join(t.load, checkpoint.tag_for(saved_at))
        load_experts(tag_dir, run.groups, run.model, run.backend, run.engine, optim)
    if run.policy is not None:
        run.policy.load_state_dict(client.get("bad_steps", {}))
    if run.fp8_guard is not None:
        run.fp8_guard.load_state_dict(client.get("fp8_fallback", {}))
    if t.load_rng and "rng" in client:  # --no-load-rng, --finetune: this run's --seed streams
        run.rng.load_state_dict(client["rng"])
    skipped = run.policy.skipped if run.policy is not None else 0  # before skipped_samples
    run.skipped_samples = client.get(
        "skipped_samples", skipped * global_batch_size(run.cfg, run.groups.dp)
    )
    run.data = build_data_iterators(
        run.cfg,
        dp_rank=run.groups.coords.dp,
        dp_size=run.groups.dp,
        consumed_train_samples=run.consumed,
        eod_mask_id=run.data.eod_mask_id,
    )
    if t.finetune:
        log.info("fine-tuning from %s (its iteration %d): the weights only", t.load, saved_at)
    else:
        log.info("resumed from %s at iteration %d (%d samples)", t.load, saved_at, run.consumed)
    return True
