"""The interleaved 1F1B schedule as pure functions: the published order, deadlock freedom and
bubble of the orders of all ranks together (an event-time simulation), the virtual-stage
assignment, the validate rules and Megatron's --num-layers-per-virtual-pipeline-stage."""

import pytest

from megafp8.cli import parse_args
from megafp8.parallel.pipeline.interleaved import interleaved_order
from megafp8.parallel.pipeline.stages import chunk_stages
from megafp8.validate import validate
from tests.helpers.tiny import tiny_config

# Megatron's interleaved order, written out by hand. Event "F1.2" = forward of model chunk 1,
# micro-batch 2. The forwards of every rank run in groups of pp micro-batches per chunk
# (chunk 0 mb 0..pp-1, chunk 1 mb 0..pp-1, then chunk 0 mb pp..2pp-1, ...); the backwards the
# same with the chunks reversed (chunk v-1 first). Rank r first runs (pp - r - 1) x 2 +
# (v - 1) x pp forwards (capped at m x v), then alternates one forward and one backward, then
# runs the remaining backwards.
#
# pp 2, v 2, m 4: warm-up 4 forwards on rank 0, 2 on rank 1.
PP2_V2_M4 = {
    0: "F0.0 F0.1 F1.0 F1.1 F0.2 B1.0 F0.3 B1.1 F1.2 B0.0 F1.3 B0.1 B1.2 B1.3 B0.2 B0.3",
    1: "F0.0 F0.1 F1.0 B1.0 F1.1 B1.1 F0.2 B0.0 F0.3 B0.1 F1.2 B1.2 F1.3 B1.3 B0.2 B0.3",
}
# pp 4, v 2, m 8 (Narayanan et al. 2021, fig. 4 bottom): warm-up 10, 8, 6, 4 forwards.
_F = "F0.0 F0.1 F0.2 F0.3 F1.0 F1.1 F1.2 F1.3 "
PP4_V2_M8 = {
    0: _F + "F0.4 F0.5 F0.6 B1.0 F0.7 B1.1 F1.4 B1.2 F1.5 B1.3 F1.6 B0.0 F1.7 B0.1 "
    "B0.2 B0.3 B1.4 B1.5 B1.6 B1.7 B0.4 B0.5 B0.6 B0.7",
    1: _F + "F0.4 B1.0 F0.5 B1.1 F0.6 B1.2 F0.7 B1.3 F1.4 B0.0 F1.5 B0.1 F1.6 B0.2 F1.7 B0.3 "
    "B1.4 B1.5 B1.6 B1.7 B0.4 B0.5 B0.6 B0.7",
    2: "F0.0 F0.1 F0.2 F0.3 F1.0 F1.1 F1.2 B1.0 F1.3 B1.1 F0.4 B1.2 F0.5 B1.3 F0.6 B0.0 "
    "F0.7 B0.1 F1.4 B0.2 F1.5 B0.3 F1.6 B1.4 F1.7 B1.5 B1.6 B1.7 B0.4 B0.5 B0.6 B0.7",
    3: "F0.0 F0.1 F0.2 F0.3 F1.0 B1.0 F1.1 B1.1 F1.2 B1.2 F1.3 B1.3 F0.4 B0.0 F0.5 B0.1 "
    "F0.6 B0.2 F0.7 B0.3 F1.4 B1.4 F1.5 B1.5 F1.6 B1.6 F1.7 B1.7 B0.4 B0.5 B0.6 B0.7",
}


def _str(order):
    return " ".join(f"{k}{c}.{j}" for k, c, j in order)


def test_interleaved_order_is_the_published_table():
    for rank, want in PP2_V2_M4.items():
        assert _str(interleaved_order(2, rank, 2, 4)) == want, rank
    for rank, want in PP4_V2_M8.items():
        assert _str(interleaved_order(4, rank, 2, 8)) == want, rank
    with pytest.raises(ValueError, match=r"micro-batches per iteration \(6\) to be a multiple"):
        interleaved_order(4, 0, 2, 6)


def simulate(pp, v, m, tf=1.0, tb=2.0):
    """Run every rank's order with blocking receives and asynchronous sends: a chunk forward
    takes ``tf``, a chunk backward ``tb``, transfers are free. Returns (makespan, per-rank
    order of completion), or None on deadlock (no rank can take its next event)."""
    orders = [interleaved_order(pp, r, v, m) for r in range(pp)]
    finish, pos, free, n = {}, [0] * pp, [0.0] * pp, pp * v
    while any(pos[r] < len(orders[r]) for r in range(pp)):
        moved = False
        for r in range(pp):
            while pos[r] < len(orders[r]):
                kind, c, j = orders[r][pos[r]]
                s = c * pp + r  # virtual stage
                dep = ("F", s - 1, j) if kind == "F" and s > 0 else None
                dep = ("B", s + 1, j) if kind == "B" and s < n - 1 else dep
                if kind == "B":
                    assert ("F", s, j) in finish  # own forward first
                if dep is not None and dep not in finish:
                    break
                start = max(free[r], finish[dep] if dep else 0.0)
                free[r] = finish[(kind, s, j)] = start + (tf if kind == "F" else tb)
                pos[r] += 1
                moved = True
        if not moved:
            return None
    return max(free)


@pytest.mark.parametrize(
    "pp,v,m", [(2, 2, 2), (2, 2, 4), (2, 3, 8), (3, 2, 6), (4, 2, 4), (4, 2, 8), (4, 4, 16)]
)
def test_orders_never_deadlock_and_the_bubble_is_megatrons(pp, v, m):
    """The ranks' orders together complete (no rank waits forever on a receive), and with a
    chunk's forward 1 and backward 2 the iteration lasts 3 (m v + pp - 1): a bubble of
    (pp - 1) / (v m + pp - 1) of it, Megatron's formula (1F1B: v = 1)."""
    makespan = simulate(pp, v, m)
    assert makespan is not None
    assert makespan == 3 * (m * v + pp - 1)
    assert 1 - 3 * m * v / makespan == pytest.approx((pp - 1) / (v * m + pp - 1))


def test_each_chunk_starts_at_micro_batch_0_and_in_flight_is_bounded():
    """TE's weight cache casts on micro-batch 0: each chunk's first forward of the iteration
    must be micro-batch 0. At most warm-up + 1 chunk-forwards are in flight."""
    for pp, v, m in [(2, 2, 4), (4, 2, 8), (4, 3, 8), (2, 2, 2)]:
        for r in range(pp):
            order = interleaved_order(pp, r, v, m)
            firsts = {}
            depth = peak = 0
            for kind, c, j in order:
                if kind == "F":
                    firsts.setdefault(c, j)
                depth += 1 if kind == "F" else -1
                peak = max(peak, depth)
            assert firsts == dict.fromkeys(range(v), 0)
            warmup = min((pp - r - 1) * 2 + (v - 1) * pp, m * v)
            assert peak == min(warmup + 1, m * v)
            assert sorted(order) == sorted([(k, c, j) for k in "FB" for c in range(v)
                                            for j in range(m)])  # fmt: skip


def test_chunk_stages_follow_megatrons_assignment():
    cfg = tiny_config(model=dict(num_layers=8), parallel=dict(
        pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2))  # fmt: skip
    # blocks of 2 layers: rank 0 gets blocks 0 and 2, rank 1 blocks 1 and 3
    assert [s.layers for s in chunk_stages(cfg, 0)] == [(0, 1), (4, 5)]
    assert [s.layers for s in chunk_stages(cfg, 1)] == [(2, 3), (6, 7)]
    firsts = [(s.first, s.last) for r in (0, 1) for s in chunk_stages(cfg, r)]
    assert firsts == [(True, False), (False, False), (False, False), (False, True)]


V2 = dict(virtual_pipeline_model_parallel_size=2)


@pytest.mark.parametrize(
    "sections,world,msg",
    [
        (dict(parallel=V2), 1, "virtual_pipeline_model_parallel_size=2 needs pipeline_model"),
        (
            dict(model=dict(num_layers=6), parallel=dict(pipeline_model_parallel_size=2, **V2)),
            2,
            "num_layers=6 is not divisible by pipeline_model_parallel_size=2 x virtual_pipeline",
        ),
        (
            dict(
                model=dict(num_layers=8),
                parallel=dict(
                    pipeline_model_parallel_size=2, decoder_first_pipeline_num_layers=2, **V2
                ),
            ),
            2,
            "uneven stages are not available with the interleaved schedule",
        ),  # fmt: skip
        (
            dict(
                model=dict(num_layers=8),
                parallel=dict(pipeline_model_parallel_size=4, **V2),
                train=dict(global_batch_size=12),
            ),
            4,
            r"= 6\) to be a multiple of pipeline_model_parallel_size=4",
        ),  # fmt: skip
    ],
)
def test_validate_interleaved_rules(sections, world, msg):
    with pytest.raises(ValueError, match=msg) as e:
        validate(tiny_config(**sections), world)
    assert "\n" not in str(e.value)


def test_validate_accepts_interleaving():
    ok = dict(pipeline_model_parallel_size=2, **V2)
    assert validate(tiny_config(model=dict(num_layers=4), parallel=ok), 4) == 2


ARGS = ["--mock-data", "--hidden-size", "64", "--num-attention-heads", "4", "--seq-length",
        "32", "--micro-batch-size", "1", "--global-batch-size", "4"]  # fmt: skip


def test_megatron_layers_per_virtual_stage_flag():
    pp2 = ["--num-layers", "8", "--pipeline-model-parallel-size", "2"]
    cfg = parse_args(ARGS + pp2 + ["--num-layers-per-virtual-pipeline-stage", "2"], notices=[])
    assert cfg.parallel.virtual_pipeline_model_parallel_size == 2  # 8 / (2 x 2)
    with pytest.raises(ValueError, match="num_layers=8 must be a multiple of pipeline_model"):
        parse_args(ARGS + pp2 + ["--num-layers-per-virtual-pipeline-stage", "3"], notices=[])
    both = ["--num-layers-per-virtual-pipeline-stage", "1",
            "--virtual-pipeline-model-parallel-size", "2"]  # fmt: skip
    with pytest.raises(ValueError, match="gives virtual_pipeline_model_parallel_size=4"):
        parse_args(ARGS + pp2 + both, notices=[])
