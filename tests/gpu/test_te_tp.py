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


def _loss_and_grads(cfg, tp, bump=False):
    """Three iterations; the last one's loss and gradients, and after every iteration the FP8
    scales (forward and backward) of every TE module. ``bump``: every parameter moved up by one
    ulp first (one process's own sensitivity to rounding)."""
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
    if bump:
        with torch.no_grad():
            for p in model.parameters():
                p.copy_(torch.nextafter(p, torch.full_like(p, float("inf"))))
    g = torch.Generator().manual_seed(5)
    tokens = torch.randint(
        0, 256, (cfg.train.micro_batch_size, cfg.model.seq_length + 1), generator=g
    ).cuda()
    scales = []
    for _ in range(3):  # delayed scaling: later steps use scales from the amax history
        model.zero_grad(set_to_none=True)
        with be.autocast():
            loss = model(tokens[:, :-1], tokens[:, 1:], None)
        loss.backward()
        scales.append(_te_scales(model, ("scaling_fwd", "scaling_bwd")))
    out = {}
    for name, p in model.named_parameters():
        out[getattr(p, "full_name", name)] = (
            p.grad.float().cpu(),
            getattr(p, "full_index", None),
            getattr(p, "partition_dim", 0),
        )
    return loss.item(), out, scales


def _te_scales(model, keys):
    """``{"module/key": scale}`` of every TE module's FP8 scaling state ``keys``, on the host."""
    return {
        f"{name}/{key}": mod.fp8_meta[key].scale.float().cpu()
        for name, mod in model.named_modules()
        if "scaling_fwd" in (getattr(mod, "fp8_meta", None) or {})
        for key in keys
    }


def _errors(grads, ref):
    """Relative error of each gradient (this rank's shard) against one process's."""
    errs = {}
    for name, (g, idx, dim) in grads.items():
        full = ref[name][0]
        if idx is not None:
            full = full.index_select(dim, idx)
        errs[name] = _rel(g, full)
    return errs


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
    ref_loss, ref, _ = run_distributed(_loss_and_grads, 1, _cfg(None, False, swiglu), 1)[0]
    loss, grads, _ = run_distributed(_loss_and_grads, 1, _cfg(None, True, swiglu), 1)[0]
    assert set(grads) == set(ref)  # one-process names: checkpoints move between the two
    assert abs(loss - ref_loss) / ref_loss < 2e-3
    for name in (
        "layers.0.mlp.fc1.linear.weight",
        "layers.1.mlp.fc2.linear.weight",
        "embedding.weight",
    ):
        assert _rel(grads[name][0], ref[name][0]) < 0.02, name


@pytest.mark.parametrize("fused_mlp", [False, True])
def test_te_backend_tp2_bf16_matches_one_process(fused_mlp):
    """bf16 without FP8: the TP partial sums are rounded to bf16 before their reduction (2e-2)."""
    pytest.importorskip("transformer_engine.pytorch")
    cfg = _cfg(None, fused_mlp, bf16=True)
    ref_loss, ref, _ = run_distributed(_loss_and_grads, 1, cfg, 1)[0]
    tp_cfg = cfg.replace(parallel=dict(tensor_model_parallel_size=2))
    for loss, grads, _ in run_distributed(_loss_and_grads, 2, tp_cfg, 2):
        assert abs(loss - ref_loss) / ref_loss < 2e-3
        errs = _errors(grads, ref)
        assert max(errs.values()) < 2e-2, errs


@pytest.mark.parametrize("fused_mlp", [False, True])
def test_te_backend_tp2_fp8_matches_one_process(fused_mlp):
    """FP8 (delayed, HYBRID) in fp32 parameters and activations, TP 2 against one process.

    1. Every FP8 scale, forward and backward, after every iteration, is bit-identical on the two
       TP ranks: TE's amax reductions (forward at the autocast's exit, backward at the end of the
       first FP8 module's backward) run once per iteration over the TP group on both ranks.
    2. The gradients are as close to one process's as one process's own are to a run whose
       parameters all moved by one ulp. The TP layout only changes the order of fp32 sums (the
       shards' GEMMs, the reductions); in this tiny model the first iteration quantizes with
       scale 1, E5M2 gradients sit near its subnormal range, and any change of order flips
       roundings there: measured on one H200, one ulp moves layer 0's QKV weight gradient by
       12-13 % and TP by 10-13 % (the same flips move the backward scales by 0.5-2 %). A wrong
       shard would be far outside that floor; a missing reduction would break (1).
    """
    pytest.importorskip("transformer_engine.pytorch")
    cfg = _cfg("hybrid", fused_mlp, bf16=False)
    ref_loss, ref, ref_scales = run_distributed(_loss_and_grads, 1, cfg, 1)[0]
    _, bumped, _ = run_distributed(_loss_and_grads, 1, cfg, 1, True)[0]
    floor = _errors(bumped, ref)
    tp_cfg = cfg.replace(parallel=dict(tensor_model_parallel_size=2))
    (loss0, grads0, scales0), (loss1, grads1, scales1) = run_distributed(
        _loss_and_grads, 2, tp_cfg, 2
    )
    assert [sorted(s) for s in scales0] == [sorted(s) for s in ref_scales]  # same FP8 modules
    for it, (a, b) in enumerate(zip(scales0, scales1, strict=True)):
        for key in a:
            assert torch.equal(a[key], b[key]), (it, key, a[key], b[key])
    for loss, grads in ((loss0, grads0), (loss1, grads1)):
        assert abs(loss - ref_loss) / ref_loss < 1e-4
        errs = _errors(grads, ref)
        mean = sum(errs.values()) / len(errs)
        assert max(errs.values()) < 2 * max(floor.values()), (errs, floor)
        assert mean < 2 * sum(floor.values()) / len(floor), (errs, floor)


def _forward_scales_alone(cfg, seed=None):
    """Under pipeline parallelism alone (TP 1 x DP 1) each rank's amax group is itself: three FP8
    iterations on this rank's own tokens (``seed``, default the rank), then every TE module's
    forward scales."""
    from megafp8.fp8.backend import build_backend
    from megafp8.model.gpt import GPTModel
    from megafp8.parallel.groups import ParallelGroups

    torch.cuda.set_device(0)
    world = torch.distributed.get_world_size()
    seed = torch.distributed.get_rank() if seed is None else seed
    amax_group = ParallelGroups.build(tp=1, pp=world).tp_dp_group  # one rank: this one
    be = build_backend(cfg.fp8, amax_group=amax_group, tp_group=ParallelGroups.single().tp_group)
    model = GPTModel(cfg, backend=be, groups=ParallelGroups.single(), vocab_size=256, device="cuda")
    g = torch.Generator().manual_seed(seed)
    b, s = cfg.train.micro_batch_size, cfg.model.seq_length
    # the ranks' inputs differ in scale too, so their activation amaxes cannot coincide
    tokens = torch.randint(0, 256 >> seed, (b, s + 1), generator=g).cuda()
    for _ in range(3):
        model.zero_grad(set_to_none=True)
        with be.autocast():
            loss = model(tokens[:, :-1], tokens[:, 1:], None)
        loss.backward()
    return _te_scales(model, ("scaling_fwd",))


def test_te_amax_group_of_one_rank_keeps_its_own_scales():
    """Two processes whose amax groups are each one rank (as pipeline stages at TP 1 x DP 1 are)
    keep the forward scales each has alone, bit for bit. TE reads an amax group of None as the
    whole world: with its reduction left on, the two would share the larger amaxes."""
    pytest.importorskip("transformer_engine.pytorch")
    cfg = _cfg("hybrid", fused_mlp=True, bf16=False)
    alone = [run_distributed(_forward_scales_alone, 1, cfg, seed)[0] for seed in (0, 1)]
    both = run_distributed(_forward_scales_alone, 2, cfg)
    assert any(not torch.equal(alone[0][k], alone[1][k]) for k in alone[0])  # a real difference
    for rank, scales in enumerate(both):
        assert sorted(scales) == sorted(alone[rank])
        for key, v in scales.items():
            assert torch.equal(v, alone[rank][key]), (rank, key, v, alone[rank][key])


@pytest.mark.parametrize("option,fused_mlp", [("qk_layernorm", False), ("squared_relu", True)])
def test_qk_layernorm_and_squared_relu_on_the_te_backend(option, fused_mlp):
    """``--qk-layernorm`` (RoPE, grouped queries) and ``--squared-relu`` on the te backend, bf16
    without FP8 (the norms before TE's RoPE in place of the fused QKV-split kernel; TE's srelu in
    the fused MLP): the same loss and gradients as the plain PyTorch backend's model built from
    the same seeds, and at TP 2 (the q/k norm weights replicated, their gradients summed over TP)
    the same as one process, to bf16 rounding (2e-2, as the TP test above)."""
    pytest.importorskip("transformer_engine.pytorch")
    model = dict(num_layers=2, hidden_size=128, num_attention_heads=4, seq_length=64)
    model[option] = True
    if option == "qk_layernorm":
        model.update(position_embedding_type="rope", num_query_groups=2, normalization="RMSNorm")
    cfg = tiny_config(
        model=model,
        train=dict(micro_batch_size=4, bf16=True),
        fp8=dict(fp8_format=None, fp8_backend="te", te_fused_mlp=fused_mlp),
    )
    plain_loss, plain, _ = run_distributed(
        _loss_and_grads, 1, cfg.replace(fp8=dict(fp8_backend="torch")), 1
    )[0]
    loss, grads, _ = run_distributed(_loss_and_grads, 1, cfg, 1)[0]
    # the te backend's norms sit inside TE's norm + GEMM modules (other names); the rest match
    shared = {n: grads[n] for n in grads.keys() & plain.keys()}
    assert sum("linear.weight" in n for n in shared) >= 4 * 2  # qkv, proj, fc1, fc2 per layer
    if option == "qk_layernorm":
        assert sum("q_norm" in n or "k_norm" in n for n in shared) == 2 * 2
    assert abs(loss - plain_loss) / plain_loss < 2e-3
    errs = _errors(shared, plain)
    assert max(errs.values()) < 2e-2, errs
    tp_cfg = cfg.replace(parallel=dict(tensor_model_parallel_size=2))
    for tp_loss, tp_grads, _ in run_distributed(_loss_and_grads, 2, tp_cfg, 2):
        assert abs(tp_loss - loss) / loss < 2e-3
        errs = _errors(tp_grads, grads)
        assert max(errs.values()) < 2e-2, errs
