"""The te backend under tensor parallelism (our collectives around TE GEMMs), on one GPU: two
processes share the device and talk over gloo (NCCL refuses two ranks on one GPU). Correctness only;
the timing of TP needs one GPU per rank."""

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


def _loss_and_grads(cfg, tp):
    from megafp8.fp8.backend import build_backend
    from megafp8.model.gpt import GPTModel
    from megafp8.parallel.groups import ParallelGroups

    torch.cuda.set_device(0)
    groups = (
        ParallelGroups.build(tp=tp, kv_heads=cfg.model.kv_heads)
        if tp > 1
        else ParallelGroups.single()
    )
    be = build_backend(cfg.fp8, amax_group=groups.tp_dp_group, tp_group=groups.tp_group)
    model = GPTModel(cfg, backend=be, groups=groups, vocab_size=256, device="cuda")
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(
        0, 256, (cfg.train.micro_batch_size, cfg.model.seq_length + 1), generator=g
    ).cuda()
    for _ in range(3):  # delayed scaling: later steps use scales from the amax history
        model.zero_grad(set_to_none=True)
        with be.autocast():
            loss = model(tokens[:, :-1], tokens[:, 1:], None)
        loss.backward()
    out = {}
    for name, p in model.named_parameters():
        out[getattr(p, "full_name", name)] = (
            p.grad.float().cpu(),
            getattr(p, "full_index", None),
            getattr(p, "partition_dim", 0),
        )
    return loss.item(), out


def _cfg(fp8, fused_mlp=False, swiglu=False, bf16=True):
    return tiny_config(
        model=dict(
            num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=64, swiglu=swiglu
        ),
        train=dict(micro_batch_size=4, bf16=bf16),
        fp8=dict(fp8_format=fp8, fp8_backend="te", fp8_amax_history_len=4, te_fused_mlp=fused_mlp),
    )


@pytest.mark.parametrize("swiglu", [False, True])
def test_fused_mlp_equals_unfused(swiglu):
    """te.LayerNormMLP holds the same weights as norm + fc1 + act + fc2 (bf16, no FP8)."""
    pytest.importorskip("transformer_engine.pytorch")
    ref_loss, ref = run_distributed(_loss_and_grads, 1, _cfg(None, False, swiglu), 1)[0]
    loss, grads = run_distributed(_loss_and_grads, 1, _cfg(None, True, swiglu), 1)[0]
    assert set(grads) == set(ref)  # one-process names: checkpoints move between the two
    assert abs(loss - ref_loss) / ref_loss < 2e-3
    for name in (
        "layers.0.mlp.fc1.linear.weight",
        "layers.1.mlp.fc2.linear.weight",
        "embedding.weight",
    ):
        assert _rel(grads[name][0], ref[name][0]) < 0.02, name


# Known gap, measured on one H200 (2026-12-02): with FP8 the loss agrees with one process to 1e-4
# and every forward scale is identical on both ranks and in one process (the TP amax reduction
# works), but the E5M2 gradient scales drift 0.5-2 % from one process's after the first
# iteration, and the weight gradients differ by up to 13 % (layer 0's qkv), FP8 noise level, even
# in fp32. Cause not found yet; the torch backend's TP is proven equal on the CPU
# (tests/parallel/test_tp.py). Strict: the test fails once the gap is closed, so it is noticed.
_TE_TP_FP8_GAP = pytest.mark.xfail(
    strict=True, reason="te backend, TP 2, FP8: gradients differ from one process (see above)"
)


@pytest.mark.parametrize(
    "fp8,fused_mlp",
    [
        (None, False),
        pytest.param("hybrid", False, marks=_TE_TP_FP8_GAP),
        pytest.param("hybrid", True, marks=_TE_TP_FP8_GAP),
    ],
)
def test_te_backend_tp2_matches_one_process(fp8, fused_mlp):
    """bf16 without FP8: the TP partial sums are rounded to bf16 before their reduction (2e-2).
    FP8 runs in fp32 parameters and activations (TE's FP8 GEMMs with fp32 outputs), where the
    shards quantize with the TP-reduced amaxes and only fp32 summation order should be left."""
    pytest.importorskip("transformer_engine.pytorch")
    cfg = _cfg(fp8, fused_mlp, bf16=fp8 is None)
    ref_loss, ref = run_distributed(_loss_and_grads, 1, cfg, 1)[0]
    tp_cfg = cfg.replace(parallel=dict(tensor_model_parallel_size=2))
    tol = 2e-2 if fp8 is None else 1e-2
    for loss, grads in run_distributed(_loss_and_grads, 2, tp_cfg, 2):
        assert abs(loss - ref_loss) / ref_loss < (2e-3 if fp8 is None else 1e-4)
        errs = {}
        for name, (g, idx, dim) in grads.items():
            full = ref[name][0]
            if idx is not None:
                full = full.index_select(dim, idx)
            errs[name] = _rel(g, full)
        assert max(errs.values()) < tol, errs
