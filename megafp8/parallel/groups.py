"""Process groups as one frozen object, built from a rank grid.

Rank order, fastest-varying first, as Megatron: tp, ep (within dp), dp, pp. So

    rank = tp_rank + tp * (dp_rank + dp * pp_rank),   dp_rank = ep_rank + ep * expert_dp_rank

``coords(rank, ...)`` is that map, a pure function testable without processes.
``ParallelGroups.build``
creates every group on every rank (torch.distributed requires all ranks to create all groups in the
same order) and keeps the ones this rank belongs to. Size-1 groups are real groups
too; collectives skip
communication for them.
"""

from __future__ import annotations

from dataclasses import dataclass
from itertools import product
from typing import Any

import torch.distributed as dist

from megafp8.parallel.mappings import SOLO


@dataclass(frozen=True)
class Coords:
    tp: int
    dp: int
    pp: int
    ep: int
    edp: int  # expert-data-parallel rank: position among replicas of the same experts


@dataclass(frozen=True)
class Layout:
    world_size: int
    tp: int = 1
    pp: int = 1
    ep: int = 1

    def __post_init__(self):
        if self.world_size % (self.tp * self.pp):
            raise ValueError(
                f"world_size={self.world_size} is not divisible by tp={self.tp} x pp={self.pp}"
            )
        if self.dp % self.ep:
            raise ValueError(f"ep={self.ep} must divide the data-parallel size {self.dp}")

    @property
    def dp(self) -> int:
        return self.world_size // (self.tp * self.pp)


def coords(rank: int, layout: Layout) -> Coords:
    """Rank -> grid coordinates (tp fastest, then ep within dp, then dp, then pp)."""
    if not 0 <= rank < layout.world_size:
        raise ValueError(f"rank={rank} outside world_size={layout.world_size}")
    tp_rank = rank % layout.tp
    dp_rank = (rank // layout.tp) % layout.dp
    pp_rank = rank // (layout.tp * layout.dp)
    return Coords(
        tp=tp_rank, dp=dp_rank, pp=pp_rank, ep=dp_rank % layout.ep, edp=dp_rank // layout.ep
    )


def rank_of(c: Coords | dict, layout: Layout) -> int:
    """Inverse of ``coords`` (``ep``/``edp`` are implied by ``dp``)."""
    c = c if isinstance(c, dict) else {"tp": c.tp, "dp": c.dp, "pp": c.pp}
    return c["tp"] + layout.tp * (c["dp"] + layout.dp * c["pp"])


def group_ranks(layout: Layout) -> dict[str, list[list[int]]]:
    """Every group of every kind, as sorted rank lists, in a deterministic order."""
    cs = [coords(r, layout) for r in range(layout.world_size)]
    keys = {
        "tp": lambda c: (c.dp, c.pp),
        "dp": lambda c: (c.tp, c.pp),
        "pp": lambda c: (c.tp, c.dp),
        "ep": lambda c: (c.tp, c.pp, c.edp),
        "edp": lambda c: (c.tp, c.pp, c.ep),
        "tp_dp": lambda c: (c.pp,),  # FP8 amax reduction: every rank holding a shard or replica
        "tp_edp": lambda c: (c.pp, c.ep),  # the same, for the experts: their replicas only
        "mp": lambda c: (c.dp,),  # model parallel = tp x pp
    }
    out: dict[str, list[list[int]]] = {}
    for name, key in keys.items():
        buckets: dict[Any, list[int]] = {}
        for r, c in enumerate(cs):
            buckets.setdefault(key(c), []).append(r)
        out[name] = sorted(buckets.values())
    return out


@dataclass(frozen=True)
class ParallelGroups:
    """This rank's groups and coordinates. Pass it to containers; leaf layers take one group."""

    layout: Layout
    rank: int
    coords: Coords
    tp_group: Any
    dp_group: Any
    pp_group: Any
    ep_group: Any
    edp_group: Any
    tp_dp_group: Any
    mp_group: Any
    ranks: dict  # kind -> this rank's group as a rank list
    tp_edp_group: Any = SOLO  # every replica of this rank's experts (TP x expert-DP)
    kv_heads: int | None = None  # the kv heads the kv-replica groups were built for
    kv_group: Any = SOLO  # the TP ranks sharing this rank's kv head (when tp > kv heads)
    embedding_group: Any = SOLO  # first + last stage of this pipeline (SOLO on middle stages)

    @classmethod
    def build(
        cls,
        tp: int = 1,
        pp: int = 1,
        ep: int = 1,
        kv_heads: int | None = None,
        backend: str | None = None,
    ) -> ParallelGroups:
        """Create all groups; torch.distributed must already be initialized. ``kv_heads``: the
        model's kv heads, for the kv-replica groups a model with tp > kv heads needs."""
        world, rank = dist.get_world_size(), dist.get_rank()
        layout = Layout(world, tp, pp, ep)
        mine: dict[str, Any] = {}
        my_ranks: dict[str, list[int]] = {}
        for name, groups in group_ranks(layout).items():
            for ranks in groups:
                if len(ranks) == world:
                    g = dist.group.WORLD
                else:
                    g = dist.new_group(ranks, backend=backend)
                if rank in ranks:
                    mine[name], my_ranks[name] = g, ranks
        mine["emb"] = SOLO  # middle stages hold no embedding; pp = 1: first is last
        for ranks in embedding_ranks(layout) if pp > 1 else []:
            g = dist.group.WORLD if len(ranks) == world else dist.new_group(ranks, backend=backend)
            if rank in ranks:
                mine["emb"], my_ranks["emb"] = g, ranks
        kv_group = SOLO
        for ranks in kv_replica_ranks(layout, kv_heads):
            g = dist.new_group(ranks, backend=backend)  # every rank creates every group
            if rank in ranks:
                kv_group, my_ranks["kv"] = g, ranks
        return cls(
            layout=layout,
            rank=rank,
            coords=coords(rank, layout),
            tp_group=mine["tp"],
            dp_group=mine["dp"],
            pp_group=mine["pp"],
            ep_group=mine["ep"],
            edp_group=mine["edp"],
            tp_dp_group=mine["tp_dp"],
            mp_group=mine["mp"],
            tp_edp_group=mine["tp_edp"],
            ranks=my_ranks,
            kv_heads=kv_heads,
            kv_group=kv_group,
            embedding_group=mine["emb"],
        )

    @classmethod
    def single(cls) -> ParallelGroups:
        """One process with no torch.distributed: every group is ``SOLO`` (size 1)."""
        layout = Layout(1)
        return cls(
            layout=layout,
            rank=0,
            coords=coords(0, layout),
            tp_group=SOLO,
            dp_group=SOLO,
            pp_group=SOLO,
            ep_group=SOLO,
            edp_group=SOLO,
            tp_dp_group=SOLO,
            mp_group=SOLO,
            ranks={k: [0] for k in ("tp", "dp", "pp", "ep", "edp", "tp_dp", "tp_edp", "mp", "emb")},
        )

    @property
    def tp(self) -> int:
        return self.layout.tp

    @property
    def dp(self) -> int:
        return self.layout.dp

    @property
    def pp(self) -> int:
        return self.layout.pp

    @property
    def ep(self) -> int:
        return self.layout.ep

    def all_tp_groups(self) -> list[list[int]]:
        """Every TP group of the world, in creation order."""
        return group_ranks(self.layout)["tp"]

    def kv_replica_group(self, kv_heads: int):
        """The group over which a model with ``kv_heads`` sums its replicated k/v rows' gradients:
        ``SOLO`` when tp <= kv heads (nothing is replicated), else the TP ranks sharing this
        rank's kv head, which ``build(kv_heads=...)`` must have created."""
        if self.tp <= kv_heads:
            return SOLO
        if self.kv_heads != kv_heads:
            raise ValueError(
                f"the model has {kv_heads} kv heads at tp={self.tp} (replicated k/v), but the "
                f"process groups were built for kv_heads={self.kv_heads}: "
                f"ParallelGroups.build(..., kv_heads={kv_heads})"
            )
        return self.kv_group

    def as_deepspeed_mpu(self) -> DeepSpeedMpu:
        return DeepSpeedMpu(self)


class DeepSpeedMpu:
    """The ``mpu`` object DeepSpeed accepts: ZeRO shards over the data-parallel group only."""

    def __init__(self, g: ParallelGroups):
        self._g = g

    def get_data_parallel_group(self):
        return self._g.dp_group

    def get_data_parallel_rank(self):
        return self._g.coords.dp

    def get_data_parallel_world_size(self):
        return self._g.dp

    def get_model_parallel_group(self):
        return self._g.mp_group

    def get_model_parallel_rank(self):
        return self._g.coords.tp + self._g.tp * self._g.coords.pp

    def get_model_parallel_world_size(self):
        return self._g.tp * self._g.pp

    def get_tensor_model_parallel_group(self):
        return self._g.tp_group

    def get_tensor_model_parallel_rank(self):
        return self._g.coords.tp

    def get_tensor_model_parallel_world_size(self):
        return self._g.tp

    def get_pipeline_model_parallel_group(self):
        return self._g.pp_group

    def get_pipeline_model_parallel_rank(self):
        return self._g.coords.pp

    def get_pipeline_model_parallel_world_size(self):
        return self._g.pp

    get_pipe_parallel_group = get_pipeline_model_parallel_group
    get_pipe_parallel_rank = get_pipeline_model_parallel_rank
    get_pipe_parallel_world_size = get_pipeline_model_parallel_world_size
    get_slice_parallel_group = get_model_parallel_group
    get_slice_parallel_rank = get_model_parallel_rank
    get_slice_parallel_world_size = get_model_parallel_world_size

    def get_data_parallel_group_ranks(self):
        return list(self._g.ranks["dp"])

    def get_tensor_model_parallel_src_rank(self):
        return self._g.ranks["tp"][0]

    def get_sequence_parallel_world_size(self):
        return 1

    def get_sequence_parallel_rank(self):
        return 0

    def get_sequence_parallel_group(self):
        return None

    def get_sequence_data_parallel_world_size(self):
        return self._g.dp

    def get_sequence_data_parallel_group(self):
        return self._g.dp_group

    def get_sequence_data_parallel_rank(self):
        return self._g.coords.dp


def embedding_ranks(layout: Layout) -> list[list[int]]:
    """The embedding groups: for each (tp, dp) position, the first and the last pipeline stage's
    ranks (one rank when pp = 1), which hold the two copies of the tied word embedding."""
    out = []
    for ranks in group_ranks(layout)["pp"]:  # sorted: stage 0 first, the last stage last
        out.append(sorted({ranks[0], ranks[-1]}))
    return out


def kv_replica_ranks(layout: Layout, kv_heads: int | None) -> list[list[int]]:
    """When tp exceeds the kv heads, each kv head is held by tp / kv consecutive ranks of a TP
    group: those rank lists, for every TP group, in creation order (none when tp <= kv)."""
    if kv_heads is None or layout.tp <= kv_heads:
        return []
    if layout.tp % kv_heads:
        raise ValueError(f"tp={layout.tp} is not a multiple of kv_heads={kv_heads}")
    share = layout.tp // kv_heads
    out = []
    for tp_ranks in group_ranks(layout)["tp"]:
        out += [tp_ranks[g * share : (g + 1) * share] for g in range(kv_heads)]
    return out


def all_layouts(max_world: int) -> list[Layout]:
    """Every valid (world, tp, pp, ep) up to ``max_world``: used by the tests."""
    out = []
    for w, tp, pp, ep in product(range(1, max_world + 1), repeat=4):
        if w % (tp * pp) == 0 and (w // (tp * pp)) % ep == 0:
            out.append(Layout(w, tp, pp, ep))
    return out
