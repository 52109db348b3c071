"""Gradient accumulation fusion under DeepSpeed ZeRO-1, on the CPU: the te backend's modules
(``TELinear`` with its ``WeightCache``) around a stand-in for TE's Linear that follows TE's rule
for ``fuse_wgrad_accumulation`` (the wgrad GEMM writes ``weight.main_grad``, overwriting on the
first micro-batch when it is given, adding otherwise, and autograd gets no weight gradient).
What is tested is everything of ours and DeepSpeed's around it: the ``.grad`` buffer made at the
forward, DeepSpeed's ZeRO-1 reading it at the boundary (2 DP ranks, 2 micro-batches each) with
its gradient hooks never firing for those weights, the release before the step, and a weight
that one of our hooks sums over ranks staying out of the fusion. TE's own kernels are tested
against autograd's accumulation on the GPU (tests/gpu/test_gpu_backends.py)."""

import contextlib
from types import SimpleNamespace

import pytest
import torch
from torch import nn

from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config


class _Wgrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, weight, fuse, first):
        ctx.save_for_backward(x)
        ctx.weight, ctx.fuse, ctx.first = weight, fuse, first
        return x @ weight.t()

    @staticmethod
    def backward(ctx, gy):
        (x,) = ctx.saved_tensors
        gx = gy @ ctx.weight
        gw = gy.reshape(-1, gy.shape[-1]).t() @ x.reshape(-1, x.shape[-1])
        if not ctx.fuse:
            return gx, gw, None, None
        main = ctx.weight.main_grad  # TE reads the attribute at backward time
        main.copy_(gw) if ctx.first else main.add_(gw)
        return gx, None, None, None


class FakeTELinear(nn.Module):
    def __init__(self, in_f, out_f, *, bias, params_dtype, device, init_method, **kw):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_f, in_f, dtype=params_dtype, device=device))
        self.bias = None
        self.fuse_wgrad_accumulation = kw.get("fuse_wgrad_accumulation", False)

    def forward(self, x, is_first_microbatch=None):
        return _Wgrad.apply(x, self.weight, self.fuse_wgrad_accumulation, bool(is_first_microbatch))


FAKE_TE = SimpleNamespace(Linear=FakeTELinear, autocast=lambda **kw: contextlib.nullcontext())


def _run(cfg, fused: bool, fp8: bool, iters: int = 3):
    import torch.distributed as dist

    from megafp8.fp8.backend import Backend
    from megafp8.fp8.te_modules import TELinear, WeightCache
    from megafp8.optim.zero import build_engine
    from megafp8.parallel.groups import ParallelGroups
    from megafp8.parallel.layers import allreduce_grad_hook
    from megafp8.parallel.pipeline.schedules import no_pipelining

    groups = ParallelGroups.build()
    cache = WeightCache()

    class Be(Backend):
        def microbatch(self, index):
            cache.first = None if index is None else index == 0

        def release_main_grads(self):
            cache.release()

    class Net(nn.Module):
        def __init__(self):
            super().__init__()
            dt = torch.bfloat16 if cfg.train.bf16 else torch.float32
            kw = dict(fp8=fp8, dtype=dt, device="cpu", cache=cache, fuse_wgrad=fused)
            self.layers = nn.ModuleList(
                TELinear(FAKE_TE, a, b, False, **kw) for a, b in ((16, 32), (32, 32), (32, 8))
            )
            g = torch.Generator().manual_seed(11)
            for lay in self.layers:
                with torch.no_grad():
                    lay.weight.copy_(torch.randn(lay.weight.shape, generator=g) * 0.3)
            self.to(dt)
            # summed over the 2 ranks by our hook: must stay out of the fusion
            allreduce_grad_hook(self.layers[2].weight, dist.group.WORLD)

        def forward(self, tokens, labels, mask):
            h = tokens.to(self.layers[0].weight.dtype)
            for lay in self.layers:
                h = torch.tanh(lay(h))
            return ((h.float() - labels) ** 2).mean()

    model = Net()
    eng = build_engine(model, cfg, groups)
    run = SimpleNamespace(engine=eng, cfg=cfg, backend=Be(), groups=groups, device="cpu")
    g = torch.Generator().manual_seed(100 + dist.get_rank())
    data = [  # this rank's two micro-batches, the same every iteration
        {"tokens": torch.randn(4, 16, generator=g), "labels": torch.randn(4, 8, generator=g),
         "loss_mask": torch.ones(4)} for _ in range(2)
    ]  # fmt: skip
    it = iter(data * iters)
    losses = [no_pipelining(run, it)[0] for _ in range(iters)]
    fused_ids = {id(p) for p in cache.fused}
    return {
        "losses": losses,
        "params": [p.detach().clone() for p in model.parameters()],
        "fused": [id(lay.weight) in fused_ids for lay in model.layers],
        "main_grad_left": any(hasattr(p, "main_grad") for p in model.parameters()),
    }


# fp8 True: TE is given is_first_microbatch (the first micro-batch overwrites); bf16: DeepSpeed's
# ZeRO-1 over bf16 parameters, the production path (fp32 master weights, fp32 reduction)
@pytest.mark.parametrize("fp8,bf16", [(True, False), (False, False), (True, True)])
def test_fused_accumulation_equals_autograd_under_zero1(fp8, bf16):
    cfg = tiny_config(
        train=dict(micro_batch_size=4, global_batch_size=16, bf16=bf16),
        optim=dict(zero_stage=1, lr=1e-2),
    )
    ref = run_distributed(_run, 2, cfg, False, fp8)
    got = run_distributed(_run, 2, cfg, True, fp8)
    for r, g in zip(ref, got, strict=True):
        assert r["fused"] == [False] * 3
        assert g["fused"] == [True, True, False]  # the hooked weight kept autograd's gradient
        assert not g["main_grad_left"]  # released before the step
        assert g["losses"] == r["losses"]
        for a, b in zip(g["params"], r["params"], strict=True):
            assert torch.equal(a, b)
    assert ref[0]["losses"][-1] < ref[0]["losses"][0]  # it trains
