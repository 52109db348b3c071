"""fp8/norm_residual.py off the GPU: the block's residual gradient reaches ``x`` whole, whether
the norm's backward takes it (here a stand-in norm that adds it where TE's ``rmsnorm_bwd_add``
would) or nobody does (the hook adds it when ``x``'s gradient is complete). Both ways the
gradients equal plain ``x + branch`` bit for bit: the same values are added, only in another
place. TE's own modules taking it are tested on the GPU (tests/gpu/test_norm_residual_gpu.py)."""

import pytest
import torch

from megafp8.fp8 import norm_residual as nr


@pytest.fixture
def on(monkeypatch):
    monkeypatch.setitem(nr._state, "on", True)
    monkeypatch.setitem(nr._state, "fused", 0)
    monkeypatch.setitem(nr._state, "late", 0)
    nr._filed.clear()
    yield
    nr._filed.clear()


class _Norm(torch.autograd.Function):
    """RMSNorm whose backward adds the filed residual gradient into its own input gradient,
    as the wrapped ``rmsnorm_bwd`` does (``take`` with the saved input)."""

    @staticmethod
    def forward(ctx, x, w, takes):
        r = torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-5)
        ctx.save_for_backward(x, w, r)
        ctx.takes = takes
        return x * r * w

    @staticmethod
    def backward(ctx, g):
        x, w, r = ctx.saved_tensors
        gw = g * w
        dx = r * gw - x * r.pow(3) * (gw * x).mean(-1, keepdim=True)
        dw = (g * x * r).reshape(-1, x.shape[-1]).sum(0)
        if ctx.takes:
            dh = nr.take(x)
            if dh is not None:
                nr._state["fused"] += 1
                dx = dx + dh.view_as(dx)
        return dx, dw, None


def _model(seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(16, 16, generator=g, dtype=torch.float64) * 0.3 for _ in range(4)] + [
        1 + 0.1 * torch.randn(16, generator=g, dtype=torch.float64) for _ in range(4)
    ]


def _grads(fold: bool, takes: bool, x0=None):
    """Two pre-norm blocks (a tanh 'attention' and a 'MLP', each behind its own norm); the
    gradients of the input and of every weight."""
    ps = [p.clone().requires_grad_() for p in _model()]
    x = (x0 if x0 is not None else torch.randn(3, 5, 16, dtype=torch.float64)).clone()
    x.requires_grad_()
    h = x
    for i in range(2):
        for j in range(2):
            w, gamma = ps[2 * i + j], ps[4 + 2 * i + j]
            y = torch.tanh(_Norm.apply(h, gamma, takes) @ w)
            h = nr.residual_add(h, y) if fold else h + y
    (h * torch.linspace(-1, 1, 16, dtype=torch.float64)).sum().backward()
    return [x.grad] + [p.grad for p in ps]


def test_the_norm_takes_it_and_the_gradients_are_the_same(on):
    x0 = torch.randn(3, 5, 16, dtype=torch.float64)
    ref = _grads(False, False, x0)
    assert nr.counts() == {"fused": 0, "late": 0}
    got = _grads(True, True, x0)
    assert nr.counts() == {"fused": 4, "late": 0}  # every norm took its block's dh
    assert nr.pending() == 0
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


def test_nobody_takes_it_and_the_hook_adds_it(on):
    x0 = torch.randn(3, 5, 16, dtype=torch.float64)
    ref = _grads(False, False, x0)
    got = _grads(True, False, x0)
    assert nr.counts() == {"fused": 0, "late": 4}
    assert nr.pending() == 0
    for a, b in zip(got, ref, strict=True):
        assert torch.equal(a, b)


def test_off_or_without_gradients_it_is_the_plain_sum(monkeypatch):
    monkeypatch.setitem(nr._state, "on", False)
    x, y = torch.randn(4, 8, requires_grad=True), torch.randn(4, 8)
    out = nr.residual_add(x, y)
    assert out.grad_fn.name() == "AddBackward0"
    monkeypatch.setitem(nr._state, "on", True)
    with torch.no_grad():
        assert torch.equal(nr.residual_add(x, y), x + y)
    assert torch.equal(nr.residual_add(x.detach(), y), x + y)


def test_a_gradient_left_by_an_interrupted_backward_is_dropped_at_the_next_forward(on):
    x = torch.randn(4, 8, requires_grad=True)
    nr._filed[x.data_ptr()] = torch.full((4, 8), 1e6)  # as if the norm's backward never ran
    out = nr.residual_add(x, 0.5 * x)
    assert nr.pending() == 0
    out.sum().backward()
    assert torch.equal(x.grad, torch.full((4, 8), 1.5))  # the hook found nothing stale to add


def test_take_refuses_another_size_or_dtype(on):
    x = torch.randn(4, 8)
    nr._filed[x.data_ptr()] = torch.randn(4, 8, dtype=torch.float64)
    assert nr.take(x) is None and nr.pending() == 1
    nr._filed[x.data_ptr()] = torch.randn(4, 8)
    assert nr.take(x) is not None and nr.pending() == 0


def test_without_transformer_engine_it_stays_off(monkeypatch):
    import builtins

    real = builtins.__import__

    def no_te(name, *a, **k):
        if name.startswith("transformer_engine"):
            raise ImportError(name)
        return real(name, *a, **k)

    monkeypatch.setattr(builtins, "__import__", no_te)
    monkeypatch.setitem(nr._state, "on", True)
    assert nr.install(True) is False and nr._state["on"] is False
