"""The loop's reads of an iteration's numbers (metrics.HostScalar, schedules._grad_norm): a value
is the tensor's as it was when read was queued, the step's early copy of its gradient norm is used
only for that very norm, and the lean ZeRO step hands its norm over before its update."""

import types

import pytest
import torch

from megafp8.metrics import HostScalar
from megafp8.parallel.pipeline.schedules import _grad_norm
from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config


def test_host_scalar_keeps_the_value_it_was_made_with():
    t = torch.tensor(2.5, dtype=torch.float64)
    read = HostScalar(t)
    t.add_(1.0)  # later work on the tensor
    assert float(read) == 2.5
    assert float(HostScalar(torch.tensor([[7.0]]))) == 7.0  # any one-element shape


def _engine(gn, early):
    opt = types.SimpleNamespace(early_grad_norm=early)
    return types.SimpleNamespace(get_global_grad_norm=lambda: gn, optimizer=opt)


def test_grad_norm_takes_the_early_copy_of_this_norm_only():
    norm = torch.tensor(3.0)
    eng = _engine(norm, (norm, HostScalar(torch.tensor(4.0))))  # 4.0: tells the copy apart
    assert _grad_norm(eng) == 4.0
    assert eng.optimizer.early_grad_norm is None  # used once
    assert _grad_norm(eng) == 3.0  # no copy: the engine's own
    other = torch.tensor(5.0)  # a copy of another tensor (an earlier step's): not this norm's
    assert _grad_norm(_engine(norm, (other, HostScalar(other)))) == 3.0
    assert _grad_norm(_engine(None, None)) is None
    assert _grad_norm(types.SimpleNamespace(get_global_grad_norm=lambda: 1.5)) == 1.5


def _lean_step_norms(cfg):
    """Three bf16 iterations through the lean step: the console's grad norms, and what the step
    left for the loop to read after each (consumed: None)."""
    import megafp8.train as T
    from megafp8.parallel.pipeline import schedules as S

    seen = []
    real = S._grad_norm

    def spy(engine):
        early = getattr(engine.optimizer, "early_grad_norm", None)
        seen.append(early is not None and early[0] is engine.get_global_grad_norm())
        return real(engine)

    S._grad_norm = spy
    try:
        hist = T.train(cfg)
    finally:
        S._grad_norm = real
    return [r["grad norm"] for r in hist], seen


@pytest.mark.parametrize("aware", [True, False])
def test_lean_step_hands_its_norm_over_before_the_update(aware):
    """With the precision-aware optimizer (the lean step) every iteration's norm reaches the loop
    as the step's early copy of that same norm; without it DeepSpeed's step runs and the loop
    reads the engine's norm. The console's norms are finite in both."""
    cfg = tiny_config(
        train=dict(bf16=True, train_iters=3, micro_batch_size=2, global_batch_size=4),
        optim=dict(zero_stage=1, use_precision_aware_optimizer=aware),
    )
    norms, seen = run_distributed(_lean_step_norms, 1, cfg)[0]
    assert len(norms) == 3 and all(n is not None and n == n and n > 0 for n in norms)
    assert seen == [aware] * 3
