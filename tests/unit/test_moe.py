"""Mixture of experts (``model/moe.py``): the router, the losses and the capacity against hand
computations; the layer against a per-token loop; training in one process, over DP (ZeRO 1 and
2) and PP against one process, in fp32 and FP8."""

import math

import pytest
import torch

from megafp8.model.moe import (
    MoELayer,
    aux_loss,
    capacity_keep,
    moe_metrics,
    route,
    seq_aux_loss,
    update_expert_bias,
    z_loss,
)
from megafp8.parallel.mappings import SOLO
from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config

LOGITS = torch.tensor([[2.0, 1.0, 0.0, -1.0], [0.0, 3.0, 1.0, 0.5], [1.0, 0.9, 2.0, 0.0]])


def test_route_softmax_topk_then_softmax():
    probs, idx, full = route(LOGITS, 2, "softmax", pre_softmax=False)
    assert idx.tolist() == [[0, 1], [1, 2], [2, 0]]
    e = math.exp
    assert probs[0].tolist() == pytest.approx([e(2) / (e(2) + e(1)), e(1) / (e(2) + e(1))])
    assert full[1].tolist() == pytest.approx(torch.softmax(LOGITS[1], 0).tolist())


def test_route_pre_softmax_and_sigmoid():
    probs, idx, _ = route(LOGITS, 2, "softmax", pre_softmax=True)
    sm = torch.softmax(LOGITS, -1)
    assert torch.equal(probs, sm.gather(1, idx))  # not renormalized
    probs, idx, full = route(LOGITS, 2, "sigmoid", pre_softmax=False)
    sg = torch.sigmoid(LOGITS)
    want = sg.gather(1, idx) / sg.gather(1, idx).sum(-1, keepdim=True)
    assert torch.allclose(probs, want) and torch.allclose(full.sum(-1), torch.ones(3))


def test_aux_and_z_loss_by_hand():
    _, idx, full = route(LOGITS, 2, "softmax", False)
    counts = torch.bincount(idx.reshape(-1), minlength=4)
    t, e, k, coeff = 3, 4, 2, 0.01
    want = sum(coeff * e / (t * t * k) * full[:, j].sum() * counts[j] for j in range(e))
    assert float(aux_loss(full, counts, k, coeff)) == pytest.approx(float(want))
    lse = [math.log(sum(math.exp(v) for v in row)) for row in LOGITS.tolist()]
    assert float(z_loss(LOGITS, 0.1)) == pytest.approx(0.1 * sum(x * x for x in lse) / 3)


def test_capacity_drops_by_probability_or_position():
    idx = torch.tensor([[0, 1], [0, 1], [0, 2]])  # expert 0 gets 3 assignments
    probs = torch.tensor([[0.6, 0.4], [0.9, 0.1], [0.7, 0.3]])
    keep = capacity_keep(probs, idx, 3, cap=2, policy="probs")
    assert keep.tolist() == [[False, True], [True, True], [True, True]]  # 0.6 is lowest for e0
    keep = capacity_keep(probs, idx, 3, cap=2, policy="position")
    assert keep.tolist() == [[True, True], [True, True], [False, True]]  # the latest token


def _cfg(**model):
    base = dict(num_layers=2, num_experts=4, moe_router_topk=2, moe_ffn_hidden_size=32,
                swiglu=True, moe_aux_loss_coeff=1e-2, moe_z_loss_coeff=1e-3)  # fmt: skip
    return tiny_config(model={**base, **model})


def _layer(cfg, fp8=False):
    from megafp8.fp8.backend import build_backend
    from megafp8.parallel.mappings import SOLO

    cfg = cfg.replace(fp8=dict(fp8_format="hybrid")) if fp8 else cfg
    be = build_backend(cfg.fp8, amax_group=SOLO, tp_group=SOLO)
    return MoELayer(cfg, backend=be, layer=0, seed=3, fp8=fp8, dtype=torch.float32, device=None)


@pytest.mark.parametrize("capacity", [None, 0.5])
def test_layer_equals_a_per_token_loop(capacity):
    cfg = _cfg(moe_expert_capacity_factor=capacity, moe_shared_expert_intermediate_size=16)
    layer = _layer(cfg)
    x = torch.randn(8, 2, 64, generator=torch.Generator().manual_seed(0))  # [s, b, h]
    with torch.no_grad():
        got = layer(x).reshape(-1, 64)
        xt = x.reshape(-1, 64)
        probs, idx, _ = route(xt @ layer.router.t(), 2, "softmax", False)
        keep = torch.ones_like(idx, dtype=torch.bool)
        if capacity:
            keep = capacity_keep(probs, idx, 4, math.ceil(capacity * 16 * 2 / 4), "probs")
            assert (~keep).sum() > 0  # some assignments dropped
        for t in range(16):
            want = layer.shared(xt[t : t + 1])[0]
            for j in range(2):
                if keep[t, j]:
                    want = want + probs[t, j] * layer.experts[int(idx[t, j])](xt[t : t + 1])[0]
            torch.testing.assert_close(got[t], want, rtol=1e-5, atol=1e-6)
    assert layer.stats["dropped"] == (~keep).sum()


def test_aux_losses_train_the_router_with_the_loss_scale():
    """The router's gradient gains exactly scale x d(aux + z)/d(router); the output is unchanged."""
    x = torch.randn(8, 2, 64, generator=torch.Generator().manual_seed(1))
    g = torch.randn(8, 2, 64, generator=torch.Generator().manual_seed(2))
    grads = {}
    for scale in (0.0, 0.25):
        layer = _layer(_cfg())
        layer.aux_scale = scale
        (layer(x) * g).sum().backward()
        grads[scale] = layer.router.grad.clone()
    ran, layer = layer, _layer(_cfg())
    logits = x.reshape(-1, 64) @ layer.router.t()
    _, idx, full = route(logits, 2, "softmax", False)
    counts = torch.bincount(idx.reshape(-1), minlength=4)
    extra = aux_loss(full, counts, 2, 1e-2) + z_loss(logits, 1e-3)
    (d,) = torch.autograd.grad(extra, layer.router)
    # the difference of two fp32 gradients: exact but for their own rounding, a few ulps of the
    # larger of them (each is a sum of the lm and the aux contributions)
    ulps = 4 * 2.0**-23 * float(grads[0.25].abs().max())
    torch.testing.assert_close(grads[0.25] - grads[0.0], 0.25 * d, rtol=1e-4, atol=ulps)
    m = moe_metrics(torch.nn.ModuleDict({"mlp": ran}))
    assert m["moe/load_balancing_loss"] > 0 and m["moe/mlp/load_imbalance"] >= 1.0


def test_fp8_experts_get_row_counts_padded_to_16():
    layer = _layer(_cfg(), fp8=True)
    rows = []
    for ex in layer.experts:
        ex.fc1.register_forward_hook(lambda mod, inp, out: rows.append(inp[0].shape[0]))
    layer(torch.randn(8, 2, 64))
    assert rows and all(r % 16 == 0 for r in rows)


def _losses(cfg):
    from tests.helpers.tiny import train_losses

    return train_losses(cfg)


def test_moe_trains_and_dp_pp_equal_one_process():
    """5 steps, top-2 of 4 experts with aux and z losses: one process learns; DP 2 (ZeRO 1 and 2)
    and PP 2 give its losses (fp32: DP averaging reorders sums, ~1e-6 after Adam, as
    test_tp_dp_zero.py). PP runs the same ops, so its first loss is the same bits; but the
    gradient norm is summed per stage and then over the stages, another order, so with clipping
    active the clip factor can differ in its last bit: the same 2e-5 after that."""
    cfg = _cfg(num_layers=2)
    ref = run_distributed(_losses, 1, cfg)[0]
    assert len(ref) == 5 and ref[-1] < ref[0]
    for zero in (1, 2):
        got = run_distributed(_losses, 2, cfg.replace(optim=dict(zero_stage=zero)))[0]
        assert got == pytest.approx(ref, rel=2e-5), zero
    got = run_distributed(_losses, 2, cfg.replace(parallel=dict(pipeline_model_parallel_size=2)))
    assert got[0][0] == ref[0] and got[0] == pytest.approx(ref, rel=2e-5)


def test_moe_fp8_trains():
    cfg = _cfg().replace(fp8=dict(fp8_format="hybrid", fp8_amax_history_len=4))
    losses = run_distributed(_losses, 1, cfg)[0]
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def test_moe_flags_and_bad_values():
    from megafp8.cli import parse_args
    from megafp8.validate import validate

    cfg = parse_args(["--mock-data", "--num-experts", "8", "--moe-router-topk", "2",
                      "--moe-grouped-gemm", "--moe-token-dispatcher-type", "alltoall"])  # fmt: skip
    validate(cfg, 1)
    for argv, says in (
        (["--num-experts", "4", "--moe-router-topk", "5"], "moe_router_topk=5"),
        (["--num-experts", "4", "--expert-model-parallel-size", "3"], "not divisible"),
        (["--num-experts", "4", "--moe-pad-expert-input-to-capacity"], "needs moe_expert_cap"),
        (["--num-experts", "4", "--moe-router-bias-update-rate", "-1"], "bias_update_rate=-1"),
    ):
        with pytest.raises(ValueError, match=says):
            validate(parse_args(["--mock-data", *argv]), 3 if "expert" in argv[2] else 1)


def test_moe_flops_count_active_experts():
    from megafp8.metrics import flops_per_iteration

    dense = _cfg(num_experts=None).model
    moe = _cfg(moe_ffn_hidden_size=dense.ffn // 2).model  # k=2 experts of half width
    assert flops_per_iteration(moe, 8, 256) == pytest.approx(flops_per_iteration(dense, 8, 256))


def _tags(cfg):
    import glob

    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    _losses(cfg)
    acc = EventAccumulator(glob.glob(cfg.logging.tensorboard_dir + "/events*")[0])
    acc.Reload()
    return [t for t in acc.Tags()["scalars"] if t.startswith("moe/")]


def test_router_metrics_reach_tensorboard(tmp_path):
    cfg = _cfg(moe_layer_freq=2).replace(
        train=dict(train_iters=2), logging=dict(tensorboard_dir=str(tmp_path / "tb"))
    )
    tags = set(run_distributed(_tags, 1, cfg)[0])
    assert tags == {  # layer 0 is MoE, layer 1 dense (freq 2)
        "moe/layers.0.mlp/load_imbalance",
        "moe/layers.0.mlp/dropped",
        "moe/layers.0.mlp/load_balancing_loss",
        "moe/layers.0.mlp/z_loss",
        "moe/load_balancing_loss",
        "moe/z_loss",
    }


def test_an_expert_without_tokens_still_gets_a_zero_gradient():
    layer = _layer(_cfg(num_experts=8, moe_router_topk=1))
    x = torch.randn(2, 1, 64, generator=torch.Generator().manual_seed(4))  # 2 tokens, 8 experts
    layer(x).sum().backward()
    idle = [e for e in range(8) if e not in layer.stats["tokens_per_expert"].nonzero()]
    assert idle  # at least 6 experts saw no token
    for e in idle:
        for p in layer.experts[e].parameters():
            assert p.grad is not None and not p.grad.any()


def test_bf16_layer_routes_in_fp32():
    """Under --bf16 DeepSpeed holds the router's weight in bf16; the routing GEMM, the softmax
    and the losses still run in fp32."""
    layer = _layer(_cfg()).to(torch.bfloat16)
    seen = []
    layer.register_forward_hook(lambda m, i, o: seen.append(m.stats["z_loss"].dtype))
    out = layer(torch.randn(8, 2, 64).to(torch.bfloat16))
    assert out.dtype == torch.bfloat16 and seen == [torch.float32]


def test_seq_aux_loss_by_hand():
    """Per sequence: coeff x E / (S^2 k) x sum_e (its scores' sum) x (its assignments), then the
    mean over the b sequences; one sequence is the plain aux loss."""
    g = torch.Generator().manual_seed(3)
    s, b, e, k, coeff = 5, 3, 4, 2, 0.01
    logits = torch.randn(s * b, e, generator=g)  # tokens [s, b] flattened sequence-first
    _, idx, full = route(logits, k, "softmax", False)
    want = 0.0
    for j in range(b):
        rows = [t * b + j for t in range(s)]
        c = torch.bincount(idx[rows].reshape(-1), minlength=e)
        want += float(aux_loss(full[rows], c, k, coeff)) / b
    assert float(seq_aux_loss(full, idx, b, k, coeff)) == pytest.approx(want)
    one = torch.bincount(idx.reshape(-1), minlength=e)
    assert float(seq_aux_loss(full, idx, 1, k, coeff)) == pytest.approx(
        float(aux_loss(full, one, k, coeff))
    )


def test_expert_bias_moves_the_choice_not_the_weights():
    """The bias changes which experts are chosen, not their probabilities; one update moves
    it by rate x sign(mean load - load)."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 5.0, 0.0])
    probs, idx, _ = route(logits, 2, "sigmoid", False, bias)
    assert sorted(idx[0].tolist()) == [0, 2]
    sg = torch.sigmoid(logits[0, [0, 2]]) if idx[0, 0] == 0 else torch.sigmoid(logits[0, [2, 0]])
    assert torch.allclose(probs[0], sg / sg.sum())
    layer = _layer(_cfg(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid"))
    layer(torch.randn(8, 2, 64)).sum().backward()
    counts = layer.bias_counts.clone()
    assert counts.sum() == 8 * 2 * 2
    update_expert_bias(layer, SOLO, 1e-3)
    assert torch.equal(layer.expert_bias, 1e-3 * torch.sign(counts.mean() - counts))
    assert not layer.bias_counts.any() and "expert_bias" in layer.state_dict()


def test_expert_bias_and_seq_aux_train_and_dp_equals_one_process():
    cfg = _cfg(moe_router_enable_expert_bias=True, moe_router_score_function="sigmoid",
               moe_router_bias_update_rate=1e-2,
               moe_router_load_balancing_type="seq_aux_loss")  # fmt: skip
    ref = run_distributed(_losses, 1, cfg)[0]
    assert ref[-1] < ref[0]
    got = run_distributed(_losses, 2, cfg.replace(parallel=dict(expert_model_parallel_size=2)))
    assert got[0] == pytest.approx(ref, rel=2e-5)


class _GroupedLinear(torch.nn.Module):
    """A reference grouped GEMM for the CPU: one F.linear per split."""

    def __init__(self, num, n_in, n_out, bias, *, fp8, dtype, device):
        super().__init__()
        self.weights = torch.nn.ParameterList(
            torch.nn.Parameter(torch.empty(n_out, n_in, dtype=dtype)) for _ in range(num)
        )
        self.biases = torch.nn.ParameterList(
            torch.nn.Parameter(torch.empty(n_out, dtype=dtype)) for _ in range(num if bias else 0)
        )
        self.splits = []

    def forward(self, x, m_splits):
        self.splits.append(list(m_splits))
        bs = list(self.biases) or [None] * len(self.weights)
        parts = zip(x.split(m_splits), self.weights, bs, strict=True)
        return torch.cat([torch.nn.functional.linear(p, w, b) for p, w, b in parts])


@pytest.mark.parametrize("capacity, pad", [(None, False), (0.5, True)])
def test_grouped_experts_equal_the_loop(capacity, pad):
    """--moe-grouped-gemm on a backend with grouped GEMMs: the same weights (seeds, names), the
    same outputs and gradients as the loop; each split padded (capacity, FP8's 16, an expert
    without tokens) as the loop pads."""
    from megafp8.fp8.backend import Backend

    class Grouped(Backend):
        grouped_gemm = True

        def make_grouped_linear(self, *a, **kw):
            return _GroupedLinear(*a, **kw)

    cfg = _cfg(num_experts=8, moe_router_topk=1, moe_expert_capacity_factor=capacity,
               moe_pad_expert_input_to_capacity=pad)  # fmt: skip
    loop = _layer(cfg)
    kw = dict(layer=0, seed=3, fp8=False, dtype=torch.float32, device=None)
    grouped = MoELayer(cfg.replace(model=dict(moe_grouped_gemm=True)), backend=Grouped(), **kw)
    for i, e in enumerate(loop.experts):
        assert torch.equal(grouped.experts.fc1.weights[i], e.fc1.weight)
        assert grouped.experts.fc2.weights[i].full_name == e.fc2.weight.full_name
    x = torch.randn(6, 1, 64, generator=torch.Generator().manual_seed(1))  # 6 tokens, 8 experts
    ya, yb = loop(x), grouped(x)
    torch.testing.assert_close(yb, ya, rtol=1e-6, atol=1e-6)
    ya.square().sum().backward()
    yb.square().sum().backward()
    for i, e in enumerate(loop.experts):
        torch.testing.assert_close(grouped.experts.fc1.weights[i].grad, e.fc1.weight.grad)
    splits = grouped.experts.fc1.splits[0]
    assert 0 not in splits and len(splits) == 8  # experts without tokens run on zero rows
    if pad:
        assert set(splits) == {math.ceil(0.5 * 6 / 8)}
