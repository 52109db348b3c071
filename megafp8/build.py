"""What a run is made of, before its first iteration: the input files checked, torch.distributed
and the process groups, the model, the DeepSpeed engine and the data iterators (``Run``).
``train.py`` runs the loop over a ``Run``."""

from __future__ import annotations

import dataclasses
import datetime
import logging
import os

import torch
import torch.distributed as dist

from megafp8 import checkpoint
from megafp8.config import Config
from megafp8.config_values import data_parallel_size, parse_data_path, split_paths
from megafp8.fp8.backend import build_backend
from megafp8.fp8.overflow_guard import Fp8OverflowGuard
from megafp8.model.gpt import GPTModel, GPTModelChunks, build_model
from megafp8.optim.step_guard import StepPolicy
from megafp8.optim.zero import build_engine, grads_accumulate_in_param, wgrad_fusion
from megafp8.parallel.groups import ParallelGroups
from megafp8.parallel.layers import VocabParallelEmbedding
from megafp8.parallel.random import model_parallel_seed

log = logging.getLogger("megafp8")


@dataclasses.dataclass
class Run:
    cfg: Config
    groups: ParallelGroups
    model: GPTModel | GPTModelChunks
    engine: object
    backend: object
    rng: object
    data: object
    device: torch.device
    iteration: int = 0
    consumed: int = 0
    skipped_samples: int = 0  # the samples of iterations whose update was skipped
    policy: StepPolicy | None = None  # NaN and spike: whether an update happens
    fp8_guard: Fp8OverflowGuard | None = None  # FP8 overflow -> the layer leaves FP8


def check_inputs(cfg: Config, world: int = 1) -> None:
    """Cheap file checks before any process group or model exists (``world``: the processes of
    the run, for the sample counts)."""
    d = cfg.data
    blends = {"data_path": d.data_path, **{f"{k}_data_path": v for k, v in split_paths(d).items()}}
    for name, blend in blends.items() if not d.mock_data else ():
        for _, p in parse_data_path(blend) if blend else ():
            for ext in (".bin", ".idx"):
                if not os.path.isfile(p + ext):
                    raise ValueError(f"{name}: {p + ext} does not exist")
    if d.tokenizer_model and not os.path.exists(d.tokenizer_model):
        raise ValueError(f"tokenizer_model: {d.tokenizer_model} does not exist")
    from megafp8.data.tokenizer import check_run_tokenizer

    check_run_tokenizer(cfg)  # type, files, vocab_size, and each dataset's ids and EOD
    from megafp8.data.loader import check_unweighted_epoch

    check_unweighted_epoch(cfg, data_parallel_size(cfg, world))
    if cfg.train.load and not os.path.isdir(cfg.train.load):
        raise ValueError(f"load: {cfg.train.load} is not a directory")
    if cfg.train.load:
        checkpoint.check_compatible(cfg.train.load, cfg)


def init_distributed(cfg: Config) -> tuple[ParallelGroups, torch.device]:
    """torch.distributed from torchrun/SLURM variables (or one process), then groups."""
    cuda = torch.cuda.is_available()
    if cfg.train.deterministic:  # before the first cuBLAS handle or TE kernel is made
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        os.environ.setdefault("NVTE_ALLOW_NONDETERMINISTIC_ALGO", "0")
        torch.use_deterministic_algorithms(True)
    # DeepSpeed reads LOCAL_RANK even where torch.distributed was set up before us
    os.environ.setdefault("LOCAL_RANK", os.environ.get("SLURM_LOCALID", "0"))
    if not dist.is_initialized():
        os.environ.setdefault("RANK", os.environ.get("SLURM_PROCID", "0"))
        os.environ.setdefault("WORLD_SIZE", os.environ.get("SLURM_NTASKS", "1"))
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", str(29500 + os.getpid() % 1000))
        backend = cfg.parallel.distributed_backend or ("nccl" if cuda else "gloo")
        if cuda:
            torch.cuda.set_device(int(os.environ["LOCAL_RANK"]) % torch.cuda.device_count())
        timeout = datetime.timedelta(minutes=cfg.train.distributed_timeout_minutes)
        if os.environ["WORLD_SIZE"] == "1":  # one process: an in-process store, no TCP server
            dist.init_process_group(
                backend, store=dist.HashStore(), rank=0, world_size=1, timeout=timeout
            )
        else:
            dist.init_process_group(backend, timeout=timeout)
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")
    p = cfg.parallel
    groups = ParallelGroups.build(
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.expert_model_parallel_size,
        kv_heads=cfg.model.kv_heads,
    )
    return groups, device


def _log_model_size(model, vocab: int, groups: ParallelGroups) -> None:
    """Megatron-LM's two lines: the padded vocab, and this rank's parameter count (what a
    side-by-side compares to be sure both stacks built the same model)."""
    c = groups.coords
    if c.dp != 0:
        return
    padded = getattr(model, "padded_vocab", None)
    if padded is not None and c.tp == 0 and c.pp == 0:
        log.info(" > padded vocab (size: %d) with %d dummy tokens (new size: %d)", vocab,
                 padded - vocab, padded)  # fmt: skip
    n = sum(p.numel() for p in model.parameters())
    log.info(" > number of parameters on (tensor, pipeline) model parallel rank (%d, %d): %d",
             c.tp, c.pp, n)  # fmt: skip


def build_run(cfg: Config, groups: ParallelGroups, device: torch.device) -> Run:
    from megafp8.data.loader import build_data_iterators
    from megafp8.data.tokenizer import build_tokenizer, model_vocab_size

    tok = build_tokenizer(cfg.data, vocab_size=cfg.model.vocab_size)
    cfg = cfg.replace(model={"vocab_size": model_vocab_size(cfg.model.vocab_size, tok)})
    rng = model_parallel_seed(cfg.train.seed, groups.coords.tp, groups.coords.pp)
    backend = build_backend(
        cfg.fp8,
        amax_group=groups.tp_dp_group,
        expert_amax_group=groups.tp_edp_group,
        tp_group=groups.tp_group,
        attention_backend=cfg.model.attention_backend,
        wgrad_fusion=wgrad_fusion(cfg),
    )
    model = build_model(
        cfg,
        backend=backend,
        groups=groups,
        vocab_size=cfg.model.vocab_size,
        device=device,
        rng=rng,
        eod=tok.eod,
    )
    _log_model_size(model, cfg.model.vocab_size, groups)
    in_place = grads_accumulate_in_param(cfg)  # gradients added into .grad: grad_in_place.py
    for m in model.modules():
        if isinstance(m, VocabParallelEmbedding):
            m.grad_in_place = in_place and cfg.optim.embedding_grad_in_place
        if isinstance(m, GPTModel):
            m.output_grad_in_place = in_place and cfg.fp8.gradient_accumulation_fusion
    engine = build_engine(model, cfg, groups)
    data = build_data_iterators(
        cfg,
        dp_rank=groups.coords.dp,
        dp_size=groups.dp,
        tokenizer=tok,
        eod_mask_id=tok.eod if cfg.data.eod_mask_loss else None,
    )
    return Run(cfg, groups, model, engine, backend, rng, data, device)
