"""fp8/norm_residual.py on the GPU: TE's te.LayerNormLinear and te.LayerNormMLP take the block's
residual gradient into their RMSNorm backward (``rmsnorm_bwd_add``), and the gradients agree with
autograd's add. The one difference is where the sum is rounded: the norm gradient plus the
residual's in fp32, rounded once to bf16, against the norm gradient rounded first and the sum
rounded again (at most half a bf16 ulp of the norm gradient, 2^-9 of it, per element and norm)."""

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _rel(a, b):
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


def _block_grads(fold: bool, fp8: bool):
    import transformer_engine.common.recipe as ter
    import transformer_engine.pytorch as te

    from megafp8.fp8 import norm_residual as nr

    torch.manual_seed(0)
    h = 256
    kw = dict(normalization="RMSNorm", params_dtype=torch.bfloat16)
    attn = te.LayerNormLinear(h, h, bias=False, **kw)
    mlp = te.LayerNormMLP(h, 512, bias=False, activation="swiglu", **kw)
    recipe = ter.DelayedScaling(fp8_format=ter.Format.HYBRID, amax_history_len=4)
    gen = torch.Generator(device="cuda").manual_seed(1)
    outs = []
    for _ in range(3):  # FP8: the scales move between the steps
        x = torch.randn(128, 2, h, device="cuda", dtype=torch.bfloat16, generator=gen)
        x.requires_grad_(True)
        dy = torch.randn(128, 2, h, device="cuda", dtype=torch.bfloat16, generator=gen)
        with te.autocast(enabled=fp8, recipe=recipe):
            a = attn(x)
            h1 = nr.residual_add(x, a) if fold else x + a
            m = mlp(h1)
            y = nr.residual_add(h1, m) if fold else h1 + m
        y.backward(dy)
        outs.append((y.detach(), x.grad))
    grads = {n: p.grad for mod in (attn, mlp) for n, p in mod.named_parameters()}
    return outs, grads


@pytest.mark.parametrize("fp8", [False, True])
def test_te_norms_take_the_residual_gradient(fp8):
    from megafp8.fp8 import norm_residual as nr

    assert nr.install(True)
    try:
        before = nr.counts()
        mine = _block_grads(True, fp8)
        after = nr.counts()
        assert after["fused"] - before["fused"] == 6  # two norms, three backwards
        assert after["late"] == before["late"] and nr.pending() == 0
        ref = _block_grads(False, fp8)
    finally:
        nr.install(False)
    # the forward is untouched; FP8 reads scales the backward set, which may flip an E5M2 rounding
    for (y, dx), (y0, dx0) in zip(mine[0], ref[0], strict=True):
        if not fp8:
            assert torch.equal(y, y0)
        # BF16: half an ulp of each norm gradient, carried through the block below (2^-8 of
        # the gradient's norm at most); FP8: the same differences can move a value across an
        # E5M2 rounding boundary (a quarter of its size) for about 2^-8 / 2^-2 of the elements
        assert _rel(dx, dx0) < (2**-7 if not fp8 else 2**-4)
    for name, g in mine[1].items():
        assert _rel(g, ref[1][name]) < (2**-7 if not fp8 else 2**-4), name


def _train(cfg):
    from megafp8.fp8 import norm_residual as nr
    from megafp8.fp8.backend import build_backend
    from megafp8.model.gpt import GPTModel
    from megafp8.parallel.groups import ParallelGroups

    torch.cuda.set_device(0)
    groups = ParallelGroups.single()
    be = build_backend(cfg.fp8, amax_group=groups.tp_dp_group, tp_group=groups.tp_group)
    model = GPTModel(cfg, backend=be, groups=groups, vocab_size=256, device="cuda")
    folds = [blk.fold for blk in model.layers.values()]
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(0, 256, (4, cfg.model.seq_length + 1), generator=g).cuda()
    losses = []
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with be.autocast():
            loss = model(tokens[:, :-1], tokens[:, 1:], None)
        loss.backward()
        losses.append(loss.item())
    grads = {n: p.grad.float().cpu() for n, p in model.named_parameters()}
    return losses, grads, folds, nr.counts()


def _cfg(on: bool, norm="RMSNorm"):
    return tiny_config(
        model=dict(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=64,
                   swiglu=True, normalization=norm),
        train=dict(micro_batch_size=4, bf16=True),
        fp8=dict(fp8_format=None, fp8_backend="te", te_fused_mlp=True, te_norm_residual_add=on),
    )  # fmt: skip


def test_the_flag_folds_both_adds_of_every_block_and_training_agrees():
    pytest.importorskip("transformer_engine.pytorch")
    losses, grads, folds, counts = run_distributed(_train, 1, _cfg(True))[0]
    assert folds == [(True, True)] * 2
    assert counts == {"fused": 12, "late": 0}  # 2 layers x 2 norms x 3 backwards
    ref_losses, ref, ref_folds, ref_counts = run_distributed(_train, 1, _cfg(False))[0]
    assert ref_folds == [(False, False)] * 2 and ref_counts == {"fused": 0, "late": 0}
    assert losses[0] == ref_losses[0]  # the first forward is the same
    for a, b in zip(losses, ref_losses, strict=True):
        assert abs(a - b) / b < 2e-3
    for name, g in grads.items():
        assert _rel(g, ref[name]) < 2**-6, name


def test_layernorm_keeps_autograds_add():
    pytest.importorskip("transformer_engine.pytorch")
    _, _, folds, counts = run_distributed(_train, 1, _cfg(True, "LayerNorm"))[0]
    assert folds == [(False, False)] * 2 and counts == {"fused": 0, "late": 0}
