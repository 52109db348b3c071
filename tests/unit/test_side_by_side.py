"""bench/side_by_side.py: its standing flag lists are valid megafp8 runs (the same lists go to
the Megatron-LM peer), and it reads both stacks' console lines."""

import importlib.util
import os

import pytest

from megafp8.cli import parse_args
from megafp8.metrics import format_line
from megafp8.validate import validate

_spec = importlib.util.spec_from_file_location(
    "side_by_side", os.path.join(os.path.dirname(__file__), "../../bench/side_by_side.py")
)
sbs = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sbs)


@pytest.mark.parametrize("shape", list(sbs.SHAPES))
@pytest.mark.parametrize("precision", list(sbs.PRECISION))
def test_standing_flag_lists_are_valid_runs(shape, precision):
    argv = sbs.flags(shape, precision, 10, "--recompute-granularity selective")
    cfg = parse_args(argv, [])
    assert validate(cfg, 1) == 1
    assert cfg.fp8.enabled == (precision == "fp8") and cfg.train.bf16
    assert sbs.gbs_seq(argv) == (cfg.train.global_batch_size, cfg.model.seq_length)
    # dropout named in the list itself: the peer gets the same value, not its own default
    assert {"--hidden-dropout", "--attention-dropout"} <= set(argv)
    assert cfg.model.hidden_dropout == cfg.model.attention_dropout == 0.0


def test_reads_both_console_lines():
    ours = "\n".join(
        format_line(i, 5, {"elapsed time per iteration (ms)": 100.0 * i, "peak memory (GB)": 9.5})
        for i in range(1, 6)
    )
    got = sbs.parse(ours, skip=3, peer=False)
    assert got["ms_per_iter"] == 450.0 and got["peak_GiB"] == 9.5 and got["iters_logged"] == 5
    peer = (
        " [2026-12-03] iteration 4/ 5 | elapsed time per iteration (ms): 900.0 | lm loss: 1 |\n"
        "[Rank 0] (after 4 iterations) memory (MB) | allocated: 1.0 | max allocated: 2048.0 |\n"
        "torch.OutOfMemoryError: CUDA out of memory."
    )
    got = sbs.parse(peer, skip=0, peer=True)
    assert got["ms_per_iter"] == 900.0 and got["peak_GiB"] == 2.0 and got["oom"]
