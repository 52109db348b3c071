"""Typed, frozen run configuration: one dataclass per section, one line of description per field.

Each field is declared with ``_f(default, help, choices)``: the description is what
``pretrain_gpt.py --help`` prints beside the flag and its default, and ``choices`` (where given)
is the one list of allowed values that the CLI and ``megafp8.validate`` both use. Nothing here
touches ``torch.distributed``; ``megafp8.validate.validate(cfg, world_size)`` checks a whole config
before any process group or model exists. The grammar of the compound values (``data_path``,
``split``) and the derived sizes (global batch, padded vocab, data-parallel size) live beside it,
in ``megafp8.config_values``; the model section in ``megafp8.config_model``.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field, fields

from megafp8.config_model import ModelConfig, _f


@dataclass(frozen=True)
class ParallelConfig:
    tensor_model_parallel_size: int = _f(1, "tensor-parallel ranks (tp)")
    pipeline_model_parallel_size: int = _f(1, "pipeline stages (pp; 1F1B schedule when > 1)")
    virtual_pipeline_model_parallel_size: int | None = _f(
        None, "model chunks per pipeline rank (v > 1: the interleaved 1F1B schedule)"
    )
    decoder_first_pipeline_num_layers: int | None = _f(
        None, "layers of the first pipeline stage (None: an even split)"
    )
    decoder_last_pipeline_num_layers: int | None = _f(
        None, "layers of the last pipeline stage (None: an even split)"
    )
    expert_model_parallel_size: int = _f(1, "expert-parallel ranks (ep): the experts split over")
    sequence_parallel: bool = _f(
        False, "shard norms, dropout and the residual stream along the sequence"
    )
    distributed_backend: str | None = _f(
        None, "torch.distributed backend (None: nccl on GPU, gloo on CPU)", (None, "nccl", "gloo")
    )


@dataclass(frozen=True)
class Fp8Config:
    fp8_format: str | None = _f(
        None,
        "FP8 GEMMs: e4m3 everywhere, or hybrid (E5M2 gradients); None: off",
        (None, "e4m3", "hybrid"),
    )
    fp8_recipe: str = _f(
        "delayed", "scaling: amax history, the tensor's own amax, or MXFP8 blocks",
        ("delayed", "tensorwise", "mxfp8"),
    )  # fmt: skip
    fp8_margin: int = _f(0, "scale down by 2^margin")
    fp8_amax_history_len: int = _f(1024, "amaxes kept per tensor (delayed scaling)")
    fp8_amax_compute_algo: str = _f(
        "max", "amax from the history's max or its most recent entry", ("max", "most_recent")
    )
    fp8_backend: str = _f(
        "auto", "te (Transformer Engine), torch (our recipe), none; auto: te with TE and a GPU",
        ("auto", "te", "torch", "none"),
    )  # fmt: skip
    fp8_gemm: str = _f(
        "auto", "torch backend: _scaled_mm, or the exact CPU emulation; auto: by device",
        ("auto", "scaled_mm", "emulated"),
    )  # fmt: skip
    te_fused_norm: bool = _f(True, "te backend: norms fused into the next GEMM (not under SP)")
    te_fused_mlp: bool = _f(True, "te backend, fused norm: each MLP as one te.LayerNormMLP")
    te_fused_dswiglu: bool = _f(
        True, "te backend, fused MLP, delayed scaling: the SwiGLU backward and its FP8 cast and "
        "transpose in one Triton kernel (TE's bytes, checked on the first call)"
    )  # fmt: skip
    te_fused_swiglu: bool = _f(
        False, "te backend, fused MLP, delayed scaling: the SwiGLU forward and its FP8 cast and "
        "transpose in one Triton kernel (TE's bytes, checked on the first call)"
    )  # fmt: skip
    te_norm_residual_add: bool = _f(
        True, "te backend, fused RMSNorm, no TP: the residual's gradient added inside the "
        "norm's backward (TE's rmsnorm_bwd_add) instead of by autograd after it"
    )  # fmt: skip
    te_weight_cache: bool = _f(True, "te backend: weights cast to FP8 once per iteration")
    gradient_accumulation_fusion: bool = _f(
        True, "te backend, ZeRO-1: weight gradients accumulate inside their wgrad GEMM"
    )
    first_last_layers_bf16: bool = _f(False, "keep the first and last blocks out of FP8")
    num_layers_at_start_in_bf16: int = _f(1, "with first_last_layers_bf16: blocks at the start")
    num_layers_at_end_in_bf16: int = _f(1, "with first_last_layers_bf16: blocks at the end")
    fp8_overflow_fallback_steps: int | None = _f(
        None, "a layer whose FP8 casts overflow this many iterations in a row leaves FP8 for "
        "good (None: never)"
    )  # fmt: skip
    fp8_overflow_saturated_share: float = _f(
        1e-3, "an FP8 cast overflows when it meets NaN/inf or clamps more than this share "
        "(torch backend)"
    )  # fmt: skip

    @property
    def enabled(self) -> bool:
        return self.fp8_format is not None


@dataclass(frozen=True)
class OptimConfig:
    lr: float = _f(3e-4, "peak learning rate")
    min_lr: float = _f(0.0, "learning rate at the end of the decay")
    lr_warmup_iters: int = _f(0, "linear warmup iterations")
    lr_warmup_init: float = _f(0.0, "lr of the warmup's first iteration (it rises linearly to lr)")
    lr_decay_iters: int | None = _f(None, "iterations of warmup + decay (None: train_iters)")
    lr_decay_style: str = _f(
        "cosine",
        "decay after warmup",
        ("constant", "linear", "cosine", "WSD", "inverse-square-root"),
    )
    lr_wsd_decay_iters: int | None = _f(None, "WSD: iterations of the final anneal")
    lr_wsd_decay_style: str = _f(
        "linear",
        "WSD: shape of the final anneal",
        ("linear", "cosine", "exponential", "minus_sqrt"),
    )
    weight_decay: float = _f(0.01, "AdamW weight decay (not on biases and norms)")
    adam_beta1: float = _f(0.9, "AdamW beta1")
    adam_beta2: float = _f(0.999, "AdamW beta2")
    adam_eps: float = _f(1e-8, "AdamW epsilon")
    clip_grad: float = _f(1.0, "clip the global gradient norm to this (0: off)")
    decoupled_lr: float | None = _f(
        None, "peak learning rate of the input embedding and output layer (None: lr)"
    )
    decoupled_min_lr: float | None = _f(None, "their final learning rate (None: min_lr)")
    overlap_grad_reduce: bool = _f(False, "ZeRO: overlap the gradient reduction with backward")
    grad_reduce_in_bf16: bool = _f(False, "with --bf16: reduce gradients in bf16 (default: fp32)")
    accumulate_allreduce_grads_in_fp32: bool = _f(
        False,
        "with --bf16: add the micro-batches' gradients in fp32 (DeepSpeed's BF16_Optimizer, "
        "ZeRO-1; default: bf16 .grad)",
    )
    use_precision_aware_optimizer: bool = _f(
        False,
        "with --bf16, ZeRO 1/2: AdamW reads the bf16 gradients and writes the bf16 weights in "
        "one pass over the fp32 masters and moments (no fp32 gradient copy, no weight copy)",
    )
    embedding_grad_in_place: bool = _f(
        True,
        "ZeRO-1 without overlap or fp32 accumulation: the word embedding's gradient rows are "
        "added into .grad after the first micro-batch (no dense [vocab, hidden] gradient each)",
    )
    zero_stage: int = _f(1, "DeepSpeed ZeRO stage over the data-parallel group", (0, 1, 2, 3))
    optimizer_group_max_numel: int = _f(
        100_000_000,
        "parameter elements per optimizer group at most (ZeRO 1/2 make one transient fp32 "
        "gradient copy per group at the step; a larger tensor is a group of its own; 0: no bound)",
    )


@dataclass(frozen=True)
class DataConfig:
    data_path: tuple[str, ...] = _f(
        (), "dataset prefix(es): 'A', a blend 'w1 A w2 B', or 'A B' unweighted (Megatron's)"
    )
    split: str = _f("969,30,1", "train,valid,test proportions of each dataset")
    train_data_path: tuple[str, ...] = _f((), "instead of data_path: the train split's own blend")
    valid_data_path: tuple[str, ...] = _f((), "instead of data_path: the valid split's own blend")
    test_data_path: tuple[str, ...] = _f((), "instead of data_path: the test split's own blend")
    mock_data: bool = _f(False, "synthetic documents instead of data_path")
    tokenizer_type: str | None = _f(
        None, "Megatron's tokenizer type (None: SentencePieceTokenizer with a model, else Null)"
    )
    tokenizer_model: str | None = _f(None, "the tokenizer's model file (or HF directory)")
    tokenizer_sentencepiece_legacy: bool = _f(
        False, "legacy SentencePiece: appended specials, <EOD> as EOD"
    )
    vocab_file: str | None = _f(None, "GPT2BPETokenizer: the GPT-2 vocab.json")
    merge_file: str | None = _f(None, "GPT2BPETokenizer: the GPT-2 merges.txt")
    tiktoken_pattern: str | None = _f(None, "TikTokenizer: the split pattern, v1 or v2 (None: v2)")
    tiktoken_num_special_tokens: int = _f(1000, "TikTokenizer: ids before the vocab's first token")
    tokenizer_special_tokens: tuple[str, ...] = _f(
        (), "TikTokenizer: the first special tokens (must hold <unk> <s> </s> <mask> <pad> <cls> "
        "<sep>; empty: those seven)"
    )  # fmt: skip
    eod_mask_loss: bool = _f(False, "no loss where the input token is the EOD (document ends)")
    reset_position_ids: bool = _f(False, "positions restart at 0 after each EOD")
    reset_attention_mask: bool = _f(
        False, "a token attends only to its own document (the EOD ends the one before)"
    )
    data_cache_path: str | None = _f(
        None, "where sample indices are cached (None: beside the data)"
    )
    num_workers: int = _f(0, "data-loader worker processes")


@dataclass(frozen=True)
class TrainConfig:
    micro_batch_size: int = _f(2, "samples per micro-batch per data-parallel rank")
    global_batch_size: int | None = _f(
        None, "samples per optimizer step (None: micro_batch_size x dp)"
    )
    rampup_batch_size: tuple[str, ...] = _f(
        (), "START INCREMENT SAMPLES: the global batch grows from START by INCREMENT, evenly over "
        "SAMPLES samples, to global_batch_size (Megatron's ramp-up)"
    )  # fmt: skip
    step_batch_size_schedule: str | None = _f(
        None, '"THRESHOLD:BS ...": global batch BS from THRESHOLD tokens on (K/M/B/T suffixes, '
        "the first 0); the last BS is the global batch (Megatron's step schedule)"
    )  # fmt: skip
    train_iters: int = _f(10, "optimizer steps to train")
    seed: int = _f(1234, "seed of weights, data order and dropout")
    bf16: bool = _f(False, "bf16 parameters and activations (fp32 otherwise)")
    save: str | None = _f(None, "checkpoint directory")
    load: str | None = _f(None, "resume from this checkpoint directory's latest")
    ckpt_format: str = _f(
        "torch", "torch: DeepSpeed's shards, loaded by the same layout; torch_dist: also each "
        "position's tensors by their one-process names, so --load may change TP, PP, DP, ZeRO",
        ("torch", "torch_dist"),
    )  # fmt: skip
    save_interval: int | None = _f(None, "save every this many iterations (and at the end)")
    most_recent_k: int | None = _f(None, "keep only the k newest checkpoints (None: keep all)")
    save_retain_interval: int | None = _f(
        None, "with most_recent_k: keep forever each checkpoint whose iteration is a multiple"
    )
    eval_interval: int | None = _f(None, "evaluate every this many iterations")
    eval_iters: int = _f(10, "validation batches per evaluation")
    exit_on_nan: bool = _f(
        True, "stop on a NaN/inf (--no-exit-on-nan: the earlier spelling of --nan-policy skip)"
    )
    check_for_nan_in_loss_and_grad: bool = _f(
        True, "detect a NaN or inf lm loss or gradient norm (then --nan-policy decides)"
    )
    nan_policy: str = _f(
        "stop", "on a NaN/inf: stop naming the iteration, or skip its optimizer update",
        ("stop", "skip"),
    )  # fmt: skip
    check_for_spiky_loss: bool = _f(
        False, "skip the update of an iteration whose loss is a spike (--spiky-loss-factor)"
    )
    spiky_loss_factor: float = _f(
        10.0, "a spike: loss > this x the mean loss of the last --spiky-loss-window updates"
    )
    spiky_loss_window: int = _f(
        100, "updated iterations in the spike mean; the check starts once it is full"
    )
    deterministic: bool = _f(False, "deterministic kernels only (torch and TE)")
    exit_duration_in_mins: float | None = _f(
        None, "save and exit once the run has lasted this long"
    )
    exit_interval: int | None = _f(None, "save and exit after an iteration divisible by this")
    distributed_timeout_minutes: int = _f(30, "timeout of the process-group collectives")
    ckpt_step: int | None = _f(None, "with --load: this iteration's checkpoint, not the newest")
    exit_on_missing_checkpoint: bool = _f(
        False, "with --load: an error, not a fresh start, when it holds no checkpoint"
    )
    finetune: bool = _f(
        False, "with --load: the weights only (iteration, samples, optimizer, RNG start anew)"
    )
    load_optim: bool = _f(True, "with --load: restore the optimizer state too")
    load_rng: bool = _f(True, "with --load: restore the RNG streams too")
    calculate_per_token_loss: bool = _f(
        False, "loss = sum over the global batch's tokens / their count (not a mean of means)"
    )
    manual_gc: bool = _f(False, "turn Python's garbage collector off; collect at set points")
    manual_gc_interval: int = _f(0, "with manual_gc: collect every this many iterations (0: never)")
    empty_unused_memory_level: int = _f(
        0, "release cached GPU memory: 1 after each step, 2 also after each micro-batch", (0, 1, 2)
    )
    profile: bool = _f(False, "torch.profiler trace of iterations profile_step_start..end")
    profile_step_start: int = _f(10, "first profiled iteration")
    profile_step_end: int = _f(12, "iteration at which profiling stops")


@dataclass(frozen=True)
class LoggingConfig:
    log_interval: int = _f(1, "print the console line every this many iterations")
    tensorboard_dir: str | None = _f(None, "TensorBoard event directory")
    log_memory: bool = _f(True, "peak memory in the console line and TensorBoard")
    log_params_norm: bool = _f(False, "the weights' L2 norm in the console line and TensorBoard")
    log_throughput: bool = _f(True, "tokens/s, TFLOP/s and MFU in the console line and TensorBoard")
    log_fp8_stats: bool = _f(
        False, "FP8 health per GEMM and role to TensorBoard at each log: amax, scale, and the "
        "shares saturated and flushed to zero (torch backend)"
    )  # fmt: skip


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


def all_fields() -> dict[str, tuple[str, dataclasses.Field]]:
    """field name -> (section, field), over every section (names are unique across sections)."""
    table = {}
    for sec in fields(Config):
        for f in fields(sec.default_factory):
            if f.name in table:
                raise RuntimeError(f"config field {f.name} appears in two sections")
            table[f.name] = (sec.name, f)
    return table
