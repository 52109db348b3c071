"""Tensor (+sequence) parallelism equals the single-process model with the same weights.

Every rank builds the model from the same seed (each layer initializes its full weight, then keeps
its shard), runs the same batch, and compares against the single-process model built in the same
process: the loss, the logits (gathered over the vocab), the gradient of the embedding output (the
input gradient of the whole decoder stack), and this rank's shard of every weight gradient.
"""

import pytest
import torch

from megafp8.parallel import mappings as M
from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config

# Tolerances. Row-parallel layers sum K/tp-long partial dot products across ranks, in another order
# than one K-long sum: fp32 rounding differs at ~1e-7 relative per sum and grows through two blocks
# and the backward pass to ~1e-5 at worst.
#
# FP8 (torch backend, CPU emulation): a GEMM sums exact FP8 products in float64, so its result does
# not depend on the summation order (tests/unit/test_fp8.py), and the scales are reduced over TP, so
# every layout quantizes the same numbers the same way. What remains are the cross-rank fp32 sums
# above: they move a value by an fp32 ulp or so, and a value lying that close to an FP8 rounding
# boundary rounds to the neighbouring FP8 value (a "flip": one step, 2^-3 relative in E4M3, 2^-2 in
# E5M2, for that one element). How often depends on the CPU's last bits, so no bound on fp32 digits
# holds. Instead the bound is the FP8 quantization noise of the same computation (single process,
# FP8 vs fp32): there every one of the N quantized elements carries a rounding error of up to half
# a step (rms step/sqrt(12)), while k flips add k one-step errors; k flips reach a fraction
# sqrt(12 k / N) of the noise, so half the noise takes ~N/48 flips (hundreds here), where the
# cross-rank sums give ~2^-20 chance of a flip per quantized element. A TP bug is not FP8 noise:
# a wrong shard or a missing reduction is O(1), and unreduced scales quantize differently
# (sqrt(2) x the noise). The per-layer tests (tests/parallel/test_tp_layers.py) are bit-exact.
FP8_NOISE_SHARE = 0.5
FP32_TOL = dict(rtol=1e-4, atol=1e-5)


def _rel(a, b):
    return ((a - b).norm() / b.norm().clamp(min=1e-30)).item()


def _model(cfg, groups):
    from megafp8.fp8.backend import build_backend
    from megafp8.model.gpt import GPTModel

    backend = build_backend(cfg.fp8, amax_group=groups.tp_dp_group, tp_group=groups.tp_group)
    return GPTModel(cfg, backend=backend, groups=groups, vocab_size=cfg.model.vocab_size), backend


def _step(model, backend, batch, steps):
    """``steps`` forward/backward passes (scales of the delayed recipe update in between)."""
    emb_grads = []
    for _ in range(steps):
        model.zero_grad(set_to_none=True)

        def keep(module, inputs, out):
            out.retain_grad()
            emb_grads.append(out)

        hook = model.embedding.register_forward_hook(keep)
        loss = model(batch["tokens"], batch["labels"], batch["loss_mask"])
        logits = model(batch["tokens"]).detach()
        hook.remove()
        loss.backward()
        backend.update()
    return loss.detach(), logits, emb_grads[-2].grad


def _batch(cfg):
    g = torch.Generator().manual_seed(3)
    b, s = cfg.train.micro_batch_size, cfg.model.seq_length
    tokens = torch.randint(0, cfg.model.vocab_size, (b, s + 1), generator=g)
    return {"tokens": tokens[:, :-1], "labels": tokens[:, 1:], "loss_mask": torch.ones(b, s)}


def _compare(cfg, steps):
    from megafp8.parallel.groups import ParallelGroups

    tp = cfg.parallel.tensor_model_parallel_size
    groups = ParallelGroups.build(tp=tp, kv_heads=cfg.model.kv_heads)
    batch = _batch(cfg)
    ref_cfg = cfg.replace(parallel=dict(tensor_model_parallel_size=1, sequence_parallel=False))
    ref, ref_be = _model(ref_cfg, ParallelGroups.single())
    par, par_be = _model(cfg, groups)
    r_loss, r_logits, r_emb = _step(ref, ref_be, batch, steps)
    p_loss, p_logits, p_emb = _step(par, par_be, batch, steps)
    p_logits = M._all_gather(p_logits, groups.tp_group, -1)  # [s, b, V]
    grads = _shard_pairs(par, ref)
    out = [(p_loss, r_loss), (p_logits, r_logits), (p_emb, r_emb), grads]
    if cfg.fp8.enabled:  # the same single-process model without FP8: the quantization noise
        ref32, be32 = _model(ref_cfg.replace(fp8=dict(fp8_format=None)), ParallelGroups.single())
        _, l32, e32 = _step(ref32, be32, batch, steps)
        pairs32 = _shard_pairs(par, ref32).values()
        grad_noise = {
            k: _rel(v[1], v32[1]) for (k, v), v32 in zip(grads.items(), pairs32, strict=True)
        }
        out.append((_rel(r_logits, l32), _rel(r_emb, e32), grad_noise))
    return out


def _shard_pairs(par, ref):
    """name -> (this rank's gradient, the same slice of the single-process gradient)."""
    ref_params = {getattr(p, "full_name", n): p for n, p in ref.named_parameters()}
    pairs = {}
    for name, p in par.named_parameters():
        full = ref_params[getattr(p, "full_name", name)].grad
        if hasattr(p, "full_index"):
            full = full.index_select(p.partition_dim, p.full_index)
        pairs[name] = (p.grad, full)
    return pairs


CASES = [(tp, sp, fp8) for tp in (2, 4) for sp in (False, True) for fp8 in (None, "delayed")]


@pytest.mark.parametrize("tp,sp,fp8", CASES, ids=lambda v: str(v))
def test_tp_matches_single_process(tp, sp, fp8):
    fp8_cfg = dict(fp8_format="hybrid", fp8_recipe=fp8, fp8_amax_history_len=4) if fp8 else {}
    cfg = tiny_config(
        parallel=dict(tensor_model_parallel_size=tp, sequence_parallel=sp),
        model=dict(
            num_query_groups=tp,
            swiglu=tp == 4,
            position_embedding_type="rope" if tp == 4 else "learned_absolute",
        ),
        fp8=fp8_cfg,
    )
    results = run_distributed(_compare, tp, cfg, 2 if fp8 else 1)
    for (loss, r_loss), (logits, r_logits), (emb, r_emb), grads, *noise in results:
        if fp8 is None:
            torch.testing.assert_close(loss, r_loss, **FP32_TOL)
            torch.testing.assert_close(logits, r_logits, **FP32_TOL)
            torch.testing.assert_close(emb, r_emb, **FP32_TOL)
            for name, (g, ref) in grads.items():
                torch.testing.assert_close(g, ref, **FP32_TOL, msg=name)
        else:
            logit_noise, emb_noise, grad_noise = noise[0]
            # |CE(z) - CE(z')| <= 2 max|z - z'| per token (log-sum-exp and the target logit each
            # move by at most max|z - z'|), so the mean loss is bounded by the logits, + fp32.
            assert abs(loss - r_loss) <= 2 * (logits - r_logits).abs().max() + 1e-6 * r_loss
            assert _rel(logits, r_logits) < FP8_NOISE_SHARE * logit_noise
            assert _rel(emb, r_emb) < FP8_NOISE_SHARE * emb_noise
            for name, (g, ref) in grads.items():
                assert _rel(g, ref) < FP8_NOISE_SHARE * grad_noise[name] + 1e-6, name


def test_tp4_with_kv_heads_replicated():
    """tp=4 with 2 kv heads (each on 2 ranks) and with 1 (on all 4): the replicated k/v rows get
    their gradient summed over the ranks sharing them (fp32; under FP8 each rank quantizes its
    partial k/v gradient, which differs from quantizing the sum by FP8 noise)."""
    for kv in (2, 1):
        _check_replicated_kv(kv)


def _check_replicated_kv(kv):
    cfg = tiny_config(parallel=dict(tensor_model_parallel_size=4), model=dict(num_query_groups=kv))
    for (loss, r_loss), _, (emb, r_emb), grads in run_distributed(_compare, 4, cfg, 1):
        torch.testing.assert_close(loss, r_loss, **FP32_TOL)
        torch.testing.assert_close(emb, r_emb, **FP32_TOL)
        assert any("kv_proj" in n for n in grads)
        for name, (g, ref) in grads.items():
            torch.testing.assert_close(g, ref, **FP32_TOL, msg=name)


@pytest.mark.parametrize(
    "tp,sp,kv,model",
    [
        (2, True, 2, dict(position_embedding_type="rope", normalization="RMSNorm")),
        # k replicated over 4 ranks; LayerNorm 1p; a squared ReLU MLP
        (4, False, 1, dict(apply_layernorm_1p=True, squared_relu=True)),
    ],
    ids=["tp2-sp-rope-rmsnorm", "tp4-kv1-layernorm1p-srelu"],
)
def test_qk_layernorm_matches_single_process(tp, sp, kv, model):
    """--qk-layernorm: one q and one k norm weight serve every head; each rank's gradient covers
    its own heads, and the sum over TP must equal one process's gradient (fp32). The second case
    also runs the squared ReLU MLP (--squared-relu) split over TP."""
    cfg = tiny_config(
        parallel=dict(tensor_model_parallel_size=tp, sequence_parallel=sp),
        model=dict(num_query_groups=kv, qk_layernorm=True, **model),
    )
    for (loss, r_loss), (logits, r_logits), _, grads in run_distributed(_compare, tp, cfg, 1):
        torch.testing.assert_close(loss, r_loss, **FP32_TOL)
        torch.testing.assert_close(logits, r_logits, **FP32_TOL)
        normed = [n for n in grads if "q_norm" in n or "k_norm" in n]
        per_norm = 2 if cfg.model.normalization == "LayerNorm" else 1  # weight (and bias)
        assert len(normed) == cfg.model.num_layers * 2 * per_norm
        for name in normed:  # (a k bias has no gradient: softmax ignores a shift of every key)
            assert "weight" not in name or grads[name][1].abs().max() > 1e-4, name
        for name, (g, ref) in grads.items():
            torch.testing.assert_close(g, ref, **FP32_TOL, msg=name)


def _ce(vocab, tp):
    from megafp8.parallel.groups import ParallelGroups
    from megafp8.parallel.layers import vocab_parallel_cross_entropy

    groups = ParallelGroups.build(tp=tp)
    g = torch.Generator().manual_seed(0)
    logits = torch.randn(6, 3, vocab, generator=g) * 4
    target = torch.randint(0, vocab, (6, 3), generator=g)
    n = vocab // tp
    r = groups.coords.tp
    local = logits[..., r * n : (r + 1) * n].clone().requires_grad_()
    loss = vocab_parallel_cross_entropy(local, target, groups.tp_group)
    loss.sum().backward()
    full = logits.clone().requires_grad_()
    ref = torch.nn.functional.cross_entropy(full.view(-1, vocab), target.view(-1), reduction="none")
    ref.sum().backward()
    return loss.detach(), ref.detach().view(6, 3), local.grad, full.grad[..., r * n : (r + 1) * n]


def test_vocab_parallel_cross_entropy():
    for loss, ref, g, rg in run_distributed(_ce, 4, 64, 4):
        torch.testing.assert_close(loss, ref, rtol=1e-6, atol=1e-6)
        torch.testing.assert_close(g, rg, rtol=1e-6, atol=1e-7)
