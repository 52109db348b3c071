"""End to end through the real entry point: `torchrun --nproc_per_node 4 pretrain_gpt.py
--pipeline-model-parallel-size 2 --tensor-model-parallel-size 2 ...` prints the lm losses of
the one-process run (fp32, CPU)."""

import os
import re
import subprocess
import sys

import pytest

from tests.parallel.test_torchrun_tp import ARGS, ROOT


def _run(extra, nproc=1):
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "pretrain_gpt.py"]
    if nproc > 1:  # ports 29950-29999: apart from test_torchrun_tp's 29600-29899
        port = str(29950 + os.getpid() % 50)
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc),
               "--master_port", port, "pretrain_gpt.py"]  # fmt: skip
    p = subprocess.run(
        cmd + ARGS + extra, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300
    )
    assert p.returncode == 0, p.stdout[-2000:] + p.stderr[-4000:]
    losses = [float(x) for x in re.findall(r"\| lm loss: ([0-9.E+-]+) \|", p.stdout)]
    assert len(losses) == 5, p.stdout
    valid = re.findall(
        r"validation loss at iteration 5 \| lm loss value: ([0-9.E+-]+) \|", p.stdout
    )
    assert len(valid) == 1, p.stdout
    return losses + [float(valid[0])]


@pytest.mark.slow
def test_torchrun_pp2_tp2_prints_the_one_process_losses():
    layers = ["--num-layers", "4", "--eval-interval", "5", "--eval-iters", "2"]
    ref = _run(layers)
    got = _run(layers + ["--pipeline-model-parallel-size", "2",
                         "--tensor-model-parallel-size", "2"], 4)  # fmt: skip
    # the same forward up to the TP sums' fp32 rounding, then Adam over 5 steps: 2e-5 (as
    # test_torchrun_tp.py); the last value is the validation loss after step 5 (forward only
    # through the pipeline)
    assert got[0] == pytest.approx(ref[0], rel=1e-6)
    for a, b in zip(got, ref, strict=True):
        assert a == pytest.approx(b, rel=2e-5), (got, ref)
    assert ref[4] < ref[0] and len(got) == 6


@pytest.mark.slow
def test_torchrun_interleaved_pp2_prints_the_one_process_losses():
    """Megatron's --num-layers-per-virtual-pipeline-stage 1 with 4 layers at pp 2: v = 2 chunks
    per rank (interleaved 1F1B); the training losses and the validation loss (forward only
    around the ring of chunks) equal one process's: bit-identical forwards, then the tied
    embedding's reassociated gradient sum under Adam (2e-5, as above)."""
    layers = ["--num-layers", "4", "--eval-interval", "5", "--eval-iters", "2"]
    ref = _run(layers)
    got = _run(layers + ["--pipeline-model-parallel-size", "2",
                         "--num-layers-per-virtual-pipeline-stage", "1"], 2)  # fmt: skip
    assert got[0] == ref[0]
    for a, b in zip(got, ref, strict=True):
        assert a == pytest.approx(b, rel=2e-5), (got, ref)
