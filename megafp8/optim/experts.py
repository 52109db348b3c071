"""Expert parallelism in DeepSpeed's ZeRO 1/2: the experts' gradients are reduced and their
optimizer state sharded over the expert-data-parallel group, the dense parameters' over DP.

Under expert parallelism (ep > 1) the ranks of a DP group hold different experts, so an expert's
gradient must be summed only over its replicas (the expert-data-parallel group, dp / ep ranks)
and then divided by dp (every replica's gradient already holds the tokens its EP group sent it).
DeepSpeed's ZeRO 1/2 optimizer does exactly that for its MoE parameter groups: a parameter with
``allreduce = False`` and a ``group_name`` is reduced and partitioned over
``expert_data_parallel_group[group_name]``, divided by the DP size; the gradient norm sums every
partition over DP once (each expert counted once: the ranks of a DP group hold different
experts or different partitions). This module hands it our groups (``ParallelGroups.ep_group``
and ``edp_group``, registered under DeepSpeed's group name ``ep_size_<ep>``), splits the
parameter groups, and marks the model so that the engine takes that path. With ep = 1 none of
this is needed: experts are ordinary data-parallel parameters.
"""

from __future__ import annotations

import torch
from torch import nn


def group_name(ep: int) -> str:
    return f"ep_size_{ep}"  # DeepSpeed reads the EP size back from this name


def split_expert_groups(param_groups: list[dict], ep: int) -> list[dict]:
    """Each parameter group -> its dense part and its expert part (``moe=True``), same options."""
    out = []
    for g in param_groups:
        dense = [p for p in g["params"] if not getattr(p, "expert", False)]
        expert = [p for p in g["params"] if getattr(p, "expert", False)]
        if dense:
            out.append({**g, "params": dense})
        if expert:
            out.append({**g, "params": expert, "moe": True, "name": group_name(ep)})
    return out


def register_expert_groups(model: nn.Module, groups) -> None:
    """Make DeepSpeed's engine reduce and shard ``model``'s expert parameters over our
    expert-data-parallel group; call before ``deepspeed.initialize``."""
    from deepspeed.moe.layer import MoE
    from deepspeed.utils import groups as ds_groups

    name = group_name(groups.ep)
    for p in model.parameters():
        if getattr(p, "expert", False):
            p.allreduce, p.group_name = False, name
    ds_groups._EXPERT_PARALLEL_GROUP[name] = groups.ep_group
    ds_groups._EXPERT_PARALLEL_GROUP_RANKS[name] = list(groups.ranks["ep"])
    ds_groups._EXPERT_DATA_PARALLEL_GROUP[name] = groups.edp_group
    ds_groups._EXPERT_DATA_PARALLEL_GROUP_RANKS[name] = list(groups.ranks["edp"])

    class ExpertGroupMarker(MoE):
        """The engine finds MoE models by this class; it holds nothing (num_local_experts 0:
        DeepSpeed writes no per-expert files; checkpoint.py writes the experts)."""

        def __init__(self):
            nn.Module.__init__(self)
            self.expert_group_name, self.num_local_experts = name, 0
            self.num_experts, self.ep_size = 0, groups.ep

        def set_deepspeed_parallelism(self, use_data_before_expert_parallel_=False):
            pass

        def forward(self, *args):
            raise RuntimeError("the expert-group marker is not a layer")

    model._expert_group_marker = ExpertGroupMarker()


def expert_state(model: nn.Module) -> dict[str, torch.Tensor]:
    """This rank's expert parameters by their one-process names."""
    return {p.full_name: p.detach() for p in model.parameters() if getattr(p, "expert", False)}


def load_expert_state(model: nn.Module, sd: dict[str, torch.Tensor], path: str) -> None:
    """Copy ``sd`` (from ``path``) into this rank's experts; every expert must be there."""
    mine = [p for p in model.parameters() if getattr(p, "expert", False)]
    missing = [p.full_name for p in mine if p.full_name not in sd]
    if missing:
        raise ValueError(f"{path} lacks this rank's experts {missing[:4]} ({len(missing)})")
    with torch.no_grad():
        for p in mine:
            p.copy_(sd[p.full_name].to(p))


def expert_file(g) -> str:
    """The file of EP rank ``g.coords.ep``'s experts at this model-parallel (tp, pp) position."""
    return f"experts_ep_{g.coords.ep:02d}_mp_rank_{g.coords.tp + g.tp * g.coords.pp:02d}.pt"


def expert_files(g, model: nn.Module, backend) -> dict:
    """For checkpoint.save's ``rank_files``: under expert parallelism DeepSpeed's model file
    (written by DP rank 0) holds only EP rank 0's experts, so one replica (expert-DP rank 0) of
    every EP rank writes its experts and their FP8 state."""
    if g.ep == 1 or g.coords.edp != 0:
        return {}
    from megafp8.fp8.recipe import is_expert_key

    fp8 = {k: v for k, v in backend.state_dict().items() if is_expert_key(k)}
    return {expert_file(g): {"module": expert_state(model), "fp8": fp8}}


def load_experts(tag_dir: str, g, model: nn.Module, backend, engine, load_optim: bool) -> None:
    """This rank's experts and their FP8 state from the checkpoint in ``tag_dir``."""
    import os

    path = os.path.join(tag_dir, expert_file(g))
    if not os.path.isfile(path):
        raise ValueError(f"{path} is missing: the checkpoint lacks EP rank {g.coords.ep}'s experts")
    sd = torch.load(path, map_location="cpu", weights_only=True)
    load_expert_state(model, sd["module"], path)
    backend.load_state_dict(sd["fp8"])
    if not load_optim:  # the fresh fp32 master copies follow the loaded weights
        engine.optimizer._restore_from_bit16_weights()
