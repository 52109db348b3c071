"""Export a megafp8 checkpoint to a HuggingFace directory, and import one back.

Export reads every rank's model shard of one checkpoint (any tp x pp, interleaved chunks too),
merges them into the one-process tensors (``layout.merge_checkpoint``), maps them to the family's
names (``families.to_hf``) and writes safetensors, config.json and the tokenizer files.

Import maps a HF directory's tensors to the one-process tensors, then writes the checkpoint the
way training does: one process per (tp, pp) rank builds its model from the config, takes its
rows of every tensor (``layout.shard``, the model's own row selections), builds its DeepSpeed
engine (so ZeRO's fp32 copies hold the imported weights) and saves through
``checkpoint.save`` as iteration 0. ``pretrain_gpt.py --load`` starts from it.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import tempfile

import torch

from megafp8.config import Config
from megafp8.config_values import padded_vocab_size
from megafp8.hf import families, io, layout
from megafp8.run_hooks import end_process

log = logging.getLogger(__name__)


def export_checkpoint(
    load_dir: str,
    out_dir: str,
    family: str | None = None,
    iteration: int | None = None,
    dtype: torch.dtype | None = None,
    shard_gb: float = 5.0,
) -> dict:
    """Write the HF model of ``load_dir``'s checkpoint into ``out_dir``; returns config.json."""
    path = layout.find_checkpoint(load_dir, iteration)
    cfg, _ = layout.read_meta(path)
    family = family or families.guess_family(cfg.model)
    families.check_exportable(cfg.model, family)  # before reading the shards
    cfg, _, full = layout.merge_checkpoint(path)
    hf_cfg, tensors = families.to_hf(cfg, full, family)
    if dtype is not None:
        tensors = {k: v.to(dtype) for k, v in tensors.items()}
        hf_cfg["torch_dtype"] = str(dtype).removeprefix("torch.")
    io.write_model(out_dir, tensors, hf_cfg, shard_gb)
    io.copy_tokenizer(cfg.data, out_dir)
    log.info("exported %s (%s, %d tensors) to %s", path, family, len(tensors), out_dir)
    return hf_cfg


def import_config(hf_dir: str, tp: int = 1, pp: int = 1, **model) -> tuple[str, Config, dict]:
    """(family, megafp8 Config, HF tensors) of a HF directory, for layout tp x pp; ``model``:
    ModelConfig fields to set (seq_length, make_vocab_size_divisible_by)."""
    hf_cfg, tensors = io.read_model(hf_dir)
    family, fields = families.model_config_from_hf(hf_cfg, model.pop("seq_length", None))
    fields.update({k: v for k, v in model.items() if v is not None})
    data = {}
    if any(os.path.isfile(os.path.join(hf_dir, n)) for n in ("tokenizer.json", "tokenizer.model")):
        data = {"tokenizer_type": "HuggingFaceTokenizer", "tokenizer_model": hf_dir}
    cfg = Config().replace(
        model=fields,
        parallel={"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
        data=data,
    )
    return family, cfg, tensors


def pad_vocab(full: dict[str, torch.Tensor], rows: int) -> None:
    """The embedding (and untied output) to ``rows`` rows, in place: rows beyond that are dropped
    (padding no token id reaches), missing ones added as zeros (their logits are 0 until
    training moves them)."""
    for name in ("embedding.weight", "output"):
        t = full.get(name)
        if t is None:
            continue
        if t.shape[0] >= rows:
            full[name] = t[:rows].contiguous()
        else:
            full[name] = torch.cat([t, t.new_zeros(rows - t.shape[0], *t.shape[1:])])


def full_tensors(cfg: Config, family: str, hf: dict) -> dict[str, torch.Tensor]:
    """One-process tensors of ``cfg``'s layout from HF tensors: the vocab padded with zero rows
    to ``padded_vocab_size`` at this tp."""
    m, tp = cfg.model, cfg.parallel.tensor_model_parallel_size
    full = families.from_hf(m, family, hf)
    for name in ("embedding.weight", "output"):
        if name in full and full[name].shape[0] != m.vocab_size:
            raise ValueError(
                f"{name}: {full[name].shape[0]} rows, config.json vocab_size={m.vocab_size}"
            )
    pad_vocab(full, padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp))
    return full


def write_rank(
    cfg: Config, full: dict[str, torch.Tensor], save_dir: str, source: str = "huggingface"
) -> None:
    """On each of tp x pp processes (torch.distributed initialized): build this rank's model,
    fill it from ``full``, save it through DeepSpeed as iteration 0."""
    from megafp8 import checkpoint
    from megafp8.fp8.backend import build_backend
    from megafp8.model.gpt import build_model
    from megafp8.optim.zero import build_engine
    from megafp8.parallel.groups import ParallelGroups
    from megafp8.parallel.random import model_parallel_seed

    p, m = cfg.parallel, cfg.model
    groups = ParallelGroups.build(
        p.tensor_model_parallel_size, p.pipeline_model_parallel_size, kv_heads=m.kv_heads
    )
    rng = model_parallel_seed(cfg.train.seed, groups.coords.tp, groups.coords.pp)
    backend = build_backend(
        cfg.fp8, amax_group=groups.tp_dp_group, tp_group=groups.tp_group,
        attention_backend=m.attention_backend,
    )  # fmt: skip
    # on the CPU, whatever the machine (the ranks are gloo processes); the backend's modules all
    # the same (TE's where TE and a GPU are present: the ones a run there loads into)
    model = build_model(
        cfg, backend=backend, groups=groups, vocab_size=m.vocab_size, rng=rng, device="cpu"
    )
    tp, r = groups.tp, groups.coords.tp
    with torch.no_grad():
        for name, t in {**dict(model.named_parameters()), **dict(model.named_buffers())}.items():
            src = layout.shard(full, name, m, tp, r)
            if src is None:
                continue
            where = layout.locate(name, m, tp, r)
            meta = getattr(t, "full_index", None)
            if meta is not None and where[2] is not None and not torch.equal(meta, where[2]):
                raise RuntimeError(f"{name}: the model holds other rows than layout.locate says")
            if src.shape != t.shape:
                raise ValueError(f"{name}: HF gives {tuple(src.shape)}, model has {tuple(t.shape)}")
            t.copy_(src)
    engine = build_engine(model, cfg, groups)
    client = {
        "iteration": 0,
        "consumed_samples": 0,
        "fp8": backend.state_dict(),
        "rng": rng.state_dict(),
    }
    meta = {
        "consumed_samples": 0,
        "config": cfg.to_dict(),
        "imported_from": source,
        "modules": checkpoint.module_family(cfg),
    }
    checkpoint.save(engine, save_dir, 0, client, meta)


def _worker(rank, world, store_path, cfg_dict, full_path, save_dir, source):
    import torch.distributed as dist

    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank))
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    torch.set_num_threads(1)
    dist.init_process_group("gloo", store=dist.FileStore(store_path, world), rank=rank,
                            world_size=world)  # fmt: skip
    try:
        full = torch.load(full_path, mmap=True, weights_only=True)
        write_rank(Config.from_dict(cfg_dict), full, save_dir, source)
    finally:
        dist.destroy_process_group()
    end_process(0)  # a finished rank's exit: no interpreter finalization (its docstring)


def import_checkpoint(hf_dir: str, save_dir: str, tp: int = 1, pp: int = 1, **model) -> Config:
    """Write ``hf_dir`` as a megafp8 checkpoint (iteration 0) at layout tp x pp into
    ``save_dir``, one gloo process per rank; returns the config (its model flags are what
    ``pretrain_gpt.py`` needs)."""
    from megafp8.validate import validate

    family, cfg, hf = import_config(hf_dir, tp, pp, **model)
    validate(cfg.replace(data={"mock_data": True}), tp * pp)  # the layout and model only
    full = full_tensors(cfg, family, hf)
    del hf
    write_checkpoint(cfg, full, save_dir, "huggingface")
    log.info("imported %s (%s) into %s at tp=%d pp=%d", hf_dir, family, save_dir, tp, pp)
    return cfg


def write_checkpoint(cfg: Config, full: dict[str, torch.Tensor], save_dir: str, source: str):
    """Save the one-process tensors ``full`` as a checkpoint of ``cfg``'s layout (iteration 0),
    one gloo process per (tp, pp) rank; ``source`` is recorded as ``imported_from``. ``full`` is
    emptied once written to a temporary file (the ranks read that, not the caller's memory)."""
    import torch.multiprocessing as mp

    p = cfg.parallel
    world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    with tempfile.TemporaryDirectory() as d:
        full_path = os.path.join(d, "full.pt")
        torch.save(full, full_path)
        full.clear()
        ctx = mp.get_context("spawn")
        args = (os.path.join(d, "store"), cfg.to_dict(), full_path, save_dir, source)
        procs = [ctx.Process(target=_worker, args=(r, world, *args)) for r in range(world)]
        for proc in procs:
            proc.start()
        for proc in procs:
            proc.join()
        bad = [r for r, proc in enumerate(procs) if proc.exitcode != 0]
        if bad:
            raise RuntimeError(f"import: rank(s) {bad} failed (see their traceback above)")


def model_flags(cfg: Config) -> list[str]:
    """The pretrain_gpt.py model flags that build ``cfg``'s model."""
    m, d = cfg.model, dataclasses.asdict(cfg.model)
    skip = {"recompute_modules", "attention_backend", "cross_entropy_loss_fusion"}
    out = []
    for f in dataclasses.fields(m):
        v = d[f.name]
        if f.name in skip or v == f.default:
            continue
        flag = "--" + f.name.replace("_", "-")
        if isinstance(v, bool):
            out.append(flag if v else "--no-" + flag[2:])
        else:
            out += [flag, str(v)]
    return out
