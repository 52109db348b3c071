"""The model section of the run configuration (``Config.model``): the network's shape, its
positions, norms, activations and experts; and ``_f``, the field declaration every section uses
(``megafp8.config`` holds the other sections and the whole)."""

from __future__ import annotations

from dataclasses import dataclass, field


def _f(default, help: str, choices: tuple | None = None):
    """A config field with its one-line description (and allowed values)."""
    return field(default=default, metadata={"help": help, "choices": choices})


@dataclass(frozen=True)
class ModelConfig:
    num_layers: int = _f(2, "transformer layers")
    hidden_size: int = _f(128, "width of the residual stream (h)")
    num_attention_heads: int = _f(4, "query heads")
    num_query_groups: int | None = _f(
        None, "kv heads for grouped-query attention (None: one per query head)"
    )
    ffn_hidden_size: int | None = _f(None, "MLP inner width (None: 4 x hidden_size)")
    seq_length: int = _f(128, "tokens per sample")
    max_position_embeddings: int | None = _f(
        None, "size of the learned position table (None: seq_length)"
    )
    position_embedding_type: str = _f(
        "learned_absolute", "learned positions or rotary (RoPE)", ("learned_absolute", "rope")
    )
    rotary_base: float = _f(10000.0, "RoPE base (theta)")
    use_rope_scaling: bool = _f(False, "Llama 3.1 RoPE frequency scaling (low/high 1/4, ctx 8192)")
    rope_scaling_factor: float = _f(8.0, "with use_rope_scaling: the low frequencies' divisor")
    normalization: str = _f(
        "LayerNorm", "norm of each block and the final one", ("LayerNorm", "RMSNorm")
    )
    norm_epsilon: float = _f(1e-5, "epsilon of the norms")
    swiglu: bool = _f(False, "SwiGLU MLP (gate and up projections) instead of GELU")
    squared_relu: bool = _f(False, "squared ReLU MLP, relu(x)^2, instead of GELU (Nemotron)")
    untie_embeddings_and_output_weights: bool = _f(
        False, "a separate output layer instead of the embedding's transpose"
    )
    add_bias_linear: bool = _f(True, "biases in the linear layers (--disable-bias-linear: none)")
    add_qkv_bias: bool = _f(False, "a bias on the QKV projection even without the others (Qwen2)")
    qk_layernorm: bool = _f(
        False,
        "normalize each query and key head (the --normalization type, over the head dim) "
        "before RoPE (Qwen3, OLMo 2)",
    )
    vocab_size: int | None = _f(
        None, "vocabulary size (None: the tokenizer's, or the mock data's default)"
    )
    make_vocab_size_divisible_by: int = _f(
        128, "pad the vocab to a multiple of this x tensor_model_parallel_size"
    )
    init_method_std: float = _f(0.02, "std of the normal initialization")
    hidden_dropout: float = _f(0.0, "dropout on the residual stream")
    attention_dropout: float = _f(0.0, "dropout on the attention probabilities")
    cross_entropy_loss_fusion: bool = _f(
        True, "the loss as fused Triton kernels on CUDA (the torch loss elsewhere)"
    )
    apply_layernorm_1p: bool = _f(
        False, "LayerNorm weights centered on zero: the norm multiplies by (1 + weight)"
    )
    attention_backend: str = _f(
        "auto", "te backend's attention kernels (torch: SDPA picks its own)",
        ("auto", "flash", "fused", "unfused", "local"),
    )  # fmt: skip
    recompute_granularity: str | None = _f(
        None, "activation recompute: full (whole layers) or selective (--recompute-modules)",
        (None, "full", "selective"),
    )  # fmt: skip
    recompute_method: str | None = _f(
        None, "full recompute: uniform (groups of --recompute-num-layers layers) or block "
        "(the first --recompute-num-layers layers of each stage)", (None, "uniform", "block"),
    )  # fmt: skip
    recompute_num_layers: int | None = _f(
        None, "full recompute: layers per group (uniform) or layers recomputed per stage (block)"
    )
    recompute_modules: tuple[str, ...] = _f(
        ("core_attn",), "selective recompute: any of core_attn, mlp, layernorm"
    )
    num_experts: int | None = _f(None, "experts per MoE layer (None: dense MLPs)")
    moe_layer_freq: int = _f(1, "an MoE layer every this many layers, from layer 0 (1: all)")
    moe_ffn_hidden_size: int | None = _f(None, "each expert's MLP width (None: ffn_hidden_size)")
    moe_shared_expert_intermediate_size: int | None = _f(
        None, "width of a shared expert every token goes through (None: none)"
    )
    moe_router_topk: int = _f(2, "experts per token (k)")
    moe_router_score_function: str = _f(
        "softmax", "router scores", ("softmax", "sigmoid")
    )  # fmt: skip
    moe_router_pre_softmax: bool = _f(
        False, "softmax over all experts before the top-k (else top-k logits, then softmax)"
    )
    moe_router_load_balancing_type: str = _f(
        "aux_loss", "load balancing", ("aux_loss", "seq_aux_loss", "none")
    )  # fmt: skip
    moe_aux_loss_coeff: float = _f(0.0, "weight of the load-balancing loss")
    moe_router_enable_expert_bias: bool = _f(
        False, "aux-loss-free balancing: a per-expert bias on the top-k choice, moved each "
        "iteration towards the mean load"
    )  # fmt: skip
    moe_router_bias_update_rate: float = _f(1e-3, "the expert bias's step per iteration")
    moe_z_loss_coeff: float | None = _f(None, "weight of the router z-loss (None: off)")
    moe_expert_capacity_factor: float | None = _f(
        None, "token assignments per expert at most ceil(factor x tokens x k / experts) "
        "(None: dropless)"
    )  # fmt: skip
    moe_token_drop_policy: str = _f(
        "probs", "beyond capacity drop the lowest-probability or the latest assignments",
        ("probs", "position"),
    )  # fmt: skip
    moe_pad_expert_input_to_capacity: bool = _f(
        False, "run every expert on exactly its capacity rows (zero padding)"
    )
    moe_grouped_gemm: bool = _f(
        False, "the experts as two grouped GEMMs (TE's GroupedLinear; te backend only: elsewhere "
        "a loop)"
    )  # fmt: skip
    moe_token_dispatcher_type: str = _f(
        "alltoall", "how tokens reach the experts other ranks hold (expert parallelism)",
        ("alltoall", "allgather"),
    )  # fmt: skip

    @property
    def ffn(self) -> int:
        return self.ffn_hidden_size or 4 * self.hidden_size

    @property
    def moe_ffn(self) -> int:
        return self.moe_ffn_hidden_size or self.ffn

    def is_moe_layer(self, i: int) -> bool:
        return bool(self.num_experts) and i % self.moe_layer_freq == 0

    @property
    def kv_heads(self) -> int:
        return self.num_query_groups or self.num_attention_heads

    @property
    def head_dim(self) -> int:
        return self.hidden_size // self.num_attention_heads

    @property
    def max_positions(self) -> int:
        return self.max_position_embeddings or self.seq_length
