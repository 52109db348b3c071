"""FP8 formats, recipes and scaling state, shared by every backend.

Math (per scaled tensor, "tensorwise"):

    scale     = fp8_max / amax / 2**margin        (kept when amax is 0 or not finite)
    x_fp8     = cast(clamp(x * scale, -fp8_max, fp8_max))
    x         ~= x_fp8 * (1 / scale)

Delayed scaling: ``amax`` comes from a history of the last ``history_len`` amaxes (``max`` of the
history or ``most_recent``), so the scale used at step t was computed at step t-1. Each use records
the tensor's amax in slot 0; ``Fp8State.update()`` reduces slot 0 of every tensor with one MAX
all-reduce over the amax group, recomputes the scales and rolls the histories.
Current scaling ("tensorwise"): the scale comes from the tensor's own amax at cast time,
reduced over
the group that holds shards of it (the TP group), so every shard shares one scale.
Formats: E4M3 everywhere, or HYBRID (E4M3 forward: activations and weights; E5M2 gradients).

Activation recompute: a checkpointed region's forward runs under ``Fp8State.recording(tape)``,
which keeps the scale each cast used, in order; its recomputation in the backward runs under
``Fp8State.replaying(tape)``, which casts with those same scales and records no amax. The
recomputed FP8 values are then the first forward's, and the amax histories see each forward once.

Health statistics (``--log-fp8-stats``): between ``Fp8State.start_stats()`` and ``take_stats()``
the first cast of each tensor role (that of the iteration's first micro-batch) also records its
amax, the scale it was cast with, and the shares of its values that saturated (|x| scale beyond
the format's max, clamped) and that flushed to zero (non-zero values cast to 0).

Overflow watch (``--fp8-overflow-fallback-steps``, ``Fp8State.watch_overflow(share)``): every cast
(every role, every micro-batch; not a recompute's replay) also records whether it *overflowed*:
the tensor held a NaN or inf, or more than ``share`` of its values saturated. ``take_overflow()``
hands over, per GEMM, a 0/1 flag (a device tensor, no host sync) since the previous call.
"""

from __future__ import annotations

import contextlib
from dataclasses import dataclass

import torch
import torch.distributed as dist

from megafp8.parallel.mappings import world

E4M3 = torch.float8_e4m3fn
E5M2 = torch.float8_e5m2
FP8_MAX = {E4M3: 448.0, E5M2: 57344.0}


@dataclass(frozen=True)
class Fp8Recipe:
    fp8_format: str = "hybrid"  # "e4m3" | "hybrid"
    recipe: str = "delayed"  # "delayed" | "tensorwise" | "mxfp8" (te backend only)
    margin: int = 0
    amax_history_len: int = 1024
    amax_compute_algo: str = "max"  # "max" | "most_recent"

    @classmethod
    def from_config(cls, f) -> Fp8Recipe:
        return cls(
            f.fp8_format,
            f.fp8_recipe,
            f.fp8_margin,
            f.fp8_amax_history_len,
            f.fp8_amax_compute_algo,
        )

    def dtype(self, role: str) -> torch.dtype:
        """``role`` is "x" (input), "w" (weight) or "g" (output gradient)."""
        return E5M2 if (role == "g" and self.fp8_format == "hybrid") else E4M3


def compute_scale(
    amax: torch.Tensor, scale: torch.Tensor, fp8_max: float, margin: int
) -> torch.Tensor:
    """``fp8_max / amax / 2**margin``; where amax is 0, inf or nan, the previous scale stays."""
    sf = (fp8_max / amax) / (2.0**margin)
    sf = torch.where(amax > 0.0, sf, scale)
    return torch.where(torch.isfinite(amax), sf, scale)


def cast_to_fp8(x: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """Saturating cast: values beyond the format's max clamp to +-max (never inf or nan)."""
    m = FP8_MAX[dtype]
    return (x.float() * scale).clamp_(-m, m).to(dtype)


class ScalingMeta:
    """Scaling state of one tensor role of one GEMM (input, weight or gradient)."""

    def __init__(self, recipe: Fp8Recipe, role: str, device=None, owner: Fp8State | None = None):
        self.recipe, self.role, self.owner = recipe, role, owner
        self.dtype = recipe.dtype(role)
        self.fp8_max = FP8_MAX[self.dtype]
        n = recipe.amax_history_len if recipe.recipe == "delayed" else 1
        self.amax_history = torch.zeros(n, dtype=torch.float32, device=device)
        self.scale = torch.ones((), dtype=torch.float32, device=device)
        self.pending = False  # an amax was recorded since the last update
        self.key = role  # "<gemm name>.<role>" once its state names it

    def to(self, device) -> ScalingMeta:
        self.amax_history = self.amax_history.to(device)
        self.scale = self.scale.to(device)
        return self

    def quantize(self, x: torch.Tensor, group) -> tuple[torch.Tensor, torch.Tensor]:
        """Return ``(x_fp8, scale_inv)``. Current scaling reduces the amax over ``group`` now."""
        if self.amax_history.device != x.device:
            self.to(x.device)
        tape = self.owner.tape if self.owner is not None else None
        if tape is not None and tape.replay:  # a recomputed forward: the first forward's scale
            scale = tape.next()
            return cast_to_fp8(x, scale, self.dtype), scale.reciprocal()
        scale = self._scale_for(x, group)
        if tape is not None:
            tape.scales.append(scale)
        xq = cast_to_fp8(x, scale, self.dtype)
        if self.owner is not None and self.owner.overflow is not None:
            self.owner.note_overflow(self.key, x, scale, self.fp8_max)
        stats = self.owner.stats if self.owner is not None else None
        if stats is not None and self.key not in stats:
            stats[self.key] = self._observe(x, scale, xq)
        return xq, scale.reciprocal()

    def _observe(self, x: torch.Tensor, scale: torch.Tensor, xq: torch.Tensor) -> torch.Tensor:
        """[amax, scale, saturated share, flushed share] of one cast, on x's device."""
        x = x.detach()
        n = max(1, x.numel())
        sat = (x.float().abs() * scale > self.fp8_max).sum()
        flushed = ((x != 0) & (xq.float() == 0)).sum()
        return torch.stack([x.abs().amax().float(), scale.float(), sat / n, flushed / n])

    def _scale_for(self, x: torch.Tensor, group) -> torch.Tensor:
        """Record x's amax (delayed) or reduce it now (current); the scale to cast x with."""
        amax = x.detach().abs().amax().float()
        if self.recipe.recipe == "delayed":
            self.amax_history[0] = torch.maximum(self.amax_history[0], amax)
            self.pending = True
            scale = self.scale
        else:
            if world(group) > 1:
                dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
            self.amax_history[0] = amax
            scale = compute_scale(amax, self.scale, self.fp8_max, self.recipe.margin)
            self.scale = scale
        return scale

    def update_from_history(self) -> None:
        """Delayed scaling, after slot 0 was reduced: new scale, then roll (slot 0 starts empty)."""
        h = self.amax_history
        amax = h.max() if self.recipe.amax_compute_algo == "max" else h[0]
        self.scale = compute_scale(amax, self.scale, self.fp8_max, self.recipe.margin)
        self.amax_history = torch.roll(h, 1)
        self.amax_history[0] = 0.0
        self.pending = False

    def state_dict(self) -> dict:
        return {"amax_history": self.amax_history.clone(), "scale": self.scale.clone()}

    def load_state_dict(self, sd: dict) -> None:
        self.amax_history = sd["amax_history"].to(self.amax_history)
        self.scale = sd["scale"].to(self.scale)


def is_expert_key(key: str) -> bool:
    """A routed expert's GEMM (``...mlp.experts.<i>.fc1.x``); the shared expert is dense."""
    return ".experts." in key


class ScaleTape:
    """The scales of one checkpointed region's forward, in cast order (see the module doc)."""

    def __init__(self):
        self.scales: list[torch.Tensor] = []
        self.replay, self._i = False, 0

    def next(self) -> torch.Tensor:
        if self._i >= len(self.scales):
            raise RuntimeError(
                f"recomputed forward casts more tensors to FP8 ({self._i + 1}) than the first "
                f"forward did ({len(self.scales)})"
            )
        self._i += 1
        return self.scales[self._i - 1]


class Fp8State:
    """Every ScalingMeta of a model, and the amax reduction that keeps their scales in agreement.

    ``amax_group`` must hold every rank that holds a shard or a replica of the same tensors
    (TP x DP):
    reducing over DP alone lets TP ranks pick different scales for one logical tensor.
    """

    def __init__(self, recipe: Fp8Recipe, *, amax_group, expert_amax_group=None):
        world(amax_group)  # required, even of size 1
        self.recipe, self.amax_group = recipe, amax_group
        # experts differ between expert-parallel ranks: theirs are reduced over their replicas
        self.expert_amax_group = amax_group if expert_amax_group is None else expert_amax_group
        self.metas: dict[str, ScalingMeta] = {}
        self.tape: ScaleTape | None = None
        self.stats: dict[str, torch.Tensor] | None = None
        self.overflow: dict[str, torch.Tensor] | None = None  # None: not watched
        self.overflow_share = 0.0

    def watch_overflow(self, share: float) -> None:
        """Record from now on whether each cast overflows (NaN/inf, or > ``share`` saturated)."""
        self.overflow, self.overflow_share = {}, share

    def note_overflow(self, key: str, x: torch.Tensor, scale: torch.Tensor, fp8_max: float):
        a = x.detach().float().abs()
        nonfinite = ~torch.isfinite(a.amax())  # amax propagates NaN
        sat = (a * scale > fp8_max).sum() / max(1, a.numel())
        flag = (nonfinite | (sat > self.overflow_share)).float()
        gemm = key.rsplit(".", 1)[0]
        prev = self.overflow.get(gemm)
        self.overflow[gemm] = flag if prev is None else torch.maximum(prev, flag)

    def take_overflow(self) -> dict[str, torch.Tensor]:
        """Per GEMM name, 1.0 where a cast overflowed since the last call (0.0 elsewhere)."""
        got = self.overflow or {}
        if self.overflow is not None:
            self.overflow = {}
        return got

    def meta(self, name: str, role: str) -> ScalingMeta:
        key = f"{name}.{role}"
        if key not in self.metas:
            self.metas[key] = meta = ScalingMeta(self.recipe, role, owner=self)
            meta.key = key
        return self.metas[key]

    def start_stats(self) -> None:
        self.stats = {}

    def take_stats(self) -> dict[str, float]:
        """``{"<gemm>.<role>/amax": ..., "/scale", "/saturated", "/flushed"}`` since
        ``start_stats``; one device-to-host copy."""
        got, self.stats = self.stats or {}, None
        if not got:
            return {}
        keys = sorted(got)
        vals = torch.stack([got[k] for k in keys]).cpu().tolist()
        out = {}
        for k, (amax, scale, sat, flushed) in zip(keys, vals, strict=True):
            out.update({f"{k}/amax": amax, f"{k}/scale": scale, f"{k}/saturated": sat,
                        f"{k}/flushed": flushed})  # fmt: skip
        return out

    @contextlib.contextmanager
    def recording(self, tape: ScaleTape):
        """A checkpointed region's forward: keep each cast's scale on ``tape``."""
        saved, self.tape = self.tape, tape
        try:
            yield
        finally:
            self.tape = saved

    @contextlib.contextmanager
    def replaying(self, tape: ScaleTape):
        """Its recomputation: cast with the kept scales, in the same order; record no amax."""
        saved, self.tape = self.tape, tape
        tape.replay, tape._i = True, 0
        try:
            yield
        finally:
            tape.replay, self.tape = False, saved

    def update(self, roles: tuple[str, ...] | None = None) -> None:
        """After a micro-batch's forward and backward: one MAX all-reduce of the new amaxes, then
        new scales for the delayed recipe. Every rank of ``amax_group`` must call it together.
        ``roles`` (e.g. ``("x", "w")`` after a forward, ``("g",)`` after a backward) limits it to
        those roles: each meta's history is its own, so updating the roles separately gives each
        the same sequence of scales (what pipelining needs, with micro-batches in flight)."""
        if self.recipe.recipe != "delayed":
            return
        metas = [
            m
            for _, m in sorted(self.metas.items())
            if m.pending and (roles is None or m.role in roles)
        ]
        if not metas:
            return
        expert = [m for m in metas if is_expert_key(m.key)]
        dense = [m for m in metas if not is_expert_key(m.key)]
        for group, ms in ((self.amax_group, dense), (self.expert_amax_group, expert)):
            if ms and world(group) > 1:
                cur = torch.stack([m.amax_history[0] for m in ms])
                dist.all_reduce(cur, op=dist.ReduceOp.MAX, group=group)
                for m, a in zip(ms, cur, strict=True):
                    m.amax_history[0] = a
        for m in metas:
            m.update_from_history()

    def state_dict(self) -> dict:
        return {k: m.state_dict() for k, m in self.metas.items()}

    def load_state_dict(self, sd: dict) -> None:
        for k, v in sd.items():
            name, role = k.rsplit(".", 1)
            self.meta(name, role).load_state_dict(v)
