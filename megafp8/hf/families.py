"""Llama, Qwen2 and GPT-2: the megafp8 config and one-process tensors <-> a HuggingFace
config.json and its tensors.

Llama (``LlamaForCausalLM``): RoPE (rotate-half, as ours: no permutation of q/k rows), RMSNorm,
SwiGLU, grouped-query attention, no biases (or biases everywhere: ``attention_bias`` and
``mlp_bias`` both set), tied or untied output layer.
Qwen2 (``Qwen2ForCausalLM``): Llama's tensors plus biases on q, k and v alone (``add_qkv_bias``).
GPT-2 (``GPT2LMHeadModel``): learned positions, LayerNorm, GELU (tanh), biases, tied output layer,
one kv head per query head. Its ``Conv1D`` stores weights as [in, out]: ours transposed. Its fused
``c_attn`` is [q; k; v], each all heads; ours is grouped head by head (q, k, v of head 0, ...).

Our grouped QKV weight [(heads + 2 kv) hd, h] is laid out group by group: hpg = heads / kv query
heads, then the group's k, then its v (``model/attention.py``).
"""

from __future__ import annotations

import torch

from megafp8.config import Config, ModelConfig
from megafp8.fp8.plain_ops import ROPE_SCALING_BANDS

FAMILIES = ("llama", "qwen2", "qwen3", "gpt2")
# the same tensor names; Qwen2 adds q, k, v biases, Qwen3 a q and a k norm (--qk-layernorm)
LLAMA_LIKE = ("llama", "qwen2", "qwen3")


def _refuse(family: str, what: str) -> None:
    raise ValueError(f"{family} cannot represent {what}")


def check_exportable(m: ModelConfig, family: str) -> None:
    """One-line ValueError naming the first setting ``family`` cannot represent."""
    if m.apply_layernorm_1p:
        _refuse(family, "apply_layernorm_1p=True (norm weights stored as w - 1)")
    if family in LLAMA_LIKE:
        if family == "llama" and m.add_qkv_bias and not m.add_bias_linear:
            _refuse(family, "add_qkv_bias=True (biases on q, k, v alone: --family qwen2)")
        if family == "qwen2" and (m.add_bias_linear or not m.add_qkv_bias):
            _refuse(family, f"add_bias_linear={m.add_bias_linear}, add_qkv_bias="
                    f"{m.add_qkv_bias} (Qwen2: biases on q, k, v alone)")  # fmt: skip
        if m.position_embedding_type != "rope":
            _refuse(family, f"position_embedding_type={m.position_embedding_type!r} (only rope)")
        if m.normalization != "RMSNorm":
            _refuse(family, f"normalization={m.normalization!r} (only RMSNorm)")
        if not m.swiglu:
            _refuse(family, "swiglu=False (a GELU MLP)")
    elif family == "gpt2":
        if m.position_embedding_type != "learned_absolute":
            _refuse(family, f"position_embedding_type={m.position_embedding_type!r}")
        if m.normalization != "LayerNorm":
            _refuse(family, f"normalization={m.normalization!r} (only LayerNorm)")
        if m.swiglu:
            _refuse(family, "swiglu=True")
        if m.kv_heads != m.num_attention_heads:
            _refuse(family, f"num_query_groups={m.num_query_groups} (grouped-query attention)")
        if m.untie_embeddings_and_output_weights:
            _refuse(family, "untie_embeddings_and_output_weights=True")
        if not m.add_bias_linear:
            _refuse(family, "add_bias_linear=False (GPT-2 layers always have biases)")
        if m.seq_length > m.max_positions:
            _refuse(family, f"seq_length={m.seq_length} > max_position_embeddings")
    else:
        raise ValueError(f"family={family!r}: one of {FAMILIES}")
    if m.squared_relu:
        _refuse(family, "squared_relu=True (a squared ReLU MLP)")
    if m.qk_layernorm and family != "qwen3":
        _refuse(family, "qk_layernorm=True (a q and a k norm: --family qwen3)")
    if family == "qwen3" and not m.qk_layernorm:
        _refuse(family, "qk_layernorm=False (Qwen3 normalizes q and k: --qk-layernorm)")
    if family == "qwen3" and (m.add_bias_linear or m.add_qkv_bias):
        _refuse(family, f"add_bias_linear={m.add_bias_linear}, add_qkv_bias={m.add_qkv_bias} "
                "(no biases)")  # fmt: skip


def guess_family(m: ModelConfig) -> str:
    if m.position_embedding_type != "rope":
        return "gpt2"
    if m.qk_layernorm:
        return "qwen3"
    return "qwen2" if m.add_qkv_bias and not m.add_bias_linear else "llama"


def _split_qkv(w: torch.Tensor, m: ModelConfig):
    """Grouped [(heads + 2 kv) hd, ...] -> q [heads hd, ...], k, v [kv hd, ...]."""
    kv, hd, hpg = m.kv_heads, m.head_dim, m.num_attention_heads // m.kv_heads
    g = w.reshape(kv, hpg + 2, hd, *w.shape[1:])  # per group: hpg q heads, k, v
    q = g[:, :hpg].reshape(kv * hpg * hd, *w.shape[1:])
    return q, g[:, hpg].reshape(kv * hd, *w.shape[1:]), g[:, hpg + 1].reshape(kv * hd, *w.shape[1:])


def _join_qkv(q, k, v, m: ModelConfig) -> torch.Tensor:
    """Inverse of ``_split_qkv``."""
    kv, hd, hpg = m.kv_heads, m.head_dim, m.num_attention_heads // m.kv_heads
    rest = q.shape[1:]
    g = torch.cat(
        [q.reshape(kv, hpg, hd, *rest), k.reshape(kv, 1, hd, *rest), v.reshape(kv, 1, hd, *rest)],
        dim=1,
    )  # [kv, hpg + 2, hd, ...]
    return g.reshape(-1, *rest).contiguous()


def _norm(out, src, dst, full, bias):
    out[dst + ".weight"] = full[src + ".weight"]
    if bias:
        out[dst + ".bias"] = full[src + ".bias"]


def to_hf(cfg: Config, full: dict[str, torch.Tensor], family: str) -> tuple[dict, dict]:
    """(HF config.json dict, HF tensors) from the one-process tensors (padded vocab dropped)."""
    m = cfg.model
    check_exportable(m, family)
    V, out = m.vocab_size, {}
    emb = full["embedding.weight"][:V]
    ln = m.normalization == "LayerNorm"
    bias = m.add_bias_linear
    llama = family in LLAMA_LIKE
    for i in range(m.num_layers):
        s = f"layers.{i}."
        d = f"model.layers.{i}." if llama else f"transformer.h.{i}."
        qkv_w = full[s + "attn.qkv.linear.weight"]
        qkv_b = full.get(s + "attn.qkv.linear.bias")
        fc1_w, fc1_b = full[s + "mlp.fc1.linear.weight"], full.get(s + "mlp.fc1.linear.bias")
        proj_w, fc2_w = full[s + "attn.proj.linear.weight"], full[s + "mlp.fc2.linear.weight"]
        if llama:
            _norm(out, s + "norm1", d + "input_layernorm", full, ln)
            _norm(out, s + "norm2", d + "post_attention_layernorm", full, ln)
            for nm, t in zip(("q", "k", "v"), _split_qkv(qkv_w, m), strict=True):
                out[d + f"self_attn.{nm}_proj.weight"] = t
            out[d + "self_attn.o_proj.weight"] = proj_w
            if m.qk_layernorm:
                for nm in ("q", "k"):
                    out[d + f"self_attn.{nm}_norm.weight"] = full[s + f"attn.{nm}_norm.weight"]
            out[d + "mlp.gate_proj.weight"] = fc1_w[: m.ffn]
            out[d + "mlp.up_proj.weight"] = fc1_w[m.ffn :]
            out[d + "mlp.down_proj.weight"] = fc2_w
            if bias or m.add_qkv_bias:
                for nm, t in zip(("q", "k", "v"), _split_qkv(qkv_b, m), strict=True):
                    out[d + f"self_attn.{nm}_proj.bias"] = t
            if bias:
                out[d + "self_attn.o_proj.bias"] = full[s + "attn.proj.bias"]
                out[d + "mlp.gate_proj.bias"] = fc1_b[: m.ffn]
                out[d + "mlp.up_proj.bias"] = fc1_b[m.ffn :]
                out[d + "mlp.down_proj.bias"] = full[s + "mlp.fc2.bias"]
        else:
            _norm(out, s + "norm1", d + "ln_1", full, True)
            _norm(out, s + "norm2", d + "ln_2", full, True)
            out[d + "attn.c_attn.weight"] = torch.cat(_split_qkv(qkv_w, m)).t()  # Conv1D [in, out]
            out[d + "attn.c_attn.bias"] = torch.cat(_split_qkv(qkv_b, m))
            out[d + "attn.c_proj.weight"] = proj_w.t()
            out[d + "attn.c_proj.bias"] = full[s + "attn.proj.bias"]
            out[d + "mlp.c_fc.weight"] = fc1_w.t()
            out[d + "mlp.c_fc.bias"] = fc1_b
            out[d + "mlp.c_proj.weight"] = fc2_w.t()
            out[d + "mlp.c_proj.bias"] = full[s + "mlp.fc2.bias"]
    tied = not m.untie_embeddings_and_output_weights
    if llama:
        out["model.embed_tokens.weight"] = emb
        _norm(out, "final_norm", "model.norm", full, ln)
        if not tied:
            out["lm_head.weight"] = full["output"][:V]
    else:
        out["transformer.wte.weight"] = emb
        out["transformer.wpe.weight"] = full["pos"]
        _norm(out, "final_norm", "transformer.ln_f", full, True)
    out = {k: v.contiguous() for k, v in out.items()}
    make = {"llama": _llama_config, "qwen2": _qwen2_config, "qwen3": _qwen3_config,
            "gpt2": _gpt2_config}[family]  # fmt: skip
    return make(m, tied, emb.dtype), out


def _dtype_name(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")


def _llama_config(m: ModelConfig, tied: bool, dtype) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": m.vocab_size,
        "hidden_size": m.hidden_size,
        "intermediate_size": m.ffn,
        "num_hidden_layers": m.num_layers,
        "num_attention_heads": m.num_attention_heads,
        "num_key_value_heads": m.kv_heads,
        "head_dim": m.head_dim,
        "hidden_act": "silu",
        "max_position_embeddings": m.max_positions,
        "rms_norm_eps": m.norm_epsilon,
        "rope_theta": m.rotary_base,
        "rope_scaling": _rope_scaling(m),
        "attention_bias": m.add_bias_linear,
        "mlp_bias": m.add_bias_linear,
        "attention_dropout": 0.0,
        "tie_word_embeddings": tied,
        "initializer_range": m.init_method_std,
        "torch_dtype": _dtype_name(dtype),
    }


def _qwen2_config(m: ModelConfig, tied: bool, dtype) -> dict:
    out = _llama_config(m, tied, dtype)
    for k in ("attention_bias", "mlp_bias", "head_dim"):  # Qwen2's q, k, v biases are implied
        del out[k]
    out.update(architectures=["Qwen2ForCausalLM"], model_type="qwen2", use_sliding_window=False,
               max_window_layers=m.num_layers)  # fmt: skip
    return out


def _qwen3_config(m: ModelConfig, tied: bool, dtype) -> dict:
    out = _llama_config(m, tied, dtype)
    del out["mlp_bias"]
    out.update(architectures=["Qwen3ForCausalLM"], model_type="qwen3", use_sliding_window=False,
               max_window_layers=m.num_layers)  # fmt: skip
    return out


def _rope_scaling(m: ModelConfig) -> dict | None:
    """Llama 3.1's ``rope_scaling`` entry (``--use-rope-scaling``), else None."""
    if not m.use_rope_scaling:
        return None
    b = ROPE_SCALING_BANDS
    return {
        "rope_type": "llama3",
        "factor": m.rope_scaling_factor,
        "low_freq_factor": b["low_freq_factor"],
        "high_freq_factor": b["high_freq_factor"],
        "original_max_position_embeddings": b["original_context"],
    }


def _rope_scaling_fields(hf: dict) -> dict:
    """ModelConfig fields from config.json's rope scaling (``rope_scaling``, or transformers 5's
    ``rope_parameters``): none, or Llama 3.1's with the bands ``--use-rope-scaling`` fixes."""
    rs = hf.get("rope_scaling") or hf.get("rope_parameters") or {}
    kind = rs.get("rope_type", rs.get("type", "default"))
    if kind == "default":
        return {}
    b = ROPE_SCALING_BANDS
    want = {"low_freq_factor": b["low_freq_factor"], "high_freq_factor": b["high_freq_factor"],
            "original_max_position_embeddings": b["original_context"]}  # fmt: skip
    got = {k: rs.get(k) for k in want}
    if kind != "llama3" or got != want or not isinstance(rs.get("factor"), (int, float)):
        raise ValueError(
            f"llama: config.json rope scaling {rs!r} is not supported (only rope_type llama3 "
            f"with {want} and a factor)"
        )
    return dict(use_rope_scaling=True, rope_scaling_factor=float(rs["factor"]))


def _gpt2_config(m: ModelConfig, tied: bool, dtype) -> dict:
    return {
        "architectures": ["GPT2LMHeadModel"],
        "model_type": "gpt2",
        "vocab_size": m.vocab_size,
        "n_positions": m.max_positions,
        "n_embd": m.hidden_size,
        "n_layer": m.num_layers,
        "n_head": m.num_attention_heads,
        "n_inner": m.ffn,
        "activation_function": "gelu_new",
        "layer_norm_epsilon": m.norm_epsilon,
        "resid_pdrop": 0.0,
        "embd_pdrop": 0.0,
        "attn_pdrop": 0.0,
        "scale_attn_weights": True,
        "scale_attn_by_inverse_layer_idx": False,
        "reorder_and_upcast_attn": False,
        "tie_word_embeddings": True,
        "initializer_range": m.init_method_std,
        "torch_dtype": _dtype_name(dtype),
    }


def model_config_from_hf(hf: dict, seq_length: int | None) -> tuple[str, dict]:
    """(family, ModelConfig fields) from a HF config.json dict; refuses what we cannot build."""
    kind = hf.get("model_type")

    def need(key, ok, default=None):
        v = hf.get(key, default)
        if not ok(v):
            raise ValueError(f"{kind}: config.json {key}={v!r} is not supported")
        return v

    if kind == "mistral":  # Llama's architecture and tensors, plus an optional sliding window
        need("sliding_window", lambda v: v is None)
        kind = "llama"
    if kind in LLAMA_LIKE:
        h, heads = hf["hidden_size"], hf["num_attention_heads"]
        need("head_dim", lambda v: v in (None, h // heads))
        extra = _rope_scaling_fields(hf)
        need("hidden_act", lambda v: v == "silu", "silu")
        if kind == "llama":
            bias = need("attention_bias", lambda v: v == hf.get("mlp_bias", False), False)
            extra["add_qkv_bias"] = False
        elif kind == "qwen3":  # a q and a k norm; no biases; no sliding window
            need("attention_bias", lambda v: not v, False)
            need("use_sliding_window", lambda v: not v, False)
            bias, extra["add_qkv_bias"], extra["qk_layernorm"] = False, False, True
        else:  # Qwen2: q, k, v biases, no others; no sliding window
            need("use_sliding_window", lambda v: not v, False)
            bias, extra["add_qkv_bias"] = False, True
        pos = hf.get("max_position_embeddings", 2048)
        # transformers 5 keeps theta under rope_parameters
        theta = hf.get("rope_theta") or (hf.get("rope_parameters") or {}).get("rope_theta", 1e4)
        fields = dict(
            num_layers=hf["num_hidden_layers"],
            hidden_size=h,
            num_attention_heads=heads,
            num_query_groups=hf.get("num_key_value_heads") or heads,
            ffn_hidden_size=hf["intermediate_size"],
            position_embedding_type="rope",
            rotary_base=float(theta),
            normalization="RMSNorm",
            norm_epsilon=hf.get("rms_norm_eps", 1e-6),
            swiglu=True,
            untie_embeddings_and_output_weights=not hf.get("tie_word_embeddings", False),
            add_bias_linear=bool(bias),
            max_position_embeddings=pos,
            seq_length=seq_length or min(pos, 4096),
            **extra,
        )
    elif kind == "gpt2":
        need("activation_function", lambda v: v in ("gelu_new", "gelu_pytorch_tanh"), "gelu_new")
        need("scale_attn_by_inverse_layer_idx", lambda v: not v, False)
        need("reorder_and_upcast_attn", lambda v: not v, False)
        need("scale_attn_weights", lambda v: v, True)
        need("tie_word_embeddings", lambda v: v, True)
        h, pos = hf["n_embd"], hf["n_positions"]
        fields = dict(
            num_layers=hf["n_layer"],
            hidden_size=h,
            num_attention_heads=hf["n_head"],
            ffn_hidden_size=hf.get("n_inner") or 4 * h,
            position_embedding_type="learned_absolute",
            normalization="LayerNorm",
            norm_epsilon=hf.get("layer_norm_epsilon", 1e-5),
            max_position_embeddings=pos,
            seq_length=seq_length or pos,
        )
    else:
        raise ValueError(
            f"config.json model_type={kind!r}: only llama, mistral, qwen2, qwen3 and gpt2 are "
            "supported"
        )
    fields["vocab_size"] = hf["vocab_size"]
    fields["init_method_std"] = hf.get("initializer_range", 0.02)
    return kind, fields


def from_hf(m: ModelConfig, family: str, t: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """One-process tensors (canonical names, unpadded vocab) from HF tensors."""
    out = {}
    llama, bias = family in LLAMA_LIKE, m.add_bias_linear
    ln = m.normalization == "LayerNorm"

    def norm(src, dst):
        out[dst + ".weight"] = t[src + ".weight"]
        if ln:
            out[dst + ".bias"] = t[src + ".bias"]

    for i in range(m.num_layers):
        s = f"model.layers.{i}." if llama else f"transformer.h.{i}."
        d = f"layers.{i}."
        if llama:
            norm(s + "input_layernorm", d + "norm1")
            norm(s + "post_attention_layernorm", d + "norm2")
            a, f = s + "self_attn.", s + "mlp."
            for k in ("weight", "bias") if bias or m.add_qkv_bias else ("weight",):
                qkv = [t[a + f"{n}_proj.{k}"] for n in "qkv"]
                out[d + f"attn.qkv.linear.{k}"] = _join_qkv(*qkv, m)
            for k in ("weight", "bias") if bias else ("weight",):
                out[d + f"mlp.fc1.linear.{k}"] = torch.cat(
                    [t[f + f"gate_proj.{k}"], t[f + f"up_proj.{k}"]]
                )
            out[d + "attn.proj.linear.weight"] = t[a + "o_proj.weight"]
            if m.qk_layernorm:
                for n in ("q", "k"):
                    out[d + f"attn.{n}_norm.weight"] = t[a + f"{n}_norm.weight"]
            out[d + "mlp.fc2.linear.weight"] = t[f + "down_proj.weight"]
            if bias:
                out[d + "attn.proj.bias"] = t[a + "o_proj.bias"]
                out[d + "mlp.fc2.bias"] = t[f + "down_proj.bias"]
        else:
            norm(s + "ln_1", d + "norm1")
            norm(s + "ln_2", d + "norm2")
            h = m.hidden_size
            w, b = t[s + "attn.c_attn.weight"].t(), t[s + "attn.c_attn.bias"]  # [3h, h], [3h]
            out[d + "attn.qkv.linear.weight"] = _join_qkv(w[:h], w[h : 2 * h], w[2 * h :], m)
            out[d + "attn.qkv.linear.bias"] = _join_qkv(b[:h], b[h : 2 * h], b[2 * h :], m)
            out[d + "attn.proj.linear.weight"] = t[s + "attn.c_proj.weight"].t()
            out[d + "attn.proj.bias"] = t[s + "attn.c_proj.bias"]
            out[d + "mlp.fc1.linear.weight"] = t[s + "mlp.c_fc.weight"].t()
            out[d + "mlp.fc1.linear.bias"] = t[s + "mlp.c_fc.bias"]
            out[d + "mlp.fc2.linear.weight"] = t[s + "mlp.c_proj.weight"].t()
            out[d + "mlp.fc2.bias"] = t[s + "mlp.c_proj.bias"]
    if llama:
        out["embedding.weight"] = t["model.embed_tokens.weight"]
        norm("model.norm", "final_norm")
        if m.untie_embeddings_and_output_weights:
            out["output"] = t["lm_head.weight"]
    else:
        out["embedding.weight"] = t["transformer.wte.weight"]
        out["pos"] = t["transformer.wpe.weight"]
        norm("transformer.ln_f", "final_norm")
    return {k: v.contiguous() for k, v in out.items()}
