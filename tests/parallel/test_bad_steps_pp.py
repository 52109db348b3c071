"""Bad steps under pipelining: the loss lives on the last stage, the boundary step of every stage
waits for it, so a NaN or a spike withholds the update on both stages (weights, the tied
embedding's copy and the optimizer state unchanged), for 1F1B and the interleaved schedule."""

import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config
from tests.unit.bad_steps_util import train_injected


@pytest.mark.parametrize("vpp", [None, 2])
def test_pp2_nan_and_spike_skipped_on_every_stage(vpp):
    cfg = tiny_config(
        model=dict(num_layers=4),
        parallel=dict(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=vpp),
        train=dict(micro_batch_size=2, global_batch_size=8, train_iters=6, nan_policy="skip",
                   check_for_spiky_loss=True, spiky_loss_window=2),
    )  # fmt: skip
    got = run_distributed(train_injected, 2, cfg, {3: "nan", 5: "spike"})
    for hist, unchanged, _, err in got:
        assert err is None
        assert unchanged == {1: False, 2: False, 3: True, 4: False, 5: True, 6: False}
        assert [r["skipped"] for r in hist] == [False, False, True, False, True, False]
    assert [str(r["lm loss"]) for r in got[0][0]] == [str(r["lm loss"]) for r in got[1][0]]
    first = [x for x in got[0][2] if x.startswith(" iteration        5/")][0]
    assert "number of skipped iterations:   1 | number of nan iterations:   0 |" in first
