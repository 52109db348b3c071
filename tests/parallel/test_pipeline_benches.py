"""The pipeline benchmarks' measurements, cut down (``bench/pipeline_bubble.py``,
``bench/pp_zero_comm.py``): what must hold whatever the machine's speed.

Bubble: the events are the schedule's table, each stage waits for its neighbour (a forward starts
after the previous virtual stage's forward of that micro-batch ended, a backward after the next
one's backward), every event lasts at least its layers' injected sleeps, and the 1F1B bubble at
pp 2, m 2 lies in a generous band around the formula. ZeRO communication (pp 2 x dp 2): exact
byte counts.
"""

import pytest

from bench import pipeline_bubble as PB
from bench import pp_zero_comm as ZC

SLEEP = 0.01  # per layer forward; 2 x in backward


@pytest.fixture(scope="module")
def bubble_rows():
    return PB.measure([2], [1], [1, 2], SLEEP, warmup=1, iters=2, layers_per_stage=2)


def _check_causality(raw, pp, v):
    """(F|B, virtual stage, micro-batch) -> (start, end) over every rank, per iteration."""
    for i in range(len(raw[0]["iterations"])):
        when = {}
        for r in raw:
            for kind, c, j, t0, t1 in r["iterations"][i]["events"]:
                when[(kind, c * pp + r["rank"], j)] = (t0, t1)
        n_virtual = pp * v
        for (kind, s, j), (t0, _) in when.items():
            if kind == "F" and s > 0:
                assert t0 >= when[("F", s - 1, j)][1]
            if kind == "B" and s < n_virtual - 1:
                assert t0 >= when[("B", s + 1, j)][1]


def test_bubble_events_follow_the_schedule_and_causality(bubble_rows):
    from megafp8.parallel.pipeline.interleaved import interleaved_order
    from megafp8.parallel.pipeline.schedules import one_f_one_b_order

    assert [(r["pp"], r["m"], r["v"]) for r in bubble_rows] == [(2, 2, 1), (2, 2, 2)]
    for row in bubble_rows:
        pp, m, v = row["pp"], row["m"], row["v"]
        for r in row["raw"]:
            assert r["layers"] == 2  # both of this rank's layers carry the injected cost
            want = (
                interleaved_order(pp, r["rank"], v, m)
                if v > 1
                else [(k, 0, j) for k, j in one_f_one_b_order(pp, r["rank"], m)]
            )
            per_chunk = 2 // v  # layers in each event
            for it in r["iterations"]:
                assert [e[:3] for e in it["events"]] == want
                for kind, _, _, t0, t1 in it["events"]:  # time.sleep sleeps at least that long
                    assert t1 - t0 >= per_chunk * SLEEP * (1 if kind == "F" else 2)
        _check_causality(row["raw"], pp, v)
        assert 0 < row["measured"] < 1 and all(0 < b < 1 for b in row["stages"])
        assert row["formula"] == pytest.approx((pp - 1) / (v * m + pp - 1))


def test_one_f_one_b_bubble_is_near_the_formula(bubble_rows):
    """pp 2, m 2: formula 1/3. With the sleeps the two stages' events take the same time up to
    overheads (the embedding on one, the loss on the other: tiny next to 30 ms of sleep per
    forward and backward); in 1F1B at pp 2, m 2 stage 0 taking r times stage 1's time gives a
    bubble of 1/(r + 2), so >= 1/3 - 0.05 allows stage 0 to be 1.5x slower. Above, each
    transfer and step between events lengthens the critical path (about 1 ms on the 2-core
    machine); + 0.25 allows about 9 ms per event on top of 30-60 ms of sleep."""
    row = bubble_rows[0]
    assert row["formula"] - 0.05 <= row["measured"] <= row["formula"] + 0.25


M = 3  # micro-batches: 2 before the boundary


@pytest.mark.slow
def test_zero2_reduces_every_micro_batch_zero1_once():
    """pp 2 x dp 2 (4 processes, 2 DeepSpeed engines each): exact byte counts."""
    rows = ZC.measure(pp=2, dp=2, ms=[M], zeros=[1, 2], layers=2, hidden=64)
    rows = {(r["zero"], r["stage"]): r for r in rows}
    assert len(rows) == 4 and all(r["dp_ranks_agree"] for r in rows.values())
    act = 32 * 2 * 64 * 4  # one activation [s, b, h] fp32
    for stage in (0, 1):
        z1, z2 = rows[(1, stage)], rows[(2, stage)]
        g = z1["grad_bytes"]
        assert z2["grad_bytes"] == g > 0
        # ZeRO-1: nothing on the DP group before the accumulation boundary, then one reduction
        # of the accumulated gradient and the all-gather of the updated weights
        assert z1["before_boundary_bytes"] == 0 and z1["before_boundary_calls"] == 0
        assert z1["dp_bytes"] >= 2 * g
        # ZeRO-2: each earlier micro-batch's backward reduces the whole gradient once more
        assert z2["before_boundary_bytes"] == (M - 1) * g and z2["before_boundary_calls"] > 0
        assert z2["dp_bytes"] - z1["dp_bytes"] == (M - 1) * g
        assert z2["dp_calls"] > z1["dp_calls"]
        # the pipeline's transfers do not depend on ZeRO: stage 0 sends M activations, stage 1
        # M activation gradients and the tied output layer's gradient [vocab 256, h]
        assert z1["p2p_bytes"] == z2["p2p_bytes"] == M * act + (256 * 64 * 4 if stage else 0)
