"""Megatron-LM checkpoints into megafp8 (``megafp8-hf from-megatron``). The fixtures were written
by Megatron Core's own GPTModel and checkpoint code (``tests/fixtures/megatron/make.py``), with
the logits it computed: a GPT-2 style model and one with a squared ReLU MLP saved as torch_dist,
a Llama style one (GQA, SwiGLU, RoPE, untied) and a Qwen3 style one (the same with
--qk-layernorm) saved in the torch format. megafp8's model, filled from each checkpoint,
must give Megatron Core's logits; the imported checkpoint trains at TP 2."""

from __future__ import annotations

import os
import shutil

import pytest
import torch

from megafp8.hf import layout, megatron
from tests.helpers.dist import run_distributed
from tests.helpers.tiny import train_losses

FIX = os.path.join(os.path.dirname(__file__), "..", "fixtures", "megatron")
REF = torch.load(os.path.join(FIX, "reference.pt"), weights_only=True)


def _ours(name: str):
    from megafp8.config_values import padded_vocab_size
    from megafp8.fp8.backend import Backend
    from megafp8.model.gpt import GPTModel
    from megafp8.parallel.groups import ParallelGroups

    cfg, full, src = megatron.import_config(os.path.join(FIX, name))
    m = cfg.model
    megatron.pad_vocab(full, padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, 1))
    model = GPTModel(cfg, backend=Backend(), groups=ParallelGroups.single(), vocab_size=64)
    names = {layout.canonical(n): p for n, p in model.named_parameters()}
    assert set(names) == set(full), set(names) ^ set(full)
    with torch.no_grad():
        for k, p in names.items():
            p.copy_(full[k])
    return cfg, model.eval(), src


@pytest.mark.parametrize("name", ["gpt_dist", "llama_torch", "qwen3_torch", "srelu_dist"])
def test_logits_equal_megatron_core(name):
    """Every tensor lands where Megatron Core had it: the logits equal its own on the same
    tokens (fp32 on both sides; the bound is rounding of sums taken in another order). The
    fixtures' 1-D weights (norms, q and k norms) were moved away from their init."""
    cfg, model, src = _ours(name)
    assert src.format == ("torch_dist" if name.endswith("_dist") else "torch")
    iteration = {"gpt_dist": 3, "llama_torch": 2, "qwen3_torch": 1, "srelu_dist": 4}
    assert src.iteration == iteration[name]
    assert cfg.model.qk_layernorm == (name == "qwen3_torch")
    assert cfg.model.squared_relu == (name == "srelu_dist")
    ref = REF[name]
    with torch.no_grad():
        ours = model(ref["tokens"]).transpose(0, 1)  # [b, s, V]
    theirs = ref["logits"]
    assert ours.shape == theirs.shape
    scale = theirs.abs().max().item()
    assert (ours - theirs).abs().max().item() <= 1e-5 * scale, (ours - theirs).abs().max()


def test_model_fields_from_args():
    """The shape comes from the saved args: the Llama fixture is read as GQA, SwiGLU, RoPE."""
    cfg, _, _ = megatron.import_config(os.path.join(FIX, "llama_torch"))
    m = cfg.model
    assert (m.num_layers, m.hidden_size, m.num_attention_heads, m.kv_heads) == (2, 32, 8, 2)
    assert (m.ffn, m.swiglu, m.normalization) == (48, True, "RMSNorm")
    assert (m.position_embedding_type, m.rotary_base) == ("rope", 500000.0)
    assert m.untie_embeddings_and_output_weights and not m.add_bias_linear
    assert (m.vocab_size, m.seq_length) == (64, 16)
    g = megatron.import_config(os.path.join(FIX, "gpt_dist"))[0].model
    assert g.add_bias_linear and not g.add_qkv_bias  # the default model, as a run names it
    assert (g.position_embedding_type, g.normalization, g.swiglu) == (
        "learned_absolute",
        "LayerNorm",
        False,
    )


def test_refusals(tmp_path):
    """Unknown layouts and shapes megafp8 cannot build: one line naming the value."""
    with pytest.raises(ValueError, match="no latest_checkpointed_iteration.txt"):
        megatron.find_iteration(str(tmp_path))
    with pytest.raises(ValueError, match="iter_0000009: no such checkpoint directory"):
        megatron.find_iteration(os.path.join(FIX, "gpt_dist"), 9)
    two = tmp_path / "two" / "iter_0000001"
    for r in ("mp_rank_00", "mp_rank_01"):
        (two / r).mkdir(parents=True)
    with pytest.raises(ValueError, match="2 model-parallel ranks .* --ckpt-convert-format"):
        megatron.checkpoint_format(str(two))
    args = megatron.read(os.path.join(FIX, "llama_torch"))[3]
    args.num_experts = 8
    with pytest.raises(ValueError, match="args.num_experts=8 is not supported"):
        megatron.model_fields(args)
    args.num_experts, args.kv_channels = None, 16
    with pytest.raises(ValueError, match="args.kv_channels=16 is not supported"):
        megatron.model_fields(args)
    args.kv_channels, args.qk_l2_norm = None, True
    with pytest.raises(ValueError, match="args.qk_l2_norm=True is not supported"):
        megatron.model_fields(args)
    with pytest.raises(ValueError, match="has no place in megafp8's model"):
        megatron.canonical_tensors({"decoder.layers.0.mlp.router.weight": torch.ones(2)}, 2, 1, "")


def _cfg(ck, **parallel):
    from megafp8.config import Config

    cfg = Config.from_dict(layout.read_meta(layout.find_checkpoint(ck))[0].to_dict())
    return cfg.replace(
        data=dict(mock_data=True),
        parallel=parallel,
        train=dict(micro_batch_size=2, global_batch_size=4, train_iters=1, load=ck, seed=3),
        optim=dict(lr=1e-4, min_lr=1e-5, lr_warmup_iters=0, zero_stage=1),
        logging=dict(log_interval=1, log_memory=False),
    )


@pytest.mark.slow  # about 20 s: an import through DeepSpeed, and a 1-step run at TP 2
def test_cli_import_then_train_tp2(tmp_path, capsys):
    """``megafp8-hf from-megatron`` at TP 2 writes a checkpoint that merges back to the Megatron
    tensors and that a TP 2 run loads and trains; it prints the flags of the model."""
    from megafp8.hf import main

    src = tmp_path / "mg"
    shutil.copytree(os.path.join(FIX, "llama_torch"), src)
    ck = str(tmp_path / "ck")
    assert main(["from-megatron", "--load", str(src), "--save", ck,
                 "--tensor-model-parallel-size", "2"]) == 0  # fmt: skip
    out = capsys.readouterr().out
    assert "(torch, iteration 2)" in out and "--num-query-groups 2" in out and "--swiglu" in out
    _, _, merged = layout.merge_checkpoint(layout.find_checkpoint(ck))
    _, full, _ = megatron.import_config(str(src))
    megatron.pad_vocab(full, 64)
    assert set(merged) == set(full)
    assert all(torch.equal(merged[k], full[k].to(merged[k].dtype)) for k in full)
    losses = run_distributed(train_losses, 2, _cfg(ck, tensor_model_parallel_size=2))
    assert losses[0] == losses[1] and torch.isfinite(torch.tensor(losses[0])).all()
