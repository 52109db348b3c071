"""FP8 amax reduction under TP x DP (the divergence of Megatron-LM #442).

Every rank that holds a shard or a replica of a tensor must use one scale for it. Reducing the
amaxes over DP only lets the two TP ranks of a layer pick different scales for the two halves of one
weight (and of one activation gradient): the sharded model is then no longer the single model. Our
reduction group is TP x DP, so all ranks agree.
"""

import torch

from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config


def _scales_after_step(group_kind):
    import torch.distributed as dist

    from megafp8.fp8.backend import build_backend
    from megafp8.model.gpt import GPTModel
    from megafp8.parallel.groups import ParallelGroups

    cfg = tiny_config(
        parallel=dict(tensor_model_parallel_size=2),
        fp8=dict(fp8_format="hybrid", fp8_recipe="delayed", fp8_amax_history_len=4),
    )
    groups = ParallelGroups.build(tp=2)
    amax_group = {"dp": groups.dp_group, "tp_dp": groups.tp_dp_group}[group_kind]
    backend = build_backend(cfg.fp8, amax_group=amax_group, tp_group=groups.tp_group)
    model = GPTModel(cfg, backend=backend, groups=groups, vocab_size=256)
    g = torch.Generator().manual_seed(100 + groups.coords.dp)  # each DP rank its own data
    tokens = torch.randint(0, 256, (2, 33), generator=g)
    model(tokens[:, :-1], tokens[:, 1:], None).backward()
    backend.update()
    names = sorted(backend.state.metas)
    mine = torch.stack([backend.state.metas[n].scale for n in names])
    everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
    dist.all_gather(everyone, mine)
    return names, torch.stack(everyone)  # [rank, meta]


def test_tp_dp_reduction_agrees_and_dp_only_does_not():
    names, ours = run_distributed(_scales_after_step, 4, "tp_dp")[0]
    assert torch.equal(ours, ours[0].expand_as(ours))  # one scale per tensor on all 4 ranks

    names, dp_only = run_distributed(_scales_after_step, 4, "dp")[0]
    # ranks 0 and 1 are the two TP ranks of DP replica 0 (Megatron order: tp fastest)
    differ = [n for i, n in enumerate(names) if dp_only[0, i] != dp_only[1, i]]
    assert any(n.endswith(".w") for n in differ)  # weight shards got different scales
    assert any(n.endswith(".g") for n in differ)  # and so did sharded activation gradients
    # the DP replicas still agree with each other: the mismatch is across TP only
    assert torch.equal(dp_only[0], dp_only[2]) and torch.equal(dp_only[1], dp_only[3])
