"""A NaN gradient under ZeRO 1/2 in bf16 on the GPU: DeepSpeed's overflow scan is off there and
the fused AdamW skips the update on the GPU through ``found_inf`` (optim/zero.py, ``norm_skip``):
weights, ZeRO's fp32 partitions, both moments and the step counts stay bit-identical across the
bad iteration, which is counted as skipped and nan; the iterations around it train."""

import os

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config
from tests.unit.bad_steps_util import train_injected

pytestmark = pytest.mark.gpu


def _on_cuda(cfg, inject):
    """run_distributed's workers name DeepSpeed's CPU accelerator; this one trains on the GPU."""
    os.environ["DS_ACCELERATOR"] = "cuda"
    return train_injected(cfg, inject)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("zero", [1, 2])
def test_nan_gradient_skipped_by_the_fused_optimizer(zero):
    cfg = tiny_config(
        train=dict(micro_batch_size=2, global_batch_size=4, train_iters=4, bf16=True,
                   nan_policy="skip"),
        optim=dict(zero_stage=zero),
    )  # fmt: skip
    hist, unchanged, lines, err = run_distributed(_on_cuda, 1, cfg, {2: "nangrad"})[0]
    assert err is None
    assert unchanged == {1: False, 2: True, 3: False, 4: False}
    assert [r["skipped"] for r in hist] == [False, True, False, False]
    (line,) = [x for x in lines if x.startswith(" iteration        2/")]
    field = lambda k: int(line.split(f"{k}: ")[1].split(" |")[0])  # noqa: E731
    assert (field("number of skipped iterations"), field("number of nan iterations")) == (1, 1)
