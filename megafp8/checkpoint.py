"""Atomic checkpoints.

Layout under ``--save DIR``::

    DIR/latest                  text: the tag of the newest complete checkpoint (DeepSpeed's format)
    DIR/iter_0000100/           DeepSpeed model + optimizer shards, our client state inside
    DIR/iter_0000100/megafp8.json  version, iteration, consumed samples, resolved config

A save writes into ``DIR/.tmp-iter_0000100/``, fsyncs every file, renames the directory into place,
then replaces ``latest`` atomically (write, fsync, rename). A crash at any instant leaves the
previous checkpoint and its ``latest`` intact; leftover ``.tmp-*`` directories are ignored and
cleaned up. Re-saving an existing iteration moves the old copy to ``.old-iter_...`` first; should a
crash fall between that move and the new copy's, loading takes the old copy.

Retention (``--most-recent-k K``, ``--save-retain-interval N``): after a save is complete and
``latest`` names it, checkpoints beyond the K newest are deleted, except those whose iteration is
a multiple of N, and never the one ``latest`` names. A deletion first renames the directory to
``.del-iter_...`` (atomic), then removes it, so a crash mid-deletion never leaves a partial
directory under a checkpoint's name.
"""

from __future__ import annotations

import json
import logging
import os
import shutil

import torch
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


def save(
    engine,
    save_dir: str,
    iteration: int,
    client_state: dict,
    meta: dict,
    most_recent_k: int | None = None,
    retain_interval: int | None = None,
    rank_files: dict | None = None,
) -> str:
    """Every rank calls this; returns the final checkpoint path. ``rank_files``: more files
    this rank writes into the checkpoint (name -> object for torch.save), inside the same
    atomic step."""
    tag = tag_for(iteration)
    tmp_root = os.path.join(save_dir, f".tmp-{tag}")
    final = os.path.join(save_dir, tag)
    rank0 = not dist.is_initialized() or dist.get_rank() == 0
    if rank0:
        os.makedirs(save_dir, exist_ok=True)
        shutil.rmtree(tmp_root, ignore_errors=True)
    _barrier()
    engine.save_checkpoint(tmp_root, tag=tag, client_state=client_state, save_latest=False)
    for name, obj in (rank_files or {}).items():
        torch.save(obj, os.path.join(tmp_root, tag, name))
    _barrier()
    if rank0:
        files = file_sizes(os.path.join(tmp_root, tag))  # what --load checks for truncation
        with open(os.path.join(tmp_root, tag, "megafp8.json"), "w") as f:
            json.dump(
                {"format_version": FORMAT_VERSION, "iteration": iteration, **meta, "files": files},
                f,
                indent=1,
            )
        _fsync_tree(tmp_root)
        old = os.path.join(save_dir, f".old-{tag}")
        if os.path.exists(final):  # re-saving the same iteration: keep the old copy until done
            shutil.rmtree(old, ignore_errors=True)
            os.rename(final, old)
        os.rename(os.path.join(tmp_root, tag), final)
        _fsync_dir(save_dir)
        shutil.rmtree(tmp_root, ignore_errors=True)
        write_atomic(os.path.join(save_dir, "latest"), tag)
        shutil.rmtree(old, ignore_errors=True)
        log.info("saved checkpoint %s", final)
        apply_retention(save_dir, most_recent_k, retain_interval)
    _barrier()
    return final


def file_sizes(root: str) -> dict[str, int]:
    """Every file under ``root`` (relative path -> bytes)."""
    out = {}
    for d, _, names in os.walk(root):
        for n in names:
            p = os.path.join(d, n)
            out[os.path.relpath(p, root)] = os.path.getsize(p)
    return out


def check_files(path: str, record: dict) -> None:
    """Every file the record of the checkpoint at ``path`` lists is there, at its size: a
    truncated or missing shard is one line naming it, before anything reads it."""
    want = record.get("files")
    if not want:  # a record from before the list
        return
    have = file_sizes(path)
    for name, size in sorted(want.items()):
        if name not in have:
            raise ValueError(f"{os.path.join(path, name)} is missing from the checkpoint")
        if have[name] != size:
            raise ValueError(
                f"{os.path.join(path, name)} has {have[name]} bytes, the checkpoint wrote {size}: "
                "truncated or overwritten"
            )


def _fsync_dir(d: str) -> None:
    fd = os.open(d, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def list_checkpoints(save_dir: str) -> list[int]:
    """Iterations of the complete checkpoints in ``save_dir``, oldest first."""
    out = []
    for name in os.listdir(save_dir):
        if name.startswith("iter_") and name[5:].isdigit():
            if os.path.isfile(os.path.join(save_dir, name, "megafp8.json")):
                out.append(int(name[5:]))
    return sorted(out)


def to_delete(iterations: list[int], latest: int | None, k: int | None, interval: int | None):
    """Which checkpoints retention removes: all but the ``k`` newest, keeping every multiple of
    ``interval`` and ``latest``. ``k`` None: keep everything."""
    if k is None:
        return []
    keep = set(sorted(iterations)[-k:]) if k > 0 else set()
    if interval:
        keep |= {i for i in iterations if i % interval == 0}
    if latest is not None:
        keep.add(latest)
    return [i for i in iterations if i not in keep]


def apply_retention(save_dir: str, k: int | None, interval: int | None) -> list[int]:
    """Delete what retention says (rank 0, after ``latest`` names the new checkpoint); also
    clears leftovers of interrupted saves and deletions. Returns the deleted iterations."""
    for name in os.listdir(save_dir):
        if name.startswith(".del-"):
            shutil.rmtree(os.path.join(save_dir, name), ignore_errors=True)
    tag = latest_tag(save_dir)
    latest = int(tag[5:]) if tag else None
    gone = to_delete(list_checkpoints(save_dir), latest, k, interval)
    for i in gone:
        src = os.path.join(save_dir, tag_for(i))
        dst = os.path.join(save_dir, f".del-{tag_for(i)}")
        os.rename(src, dst)  # atomic: the name disappears whole
        _fsync_dir(save_dir)
        shutil.rmtree(dst, ignore_errors=True)
    if gone:
        log.info("retention: deleted checkpoints %s", [tag_for(i) for i in gone])
    return gone


def load_tag(t, load_dir: str | None = None) -> str | None:
    """The checkpoint a run's ``TrainConfig`` loads from ``load_dir`` (default ``t.load``):
    iteration ``t.ckpt_step`` (Megatron's ``--ckpt-step``), else the one ``latest`` names; None:
    there is none (an error with ``--exit-on-missing-checkpoint``)."""
    d = load_dir or t.load
    if t.ckpt_step is not None:
        tag = tag_for(t.ckpt_step)
        if not os.path.isfile(os.path.join(d, tag, "megafp8.json")):
            raise ValueError(f"ckpt_step={t.ckpt_step}: {d}/{tag} is no complete checkpoint")
        return tag
    tag = latest_tag(d)
    if tag is None and t.exit_on_missing_checkpoint:
        raise ValueError(f"load: no checkpoint in {d} (--exit-on-missing-checkpoint)")
    return tag


def latest_tag(load_dir: str) -> str | None:
    """The tag named by ``latest`` when that checkpoint is complete; else None."""
    p = os.path.join(load_dir, "latest")
    if not os.path.isfile(p):
        return None
    tag = open(p).read().strip()
    old = os.path.join(load_dir, f".old-{tag}")
    if not os.path.exists(os.path.join(load_dir, tag)) and os.path.isfile(
        os.path.join(old, "megafp8.json")
    ):  # a crash while re-saving this iteration: the previous copy is complete
        os.rename(old, os.path.join(load_dir, tag))
    if not os.path.isfile(os.path.join(load_dir, tag, "megafp8.json")):
        raise ValueError(
            f"{p} names {tag!r}, but {os.path.join(load_dir, tag)} is not a complete "
            "megafp8 checkpoint"
        )
    return tag


# what a checkpoint's shards depend on: (section, field); a run loading it must agree
SHAPE = [("model", f) for f in (
    "vocab_size", "num_layers", "hidden_size", "num_attention_heads", "num_query_groups",
    "ffn_hidden_size", "position_embedding_type", "normalization", "swiglu", "squared_relu",
    "untie_embeddings_and_output_weights", "add_bias_linear", "add_qkv_bias", "apply_layernorm_1p",
    "qk_layernorm", "num_experts", "moe_ffn_hidden_size", "moe_layer_freq",
    "moe_shared_expert_intermediate_size",
)] + [("parallel", f) for f in (
    "tensor_model_parallel_size", "pipeline_model_parallel_size",
    "virtual_pipeline_model_parallel_size", "expert_model_parallel_size",
    "decoder_first_pipeline_num_layers", "decoder_last_pipeline_num_layers",
)] + [("optim", "optimizer_group_max_numel")]  # fmt: skip


LAYOUT = {f for sec, f in SHAPE if sec in ("parallel", "optim")}


def module_family(cfg) -> str:
    """Which modules hold the weights, hence the names in DeepSpeed's torch-format shards: TE's
    (with the norms fused into the next GEMM and the MLP as one module, or not) or ours."""
    from megafp8.fp8.backend import resolve_backend_name

    if resolve_backend_name(cfg.fp8) != "te":
        return "torch"
    norm = cfg.fp8.te_fused_norm and not cfg.parallel.sequence_parallel
    return (
        "te"
        + ("+fused-norm" if norm else "")
        + ("+fused-mlp" if norm and cfg.fp8.te_fused_mlp else "")
    )


def recorded_family(record: dict) -> str | None:
    """The record's module family; for a record older than the field: ``torch`` where FP8 was
    off and the backend not forced to te (BF16 ran on our modules then), else unknown (None)."""
    if "modules" in record:
        return record["modules"]
    f = record.get("config", {}).get("fp8", {})
    return "torch" if f.get("fp8_format") is None and f.get("fp8_backend") != "te" else None


def check_compatible(load_dir: str, cfg) -> None:
    """Before any process group: the checkpoint ``latest`` names in ``load_dir`` (if any) was
    written by a model of this run's shape in this layout. Raises ValueError, one line naming the
    file and every differing value; a foreign or unreadable record is named too."""
    tag = load_tag(cfg.train, load_dir)
    if tag is None:
        return
    path = os.path.join(load_dir, tag, "megafp8.json")
    try:
        with open(path) as f:
            record = json.load(f)
        saved = record["config"]
        saved.setdefault("optim", {}).setdefault("optimizer_group_max_numel", 0)  # older: unbounded
        pairs = [(sec, name, saved[sec].get(name), getattr(getattr(cfg, sec), name))
                 for sec, name in SHAPE if name in saved.get(sec, {})]  # fmt: skip
    except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:
        raise ValueError(f"{path}: not a readable megafp8 checkpoint record ({exc!r})") from None
    # a value this run leaves to be derived (None: the tokenizer's vocab, 4h, all heads) is not
    # compared; the layout and every value given must match
    diff = [(n, a, b) for _, n, a, b in pairs if b is not None and a != b]
    was = recorded_family(record)
    if was is not None and was != module_family(cfg):
        diff.append(("modules", was, module_family(cfg)))
    if saved.get("train", {}).get("ckpt_format") == "torch_dist":  # any layout, any modules
        diff = [d for d in diff if d[0] not in LAYOUT | {"modules"}]
    if diff:
        had = ", ".join(f"{n}={a!r}" for n, a, _ in diff)
        has = ", ".join(f"{n}={b!r}" for n, _, b in diff)
        raise ValueError(
            f"{path} was written with {had}; this run has {has}: load it with the same shape "
            "and layout (modules: --fp8-backend, --[no-]te-fused-norm, --[no-]te-fused-mlp; "
            "one saved with --ckpt-format torch_dist loads into any layout: "
            "data_tools/convert_checkpoint.py converts this one)"
        )
    check_files(os.path.join(load_dir, tag), record)


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
    check_files(os.path.join(load_dir, tag), meta)
    path, client = engine.load_checkpoint(
        load_dir,
        tag=tag,
        load_optimizer_states=load_optimizer_states,
        load_lr_scheduler_states=False,
    )
    if path is None:
        raise ValueError(f"DeepSpeed could not load {load_dir}/{tag}")
    return client, meta
