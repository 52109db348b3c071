"""Pipeline stages, the 1F1B order and the pipeline rules of validate: pure functions, no
processes."""

import pytest

from megafp8.parallel.groups import Layout, embedding_ranks
from megafp8.parallel.pipeline.schedules import one_f_one_b_order
from megafp8.parallel.pipeline.stages import Stage, layer_counts, stage_of
from megafp8.validate import validate
from tests.helpers.tiny import tiny_config


def test_even_and_uneven_splits():
    assert layer_counts(8, 4) == [2, 2, 2, 2]
    assert layer_counts(8, 1) == [8]
    assert layer_counts(6, 4, first=1, last=1) == [1, 2, 2, 1]
    assert layer_counts(7, 3, first=3) == [3, 2, 2]
    assert layer_counts(5, 2, last=2) == [3, 2]
    assert layer_counts(4, 2, first=0, last=4) == [0, 4]  # an embedding-only first stage
    cfg = tiny_config(model=dict(num_layers=6), parallel=dict(
        pipeline_model_parallel_size=4, decoder_first_pipeline_num_layers=1,
        decoder_last_pipeline_num_layers=1))  # fmt: skip
    stages = [stage_of(cfg, k) for k in range(4)]
    assert [s.layers for s in stages] == [(0,), (1, 2), (3, 4), (5,)]
    assert [(s.first, s.last) for s in stages] == [(1, 0), (0, 0), (0, 0), (0, 1)]
    assert Stage.whole(3).first and Stage.whole(3).last and Stage.whole(3).layers == (0, 1, 2)


@pytest.mark.parametrize(
    "args,msg",
    [
        ((3, 2), "num_layers=3 does not split over pipeline_model_parallel_size=2"),
        ((2, 4), "pipeline_model_parallel_size=4 is larger than num_layers=2"),
        ((7, 4, 1, 1), "5 layers left for the 2 stage"),
        ((4, 2, 9, None), r"decoder_first_pipeline_num_layers=9 must be in \[0, num_layers=4\]"),
        ((4, 2, 1, 1), "2 layers left for the 0 stage"),
    ],
)
def test_bad_splits(args, msg):
    with pytest.raises(ValueError, match=msg):
        layer_counts(*args)


# Megatron's non-interleaved 1F1B (Narayanan et al., 2021, fig. 4 top): pp = 4, m = 8.
PUBLISHED_1F1B = {
    0: "F0 F1 F2 F3 B0 F4 B1 F5 B2 F6 B3 F7 B4 B5 B6 B7",
    1: "F0 F1 F2 B0 F3 B1 F4 B2 F5 B3 F6 B4 F7 B5 B6 B7",
    2: "F0 F1 B0 F2 B1 F3 B2 F4 B3 F5 B4 F6 B5 F7 B6 B7",
    3: "F0 B0 F1 B1 F2 B2 F3 B3 F4 B4 F5 B5 F6 B6 F7 B7",
}


def _str(order):
    return " ".join(f"{k}{j}" for k, j in order)


def test_one_f_one_b_order_is_the_published_table():
    for rank, want in PUBLISHED_1F1B.items():
        assert _str(one_f_one_b_order(4, rank, 8)) == want
    # fewer micro-batches than stages: the warm-up is cut to m
    assert _str(one_f_one_b_order(4, 0, 2)) == "F0 F1 B0 B1"
    assert _str(one_f_one_b_order(1, 0, 3)) == "F0 B0 F1 B1 F2 B2"


def test_in_flight_never_exceeds_pp_minus_rank():
    for pp in (2, 3, 4):
        for m in (1, 2, 5, 8):
            for rank in range(pp):
                depth = peak = 0
                for kind, _ in one_f_one_b_order(pp, rank, m):
                    depth += 1 if kind == "F" else -1
                    peak = max(peak, depth)
                assert peak == min(pp - rank, m)


def test_embedding_groups():
    # tp=2, pp=4, world 16 -> dp=2: first stage ranks 0-3, last stage 12-15
    assert embedding_ranks(Layout(16, tp=2, pp=4)) == [[0, 12], [1, 13], [2, 14], [3, 15]]
    assert embedding_ranks(Layout(2, pp=1)) == [[0], [1]]


PP2 = dict(pipeline_model_parallel_size=2)


@pytest.mark.parametrize(
    "sections,world,msg",
    [
        (dict(parallel=dict(pipeline_model_parallel_size=4)), 4, "is larger than num_layers=2"),
        (
            dict(model=dict(num_layers=3), parallel=PP2),
            2,
            "num_layers=3 is not divisible by pipeline_model_parallel_size=2",
        ),
        (
            dict(parallel=dict(virtual_pipeline_model_parallel_size=2, **PP2)),
            2,
            "num_layers=2 is not divisible by pipeline_model_parallel_size=2 x virtual",
        ),
        (dict(parallel=PP2, optim=dict(zero_stage=3)), 2, "zero_stage=3 with pipeline"),
        (
            dict(parallel=dict(decoder_first_pipeline_num_layers=1)),
            1,
            "need pipeline_model_parallel_size > 1",
        ),
        (
            dict(
                model=dict(num_layers=5),
                parallel=dict(decoder_last_pipeline_num_layers=2, pipeline_model_parallel_size=3),
            ),
            3,
            "num_layers=5 does not split over pipeline_model_parallel_size=3: 3 layers left",
        ),
    ],
)
def test_validate_pipeline_rules(sections, world, msg):
    with pytest.raises(ValueError, match=msg):
        validate(tiny_config(**sections), world)


def test_validate_accepts_pipelines():
    assert validate(tiny_config(model=dict(num_layers=4), parallel=PP2), 8) == 4
    uneven = dict(decoder_first_pipeline_num_layers=3, **PP2)
    assert validate(tiny_config(model=dict(num_layers=5), parallel=uneven), 2) == 1
