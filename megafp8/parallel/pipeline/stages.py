"""Which decoder layers each pipeline stage holds, and what else it holds.

Layers are split over the ``pp`` stages in order: evenly by default, or with
``decoder_first_pipeline_num_layers`` / ``decoder_last_pipeline_num_layers`` fixing the first and
last stage and the remaining layers split evenly over the stages in between. The first stage also
holds the word (and position) embedding; the last holds the final norm, the output layer and the
loss. Layers keep their global index (in parameter names, seeds and FP8 scaling names), so stage
``k`` holds exactly the single-process weights of its layers.

Interleaved schedule (``virtual_pipeline_model_parallel_size`` v > 1): the layers are split into
``pp x v`` consecutive blocks, the virtual stages; pipeline rank ``r`` holds v model chunks, chunk
``c`` being virtual stage ``c x pp + r`` (Megatron's assignment: rank r gets blocks r, r + pp,
r + 2 pp, ...). Virtual stage 0 (rank 0, chunk 0) holds the embedding, the last one (rank pp - 1,
chunk v - 1) the final norm, output layer and loss. A chunk is a ``Stage`` over the ``pp x v``
virtual stages, so the model builds it as it builds a stage.

The tied word embedding: the last stage keeps a copy used as the output layer (same seed, same
values); the embedding group (first + last stage of each pipeline, ``ParallelGroups``) keeps the
two copies identical (``schedules.py``).
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Stage:
    """Stage ``rank`` of ``pp``: its global layer indices ``layers`` (consecutive). Under the
    interleaved schedule a model chunk: ``rank`` is its virtual stage, ``pp`` = pp x v."""

    rank: int
    pp: int
    layers: tuple[int, ...]

    @property
    def first(self) -> bool:
        return self.rank == 0

    @property
    def last(self) -> bool:
        return self.rank == self.pp - 1

    @classmethod
    def whole(cls, num_layers: int) -> Stage:
        """One process (pp = 1): every layer, embedding and loss."""
        return cls(0, 1, tuple(range(num_layers)))


def layer_counts(
    num_layers: int, pp: int, first: int | None = None, last: int | None = None
) -> list[int]:
    """Layers per stage. Raises ValueError (naming the values) when they do not fit."""
    if pp < 1 or num_layers < 1:
        raise ValueError(
            f"num_layers={num_layers} and pipeline_model_parallel_size={pp} must be >= 1"
        )
    if pp == 1:
        return [num_layers]
    if num_layers < pp and first is None and last is None:
        raise ValueError(
            f"pipeline_model_parallel_size={pp} is larger than num_layers={num_layers}"
        )
    fixed = {0: first, pp - 1: last}
    for name, v in (("first", first), ("last", last)):
        if v is not None and not 0 <= v <= num_layers:
            raise ValueError(
                f"decoder_{name}_pipeline_num_layers={v} must be in [0, num_layers={num_layers}]"
            )
    given = {k: v for k, v in fixed.items() if v is not None}
    rest, n_rest = num_layers - sum(given.values()), pp - len(given)
    if rest < 0 or (n_rest == 0 and rest != 0) or (n_rest and rest % n_rest):
        raise ValueError(
            f"num_layers={num_layers} does not split over pipeline_model_parallel_size={pp}: "
            f"{rest} layers left for the {n_rest} stage(s) without a fixed count "
            f"(decoder_first_pipeline_num_layers={first}, decoder_last_pipeline_num_layers={last})"
        )
    each = rest // n_rest if n_rest else 0
    return [given.get(k, each) for k in range(pp)]


def stage_of(cfg, pp_rank: int) -> Stage:
    """This pipeline rank's stage under ``cfg``."""
    p = cfg.parallel
    pp = p.pipeline_model_parallel_size
    counts = layer_counts(
        cfg.model.num_layers,
        pp,
        p.decoder_first_pipeline_num_layers,
        p.decoder_last_pipeline_num_layers,
    )
    start = sum(counts[:pp_rank])
    return Stage(pp_rank, pp, tuple(range(start, start + counts[pp_rank])))


def virtual_size(cfg) -> int:
    """v: model chunks per pipeline rank (1 without the interleaved schedule)."""
    return cfg.parallel.virtual_pipeline_model_parallel_size or 1


def chunk_stages(cfg, pp_rank: int) -> list[Stage]:
    """This pipeline rank's model chunks, in chunk order: chunk ``c`` is virtual stage
    ``c x pp + pp_rank`` of ``pp x v``, holding the ``num_layers / (pp x v)`` layers of that block.
    Without virtual stages: ``[stage_of(cfg, pp_rank)]``."""
    v, pp = virtual_size(cfg), cfg.parallel.pipeline_model_parallel_size
    if v == 1:
        return [stage_of(cfg, pp_rank)]
    n_stages, n_layers = pp * v, cfg.model.num_layers
    if n_layers % n_stages:
        raise ValueError(
            f"num_layers={n_layers} is not divisible by pipeline_model_parallel_size={pp} "
            f"x virtual_pipeline_model_parallel_size={v}"
        )
    each = n_layers // n_stages
    out = []
    for c in range(v):
        k = c * pp + pp_rank
        out.append(Stage(k, n_stages, tuple(range(k * each, (k + 1) * each))))
    return out
