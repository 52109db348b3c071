"""HuggingFace export/import: checkpoints saved at TP 2 and PP 2 export to Llama and GPT-2
directories whose transformers logits match our one-process model's; export -> import -> export
is bit-identical; an import at TP 2 resumes training."""

from __future__ import annotations

import os

import pytest
import torch

from megafp8.hf import convert, layout
from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config, train_losses

pytest.importorskip("safetensors")
transformers = pytest.importorskip("transformers")

LLAMA = dict(
    position_embedding_type="rope",
    normalization="RMSNorm",
    swiglu=True,
    num_query_groups=2,
    untie_embeddings_and_output_weights=True,
    add_bias_linear=False,
    ffn_hidden_size=96,
    vocab_size=250,
    rotary_base=500.0,
)
MODELS = {
    "llama": LLAMA,
    "qwen2": dict(
        LLAMA, add_qkv_bias=True, untie_embeddings_and_output_weights=False, rotary_base=1e6
    ),  # fmt: skip
    "qwen3": dict(LLAMA, qk_layernorm=True),
    "gpt2": dict(vocab_size=250, ffn_hidden_size=160, max_position_embeddings=40),
}
ARCH = {"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM",
        "gpt2": "GPT2LMHeadModel"}  # fmt: skip
LAYOUTS = {"tp2": dict(tensor_model_parallel_size=2), "pp2": dict(pipeline_model_parallel_size=2)}


def _cfg(family, ck, **parallel):
    return tiny_config(
        model=MODELS[family],
        train=dict(train_iters=2, save=ck, global_batch_size=4),
        parallel=parallel,
    )


def _train_and_check_rows(cfg):
    """Train, then check that ``layout.locate`` names the rows each shard's metadata records."""
    from megafp8.train import build_run, init_distributed, train

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    groups, device = init_distributed(cfg)
    run = build_run(cfg, groups, device)
    train(cfg, run)
    for name, p in run.model.named_parameters():
        c, dim, index, _ = layout.locate(name, run.cfg.model, groups.tp, groups.coords.tp)
        if hasattr(p, "full_index"):
            assert (c, dim) == (layout.canonical(p.full_name), p.partition_dim), name
            assert torch.equal(index, p.full_index), name
        elif hasattr(p, "full_name"):
            whole = dim is None or torch.equal(index, torch.arange(p.shape[dim]))
            assert c == layout.canonical(p.full_name) and whole, name
    return True


@pytest.fixture(scope="module", params=[(f, lay) for f in MODELS for lay in LAYOUTS])
def saved(request, tmp_path_factory):
    family, lay = request.param
    ck = str(tmp_path_factory.mktemp(f"{family}_{lay}") / "ck")
    run_distributed(_train_and_check_rows, 2, _cfg(family, ck, **LAYOUTS[lay]))
    return family, ck


def _our_logits(ck, tokens):
    """Logits [b, s, V] of the one-process model built from the merged checkpoint."""
    from megafp8.fp8.backend import Backend
    from megafp8.model.gpt import GPTModel
    from megafp8.parallel.groups import ParallelGroups

    cfg, _, full = layout.merge_checkpoint(layout.find_checkpoint(ck))
    cfg = cfg.replace(parallel=dict(tensor_model_parallel_size=1, pipeline_model_parallel_size=1))
    m = cfg.model
    model = GPTModel(
        cfg, backend=Backend(), groups=ParallelGroups.single(), vocab_size=m.vocab_size
    )
    with torch.no_grad():
        for name, p in model.named_parameters():
            src = layout.shard(full, name, m, 1, 0)
            if src.shape[0] != p.shape[0] and name in ("embedding.weight", "output"):
                src = src[: m.vocab_size]  # padding differs with tp: zero rows beyond the vocab
                p.zero_()
            p[: src.shape[0]].copy_(src)
        model.eval()
        return model(tokens).transpose(0, 1)[..., : m.vocab_size]  # [s, b, Vp] -> [b, s, V]


def _hf_logits(hf_dir, tokens):
    model = transformers.AutoModelForCausalLM.from_pretrained(hf_dir, torch_dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        return model(tokens).logits


def _tensors(hf_dir):
    from safetensors.torch import load_file

    return load_file(os.path.join(hf_dir, "model.safetensors"))


def test_export_logits_match(saved, tmp_path):
    family, ck = saved
    out = str(tmp_path / "hf")
    convert.export_checkpoint(ck, out, family)
    arch = ARCH[family]
    model = transformers.AutoModelForCausalLM.from_pretrained(out, torch_dtype=torch.float32)
    assert type(model).__name__ == arch
    tokens = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(0))
    ours, theirs = _our_logits(ck, tokens), _hf_logits(out, tokens)
    assert ours.shape == theirs.shape
    # Same fp32 weights, different op order (fused vs split QKV GEMMs, SDPA vs eager attention,
    # norm and RoPE formulations): each output carries a few ulps of fp32 round-off (eps 1.2e-7)
    # per reduction, grown through 2 layers; 1e-4 of the logit scale bounds that with a wide
    # margin, while any mapping error (a swapped head, a transposed weight) is O(logit scale).
    scale = ours.abs().max().item()
    assert (ours - theirs).abs().max().item() <= 1e-4 * scale, (family, scale)


def test_round_trip_bit_identical(saved, tmp_path):
    family, ck = saved
    a, back, b = (str(tmp_path / n) for n in ("a", "ck", "b"))
    convert.export_checkpoint(ck, a, family)
    convert.import_checkpoint(a, back)
    convert.export_checkpoint(back, b, family)
    ta, tb = _tensors(a), _tensors(b)
    assert ta.keys() == tb.keys()
    for k in ta:
        assert torch.equal(ta[k], tb[k]), k


def test_refusals(saved, tmp_path):
    family, ck = saved
    other = "llama" if family == "gpt2" else "gpt2"
    with pytest.raises(ValueError, match=f"{other} cannot represent position_embedding_type"):
        convert.export_checkpoint(ck, str(tmp_path / "x"), other)
    if family == "qwen2":  # Llama's attention_bias would put a bias on o_proj as well
        with pytest.raises(ValueError, match="llama cannot represent add_qkv_bias=True"):
            convert.export_checkpoint(ck, str(tmp_path / "y"), "llama")
    if family == "qwen3":  # Llama has no q and k norms
        with pytest.raises(ValueError, match="llama cannot represent qk_layernorm=True"):
            convert.export_checkpoint(ck, str(tmp_path / "y"), "llama")
    if family == "llama":
        with pytest.raises(ValueError, match="qwen3 cannot represent qk_layernorm=False"):
            convert.export_checkpoint(ck, str(tmp_path / "y"), "qwen3")


def _resume_one_step(cfg):
    return train_losses(cfg)


@pytest.mark.slow  # about 30 s: a training, an import and a resumed run
@pytest.mark.parametrize("family", list(MODELS))
def test_import_tp2_then_train(family, tmp_path):
    """A HF model written by export, imported at TP 2: a 1-step run loads it (optimizer state
    included) and a second export gives back the same tensors."""
    ck = str(tmp_path / "ck")
    run_distributed(train_losses, 1, _cfg(family, ck))
    a, ck2, b = (str(tmp_path / n) for n in ("a", "ck2", "b"))
    convert.export_checkpoint(ck, a, family)
    convert.import_checkpoint(a, ck2, tp=2)
    convert.export_checkpoint(ck2, b, family)
    ta, tb = _tensors(a), _tensors(b)
    assert all(torch.equal(ta[k], tb[k]) for k in ta)
    cfg = _cfg(family, None, tensor_model_parallel_size=2).replace(
        train=dict(train_iters=1, load=ck2, save=None)
    )
    losses = run_distributed(_resume_one_step, 2, cfg)
    assert len(losses[0]) == 1 and losses[0] == losses[1]
    assert all(torch.isfinite(torch.tensor(x)).all() for x in losses[0])


def test_cli_refuses_and_requires(tmp_path, capsys):
    from megafp8.hf import main

    assert main(["export", "--load", str(tmp_path), "--out", str(tmp_path / "o")]) == 2
    assert "no 'latest'" in capsys.readouterr().err


def test_llama31_rope_scaling_exports_and_imports(tmp_path):
    """--use-rope-scaling (Llama 3.1's, factor 32 as Llama 3.2's): exported as config.json's
    rope_scaling, whose transformers logits match ours (the same 1e-4 bound as above) and differ
    from those of the same weights without the scaling by far more; imported back, the config
    holds the scaling again and a second export gives the same tensors."""
    import json

    ck, out, back, again = (str(tmp_path / n) for n in ("ck", "hf", "back", "again"))
    # init std 0.3: peaked attention, so that the rotation's frequencies show in the logits
    model = dict(MODELS["llama"], rotary_base=500000.0, use_rope_scaling=True,
                 rope_scaling_factor=32.0, seq_length=256, max_position_embeddings=256,
                 init_method_std=0.3)  # fmt: skip
    cfg = tiny_config(model=model, train=dict(train_iters=2, save=ck, global_batch_size=4))
    run_distributed(train_losses, 1, cfg)
    convert.export_checkpoint(ck, out, "llama")
    conf = json.loads(open(os.path.join(out, "config.json")).read())
    llama3 = {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
              "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}  # fmt: skip
    assert conf["rope_scaling"] == llama3
    tokens = torch.randint(0, 250, (2, 256), generator=torch.Generator().manual_seed(0))
    ours, theirs = _our_logits(ck, tokens), _hf_logits(out, tokens)
    scale = ours.abs().max().item()
    assert (ours - theirs).abs().max().item() <= 1e-4 * scale
    conf["rope_scaling"] = None
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(conf, f)
    assert (ours - _hf_logits(out, tokens)).abs().max().item() > 1e-2 * scale
    conf["rope_scaling"] = llama3
    with open(os.path.join(out, "config.json"), "w") as f:
        json.dump(conf, f)
    convert.import_checkpoint(out, back)
    got, _, _ = layout.merge_checkpoint(layout.find_checkpoint(back))
    assert got.model.use_rope_scaling and got.model.rope_scaling_factor == 32.0
    convert.export_checkpoint(back, again, "llama")
    ta, tb = _tensors(out), _tensors(again)
    assert ta.keys() == tb.keys() and all(torch.equal(ta[k], tb[k]) for k in ta)


@pytest.mark.parametrize("family", ["qwen2", "qwen3"])
def test_qwen_extras_map_to_transformers(family):
    """Every weight of a one-process Qwen2- or Qwen3-shaped model drawn at random (Qwen2's q, k,
    v biases far from the zeros they start at, Qwen3's q and k norm weights far from their ones),
    mapped by ``to_hf`` and loaded into transformers' model: the same logits (the 1e-4 bound
    above), so each bias reaches its head and each norm its heads, before RoPE."""
    from megafp8.fp8.backend import Backend
    from megafp8.hf import families
    from megafp8.model.gpt import GPTModel
    from megafp8.parallel.groups import ParallelGroups

    cfg = tiny_config(model=MODELS[family])
    ours = GPTModel(cfg, backend=Backend(), groups=ParallelGroups.single(), vocab_size=250)
    g = torch.Generator().manual_seed(1)
    with torch.no_grad():
        for p in ours.parameters():
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    full = {layout.canonical(n): p.detach() for n, p in ours.named_parameters()}
    full = {k: v for k, v in full.items() if k is not None}
    hf_cfg, tensors = families.to_hf(cfg, full, family)
    extra = "k_proj.bias" if family == "qwen2" else "k_norm.weight"
    assert sum(k.endswith(extra) for k in tensors) == cfg.model.num_layers
    assert not any(k.endswith(("o_proj.bias", "gate_proj.bias", "down_proj.bias")) for k in tensors)
    arch = getattr(transformers, ARCH[family])
    theirs = arch(getattr(transformers, family.capitalize() + "Config")(**hf_cfg))
    missing, unexpected = theirs.load_state_dict(tensors, strict=False)
    tied = not cfg.model.untie_embeddings_and_output_weights
    assert not unexpected and set(missing) <= ({"lm_head.weight"} if tied else set())
    tokens = torch.randint(0, 250, (2, 32), generator=g)
    ours.eval()
    theirs.eval()
    with torch.no_grad():
        a = ours(tokens).transpose(0, 1)[..., :250]
        b = theirs(tokens).logits
    scale = a.abs().max().item()
    assert (a - b).abs().max().item() <= 1e-4 * scale
    back = families.from_hf(cfg.model, family, tensors)  # and back, padded vocab rows aside
    assert back.keys() == full.keys()
    for k, v in back.items():
        assert torch.equal(v, full[k][: v.shape[0]]), k
    fields = families.model_config_from_hf(hf_cfg, 32)[1]
    assert fields.get("qk_layernorm", False) == (family == "qwen3")


def test_mistral_config_imports_as_llama():
    """A Mistral config.json (no sliding window, as Mistral-7B v0.2/v0.3) is Llama's model: the
    same fields as the Llama config.json of the same shape, and Mistral in transformers gives
    our logits on the tensors mapped for Llama; a sliding window is refused."""
    from megafp8.fp8.backend import Backend
    from megafp8.hf import families
    from megafp8.model.gpt import GPTModel
    from megafp8.parallel.groups import ParallelGroups

    cfg = tiny_config(model=MODELS["llama"])
    ours = GPTModel(cfg, backend=Backend(), groups=ParallelGroups.single(), vocab_size=250)
    full = {layout.canonical(n): p.detach() for n, p in ours.named_parameters()}
    llama_cfg, tensors = families.to_hf(cfg, full, "llama")
    keep = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
            "num_attention_heads", "num_key_value_heads", "max_position_embeddings",
            "rms_norm_eps", "rope_theta", "tie_word_embeddings")  # fmt: skip
    mistral = transformers.MistralConfig(sliding_window=None, **{k: llama_cfg[k] for k in keep})
    as_dict = mistral.to_dict()
    assert families.model_config_from_hf(as_dict, 32) == families.model_config_from_hf(
        llama_cfg, 32
    )
    theirs = transformers.MistralForCausalLM(mistral)
    missing, unexpected = theirs.load_state_dict(tensors, strict=False)
    assert not missing and not unexpected
    tokens = torch.randint(0, 250, (2, 32), generator=torch.Generator().manual_seed(2))
    ours.eval()
    theirs.eval()
    with torch.no_grad():
        a, b = ours(tokens).transpose(0, 1)[..., :250], theirs(tokens).logits
    assert (a - b).abs().max().item() <= 1e-4 * a.abs().max().item()
    with pytest.raises(ValueError, match="sliding_window=4096 is not supported"):
        families.model_config_from_hf(dict(as_dict, sliding_window=4096), 32)


def test_squared_relu_has_no_family():
    """No HF family here has a squared ReLU MLP: export refuses it in one line."""
    from megafp8.hf import families

    m = tiny_config(model=dict(MODELS["gpt2"], squared_relu=True)).model
    with pytest.raises(ValueError, match="gpt2 cannot represent squared_relu=True"):
        families.check_exportable(m, "gpt2")
    m = tiny_config(model=dict(MODELS["qwen3"], swiglu=False, squared_relu=True)).model
    with pytest.raises(ValueError, match="qwen3 cannot represent swiglu=False"):
        families.check_exportable(m, "qwen3")
