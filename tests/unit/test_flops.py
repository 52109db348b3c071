"""megafp8.metrics.flops_per_iteration against GEMM-by-GEMM hand counts.

Convention (the module's docstring): a GEMM [m, k] x [k, n] costs 2*m*n*k FLOPs; forward + backward
= 3 x forward (dgrad and wgrad are one forward GEMM each); the attention scores Q K^T and the
context P V are counted *causal* (half of the s x s products) unless ``causal=False``; the logits
layer (h -> padded vocab) is counted, the embedding lookup, norms, activations and softmax are not.
"""

import pytest

from megafp8.config import ModelConfig
from megafp8.metrics import flops_per_iteration


def hand_count(B, s, L, h, heads, kv, hd, ffn, swiglu, V, causal=True):
    """Forward GEMMs of one iteration listed one by one, times 3 (forward + backward)."""
    T = B * s  # tokens in the global batch
    qkv = 2 * T * ((heads + 2 * kv) * hd) * h  # [T, h] x [h, (heads + 2 kv) hd]
    # per sequence and query head: [s, hd] x [hd, s], then [s, s] x [s, hd]; causal keeps half
    frac = 0.5 if causal else 1.0
    scores = frac * B * heads * 2 * s * s * hd
    context = frac * B * heads * 2 * s * hd * s
    proj = 2 * T * h * (heads * hd)  # [T, heads hd] x [heads hd, h]
    fc1 = 2 * T * ((2 if swiglu else 1) * ffn) * h  # SwiGLU: gate and up in one GEMM
    fc2 = 2 * T * h * ffn
    logits = 2 * T * V * h  # [T, h] x [h, V], tied or not
    return 3 * (L * (qkv + scores + context + proj + fc1 + fc2) + logits)


def test_gpt_learned_positions_gelu_tied():
    """GPT-1.3B-like: multi-head attention, GELU MLP of 4h, tied output layer."""
    m = ModelConfig(
        num_layers=24,
        hidden_size=2048,
        num_attention_heads=16,
        seq_length=2048,
        position_embedding_type="learned_absolute",
    )
    B, V = 512, 50304
    want = hand_count(B, 2048, 24, 2048, 16, 16, 128, 8192, False, V)
    # the same count in closed form: Megatron's paper has 72 B s L h^2 (1 + s/(6h) + V/(12 L h))
    # with the full s x s attention; causal halves that term to s/(12h)
    closed = 72 * B * 2048 * 24 * 2048**2 * (1 + 2048 / (12 * 2048) + V / (12 * 24 * 2048))
    assert want == pytest.approx(closed, rel=1e-12)
    assert flops_per_iteration(m, B, V) == pytest.approx(want, rel=1e-12)


def test_llama_gqa_swiglu_untied():
    """Llama-8B-like: 32 query heads sharing 8 kv heads (hd 128), SwiGLU of 14336, untied."""
    m = ModelConfig(
        num_layers=32,
        hidden_size=4096,
        num_attention_heads=32,
        num_query_groups=8,
        ffn_hidden_size=14336,
        seq_length=4096,
        position_embedding_type="rope",
        normalization="RMSNorm",
        swiglu=True,
        untie_embeddings_and_output_weights=True,
        add_bias_linear=False,
    )
    B, V = 1024, 128256
    want = hand_count(B, 4096, 32, 4096, 32, 8, 128, 14336, True, V)
    assert flops_per_iteration(m, B, V) == pytest.approx(want, rel=1e-12)
    # GQA matters: the same model with 32 kv heads does 2 * (24 * 128 * 4096) more qkv FLOPs per
    # token per layer (x3 for backward), which the formula must see
    mha = ModelConfig(**{**m.__dict__, "num_query_groups": None})
    extra = 3 * 32 * 2 * (B * 4096) * (2 * 24 * 128) * 4096
    assert flops_per_iteration(mha, B, V) - flops_per_iteration(m, B, V) == pytest.approx(
        extra, rel=1e-9
    )


def test_non_causal_counts_the_full_score_matrix():
    """causal=False: scores and context count all s x s products (twice the causal count)."""
    m = ModelConfig(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32)
    want = hand_count(8, 32, 2, 64, 4, 4, 16, 256, False, 256, causal=False)
    assert flops_per_iteration(m, 8, 256, causal=False) == pytest.approx(want, rel=1e-12)
    # difference causal vs not: 3 * L * (2 matmuls) * 0.5 * B * heads * 2 s^2 hd
    diff = 3 * 2 * 2 * 0.5 * 8 * 4 * 2 * 32 * 32 * 16
    got = flops_per_iteration(m, 8, 256, causal=False) - flops_per_iteration(m, 8, 256)
    assert got == pytest.approx(diff, rel=1e-12)


@pytest.mark.parametrize("variant", ["gpt", "llama"])
def test_formula_matches_the_gemms_of_the_built_model(variant):
    """The hand count's GEMM shapes are the model's: summing 2 * out * in over every linear
    weight the single-process model builds (plus the logits and attention matmuls) gives the
    formula's number, so a changed layer (e.g. a wider fc1) would show up here."""
    from megafp8.config import Config
    from megafp8.fp8.backend import Backend
    from megafp8.model.gpt import GPTModel
    from megafp8.parallel.groups import ParallelGroups

    model = dict(num_layers=2, hidden_size=64, num_attention_heads=4, seq_length=32)
    if variant == "llama":
        model.update(
            num_query_groups=2,
            ffn_hidden_size=96,
            swiglu=True,
            untie_embeddings_and_output_weights=True,
            position_embedding_type="rope",
            add_bias_linear=False,
        )
    cfg = Config().replace(model=model)
    net = GPTModel(cfg, backend=Backend(), groups=ParallelGroups.single(), vocab_size=200)
    V, h, s, B, m = net.padded_vocab, 64, 32, 4, cfg.model
    linear = [
        w for n, w in net.named_parameters() if n.startswith("layers.") and w.ndim == 2
    ]  # qkv, proj, fc1, fc2 of each layer
    assert len(linear) == 4 * m.num_layers
    per_token = sum(2 * w.shape[0] * w.shape[1] for w in linear) + 2 * V * h
    attn = m.num_layers * 2 * (0.5 * 2 * s * m.num_attention_heads * m.head_dim)  # per token
    want = 3 * B * s * (per_token + attn)
    assert V == 256  # 200 padded to a multiple of 128
    assert flops_per_iteration(m, B, V) == pytest.approx(want, rel=1e-12)
