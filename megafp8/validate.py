"""``validate(cfg, world_size)``: every rule a run must meet, checked before anything starts.

Runs before any process group, model or DeepSpeed engine exists and raises one ``ValueError``
listing every problem, each naming the fields and their values. The rules are grouped by concern
(values, layout, model vs tensor parallelism, FP8, batch, optimizer, data; the batch and data
rules live in ``validate_data.py``); each is written once, and where the code that uses a value
parses it (``parse_split``, ``parse_data_path``, ``global_batch_size``) the rule calls that same
function.
"""

from __future__ import annotations

from megafp8.config import Config, all_fields
from megafp8.config_values import data_parallel_size
from megafp8.parallel.pipeline.stages import chunk_stages, layer_counts
from megafp8.validate_data import batches, data

FP8_GEMM_MULTIPLE = 16  # TE and cuBLASLt FP8 kernels need GEMM dims divisible by 16
RECOMPUTE_MODULES = ("core_attn", "mlp", "layernorm")


def _values(cfg: Config, world_size: int, e: list[str]) -> None:
    """Counts are >= 1; every field with a list of choices holds one of them."""
    m, p, t, f = cfg.model, cfg.parallel, cfg.train, cfg.fp8
    counts = dict(
        world_size=world_size,
        tensor_model_parallel_size=p.tensor_model_parallel_size,
        pipeline_model_parallel_size=p.pipeline_model_parallel_size,
        expert_model_parallel_size=p.expert_model_parallel_size,
        virtual_pipeline_model_parallel_size=p.virtual_pipeline_model_parallel_size,
        num_layers=m.num_layers,
        hidden_size=m.hidden_size,
        num_attention_heads=m.num_attention_heads,
        num_query_groups=m.num_query_groups,
        seq_length=m.seq_length,
        vocab_size=m.vocab_size,
        micro_batch_size=t.micro_batch_size,
        global_batch_size=t.global_batch_size,
        train_iters=t.train_iters,
        save_interval=t.save_interval,
        eval_interval=t.eval_interval,
        exit_interval=t.exit_interval,
        log_interval=cfg.logging.log_interval,
        fp8_amax_history_len=f.fp8_amax_history_len,
    )
    for name, v in counts.items():
        if v is not None and v < 1:
            e.append(f"{name}={v} must be >= 1")
    for name, (section, fld) in all_fields().items():
        choices = fld.metadata.get("choices")
        value = getattr(getattr(cfg, section), name)
        if choices is not None and value not in choices:
            allowed = [c for c in choices if c is not None]
            e.append(f"{name}={value!r} must be one of {allowed}")
    if f.fp8_margin < 0:
        e.append(f"fp8_margin={f.fp8_margin} must be >= 0")
    for name in ("hidden_dropout", "attention_dropout"):
        v = getattr(m, name)
        if not 0.0 <= v < 1.0:
            e.append(f"{name}={v} must be in [0, 1)")


def _layout(cfg: Config, world_size: int, e: list[str]) -> None:
    """world = tp x pp x dp, ep inside dp; features not built yet are refused."""
    p = cfg.parallel
    tp, pp, ep = (
        p.tensor_model_parallel_size,
        p.pipeline_model_parallel_size,
        p.expert_model_parallel_size,
    )
    if world_size % (tp * pp):
        e.append(
            f"world_size={world_size} is not divisible by tensor_model_parallel_size={tp} "
            f"x pipeline_model_parallel_size={pp}"
        )
    dp = max(1, data_parallel_size(cfg, world_size))
    if dp % ep:
        e.append(
            f"expert_model_parallel_size={ep} must divide the data-parallel size {dp} "
            f"(world_size={world_size} / (tp={tp} x pp={pp}))"
        )
    if p.sequence_parallel and tp == 1:
        e.append("sequence_parallel=True needs tensor_model_parallel_size > 1 (got 1)")
    if ep > 1 and not cfg.model.num_experts:
        e.append(f"expert_model_parallel_size={ep} needs --num-experts (an MoE model)")
    vpp = p.virtual_pipeline_model_parallel_size
    if vpp is not None and vpp > 1 and pp == 1:
        e.append(
            f"virtual_pipeline_model_parallel_size={vpp} needs pipeline_model_parallel_size > 1 "
            "(the interleaved schedule splits each pipeline rank's layers into virtual stages)"
        )
    uneven = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    if vpp is not None and vpp > 1 and any(n is not None for n in uneven):
        e.append(
            f"virtual_pipeline_model_parallel_size={vpp} with decoder_first_pipeline_num_layers="
            f"{uneven[0]} / decoder_last_pipeline_num_layers={uneven[1]}: uneven stages are not "
            "available with the interleaved schedule"
        )
    o = cfg.optim
    if cfg.train.bf16 and o.accumulate_allreduce_grads_in_fp32 and (o.zero_stage != 1 or ep > 1):
        e.append(
            f"accumulate_allreduce_grads_in_fp32 with zero_stage={o.zero_stage}, "
            f"expert_model_parallel_size={ep}: fp32 gradient accumulation is DeepSpeed's "
            "BF16_Optimizer, ZeRO-1 without expert parallelism"
        )
    if cfg.optim.optimizer_group_max_numel < 0:
        e.append(
            f"optimizer_group_max_numel={cfg.optim.optimizer_group_max_numel}: give the most "
            "parameter elements per optimizer group (0: no bound)"
        )
    if pp > 1 and cfg.optim.zero_stage == 3:
        e.append(
            f"zero_stage=3 with pipeline_model_parallel_size={pp}: ZeRO-3 gathers and releases "
            "parameters around each engine forward/backward, while the pipeline schedule keeps "
            "several micro-batches in flight between them; use zero_stage 1 or 2"
        )
    if pp == 1 and (p.decoder_first_pipeline_num_layers or p.decoder_last_pipeline_num_layers):
        e.append("decoder_first/last_pipeline_num_layers need pipeline_model_parallel_size > 1")


def _model(cfg: Config, e: list[str]) -> None:
    """The shape splits over TP (heads, kv heads, ffn, sequence) and over pipeline stages."""
    m, p = cfg.model, cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
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
    if m.swiglu and m.squared_relu:
        e.append("swiglu=True and squared_relu=True: the MLP has one activation")
    if m.use_rope_scaling and m.position_embedding_type != "rope":
        e.append(f"use_rope_scaling needs rope, got {m.position_embedding_type}")
    if m.use_rope_scaling and not m.rope_scaling_factor >= 1.0:
        e.append(f"rope_scaling_factor={m.rope_scaling_factor} must be >= 1")
    if p.sequence_parallel and m.seq_length % tp:
        e.append(
            f"seq_length={m.seq_length} is not divisible by tensor_model_parallel_size={tp} "
            "(sequence parallelism splits the sequence)"
        )
    if m.seq_length > m.max_positions:
        e.append(f"seq_length={m.seq_length} exceeds max_position_embeddings={m.max_positions}")
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    vpp = p.virtual_pipeline_model_parallel_size or 1
    if vpp > 1 and pp > 1:
        if m.num_layers % (pp * vpp):
            e.append(
                f"num_layers={m.num_layers} is not divisible by pipeline_model_parallel_size={pp} "
                f"x virtual_pipeline_model_parallel_size={vpp}"
            )
        return
    if first is None and last is None and pp > m.num_layers:
        e.append(f"pipeline_model_parallel_size={pp} is larger than num_layers={m.num_layers}")
    elif first is None and last is None and m.num_layers % pp:
        e.append(
            f"num_layers={m.num_layers} is not divisible by pipeline_model_parallel_size={pp} "
            "(or set decoder_first/last_pipeline_num_layers)"
        )
    else:
        try:
            layer_counts(m.num_layers, pp, first, last)
        except ValueError as exc:
            e.append(str(exc))


def _recompute(cfg: Config, e: list[str]) -> None:
    """Megatron's rules: full needs a method and a layer count that fits every stage (or model
    chunk); selective takes neither; modules are ones this model has."""
    m = cfg.model
    g, method, n = m.recompute_granularity, m.recompute_method, m.recompute_num_layers
    bad = [x for x in m.recompute_modules if x not in RECOMPUTE_MODULES]
    if bad:
        e.append(f"recompute_modules={list(m.recompute_modules)}: {bad} not in {RECOMPUTE_MODULES}")
    if g != "full" and (method is not None or n is not None):
        e.append(
            f"recompute_method={method!r} / recompute_num_layers={n} need "
            f"recompute_granularity='full' (got {g!r})"
        )
    if g != "full":
        return
    if method is None or n is None:
        e.append(
            f"recompute_granularity='full' needs recompute_method (uniform or block) and "
            f"recompute_num_layers (got {method!r} and {n})"
        )
        return
    try:
        stages = [c for r in range(cfg.parallel.pipeline_model_parallel_size)
                  for c in chunk_stages(cfg, r)]  # fmt: skip
    except ValueError:
        return  # the layout rules name that problem
    fewest = min(len(s.layers) for s in stages)
    if not 1 <= n <= max(1, fewest):
        e.append(
            f"recompute_num_layers={n} must be in [1, {fewest}] (the fewest layers a pipeline "
            "stage or model chunk holds)"
        )


def _moe(cfg: Config, e: list[str]) -> None:
    """Mixture of experts: counts, k <= E, what is not available yet."""
    m, p = cfg.model, cfg.parallel
    if not m.num_experts:
        base = type(m)()
        given = {f: getattr(m, f) for f in vars(base) if f.startswith("moe_")}
        given = {f: v for f, v in given.items() if v != getattr(base, f)}
        if given:
            e.append(f"{given} without num_experts: the MoE flags need --num-experts")
        return
    if m.num_experts < 1 or not 1 <= m.moe_router_topk <= m.num_experts:
        e.append(f"moe_router_topk={m.moe_router_topk} must be in [1, num_experts={m.num_experts}]")
    if m.moe_layer_freq < 1:
        e.append(f"moe_layer_freq={m.moe_layer_freq} must be >= 1")
    if m.moe_router_bias_update_rate < 0:
        e.append(f"moe_router_bias_update_rate={m.moe_router_bias_update_rate} must be >= 0")
    if m.moe_expert_capacity_factor is not None and m.moe_expert_capacity_factor <= 0:
        e.append(f"moe_expert_capacity_factor={m.moe_expert_capacity_factor} must be > 0")
    if m.moe_pad_expert_input_to_capacity and m.moe_expert_capacity_factor is None:
        e.append("moe_pad_expert_input_to_capacity needs moe_expert_capacity_factor")
    ep = p.expert_model_parallel_size
    if m.num_experts % ep:
        e.append(f"num_experts={m.num_experts} is not divisible by expert_model_parallel_size={ep}")
    if ep > 1 and cfg.optim.zero_stage not in (1, 2):
        e.append(
            f"expert_model_parallel_size={ep} with zero_stage={cfg.optim.zero_stage}: expert "
            "parallelism shards the experts' optimizer state with ZeRO 1 or 2 (--zero-stage 1|2)"
        )
    f = cfg.fp8
    if f.enabled:
        widths = {
            "moe_ffn_hidden_size": m.moe_ffn,
            "moe_shared_expert_intermediate_size": m.moe_shared_expert_intermediate_size,
        }
        bad = {k: v for k, v in widths.items() if v and v % FP8_GEMM_MULTIPLE}  # fmt: skip
        if bad:
            e.append(f"FP8 GEMM dims must be divisible by {FP8_GEMM_MULTIPLE}: {bad}")


def _fp8(cfg: Config, e: list[str]) -> None:
    """FP8 GEMM dims (local to each TP rank) and token counts are multiples of 16."""
    m, p, t, f = cfg.model, cfg.parallel, cfg.train, cfg.fp8
    if cfg.logging.log_fp8_stats and not f.enabled:
        e.append("log_fp8_stats=True needs FP8 GEMMs (--fp8-format e4m3|hybrid)")
    if not f.enabled:
        return
    tp = p.tensor_model_parallel_size
    local = {
        "hidden_size": m.hidden_size,
        "ffn_hidden_size/tp": m.ffn // tp,
        "qkv width/tp": (m.num_attention_heads + 2 * m.kv_heads) * m.head_dim // tp,
    }
    bad = {k: v for k, v in local.items() if v % FP8_GEMM_MULTIPLE}
    if bad:
        e.append(f"FP8 GEMM dims must be divisible by {FP8_GEMM_MULTIPLE}: {bad}")
    tokens = t.micro_batch_size * m.seq_length // (tp if p.sequence_parallel else 1)
    if tokens % FP8_GEMM_MULTIPLE:
        e.append(
            f"FP8 needs micro_batch_size x seq_length (/tp under SP) divisible by "
            f"{FP8_GEMM_MULTIPLE}, got micro_batch_size={t.micro_batch_size} x "
            f"seq_length={m.seq_length}"
        )
    if f.fp8_recipe == "mxfp8" and f.fp8_backend not in ("te", "auto"):
        e.append("fp8_recipe='mxfp8' needs fp8_backend='te' (Blackwell block scaling)")
    if f.first_last_layers_bf16 and (
        f.num_layers_at_start_in_bf16 < 0 or f.num_layers_at_end_in_bf16 < 0
    ):
        e.append("num_layers_at_start_in_bf16 / num_layers_at_end_in_bf16 must be >= 0")


def _optim(cfg: Config, e: list[str]) -> None:
    o = cfg.optim
    if o.lr < 0 or o.min_lr < 0 or o.min_lr > o.lr:
        e.append(f"need 0 <= min_lr <= lr, got lr={o.lr}, min_lr={o.min_lr}")
    if o.lr_warmup_iters < 0:
        e.append(f"lr_warmup_iters={o.lr_warmup_iters} must be >= 0")
    if not 0 <= o.lr_warmup_init <= o.lr:
        e.append(
            f"need 0 <= lr_warmup_init <= lr, got lr_warmup_init={o.lr_warmup_init}, lr={o.lr}"
        )
    if o.lr_decay_style == "inverse-square-root" and o.lr_warmup_iters <= 0:
        e.append(
            "lr_decay_style=inverse-square-root decays as lr * sqrt(warmup / iteration): it "
            f"needs lr_warmup_iters > 0, got {o.lr_warmup_iters}"
        )
    if o.clip_grad < 0:
        e.append(f"clip_grad={o.clip_grad} must be >= 0 (0 disables clipping)")
    if cfg.logging.log_params_norm and o.zero_stage == 3:
        e.append("log_params_norm with zero_stage=3: ZeRO-3 holds no whole weight to measure")
    if o.use_precision_aware_optimizer and not (
        cfg.train.bf16
        and o.zero_stage in (1, 2)
        and not o.accumulate_allreduce_grads_in_fp32
        and not cfg.model.num_experts
    ):
        e.append(
            f"use_precision_aware_optimizer with bf16={cfg.train.bf16}, zero_stage={o.zero_stage}"
            f", accumulate_allreduce_grads_in_fp32={o.accumulate_allreduce_grads_in_fp32}, "
            f"num_experts={cfg.model.num_experts}: it needs --bf16, ZeRO 1 or 2, bf16 gradient "
            "accumulation and a dense model"
        )


def _bad_steps(cfg: Config, e: list[str]) -> None:
    """NaN / spike policies and the FP8 overflow fallback."""
    t, f = cfg.train, cfg.fp8
    if (t.nan_policy == "skip" or not t.exit_on_nan) and not t.check_for_nan_in_loss_and_grad:
        e.append(
            "nan_policy='skip' (or exit_on_nan=False) needs check_for_nan_in_loss_and_grad: "
            "without the check nothing is skipped"
        )
    if t.check_for_spiky_loss and not t.spiky_loss_factor > 1.0:
        e.append(f"spiky_loss_factor={t.spiky_loss_factor} must be > 1 (a spike is above the mean)")
    if t.check_for_spiky_loss and t.spiky_loss_window < 1:
        e.append(f"spiky_loss_window={t.spiky_loss_window} must be >= 1")
    n = f.fp8_overflow_fallback_steps
    if n is not None and n < 1:
        e.append(f"fp8_overflow_fallback_steps={n} must be >= 1 (None: off)")
    if n is not None and not f.enabled:
        e.append("fp8_overflow_fallback_steps needs FP8 GEMMs (--fp8-format e4m3|hybrid)")
    if not 0.0 <= f.fp8_overflow_saturated_share < 1.0:
        e.append(f"fp8_overflow_saturated_share={f.fp8_overflow_saturated_share} must be in [0, 1)")


def validate(cfg: Config, world_size: int) -> int:
    """Check the whole config against ``world_size``; return the data-parallel size.

    Raises ValueError listing every problem found, each naming the fields and their values.
    """
    e: list[str] = []
    _values(cfg, world_size, e)
    if e:  # the rules below divide by these
        raise ValueError("invalid config: " + "; ".join(e))
    _layout(cfg, world_size, e)
    dp = max(1, data_parallel_size(cfg, world_size))
    _model(cfg, e)
    _recompute(cfg, e)
    _moe(cfg, e)
    _fp8(cfg, e)
    batches(cfg, dp, e)
    _optim(cfg, e)
    _bad_steps(cfg, e)
    data(cfg, e)
    if e:
        raise ValueError("invalid config: " + "; ".join(e))
    return dp
