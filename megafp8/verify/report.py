"""The comparison of ``megafp8-verify``: per-step table, tolerance (with its reason), verdict.

Tolerances come from the arithmetic (as ``tests/parallel/test_tp.py`` argues them):

* fp32: 1e-5 relative, per step, on the loss and on the gradient norm. A layout sums across
  ranks what one process sums in one loop (TP row-parallel outputs, DP gradient averaging, the
  tied embedding's gradient under PP), in another order: ~6e-8 (2^-24) relative per sum,
  compounding through the layers to ~1e-7. Adam divides each gradient element by its own running
  rms, so an element near zero whose rounding differs moves its weight by a fraction of lr, and
  later steps carry that on: a few steps end near 1e-6. A layout bug (a lost or doubled
  reduction, a wrong shard, a missing micro-batch, replicas out of step) moves them by >= 1e-3.
* FP8 (the torch backend): its GEMMs sum exact FP8 products, independent of order, and every
  layout quantizes with the same TP x DP-reduced scales; only the reordered fp32 sums above
  remain, and where one moves a value across an FP8 rounding boundary that element rounds one FP8
  step away (a flip). The yardstick is the FP8 noise of this very model: the one-process FP8
  run's gap to its fp32 twin (same seed), the largest over the steps. Every quantized element
  carries up to half a step of error there, so reaching half of that noise takes ~N/48 flips of
  N quantized values, while reordered fp32 sums flip ~2^-20 of them. A bug is not noise: a wrong
  shard or a lost reduction is O(1), unshared scales quantize differently (~1.4 x the noise).
  Bound: 0.5 x noise + the fp32 tolerance.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

FP32_TOL = 1e-5
FP8_NOISE_SHARE = 0.5
QUANTITIES = ("loss", "grad norm")

FP32_REASON = (
    "fp32: the layout sums across ranks (TP row-parallel outputs, DP gradient averaging, the "
    "tied embedding under PP) in another order than one process (~6e-8 relative per sum); Adam "
    "normalizes each gradient element, so near-zero elements carry such rounding into later "
    "steps (~1e-6 after a few); a layout bug moves the loss or the norm by >= 1e-3"
)
FP8_REASON = (
    "FP8: GEMMs are order-independent and scales are shared, so only fp32 reordering remains, "
    "which can move a value across an FP8 rounding boundary (one element, one FP8 step); half "
    "the model's own FP8 noise (one-process FP8 vs fp32, same seed) takes ~N/48 such flips of N "
    "quantized values where reordering makes ~N/2^20; a wrong shard, a lost reduction or "
    "unshared scales are O(1) or ~1.4 x that noise"
)


def rel(a: float | None, b: float | None) -> float:
    """|a - b| / |b|; inf when either is missing or not finite (and they are not both None)."""
    if a is None and b is None:
        return 0.0
    if a is None or b is None or not (math.isfinite(a) and math.isfinite(b)):
        return math.inf
    return abs(a - b) / abs(b) if b else abs(a - b)


@dataclass
class Verdict:
    ok: bool
    lines: list[str]


def _noise(ref: list, ref32: list, q: int) -> float:
    return max(rel(a[q], b[q]) for a, b in zip(ref, ref32, strict=True))


def bounds(ref: list, ref32: list | None, tolerance: float | None) -> tuple[list, list[str]]:
    """Per quantity (loss, grad norm): the relative bound; and the lines that justify it."""
    if tolerance is not None:
        return [tolerance] * 2, [f"tolerance: {tolerance:.1e} relative per step (--tolerance)"]
    if ref32 is None:
        lines = [f"tolerance: {FP32_TOL:.0e} relative per step", f"why: {FP32_REASON}"]
        return [FP32_TOL] * 2, lines
    out, lines = [], []
    for q, name in enumerate(QUANTITIES):
        noise = _noise(ref, ref32, q)
        out.append(FP8_NOISE_SHARE * noise + FP32_TOL)
        lines.append(
            f"FP8 noise of the {name} (one process, FP8 vs fp32, largest over the steps): "
            f"{noise:.2e} -> bound {FP8_NOISE_SHARE} x {noise:.2e} + {FP32_TOL:.0e} = "
            f"{out[-1]:.2e} relative per step"
        )
    if all(_noise(ref, ref32, q) == 0 for q in range(2)):
        lines.append("note: FP8 changed nothing here (no FP8 GEMM ran?): the bound is fp32's")
    lines += [f"why: {FP8_REASON}", f"and {FP32_REASON}"]
    return out, lines


def _num(v: float | None) -> str:
    return "-" if v is None else f"{v:.9g}"  # 9 digits: an fp32 value exactly


def table(ref: list, got: list) -> list[str]:
    """The per-step table, columns aligned."""
    head = [
        "step", "loss (1 proc)", "loss (layout)", "rel diff",
        "grad norm (1 proc)", "grad norm (layout)", "rel diff",
    ]  # fmt: skip
    rows = []
    for i, (a, b) in enumerate(zip(ref, got, strict=True), 1):
        rows.append(
            [str(i), _num(a[0]), _num(b[0]), f"{rel(b[0], a[0]):.1e}"]
            + [_num(a[1]), _num(b[1]), f"{rel(b[1], a[1]):.1e}"]
        )
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]
    fmt = " | ".join(f"{{:>{w}}}" for w in widths)
    return [fmt.format(*head)] + [fmt.format(*r) for r in rows]


def verdict(ref: list, got: list, limits: list[float]) -> Verdict:
    """PASS when every step's loss and grad norm are within their bound."""
    if len(got) != len(ref):
        return Verdict(False, [f"FAIL: the layout ran {len(got)} steps, one process {len(ref)}"])
    worst = (0.0, "loss", 1)
    over = []
    for i, (a, b) in enumerate(zip(ref, got, strict=True), 1):
        for q, name in enumerate(QUANTITIES):
            d = rel(b[q], a[q])
            if d > worst[0] or (math.isinf(d) and not math.isinf(worst[0])):
                worst = (d, name, i)
            if not d <= limits[q]:
                over.append(f"{name} at step {i}: {d:.2e} > {limits[q]:.2e}")
    lines = [f"largest relative difference: {worst[0]:.2e} ({worst[1]}, step {worst[2]})"]
    if over:
        return Verdict(False, lines + ["FAIL: " + "; ".join(over)])
    return Verdict(True, lines + ["PASS"])
