"""Checkpoints that load into another layout: ``--ckpt-format torch_dist``.

Besides DeepSpeed's shards (which load only into the layout that wrote them), every save then
writes, for each (tp, pp) position, the parameters this position holds with their fp32 master
copies and both Adam moments, by their one-process names and the indices of their TP shard
(``full_name`` / ``partition_dim`` / ``full_index``), the optimizer's step count and the FP8
scaling state: ``dist_mp_rank_NN.pt``, written by data-parallel rank 0 inside the same atomic
save. The values are read through DeepSpeed's per-parameter API (``safe_get_full_*``), so the
ZeRO stage that wrote them does not matter.

``--load`` of such a checkpoint into another TP, PP (virtual stages included), DP size or ZeRO
stage (0-2) assembles each one-process tensor from the positions that hold its shards, takes this
rank's shard of it, and sets the weight, the fp32 master and the moments (``safe_set_full_*``),
then the step count. The iteration, the consumed samples and the FP8 state come along; the RNG
streams are the new layout's own (seeded by ``--seed``).
"""

from __future__ import annotations

import glob
import os

import torch

FILE = "dist_mp_rank_{:02d}.pt"
MOMENTS = ("exp_avg", "exp_avg_sq")


def _base(engine):
    """The torch optimizer under DeepSpeed's wrapper (ZeRO 1/2), or the optimizer itself."""
    return getattr(engine.optimizer, "optimizer", engine.optimizer)


def _step(engine) -> float:
    for st in _base(engine).state.values():
        if "step" in st:
            return float(st["step"])
    return 0.0


def named(model):
    """(one-process name, parameter): the ``full_name`` mark, else the module path (replicated
    parameters: norms, positions), without the ``chunks.<c>.`` of virtual stages."""
    for name, p in model.named_parameters():
        if name.startswith("chunks."):
            name = name.split(".", 2)[2]
        yield getattr(p, "full_name", name), p


def _link(engine) -> None:
    """(Re)link DeepSpeed's per-parameter views to the optimizer's current Adam state (ZeRO 1/2
    links them once, possibly before the state existed)."""
    zo = engine.optimizer
    if hasattr(zo, "_lazy_init_hp_params_optimizer_state"):
        zo._hp_optimizer_states_linked = False
        zo._lazy_init_hp_params_optimizer_state()


def _shard_of(p):
    """(dim, index) of a TP shard, or (None, None) for a replicated parameter."""
    if hasattr(p, "full_index"):  # (kv rows replicated over TP: marked on every copy)
        return p.partition_dim, p.full_index
    return None, None


def local_state(run) -> dict | None:
    """Every rank calls this (the reads are collective over its data-parallel group); DP rank 0
    of each (tp, pp) position returns what that position holds, the others None."""
    from deepspeed.utils import safe_get_full_fp32_param, safe_get_full_optimizer_state

    engine, params = run.engine, {}
    if _base(engine).state:
        _link(engine)
    for name, p in named(run.model):
        if hasattr(p, "_hp_mapping") or hasattr(p, "ds_id"):  # ZeRO 1-3, the bf16 optimizer
            got = {"fp32": safe_get_full_fp32_param(p)}
            if _base(engine).state:  # none before the first step
                got.update({k: safe_get_full_optimizer_state(p, k) for k in MOMENTS})
        else:  # no ZeRO, fp32: the parameter is its own master copy
            st = _base(engine).state.get(p, {})
            got = {"fp32": p.detach(), **{k: st.get(k) for k in MOMENTS}}
        dim, index = _shard_of(p)
        shape = getattr(p, "ds_shape", p.shape)  # ZeRO 3 returns the tensors flat
        got = {
            k: None if v is None else v.detach().float().cpu().reshape(shape).clone()
            for k, v in got.items()
        }
        # a name may come twice (q rows and replicated k/v rows of one fused QKV when tp
        # exceeds the kv heads): each part with its own rows
        params.setdefault(name, []).append({**got, "dim": dim, "index": index})
    if run.groups.coords.edp != 0:  # one replica of each position (and EP rank) writes
        return None
    return {
        "params": params,
        "step": _step(engine),
        "fp8": run.backend.state_dict(),
        "bad_steps": run.policy.state_dict() if run.policy else {},
        "fp8_fallback": run.fp8_guard.state_dict() if run.fp8_guard else {},
    }


def files(run) -> dict:
    """``checkpoint.save``'s ``rank_files`` under torch_dist (every rank must call it)."""
    got = local_state(run)
    if got is None:
        return {}
    g = run.groups
    mp = g.coords.tp + g.tp * g.coords.pp
    if g.ep > 1:  # each EP rank holds other experts
        return {f"dist_ep_{g.coords.ep:02d}_mp_rank_{mp:02d}.pt": got}
    return {FILE.format(mp): got}


def _assemble(paths: list[str]) -> tuple[dict, float, dict]:
    """-> (one-process tensors by name: {"fp32", "exp_avg", "exp_avg_sq"}, step, the client
    state: the FP8 state of every stage, the bad-step and FP8-fallback states)."""
    parts: dict[str, list] = {}
    step, fp8, client = 0.0, {}, {}
    for path in paths:
        sd = torch.load(path, map_location="cpu", weights_only=False)
        step = max(step, sd["step"])
        fp8.update(sd["fp8"])
        client.setdefault("bad_steps", sd.get("bad_steps", {}))
        client.setdefault("fp8_fallback", sd.get("fp8_fallback", {}))
        for name, es in sd["params"].items():
            parts.setdefault(name, []).extend(es)
    full = {}
    for name, es in parts.items():
        if es[0]["dim"] is None:
            full[name] = {k: es[0][k] for k in ("fp32", *MOMENTS)}
            continue
        dim = es[0]["dim"]
        n = max(int(e["index"].max()) for e in es) + 1
        out = {}
        for k in ("fp32", *MOMENTS):
            if es[0][k] is None:
                out[k] = None
                continue
            shape = list(es[0][k].shape)
            shape[dim] = n
            t = torch.zeros(shape)
            for e in es:
                t.index_copy_(dim, e["index"], e[k])
            out[k] = t
        full[name] = out
    return full, step, {**client, "fp8": fp8}


def _init_moments(engine, step: float) -> None:
    """A fresh optimizer has no Adam state yet: create it (zeros, this step count) so that the
    moments can be set, and link DeepSpeed's per-parameter views to it."""
    base = _base(engine)
    fused = bool(base.defaults.get("fused"))
    zo = engine.optimizer
    flats = getattr(zo, "single_partition_of_fp32_groups", None)  # ZeRO 1/2
    if flats is None:
        flats = getattr(zo, "fp32_partitioned_groups_flat", None)  # ZeRO 3
    if flats is None:  # no ZeRO, fp32: a state per parameter
        flats = [p for g in base.param_groups for p in g["params"]]
    for t in flats:
        base.state[t] = {
            "step": torch.tensor(step, dtype=torch.float32, device=t.device if fused else "cpu"),
            "exp_avg": torch.zeros_like(t),
            "exp_avg_sq": torch.zeros_like(t),
        }
    _link(engine)


def _set_zero3(zo, p, mine: dict) -> None:
    dev = p.ds_tensor.device
    zo.set_full_hp_param(mine["fp32"].to(dev), p)
    for k in MOMENTS:
        if mine[k] is not None:
            zo.set_full_hp_param(mine[k].to(dev), p, k)
    part, _ = zo._get_fp32_opt_state_partition(p, release_swap_buffers=True)
    with torch.no_grad():  # the low-precision partition the forward gathers
        p.ds_tensor.data[: part.numel()].copy_(part.to(p.ds_tensor.dtype))


def load(run, tag_dir: str, optim: bool = True) -> None:
    """Set this rank's weights, fp32 masters, moments and step count, and the FP8 state, from
    the torch_dist files of the checkpoint in ``tag_dir`` (written by any layout). ``optim``
    False (``--no-load-optim``, ``--finetune``): the weights and fp32 masters only; Adam starts
    fresh."""
    from deepspeed.utils import safe_set_full_fp32_param, safe_set_full_optimizer_state

    paths = sorted(glob.glob(os.path.join(tag_dir, "dist_*.pt")))
    if not paths:
        raise ValueError(f"{tag_dir} holds no {FILE.format(0)}: it was not saved with torch_dist")
    full, step, client = _assemble(paths)
    engine = run.engine
    if optim:
        _init_moments(engine, step)
    base = _base(engine)
    for name, p in named(run.model):
        if name not in full:
            raise ValueError(f"{tag_dir}: no parameter {name} in its torch_dist files")
        dim, index = _shard_of(p)
        mine = {
            k: (v if dim is None else v.index_select(dim, index))
            if v is not None and (optim or k not in MOMENTS)
            else None
            for k, v in full[name].items()
        }
        shape = tuple(getattr(p, "ds_shape", p.shape))  # ZeRO 3: the unpartitioned shape
        if tuple(mine["fp32"].shape) != shape:
            raise ValueError(
                f"{tag_dir}: {name} has shape {tuple(mine['fp32'].shape)} for this rank, "
                f"the model {shape}"
            )
        if hasattr(p, "ds_id"):  # ZeRO 3: this rank's partitions of the master, moments, weight
            _set_zero3(engine.optimizer, p, mine)
            continue
        with torch.no_grad():
            p.copy_(mine["fp32"].to(p))
        for k in MOMENTS:
            if mine[k] is None:
                continue
            if hasattr(p, "_hp_mapping"):
                safe_set_full_optimizer_state(p, mine[k].to(p.device), k)
            else:
                base.state[p][k].copy_(mine[k])
        if hasattr(p, "_hp_mapping"):
            safe_set_full_fp32_param(p, mine["fp32"].to(p.device))
    r = run.groups.coords.tp
    for m in run.model.modules():  # a last stage's copy of the tied word embedding (a buffer)
        w = getattr(m, "tied_output_weight", None)
        if w is not None:
            n = w.shape[0]  # this rank's contiguous vocab rows
            with torch.no_grad():
                w.copy_(full["embedding.weight"]["fp32"][r * n : (r + 1) * n].to(w))
    return client


LAYOUT_FIELDS = ("tensor_model_parallel_size", "pipeline_model_parallel_size",
                 "virtual_pipeline_model_parallel_size", "decoder_first_pipeline_num_layers",
                 "decoder_last_pipeline_num_layers", "expert_model_parallel_size")  # fmt: skip


def layout_changed(run, load_dir: str) -> tuple[str, dict] | None:
    """(the checkpoint's directory, its record) when ``latest`` in ``load_dir`` was saved with
    torch_dist by another layout (TP, PP, stages, world size, ZeRO stage, optimizer groups or
    module family: the shards' names); else None."""
    import json

    from megafp8.checkpoint import load_tag

    tag = load_tag(run.cfg.train, load_dir)
    if tag is None:
        return None
    with open(os.path.join(load_dir, tag, "megafp8.json")) as f:
        meta = json.load(f)
    saved = meta.get("config", {})
    if saved.get("train", {}).get("ckpt_format") != "torch_dist":
        return None
    cfg = run.cfg
    now = {f: getattr(cfg.parallel, f) for f in LAYOUT_FIELDS}
    now["zero_stage"] = cfg.optim.zero_stage
    now["groups"] = cfg.optim.optimizer_group_max_numel  # the optimizer's shards too
    was = {f: saved.get("parallel", {}).get(f) for f in LAYOUT_FIELDS}
    was["zero_stage"] = saved.get("optim", {}).get("zero_stage")
    was["groups"] = saved.get("optim", {}).get("optimizer_group_max_numel", 0)
    from megafp8.checkpoint import module_family, recorded_family

    now["modules"] = module_family(cfg)
    was["modules"] = recorded_family(meta) or now["modules"]  # unknown: take it as this run's
    if was == now and meta.get("world_size") == run.groups.layout.world_size:
        return None
    return os.path.join(load_dir, tag), meta


def load_moved(run, tag_dir: str, meta: dict, optim: bool = True) -> tuple[dict, dict]:
    """``checkpoint.load`` for a checkpoint of another layout: (client state, record)."""
    import logging

    client = load(run, tag_dir, optim)
    client.update(iteration=meta["iteration"], consumed_samples=meta["consumed_samples"])
    if run.groups.rank == 0:
        logging.getLogger("megafp8").info(
            "%s was saved by another layout (%d ranks): resharded into this one", tag_dir,
            meta.get("world_size", 0),
        )  # fmt: skip
    return client, meta
