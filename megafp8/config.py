"""Typed, frozen run configuration and its validation.

Nothing here touches ``torch.distributed``: ``validate(cfg, world_size)`` runs before any process
group or model exists and raises ``ValueError`` naming the offending fields and values.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

FP8_FORMATS = ("e4m3", "hybrid")
FP8_RECIPES = ("delayed", "tensorwise", "mxfp8")
FP8_BACKENDS = ("auto", "te", "torch", "none")
FP8_GEMMS = ("auto", "scaled_mm", "emulated")
AMAX_ALGOS = ("max", "most_recent")
POSITION_TYPES = ("learned_absolute", "rope")
NORMS = ("LayerNorm", "RMSNorm")
LR_STYLES = ("constant", "linear", "cosine", "WSD")
WSD_STYLES = ("linear", "cosine", "exponential", "minus_sqrt")


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int = 2
    hidden_size: int = 128
    num_attention_heads: int = 4
    num_query_groups: int | None = None  # None: multi-head attention (as many kv heads as heads)
    ffn_hidden_size: int | None = None  # None: 4 * hidden_size
    seq_length: int = 128
    max_position_embeddings: int | None = None  # None: seq_length
    position_embedding_type: str = "learned_absolute"
    rotary_base: float = 10000.0
    normalization: str = "LayerNorm"
    norm_epsilon: float = 1e-5
    swiglu: bool = False
    untie_embeddings_and_output_weights: bool = False
    add_bias_linear: bool = True
    vocab_size: int | None = None  # None: from the tokenizer (or the mock data's default)
    make_vocab_size_divisible_by: int = 128
    init_method_std: float = 0.02
    hidden_dropout: float = 0.0
    attention_dropout: float = 0.0
    cross_entropy_loss_fusion: bool = True  # Triton kernels on CUDA; the torch loss elsewhere

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = 1
    pipeline_model_parallel_size: int = 1
    virtual_pipeline_model_parallel_size: int | None = None
    expert_model_parallel_size: int = 1
    sequence_parallel: bool = False
    distributed_backend: str | None = None  # None: nccl on GPU, gloo on CPU


@dataclass(frozen=True)
class Fp8Config:
    fp8_format: str | None = None  # None: no FP8 GEMMs
    fp8_recipe: str = "delayed"
    fp8_margin: int = 0
    fp8_amax_history_len: int = 1024
    fp8_amax_compute_algo: str = "max"
    fp8_backend: str = "auto"  # auto: te where TE and a GPU are present, else torch
    fp8_gemm: str = "auto"  # torch backend: scaled_mm on GPU; emulated (q->dq->fp32 mm) on CPU
    te_fused_norm: bool = True  # te backend: LayerNorm/RMSNorm fused into the next GEMM (no SP)
    te_fused_mlp: bool = False  # te backend, fused norm: the whole MLP as one te.LayerNormMLP
    te_weight_cache: bool = True  # te backend: weights cast to FP8 once per iteration
    first_last_layers_bf16: bool = False
    num_layers_at_start_in_bf16: int = 1
    num_layers_at_end_in_bf16: int = 1

    @property
    def enabled(self) -> bool:
        return self.fp8_format is not None


@dataclass(frozen=True)
class OptimConfig:
    lr: float = 3e-4
    min_lr: float = 0.0
    lr_warmup_iters: int = 0
    lr_decay_iters: int | None = None  # None: train_iters
    lr_decay_style: str = "cosine"
    lr_wsd_decay_iters: int | None = None
    lr_wsd_decay_style: str = "linear"
    weight_decay: float = 0.01
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0
    zero_stage: int = 1


@dataclass(frozen=True)
class DataConfig:
    data_path: tuple[str, ...] = ()  # ("A",) or Megatron's ("0.7", "A", "0.3", "B")
    split: str = "969,30,1"
    mock_data: bool = False
    tokenizer_type: str | None = (
        None  # None: SentencePieceTokenizer with a model, else NullTokenizer
    )
    tokenizer_model: str | None = None
    data_cache_path: str | None = None
    num_workers: int = 0


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int = 2
    global_batch_size: int | None = None  # None: micro_batch_size * dp
    train_iters: int = 10
    seed: int = 1234
    bf16: bool = False
    save: str | None = None
    load: str | None = None
    save_interval: int | None = None
    eval_interval: int | None = None
    eval_iters: int = 10
    exit_on_nan: bool = True
    deterministic: bool = False


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = 1
    tensorboard_dir: str | None = None
    log_memory: bool = True
    log_throughput: bool = True


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    fp8: Fp8Config = field(default_factory=Fp8Config)
    optim: OptimConfig = field(default_factory=OptimConfig)
    data: DataConfig = field(default_factory=DataConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict) -> Config:
        """Inverse of ``to_dict``; unknown sections or keys raise ValueError."""
        kwargs = {}
        for f in fields(cls):
            section = d.get(f.name, {})
            sub = f.default_factory
            names = {g.name for g in fields(sub)}
            unknown = set(section) - names
            if unknown:
                raise ValueError(f"unknown key(s) in section '{f.name}': {sorted(unknown)}")
            section = {k: tuple(v) if isinstance(v, list) else v for k, v in section.items()}
            kwargs[f.name] = sub(**section)
        unknown = set(d) - {f.name for f in fields(cls)}
        if unknown:
            raise ValueError(f"unknown config section(s): {sorted(unknown)}")
        return cls(**kwargs)

    def replace(self, **sections) -> Config:
        """``cfg.replace(model={'num_layers': 4})``: a copy with some fields changed."""
        new = {k: dataclasses.replace(getattr(self, k), **v) for k, v in sections.items()}
        return dataclasses.replace(self, **new)


def padded_vocab_size(vocab_size: int, divisible_by: int, tp: int) -> int:
    """Megatron's padding: round the vocab up to a multiple of ``divisible_by * tp``."""
    multiple = divisible_by * tp
    return ((vocab_size + multiple - 1) // multiple) * multiple


def data_parallel_size(cfg: Config, world_size: int) -> int:
    p = cfg.parallel
    return world_size // (p.tensor_model_parallel_size * p.pipeline_model_parallel_size)


def _choice(errors: list[str], name: str, value, allowed) -> None:
    if value not in allowed:
        errors.append(f"{name}={value!r} must be one of {list(allowed)}")


def _positive(errors: list[str], **values) -> None:
    for name, v in values.items():
        if v is not None and v < 1:
            errors.append(f"{name}={v} must be >= 1")


def validate(cfg: Config, world_size: int) -> int:
    """Check the whole config against ``world_size``; return the data-parallel size.

    Raises ValueError listing every problem found, each naming the fields and their values.
    """
    m, p, f, o, d, t = cfg.model, cfg.parallel, cfg.fp8, cfg.optim, cfg.data, cfg.train
    e: list[str] = []
    tp, pp, ep = (
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.expert_model_parallel_size,
    )
    _positive(
        e,
        world_size=world_size,
        tensor_model_parallel_size=tp,
        pipeline_model_parallel_size=pp,
        expert_model_parallel_size=ep,
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        seq_length=m.seq_length,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        train_iters=t.train_iters,
        log_interval=cfg.logging.log_interval,
        save_interval=t.save_interval,
        eval_interval=t.eval_interval,
        fp8_amax_history_len=f.fp8_amax_history_len,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
    )
    if e:
        raise ValueError("invalid config: " + "; ".join(e))
    _choice(e, "position_embedding_type", m.position_embedding_type, POSITION_TYPES)
    _choice(e, "normalization", m.normalization, NORMS)
    _choice(e, "fp8_recipe", f.fp8_recipe, FP8_RECIPES)
    _choice(e, "fp8_backend", f.fp8_backend, FP8_BACKENDS)
    _choice(e, "fp8_gemm", f.fp8_gemm, FP8_GEMMS)
    _choice(e, "fp8_amax_compute_algo", f.fp8_amax_compute_algo, AMAX_ALGOS)
    _choice(e, "lr_decay_style", o.lr_decay_style, LR_STYLES)
    _choice(e, "lr_wsd_decay_style", o.lr_wsd_decay_style, WSD_STYLES)
    _choice(e, "zero_stage", o.zero_stage, (0, 1, 2, 3))
    if f.fp8_format is not None:
        _choice(e, "fp8_format", f.fp8_format, FP8_FORMATS)
    if f.fp8_margin < 0:
        e.append(f"fp8_margin={f.fp8_margin} must be >= 0")

    # Parallel layout.
    if world_size % (tp * pp):
        e.append(
            f"world_size={world_size} is not divisible by tensor_model_parallel_size={tp} "
            f"x pipeline_model_parallel_size={pp}"
        )
    dp = max(1, world_size // (tp * pp))
    if dp % ep:
        e.append(
            f"expert_model_parallel_size={ep} must divide the data-parallel size {dp} "
            f"(world_size={world_size} / (tp={tp} x pp={pp}))"
        )
    if p.sequence_parallel and tp == 1:
        e.append("sequence_parallel=True needs tensor_model_parallel_size > 1 (got 1)")
    if ep > 1:
        e.append(f"expert_model_parallel_size={ep}: expert parallelism (MoE) is not available yet")

    # Model shape vs tensor/pipeline parallelism.
    h, heads, kv = m.hidden_size, m.num_attention_heads, m.kv_heads
    if h % heads:
        e.append(f"hidden_size={h} is not divisible by num_attention_heads={heads}")
    if heads % kv:
        e.append(f"num_attention_heads={heads} is not divisible by num_query_groups={kv}")
    if heads % tp:
        e.append(f"num_attention_heads={heads} is not divisible by tensor_model_parallel_size={tp}")
    if kv % tp and tp % kv:
        e.append(
            f"num_query_groups={kv} and tensor_model_parallel_size={tp}: one must divide "
            "the other (kv heads are split, or replicated when tp exceeds them)"
        )
    if m.ffn % tp:
        e.append(f"ffn_hidden_size={m.ffn} is not divisible by tensor_model_parallel_size={tp}")
    if m.position_embedding_type == "rope" and m.head_dim % 2:
        e.append(f"rope needs an even head dim; hidden_size/num_attention_heads = {m.head_dim}")
    if p.sequence_parallel and m.seq_length % tp:
        e.append(
            f"seq_length={m.seq_length} is not divisible by tensor_model_parallel_size={tp} "
            "(sequence parallelism splits the sequence)"
        )
    if m.seq_length > m.max_positions:
        e.append(f"seq_length={m.seq_length} exceeds max_position_embeddings={m.max_positions}")
    vpp = p.virtual_pipeline_model_parallel_size or 1
    if m.num_layers % (pp * vpp):
        e.append(
            f"num_layers={m.num_layers} is not divisible by pipeline_model_parallel_size={pp} "
            f"x virtual_pipeline_model_parallel_size={vpp}"
        )
    if pp > 1:
        e.append(f"pipeline_model_parallel_size={pp}: pipeline parallelism is not available yet")
    if m.vocab_size is not None and m.vocab_size < 1:
        e.append(f"vocab_size={m.vocab_size} must be >= 1")
    for name in ("hidden_dropout", "attention_dropout"):
        v = getattr(m, name)
        if not 0.0 <= v < 1.0:
            e.append(f"{name}={v} must be in [0, 1)")

    # FP8: the GEMM dims must be multiples of 16 (TE and cuBLASLt FP8 kernels).
    if f.enabled:
        local = {
            "hidden_size": h,
            "ffn_hidden_size/tp": m.ffn // tp,
            "qkv width/tp": (heads + 2 * kv) * m.head_dim // tp,
        }
        bad = {k: v for k, v in local.items() if v % 16}
        if bad:
            e.append(f"FP8 GEMM dims must be divisible by 16: {bad}")
        tokens = t.micro_batch_size * m.seq_length // (tp if p.sequence_parallel else 1)
        if tokens % 16:
            e.append(
                f"FP8 needs micro_batch_size x seq_length (/tp under SP) divisible by 16, "
                f"got micro_batch_size={t.micro_batch_size} x seq_length={m.seq_length}"
            )
        if f.fp8_recipe == "mxfp8" and f.fp8_backend not in ("te", "auto"):
            e.append("fp8_recipe='mxfp8' needs fp8_backend='te' (Blackwell block scaling)")
        if f.first_last_layers_bf16 and (
            f.num_layers_at_start_in_bf16 < 0 or f.num_layers_at_end_in_bf16 < 0
        ):
            e.append("num_layers_at_start_in_bf16 / num_layers_at_end_in_bf16 must be >= 0")

    # Batch arithmetic.
    gbs = t.global_batch_size or t.micro_batch_size * dp
    if gbs % (t.micro_batch_size * dp):
        e.append(
            f"global_batch_size={gbs} is not divisible by micro_batch_size={t.micro_batch_size} "
            f"x data-parallel size {dp}"
        )

    # Optimizer and schedule.
    if o.lr < 0 or o.min_lr < 0 or o.min_lr > o.lr:
        e.append(f"need 0 <= min_lr <= lr, got lr={o.lr}, min_lr={o.min_lr}")
    if o.lr_warmup_iters < 0:
        e.append(f"lr_warmup_iters={o.lr_warmup_iters} must be >= 0")
    if o.clip_grad < 0:
        e.append(f"clip_grad={o.clip_grad} must be >= 0 (0 disables clipping)")

    # Data.
    if not d.mock_data and not d.data_path:
        e.append("no data: give data_path (--data-path) or mock_data (--mock-data)")
    if d.data_path and len(d.data_path) > 1:
        if len(d.data_path) % 2:
            e.append(f"data_path {list(d.data_path)}: a blend is 'weight prefix' pairs")
        else:
            for w in d.data_path[0::2]:
                try:
                    if float(w) < 0:
                        raise ValueError
                except ValueError:
                    e.append(f"data_path weight {w!r} is not a non-negative number")
    try:
        parts = [float(x) for x in d.split.replace("/", ",").split(",")]
        if not parts or any(x < 0 for x in parts) or sum(parts) <= 0:
            raise ValueError
    except ValueError:
        e.append(f"split={d.split!r} must be comma-separated non-negative numbers, e.g. '969,30,1'")
    if t.save_interval and not t.save:
        e.append(f"save_interval={t.save_interval} needs save (--save DIR)")
    if e:
        raise ValueError("invalid config: " + "; ".join(e))
    return dp
