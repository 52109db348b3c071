"""megafp8-verify end to end (gloo processes on the CPU): a correct layout PASSes (TP 2, PP 2,
TP 2 with SP under FP8), a reference that is not the same run FAILs (exit 1), bad input exits 2
with one line."""

import os
import subprocess
import sys

import pytest

from megafp8.verify import main

STEPS = "3"


def _verify(capsys, *args):
    rc = main([*args, "--steps", STEPS])
    return rc, capsys.readouterr().out


def _table(out: str) -> list[list[str]]:
    """The rows of the per-step table, as cells."""
    rows = [ln.split("|") for ln in out.splitlines() if ln.count("|") == 6]
    assert rows[0][0].strip() == "step"
    return [[c.strip() for c in r] for r in rows[1:]]


def _check_pass(rc, out, bound):
    assert rc == 0, out
    assert out.rstrip().endswith("PASS")
    rows = _table(out)
    assert [r[0] for r in rows] == ["1", "2", "3"]
    for r in rows:  # every step's loss and norm printed, and within the stated bound
        assert float(r[1]) > 0 and float(r[4]) > 0
        assert float(r[3]) <= bound and float(r[6]) <= bound


def test_tp2_fp32_passes(capsys):
    rc, out = _verify(capsys, "--tensor-model-parallel-size", "2", "--num-query-groups", "2")
    assert "tp 2 x pp 1 x dp 1 = 2 processes" in out and "tolerance: 1e-05" in out
    _check_pass(rc, out, 1e-5)


def test_pp2_passes(capsys):
    rc, out = _verify(capsys, "--pipeline-model-parallel-size", "2", "--num-layers", "8")
    assert "num_layers 8 -> 2" in out
    _check_pass(rc, out, 1e-5)


def test_tp2_sp_fp8_passes(capsys):
    rc, out = _verify(
        capsys, "--tensor-model-parallel-size", "2", "--sequence-parallel",
        "--fp8-format", "hybrid", "--hidden-dropout", "0.1",
    )  # fmt: skip
    assert "fp8_backend auto -> torch" in out and "dropout off" in out
    noise = [ln for ln in out.splitlines() if ln.startswith("FP8 noise of the loss")]
    assert len(noise) == 1
    assert float(noise[0].split(": ")[1].split()[0]) > 0  # FP8 really ran: it is not fp32
    _check_pass(rc, out, 1e-3)


def test_a_different_run_fails(capsys):
    """The same layout against a one-process run with another seed: not the same training, so
    the comparison must say FAIL (exit 1), naming the steps over the bound."""
    rc, out = _verify(
        capsys, "--tensor-model-parallel-size", "2", "--num-query-groups", "2",
        "--reference-seed", "99",
    )  # fmt: skip
    assert rc == 1, out
    assert "FAIL: loss at step 1" in out and "PASS" not in out
    assert max(float(r[3]) for r in _table(out)) > 1e-3


@pytest.mark.parametrize(
    "args, message",
    [
        (["--tensor-model-parallel-size", "3"], "not divisible by tensor_model_parallel_size=3"),
        (["--num-layers", "2"], "the layout is one process"),
        (["--tensor-model-parallel-size", "2", "--processes", "3"], "--processes=3"),
        (["--data-parallel-size", "2", "--steps", "0"], "--steps=0"),
        (["--data-parallel-size", "2", "--tolerance", "0"], "--tolerance=0"),
        (
            ["--data-parallel-size", "2", "--fp8-format", "hybrid", "--steps", "2"],
            "--steps=2 under FP8",
        ),
    ],
)
def test_bad_input_exits_2_with_one_line(capsys, args, message):
    assert main(args) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    assert cap.err.count("\n") == 1 and cap.err.startswith("error: ") and message in cap.err


def test_entry_point_bad_flag_exits_2_with_one_line():
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    p = subprocess.run(
        [sys.executable, "-m", "megafp8.verify", "--tensor-model-parallel-size", "2", "--nope"],
        capture_output=True, text=True, env=env, timeout=120,
    )  # fmt: skip
    assert p.returncode == 2 and p.stdout == ""
    assert p.stderr == "error: unrecognized arguments: --nope\n"
