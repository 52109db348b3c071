"""On the GPU: a HostScalar's read waits for the work queued before it was made and not for what
was queued after (the optimizer update, in the loop); a bf16 run through the lean ZeRO step hands
every iteration's norm to the loop that way."""

import os
import time

import pytest
import torch

from megafp8.metrics import HostScalar
from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config
from tests.unit.test_host_reads import _lean_step_norms

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


def test_host_scalar_does_not_wait_for_later_work():
    x = torch.full((), 3.0, device="cuda")
    float(HostScalar(x * 2))  # every kernel below loaded once: a lazy module load waits for
    x.add_(0.0)  # the device, which is not what is tested
    torch.cuda.synchronize()
    read = HostScalar(x * 2)
    torch.cuda._sleep(2_000_000_000)  # ~1 s of GPU cycles (an int32 count), after the copy
    x.add_(1.0)
    t0 = time.perf_counter()
    value = float(read)
    waited = time.perf_counter() - t0
    still_busy = not torch.cuda.current_stream().query()
    torch.cuda.synchronize()
    assert value == 6.0
    assert still_busy, "the read waited for the work queued after it"
    assert waited < 0.5, f"the read took {waited:.3f} s"


def _on_cuda(cfg):
    os.environ["DS_ACCELERATOR"] = "cuda"
    return _lean_step_norms(cfg)


def test_lean_step_hands_its_norm_over_on_the_gpu():
    cfg = tiny_config(
        train=dict(bf16=True, train_iters=3, micro_batch_size=2, global_batch_size=4),
        optim=dict(zero_stage=1, use_precision_aware_optimizer=True),
    )
    norms, seen = run_distributed(_on_cuda, 1, cfg)[0]
    assert seen == [True] * 3
    assert all(n is not None and n == n and n > 0 for n in norms)
