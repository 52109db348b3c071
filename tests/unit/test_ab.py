"""megafp8-ab: the console-line parser, the gap and verdict arithmetic, bad input (exit 2 before
any run), and one real A/B of the tiny run file (8 steps, both arms through pretrain_gpt.py):
its report files, per-step table, verdict recomputed from its numbers, which arm ran FP8, and
a threshold too small for its gaps failing with exit 1."""

import json
import math
import os
import shutil
from pathlib import Path

import pytest
import yaml

import megafp8.ab as ab
from megafp8.ab import report
from megafp8.ab.runs import losses_per_step, mean_tokens_per_second, parse_losses
from megafp8.metrics import format_line

ROOT = Path(__file__).resolve().parents[2]
TINY = str(ROOT / "launch" / "configs" / "tiny.yaml")
STEPS = 8

SAMPLE = """\
data-parallel size 1, tp 1, pp 1
 iteration        1/       3 | consumed samples:            4 | elapsed time per iteration (ms): \
95.8 | learning rate: 1.000000E-03 | global batch size:     4 | lm loss: 5.549877E+00 | grad \
norm: 0.764 | tokens per second: 2672.4 |
[2026-01-01 09:03:15,057] [WARNING] [real_accelerator.py:213:get_accelerator] Setting accelerator
[default0]: iteration        2/       3 | consumed samples:            8 | lm loss: 5.515328E+00 |
 validation loss at iteration 2 | lm loss value: 6.201234E+00 | lm loss PPL: 4.935901E+02 |
 iteration        3/       3 | consumed samples:           12 | lm loss: NAN | grad norm: 1.0 |
"""


def test_parse_console_lines():
    found = parse_losses(SAMPLE)
    assert list(found) == [1, 2, 3]  # validation lines and banners are not iterations
    assert found[1] == 5.549877 and found[2] == 5.515328 and math.isnan(found[3])
    line = format_line(10, 100, {"consumed samples": 640, "lm loss": 7.123456, "grad norm": 1.2})
    assert parse_losses(line + "\n" + line.replace("7.123456", "7.5")) == {10: 7.5}  # last wins
    assert parse_losses(format_line(4, 9, {"consumed samples": 4, "grad norm": 1.0})) == {}
    assert losses_per_step({1: 5.0, 3: 4.0}, 4) == [5.0, None, 4.0, None]
    tps = [format_line(i, 4, {"lm loss": 5.0, "tokens per second": 100.0 * i}) for i in (1, 2, 3)]
    assert mean_tokens_per_second("\n".join(tps), skip=1) == 250.0  # iterations 2 and 3
    assert mean_tokens_per_second(format_line(2, 4, {"lm loss": 5.0}), skip=0) is None


def test_gap_mean_after_warmup_and_verdict():
    bf16 = [10.0, 8.0, 6.0, 5.0]
    fp8 = [12.0, 8.08, 5.97, 5.0]  # +20 % in warm-up, then +1 %, -0.5 %, 0
    s = report.summarize(bf16, fp8, skip=1, threshold=0.01)
    assert s.gaps == pytest.approx([0.2, 0.01, -0.005, 0.0])
    assert s.mean_abs_gap == pytest.approx(0.005) and s.max_abs_gap == pytest.approx(0.01)
    assert s.max_abs_gap_step == 2 and s.verdict == "PASS"
    assert report.summarize(bf16, fp8, skip=0, threshold=0.01).verdict == "FAIL"  # warm-up in
    assert report.summarize(bf16, fp8, skip=1, threshold=0.004).verdict == "FAIL"
    missing = report.summarize(bf16, fp8[:3] + [math.nan], skip=1, threshold=1.0)
    assert missing.verdict == "FAIL" and missing.incomplete == [4]
    short = report.summarize(bf16, fp8[:2], skip=1, threshold=1.0)  # the FP8 arm stopped
    assert short.verdict == "FAIL" and short.incomplete == [3, 4]
    lines = report.table(bf16, fp8, s, "fp32")
    assert len(lines) == 2 + 4 and len({len(ln) for ln in lines}) == 1
    assert "warm-up" in lines[2] and "warm-up" not in lines[3]


@pytest.fixture
def no_runs(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError("a run started on bad input")

    monkeypatch.setattr(ab, "run_arms", refuse)


@pytest.mark.parametrize(
    "argv, says",
    [
        (["--steps", "1"], "--steps=1 must be >= 2"),
        (["--threshold", "0"], "--threshold=0.0 must be > 0"),
        (["--threshold", "-0.5"], "--threshold=-0.5 must be > 0"),
        (["--config", "no/such/run.yaml"], "no/such/run.yaml does not exist"),
        (["--skip", "8"], "--skip=8 must be >= 0 and < --steps=8"),
        (["--train-iters", "8", "--lr-warmup-iters", "8"], "lr warm-up (8 iterations) covers all"),
        (["--script", "no/such/pretrain_gpt.py"], "no/such/pretrain_gpt.py does not exist"),
        (["--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--num-attention-heads", "3"], "invalid config"),
        (["--nproc", "0"], "--nproc=0 must be >= 1"),
    ],
)
def test_bad_input_is_one_line_and_exit_2(argv, says, tmp_path, capsys, no_runs):
    out = tmp_path / "ab"
    rc = ab.main(["--out", str(out), "--steps", "8", "--mock-data", *argv])
    err = capsys.readouterr().err
    assert rc == 2 and err.startswith("error: ") and err.count("\n") == 1 and says in err, err
    assert not out.exists()  # nothing written: no run started


def test_earlier_report_is_kept_without_overwrite(tmp_path, capsys, no_runs):
    (tmp_path / "ab.json").write_text("{}")
    assert ab.main(["--out", str(tmp_path), "--mock-data"]) == 2
    assert "--overwrite" in capsys.readouterr().err


def test_plan_arms_differ_only_in_fp8(tmp_path):
    p = ab.plan(["--out", str(tmp_path), "--steps", "8", "--config", TINY])
    assert p.device == "cpu" and p.baseline == "fp32" and p.nproc == 1
    assert p.fp8.fp8.fp8_format == "hybrid" and p.fp8.fp8.fp8_backend == "torch"
    assert p.bf16.fp8.fp8_format is None and not p.bf16.train.bf16
    same = lambda c: c.replace(fp8=dict(fp8_format=None), logging=dict(tensorboard_dir=None))
    assert same(p.fp8) == same(p.bf16)
    # tiny.yaml: 100 iterations, 10 of warm-up -> 8 steps, 1 of warm-up, left out
    assert p.fp8.train.train_iters == STEPS and p.fp8.optim.lr_warmup_iters == 1 and p.skip == 1
    assert p.fp8.model.hidden_size < 128 and p.changes  # shrunk on the CPU
    assert any("fp32 on the CPU" in n for n in p.notes)
    q = ab.plan(["--out", str(tmp_path), "--steps", "20", "--mock-data", "--no-shrink"])
    assert q.fp8.fp8.fp8_format == "hybrid" and any("hybrid" in n for n in q.notes)
    assert q.skip == 2 and not q.changes  # no warm-up: 10 % of the steps


@pytest.fixture(scope="module")
def tiny_ab(tmp_path_factory):
    """One real A/B: the tiny run file, 8 steps, both arms through pretrain_gpt.py."""
    out = tmp_path_factory.mktemp("ab") / "out"
    rc = ab.main(["--out", str(out), "--steps", str(STEPS), "--config", TINY])
    return rc, out


def _verdict(doc) -> str:
    """The verdict from the two loss lists alone, by the stated rule."""
    gaps = [(f - b) / b for b, f in zip(doc["bf16_loss"], doc["fp8_loss"], strict=True)]
    after = gaps[doc["skip"] :]
    assert len(after) == STEPS - doc["skip"]
    mean = sum(abs(g) for g in after) / len(after)
    assert mean == pytest.approx(doc["mean_abs_gap"], rel=1e-12)
    assert max(abs(g) for g in after) == pytest.approx(doc["max_abs_gap"], rel=1e-12)
    return "PASS" if mean <= doc["threshold"] else "FAIL"


def test_tiny_ab_report(tiny_ab):
    rc, out = tiny_ab
    for name in ("report.md", "ab.json", "loss.png", "bf16.log", "fp8.log"):
        assert (out / name).stat().st_size > 0, name
    for arm in ("bf16", "fp8", "gap"):
        assert any(f.startswith("events.out.tfevents") for f in os.listdir(out / "tb" / arm))
    doc = json.loads((out / "ab.json").read_text())
    assert len(doc["bf16_loss"]) == len(doc["fp8_loss"]) == len(doc["relative_gap"]) == STEPS
    assert doc["threshold"] == 0.01 and doc["skip"] == 1 and doc["failures"] == []
    assert all(doc["runs"][a]["tokens_per_second"] > 0 for a in ("bf16", "fp8"))
    assert doc["verdict"] == _verdict(doc) == "PASS" and rc == 0  # FP8 tracks fp32 here
    text = (out / "report.md").read_text()
    rows = [ln for ln in text.splitlines() if ln.startswith("|")]
    assert len(rows) == 2 + STEPS  # header, separator, one per step
    assert [int(r.split("|")[1]) for r in rows[2:]] == list(range(1, STEPS + 1))
    assert "**PASS" in text and "rule: PASS when" in text


def test_tiny_ab_arms_ran_without_and_with_fp8(tiny_ab):
    _, out = tiny_ab
    ran = {a: yaml.safe_load((out / "tb" / a / "config.yaml").read_text()) for a in ("bf16", "fp8")}
    assert ran["bf16"]["fp8"]["fp8_format"] is None and ran["fp8"]["fp8"]["fp8_format"] == "hybrid"
    assert ran["bf16"]["model"] == ran["fp8"]["model"]
    assert ran["bf16"]["train"] == ran["fp8"]["train"] and ran["bf16"]["data"] == ran["fp8"]["data"]
    doc = json.loads((out / "ab.json").read_text())
    assert doc["bf16_loss"] != doc["fp8_loss"]  # FP8 GEMMs changed the numbers
    assert all(abs(g) < 1e-2 for g in doc["relative_gap"])  # and only by FP8 rounding


def test_tiny_threshold_fails_with_exit_1(tiny_ab, tmp_path, monkeypatch, capsys):
    """The same numbers (the real run's logs, replayed) against a threshold below its gaps."""
    _, real = tiny_ab

    def replay(arms, device, nproc, say):
        for arm in arms:
            shutil.copy(real / f"{arm.name}.log", arm.log)
            arm.status = 0
            arm.losses = losses_per_step(parse_losses(Path(arm.log).read_text()), STEPS)

    monkeypatch.setattr(ab, "run_arms", replay)
    out = tmp_path / "fail"
    argv = ["--out", str(out), "--steps", str(STEPS), "--config", TINY, "--threshold", "1e-9"]
    assert ab.main(argv) == 1
    doc = json.loads((out / "ab.json").read_text())
    assert doc["verdict"] == _verdict(doc) == "FAIL"
    printed = capsys.readouterr().out
    assert "**FAIL: mean |relative gap|" in printed and "> 1e-09" in printed
    assert (out / "report.md").read_text() in printed  # the report is what was printed
