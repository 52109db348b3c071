"""The Triton cross-entropy against float64 and against the unfused torch loss; vocab-parallel at
TP 2 (two processes on one GPU over gloo)."""

import pytest
import torch

from tests.helpers.dist import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _data(dtype, v=5003, scale=30.0, s=64, b=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    logits = (torch.randn(s, b, v, generator=g) * scale).to("cuda", dtype)
    target = torch.randint(0, v, (s, b), generator=g).cuda()
    target[0, 0] = v - 1  # the last column, in the last (partial) block
    weight = torch.rand(s, b, generator=g).cuda()  # a non-uniform upstream gradient
    return logits, target, weight


def _reference(logits, target, weight):
    z = logits.detach().double().requires_grad_()
    loss = torch.nn.functional.cross_entropy(
        z.reshape(-1, z.shape[-1]), target.reshape(-1), reduction="none"
    ).reshape(target.shape)
    (loss * weight.double()).sum().backward()
    return loss.detach(), z.grad


def _ours(logits, target, weight, fused, inplace=False, group=None):
    from megafp8.parallel.layers import vocab_parallel_cross_entropy
    from megafp8.parallel.mappings import SOLO

    z = logits.detach().clone().requires_grad_()
    group = SOLO if group is None else group  # one process: the group of one
    loss = vocab_parallel_cross_entropy(z, target, group, fused=fused, inplace=inplace)
    (loss * weight).sum().backward()
    return loss.detach(), z.grad


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_fused_matches_float64_and_unfused(dtype):
    from megafp8.parallel import fused_cross_entropy as fce

    logits, target, weight = _data(dtype)
    assert fce.available(logits)
    ref_loss, ref_grad = _reference(logits, target, weight)
    loss, grad = _ours(logits, target, weight, fused=True)
    uloss, ugrad = _ours(logits, target, weight, fused=False)
    assert grad.dtype == dtype and loss.dtype == torch.float32
    tol = 1e-5 if dtype == torch.float32 else 1e-2  # bf16: the gradient's own rounding
    assert ((loss.double() - ref_loss).abs() / ref_loss.abs().clamp(min=1)).max() < 1e-5
    rel = (grad.double() - ref_grad).norm() / ref_grad.norm()
    assert rel < tol
    # the unfused loss computes the same numbers (both work in fp32)
    assert (loss - uloss).abs().max() < 1e-4
    assert (grad.float() - ugrad.float()).norm() / ugrad.float().norm() < tol


def test_inplace_gradient_reuses_the_logits_buffer():
    from megafp8.parallel.layers import vocab_parallel_cross_entropy
    from megafp8.parallel.mappings import SOLO

    logits, target, weight = _data(torch.bfloat16)
    _, grad = _ours(logits, target, weight, fused=True)
    z = logits.detach().clone().requires_grad_()
    y = z * 1  # a non-leaf: the loss may overwrite it
    seen = {}
    y.register_hook(lambda g: seen.setdefault("g", g))
    (
        vocab_parallel_cross_entropy(y, target, SOLO, fused=True, inplace=True) * weight
    ).sum().backward()
    assert seen["g"].data_ptr() == y.data_ptr()
    assert torch.equal(seen["g"], grad)


def _tp_part(logits, target, weight):
    import torch.distributed as dist

    torch.cuda.set_device(0)
    r, n = dist.get_rank(), logits.shape[-1] // 2
    mine = logits[..., r * n : (r + 1) * n].contiguous().cuda()
    loss, grad = _ours(mine, target.cuda(), weight.cuda(), True, group=dist.group.WORLD)
    return loss.cpu(), grad.cpu()


def test_vocab_parallel_tp2_matches_one_process():
    logits, target, weight = _data(torch.float32, v=6000)
    ref_loss, ref_grad = _reference(logits, target, weight)
    outs = run_distributed(_tp_part, 2, logits.cpu(), target.cpu(), weight.cpu())
    for loss, _ in outs:
        assert (loss.double() - ref_loss.cpu()).abs().max() < 1e-4
    grad = torch.cat([g for _, g in outs], dim=-1).double()
    assert (grad - ref_grad.cpu()).norm() / ref_grad.norm().cpu() < 1e-5
