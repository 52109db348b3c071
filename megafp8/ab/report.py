"""The numbers of ``megafp8-ab`` and where they go: the table, report.md, ab.json, loss.png and
the gap as a TensorBoard series.

Per step i: gap_i = (fp8_i - bf16_i) / bf16_i, signed (positive: FP8's loss is higher). After
warm-up (steps skip+1 .. N): mean |gap_i| and max |gap_i|. Verdict: PASS when every step after
warm-up was logged by both arms with a finite loss and mean |gap_i| <= threshold.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass

DEFAULT_THRESHOLD = 0.01
RULE = (
    "PASS when both arms logged a finite loss at every step after warm-up and the mean of "
    "|fp8 - bf16| / bf16 over those steps is <= the threshold"
)
THRESHOLD_REASON = (
    "the default 0.01 is the usual acceptance bar for FP8 pretraining: after warm-up the FP8 "
    "loss curve lies within about 1 % of the BF16 one (FP8 training reports, e.g. Micikevicius "
    "et al. 2022, 'FP8 Formats for Deep Learning', show the two curves on top of each other); "
    "warm-up is left out because the loss falls fastest there, where a small shift in time is a "
    "large relative gap; an FP8 fault (a stale or unshared scale, saturation, a wrong format) "
    "drifts well past 1 %"
)


def gap(fp8: float | None, bf16: float | None) -> float | None:
    """(fp8 - bf16) / bf16; None when a loss is missing; nan when one is not finite or 0."""
    if fp8 is None or bf16 is None:
        return None
    if not (math.isfinite(fp8) and math.isfinite(bf16)) or bf16 == 0:
        return math.nan
    return (fp8 - bf16) / bf16


@dataclass
class Summary:
    steps: int
    skip: int
    threshold: float
    gaps: list  # per step, signed; None: missing
    mean_abs_gap: float | None  # after warm-up, over the steps both arms logged finitely
    max_abs_gap: float | None
    max_abs_gap_step: int | None
    incomplete: list  # steps after warm-up without a finite loss from both arms
    verdict: str


def summarize(bf16: list, fp8: list, skip: int, threshold: float) -> Summary:
    """The gaps, their mean and max after warm-up, and the verdict (``RULE``)."""
    steps = max(len(bf16), len(fp8))
    bf16 = list(bf16) + [None] * (steps - len(bf16))
    fp8 = list(fp8) + [None] * (steps - len(fp8))
    gaps = [gap(f, b) for f, b in zip(fp8, bf16, strict=True)]
    after = [(i, g) for i, g in enumerate(gaps, 1) if i > skip]
    good = [(i, abs(g)) for i, g in after if g is not None and math.isfinite(g)]
    incomplete = [i for i, g in after if g is None or not math.isfinite(g)]
    mean = sum(a for _, a in good) / len(good) if good else None
    worst = max(good, key=lambda t: t[1]) if good else (None, None)
    ok = not incomplete and mean is not None and mean <= threshold
    return Summary(
        steps, skip, threshold, gaps, mean, worst[1], worst[0], incomplete,
        "PASS" if ok else "FAIL",
    )  # fmt: skip


def _loss(v: float | None) -> str:
    return "-" if v is None else f"{v:.7g}"


def _gap(g: float | None) -> str:
    return "-" if g is None else f"{g:+.2e}"


def table(bf16: list, fp8: list, s: Summary, baseline: str) -> list[str]:
    """A Markdown table (right-aligned, columns padded so it reads as text too)."""
    head = ["step", f"{baseline} loss", "fp8 loss", "rel gap (fp8-base)/base", ""]
    rows = []
    for i in range(1, s.steps + 1):
        b = bf16[i - 1] if i <= len(bf16) else None
        f = fp8[i - 1] if i <= len(fp8) else None
        rows.append([str(i), _loss(b), _loss(f), _gap(s.gaps[i - 1]), "warm-up" * (i <= s.skip)])
    widths = [max(len(r[c]) for r in [head, *rows]) for c in range(len(head))]
    line = lambda r: "| " + " | ".join(v.rjust(w) for v, w in zip(r, widths, strict=True)) + " |"
    sep = "|" + "|".join("-" * (w + 1) + ":" for w in widths) + "|"
    return [line(head), sep] + [line(r) for r in rows]


def findings(s: Summary, skip_source: str) -> list[str]:
    """The summary lines below the table (without the verdict)."""
    first = s.skip + 1
    left = {0: "none", 1: "step 1"}.get(s.skip, f"steps 1-{s.skip}")
    out = [f"warm-up left out: {left} ({skip_source})"]
    if s.mean_abs_gap is None:
        out.append(f"no step after warm-up (steps {first}-{s.steps}) has both losses")
    else:
        out.append(
            f"mean |relative gap| over steps {first}-{s.steps}: {s.mean_abs_gap:.3e} "
            f"({100 * s.mean_abs_gap:.3f} %); max {s.max_abs_gap:.3e} at step "
            f"{s.max_abs_gap_step}"
        )
    if s.incomplete:
        out.append(f"steps without a finite loss from both arms: {s.incomplete}")
    out.append(f"rule: {RULE}; threshold {s.threshold:g} (--threshold)")
    out.append(f"why: {THRESHOLD_REASON}")
    return out


def verdict_line(s: Summary, failures: list[str]) -> str:
    if failures:
        return "FAIL: " + "; ".join(failures)
    if s.verdict == "PASS":
        return f"PASS: mean |relative gap| {s.mean_abs_gap:.3e} <= {s.threshold:g}"
    if s.incomplete or s.mean_abs_gap is None:
        return "FAIL: steps after warm-up without a finite loss from both arms"
    return f"FAIL: mean |relative gap| {s.mean_abs_gap:.3e} > {s.threshold:g}"


def _finite(v):
    """JSON has no nan/inf: those become strings, missing values null."""
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def write_atomic(path: str, text: str) -> None:
    tmp = path + ".tmp"
    with open(tmp, "w") as f:
        f.write(text)
    os.replace(tmp, path)


def write_json(path: str, s: Summary, bf16: list, fp8: list, extra: dict) -> None:
    d = asdict(s)
    d["gaps"] = [_finite(g) for g in d.pop("gaps")]
    doc = {
        "verdict": s.verdict,
        "rule": RULE,
        **{k: _finite(v) for k, v in d.items() if k != "gaps"},
        "bf16_loss": [_finite(v) for v in bf16],
        "fp8_loss": [_finite(v) for v in fp8],
        "relative_gap": d["gaps"],
        **extra,
    }
    write_atomic(path, json.dumps(doc, indent=2) + "\n")


def write_tensorboard(log_dir: str, s: Summary, verdict: str) -> None:
    """The gap per step (signed and absolute) and the verdict, beside the arms' own events."""
    from megafp8.metrics import TensorBoard

    tb = TensorBoard(log_dir, True)
    for i, g in enumerate(s.gaps, 1):
        if g is not None:
            tb.scalars({"lm loss relative gap": g, "lm loss abs relative gap": abs(g)}, i)
    tb.text("verdict", verdict)
    tb.close()


def write_png(path: str, bf16: list, fp8: list, s: Summary, baseline: str, title: str) -> bool:
    """Both loss curves and the relative gap; False when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    steps = list(range(1, s.steps + 1))
    nan = lambda xs: [math.nan if v is None else v for v in xs]
    fig, (ax1, ax2) = plt.subplots(2, 1, figsize=(8, 6.5), sharex=True)
    ax1.plot(steps, nan(bf16), label=baseline, color="tab:blue")
    ax1.plot(steps, nan(fp8), label="fp8", color="tab:orange")
    ax1.set_ylabel("lm loss")
    ax1.set_title(title)
    pct = [100 * v for v in nan(s.gaps)]
    ax2.plot(steps, pct, color="tab:red", label=f"(fp8 - {baseline}) / {baseline}")
    top = max([abs(v) for v in pct if math.isfinite(v)], default=0.0) * 1.3
    thr = 100 * s.threshold
    if top >= 0.5 * thr:  # the threshold is on this scale: draw it
        for y in (thr, -thr):
            ax2.axhline(y, color="gray", linestyle="--", linewidth=0.8)
        top = max(top, 1.2 * thr)
    else:
        ax2.set_title(f"threshold ±{thr:g} % is off this scale", fontsize=9)
    if top > 0:
        ax2.set_ylim(-top, top)
    if s.mean_abs_gap is not None:
        ax2.axhline(
            100 * s.mean_abs_gap, color="tab:green", linewidth=0.8,
            label=f"mean |gap| after warm-up {100 * s.mean_abs_gap:.3f} %",
        )  # fmt: skip
    ax2.set_ylabel("relative gap (%)")
    ax2.set_xlabel("step")
    for ax in (ax1, ax2):
        if s.skip:
            ax.axvspan(0.5, s.skip + 0.5, color="gray", alpha=0.15, label="warm-up (left out)")
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path + ".tmp.png", dpi=110)
    plt.close(fig)
    os.replace(path + ".tmp.png", path)
    return True
