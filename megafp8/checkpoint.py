"""Atomic checkpoints.

Layout under ``--save DIR``::

    DIR/latest                  text: the tag of the newest complete checkpoint (DeepSpeed's format)
    DIR/iter_0000100/           DeepSpeed model + optimizer shards, our client state inside
    DIR/iter_0000100/megafp8.json  version, iteration, consumed samples, resolved config

A save writes into ``DIR/.tmp-iter_0000100/``, fsyncs every file, renames the directory into place,
then replaces ``latest`` atomically (write, fsync, rename). A crash at any instant leaves the
previous
checkpoint and its ``latest`` intact; leftover ``.tmp-*`` directories are ignored and cleaned up.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import torch.distributed as dist

FORMAT_VERSION = 1
log = logging.getLogger(__name__)


def tag_for(iteration: int) -> str:
    return f"iter_{iteration:07d}"


def _fsync_tree(root: str) -> None:
    for d, _, files in os.walk(root):
        for f in files:
            with open(os.path.join(d, f), "rb") as fh:
                os.fsync(fh.fileno())
        fd = os.open(d, os.O_RDONLY)
        try:
            os.fsync(fd)
        finally:
            os.close(fd)


def write_atomic(path: str, text: str) -> None:
    tmp = f"{path}.tmp.{os.getpid()}"
    with open(tmp, "w") as f:
        f.write(text)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fd = os.open(os.path.dirname(os.path.abspath(path)), os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _barrier():
    if dist.is_initialized():
        dist.barrier()


def save(engine, save_dir: str, iteration: int, client_state: dict, meta: dict) -> str:
    """Every rank calls this; returns the final checkpoint path."""
    tag = tag_for(iteration)
    tmp_root = os.path.join(save_dir, f".tmp-{tag}")
    final = os.path.join(save_dir, tag)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp_root, ignore_errors=True)
    _barrier()
    engine.save_checkpoint(tmp_root, tag=tag, client_state=client_state, save_latest=False)
    _barrier()
    if rank0:
        with open(os.path.join(tmp_root, tag, "megafp8.json"), "w") as f:
            json.dump(
                {"format_version": FORMAT_VERSION, "iteration": iteration, **meta}, f, indent=1
            )
        _fsync_tree(tmp_root)
        if os.path.exists(final):  # re-saving the same iteration: replace the old copy
            shutil.rmtree(final)
        os.rename(os.path.join(tmp_root, tag), final)
        shutil.rmtree(tmp_root, ignore_errors=True)
        write_atomic(os.path.join(save_dir, "latest"), tag)
        log.info("saved checkpoint %s", final)
    _barrier()
    return final


def latest_tag(load_dir: str) -> str | None:
    """The tag named by ``latest`` when that checkpoint is complete; else None."""
    p = os.path.join(load_dir, "latest")
    if not os.path.isfile(p):
        return None
    tag = open(p).read().strip()
    if not os.path.isfile(os.path.join(load_dir, tag, "megafp8.json")):
        raise ValueError(
            f"{p} names {tag!r}, but {os.path.join(load_dir, tag)} is not a complete "
            "megafp8 checkpoint"
        )
    return tag


def load(
    engine, load_dir: str, tag: str | None = None, load_optimizer_states: bool = True
) -> tuple[dict, dict] | None:
    """Load the newest (or ``tag``) checkpoint; returns (client_state, meta) or None if none.
    ``load_optimizer_states=False`` (``--no-load-optim``) keeps the fresh optimizer."""
    tag = tag or latest_tag(load_dir)
    if tag is None:
        return None
    with open(os.path.join(load_dir, tag, "megafp8.json")) as f:
        meta = json.load(f)
    if meta.get("format_version") != FORMAT_VERSION:
        raise ValueError(
            f"{load_dir}/{tag}: checkpoint format {meta.get('format_version')} "
            f"is not {FORMAT_VERSION}"
        )
    path, client = engine.load_checkpoint(
        load_dir,
        tag=tag,
        load_optimizer_states=load_optimizer_states,
        load_lr_scheduler_states=False,
    )
    if path is None:
        raise ValueError(f"DeepSpeed could not load {load_dir}/{tag}")
    return client, meta
