"""DP=2 under ZeRO 1, 2 and 3 gives the losses of one process over 5 steps (fp32)."""

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config, train_losses


def _losses(cfg):
    return train_losses(cfg)


@pytest.fixture(scope="module")
def reference():
    return run_distributed(_losses, 1, tiny_config())[0]


@pytest.mark.parametrize("stage", [1, 2, 3])
def test_dp2_zero_matches_one_process(reference, stage):
    cfg = tiny_config(optim=dict(zero_stage=stage))
    got = run_distributed(_losses, 2, cfg)
    assert got[0] == got[1]  # the DP-mean loss is the same on both ranks
    # The only differences: the order of the sums over the global batch (DP all-reduce vs
    # accumulation) in fp32, which compounds over 5 Adam steps to ~1e-6 relative.
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(reference), rtol=2e-6, atol=2e-6)
    assert reference[-1] < reference[0]


@pytest.mark.parametrize("stage", [1, 2])
def test_bounded_optimizer_groups_match_one_process(reference, stage):
    """Optimizer groups bounded to 2048 elements (every weight its own group, the norms cut into
    several): the same losses, as AdamW is elementwise and the norm is over all groups."""
    cfg = tiny_config(optim=dict(zero_stage=stage, optimizer_group_max_numel=2048))
    got = run_distributed(_losses, 2, cfg)
    assert got[0] == got[1]
    torch.testing.assert_close(torch.tensor(got[0]), torch.tensor(reference), rtol=2e-6, atol=2e-6)
