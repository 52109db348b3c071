"""adamw_bf16's Triton kernel on the GPU: equal to the same arithmetic in torch ops and to torch's
fused CUDA AdamW to fp32 rounding (tests/unit/test_adamw_bf16.py gives the bound), found_inf
withholding every bit without a host wait, pieces of any size (partial blocks); and a bf16 ZeRO-1
run on the GPU with --use-precision-aware-optimizer trains as the one without it (DeepSpeed's own
step, torch's fused AdamW)."""

import os

import pytest
import torch

from tests.helpers.dist import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def _run(device, steps=3, n=3 * 2048 + 17, scales=None, founds=None):
    from megafp8.optim import adamw_bf16

    gen = torch.Generator().manual_seed(0)
    p0 = torch.randn(n, generator=gen)
    grads = [(torch.randn(n, generator=gen) * 10.0 ** (-i)).bfloat16() for i in range(steps)]
    p = torch.nn.Parameter(p0.clone().to(device))
    opt = torch.optim.AdamW([p], lr=1e-2, betas=(0.9, 0.95), weight_decay=0.1)
    out = p0.bfloat16().to(device)
    for i, g in enumerate(grads):
        g = g.to(device)
        pieces = [g[:1000], g[1000:1001], g[1001:].reshape(-1)]  # partial blocks, one element
        adamw_bf16.step(opt, pieces, out,
                        grad_scale=None if scales is None else scales[i].to(device),
                        found_inf=None if founds is None else founds[i].to(device))  # fmt: skip
    st = opt.state[p]
    return [t.detach().cpu() for t in (p, st["exp_avg"], st["exp_avg_sq"], st["step"], out)]


def _close(a, b):
    torch.testing.assert_close(a, b, rtol=2e-6, atol=1e-9)


def test_kernel_equals_the_torch_ops():
    scales = [torch.tensor(4.0), torch.tensor(1.0), torch.tensor(0.5)]
    founds = [torch.tensor(0.0), torch.tensor(1.0), torch.tensor(0.0)]
    for kw in ({}, {"scales": scales, "founds": founds}):
        gpu, cpu = _run("cuda", **kw), _run("cpu", **kw)
        for a, b in zip(gpu[:3], cpu[:3], strict=True):
            _close(a, b)
        assert float(gpu[3]) == float(cpu[3])
        assert torch.equal(gpu[4], gpu[0].bfloat16())  # the bf16 weights: the masters rounded


@pytest.mark.parametrize("block,warps", [(1024, 4), (4096, 8), (8192, 16)])
def test_every_launch_gives_the_same_bits(block, warps, monkeypatch):
    """The launches kernel_probes times: each writes what the default launch writes, bit for bit
    (elementwise arithmetic: the tiling changes no sum)."""
    from megafp8.optim import adamw_bf16

    default = _run("cuda", n=5 * 8192 + 3)
    monkeypatch.setitem(adamw_bf16.LAUNCH, "BLOCK", block)
    monkeypatch.setitem(adamw_bf16.LAUNCH, "WARPS", warps)
    other = _run("cuda", n=5 * 8192 + 3)
    for a, b in zip(default, other, strict=True):
        assert torch.equal(a, b)


def test_kernel_equals_torch_fused_cuda_adamw():
    """Three steps, gradient scales 4, 1, 0.5 and the second withheld by found_inf."""
    from megafp8.optim import adamw_bf16

    gen = torch.Generator().manual_seed(1)
    p0 = torch.randn(10_000, generator=gen).cuda()
    grads = [(torch.randn(10_000, generator=gen) * 1e-2).bfloat16().cuda() for _ in range(3)]
    scales = [torch.tensor(v, device="cuda") for v in (4.0, 1.0, 0.5)]
    founds = [torch.tensor(v, device="cuda") for v in (0.0, 1.0, 0.0)]
    a, b = torch.nn.Parameter(p0.clone()), torch.nn.Parameter(p0.clone())
    oa = torch.optim.AdamW([a], lr=1e-3, weight_decay=0.1)
    ob = torch.optim.AdamW([b], lr=1e-3, weight_decay=0.1, fused=True)
    out = p0.bfloat16()
    for g, scale, found in zip(grads, scales, founds, strict=True):
        adamw_bf16.step(oa, [g], out, grad_scale=scale, found_inf=found)
        b.grad = g.float()
        ob.grad_scale, ob.found_inf = scale, found
        ob.step()
    # torch's kernel forms the first moment as a lerp, m + (1 - b1)(g - m), ours as
    # b1 m + (1 - b1) g: one fp32 ulp of the scaled gradient apart per step (two steps applied).
    # Through the update that is lr x (2 ulp of g) / sqrt(v_hat) / (1 - b1^t) per step, and
    # sqrt(v_hat) >= max|g| / sqrt(2) over two steps: 2 steps x lr x 32 eps / (1 - b1) bounds it.
    eps = 2.0**-24
    gmax = max(float((g.float() / s).abs().max()) for g, s in zip(grads, scales, strict=True))
    torch.testing.assert_close(oa.state[a]["exp_avg"], ob.state[b]["exp_avg"], rtol=2e-6,
                               atol=4 * eps * gmax)  # fmt: skip
    _close(oa.state[a]["exp_avg_sq"], ob.state[b]["exp_avg_sq"])
    torch.testing.assert_close(a.detach(), b.detach(), rtol=2e-6, atol=2 * 1e-3 * 32 * eps / 0.1)
    assert float(oa.state[a]["step"]) == float(ob.state[b]["step"]) == 2.0
    assert torch.equal(out, a.detach().bfloat16())


def test_found_inf_withholds_every_bit():
    from megafp8.optim import adamw_bf16

    p = torch.nn.Parameter(torch.randn(5000, device="cuda"))
    opt = torch.optim.AdamW([p], lr=1e-2)
    out = p.detach().bfloat16()
    g = torch.randn(5000, device="cuda").bfloat16()
    adamw_bf16.step(opt, [g], out)
    st = opt.state[p]
    before = [t.clone() for t in (p.detach(), st["exp_avg"], st["exp_avg_sq"], out)]
    adamw_bf16.step(opt, [g], out, found_inf=torch.ones((), device="cuda"))
    after = [p.detach(), st["exp_avg"], st["exp_avg_sq"], out]
    assert all(torch.equal(x, y) for x, y in zip(before, after, strict=True))
    assert float(opt.state[p]["step"]) == 1.0


def _on_cuda(cfg):
    os.environ["DS_ACCELERATOR"] = "cuda"
    from tests.unit.test_adamw_bf16 import _train

    hist, calls, first, masters, _ = _train(cfg)
    return hist, calls, first.cpu(), masters.cpu()


def test_gpu_training_matches_deepspeeds_step():
    """As tests/unit/test_adamw_bf16.py's training test, one GPU: the masters after the first
    update to fp32 rounding, then losses and gradient norms."""
    from tests.helpers.tiny import tiny_config

    cfg = tiny_config(
        model=dict(ffn_hidden_size=100),
        train=dict(bf16=True, train_iters=3),
        optim=dict(zero_stage=1, optimizer_group_max_numel=5000, clip_grad=0.05),
    )
    aware = cfg.replace(optim=dict(use_precision_aware_optimizer=True))
    ours, calls, first, masters = run_distributed(_on_cuda, 1, aware)[0]
    ref, none, rfirst, rmasters = run_distributed(_on_cuda, 1, cfg)[0]
    assert calls >= 9 and none == 0
    assert ours[0] == ref[0]
    torch.testing.assert_close(first, rfirst, rtol=2e-6, atol=1e-9)
    for (la, ga), (lb, gb) in zip(ours, ref, strict=True):
        assert la == pytest.approx(lb, rel=1e-5)
        assert ga == pytest.approx(gb, rel=1e-4)
    torch.testing.assert_close(masters, rmasters, rtol=0, atol=2 * 3.2e-3)
