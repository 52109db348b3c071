"""Rank <-> coordinates over many layouts (no processes), and the groups on 4 gloo processes."""

import pytest

from megafp8.parallel.groups import (
    Layout,
    ParallelGroups,
    all_layouts,
    coords,
    group_ranks,
    rank_of,
)
from tests.helpers.dist import run_distributed


@pytest.mark.parametrize("layout", all_layouts(8), ids=str)
def test_coords_bijective_and_groups_partition(layout):
    seen = set()
    for r in range(layout.world_size):
        c = coords(r, layout)
        assert rank_of(c, layout) == r
        assert c.dp == c.ep + layout.ep * c.edp
        seen.add((c.tp, c.dp, c.pp))
    assert len(seen) == layout.world_size
    sizes = {
        "tp": layout.tp,
        "dp": layout.dp,
        "pp": layout.pp,
        "ep": layout.ep,
        "edp": layout.dp // layout.ep,
        "tp_dp": layout.tp * layout.dp,
        "tp_edp": layout.tp * layout.dp // layout.ep,
        "mp": layout.tp * layout.pp,
    }
    for kind, groups in group_ranks(layout).items():
        flat = sorted(r for g in groups for r in g)
        assert flat == list(range(layout.world_size)), kind  # a partition of the world
        assert all(len(g) == sizes[kind] for g in groups), kind


def test_megatron_order():
    # tp=2, pp=2, world 8 -> dp=2, as Megatron: tp [0,1],[2,3].., dp [0,2],[1,3],[4,6],[5,7]
    g = group_ranks(Layout(8, tp=2, pp=2))
    assert g["tp"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["dp"] == [[0, 2], [1, 3], [4, 6], [5, 7]]
    assert g["pp"] == [[0, 4], [1, 5], [2, 6], [3, 7]]
    g = group_ranks(Layout(8, tp=1, pp=1, ep=2))
    assert g["ep"] == [[0, 1], [2, 3], [4, 5], [6, 7]]
    assert g["edp"] == [[0, 2, 4, 6], [1, 3, 5, 7]]


def test_bad_layout():
    with pytest.raises(ValueError, match="world_size=6 is not divisible by tp=4"):
        Layout(6, tp=4)
    with pytest.raises(ValueError, match="ep=3"):
        Layout(4, ep=3)


def _groups_on_rank():
    import torch
    import torch.distributed as dist

    g = ParallelGroups.build(tp=2, pp=1)
    mpu = g.as_deepspeed_mpu()
    x = torch.tensor([float(g.rank)])
    dist.all_reduce(x, group=g.tp_group)
    y = torch.tensor([float(g.rank)])
    dist.all_reduce(y, group=g.dp_group)
    return (
        g.coords.tp,
        g.coords.dp,
        x.item(),
        y.item(),
        mpu.get_data_parallel_world_size(),
        mpu.get_model_parallel_world_size(),
        mpu.get_data_parallel_group_ranks(),
    )


def test_four_processes():
    res = run_distributed(_groups_on_rank, 4)
    # ranks 0,1 share a tp group (sum 1), 2,3 (sum 5); dp groups {0,2} (sum 2), {1,3} (sum 4)
    assert [r[:4] for r in res] == [
        (0, 0, 1.0, 2.0),
        (1, 0, 1.0, 4.0),
        (0, 1, 5.0, 2.0),
        (1, 1, 5.0, 4.0),
    ]
    assert all(r[4] == 2 and r[5] == 2 for r in res)
    assert res[1][6] == [1, 3]
