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


def test_both_stacks_must_build_the_same_model(capsys):
    """Each stack's parameter count (Megatron's line; the peer's has a third coordinate) is
    read, and a shape whose two counts differ is named: its ratio compares unequal work."""
    ours = " > number of parameters on (tensor, pipeline) model parallel rank (0, 0): 1825480704"
    peer = (" > number of parameters on (tensor, gtp_remat, pipeline) model parallel rank "
            "(0, 0, 0): 1826004992")  # fmt: skip
    assert sbs.parse(ours, 0, False)["params"] == 1825480704
    assert sbs.parse(peer, 0, True)["params"] == 1826004992
    rows = [
        dict(shape="gpt7b", precision="fp8", stack="megafp8", params=1825480704),
        dict(shape="gpt7b", precision="fp8", stack="megatron-lm", params=1826004992),
        dict(shape="gpt7b", precision="bf16", stack="megafp8", params=1825480704),
        dict(shape="gpt7b", precision="bf16", stack="megatron-lm", params=1825480704),
        dict(shape="llama8b-16", precision="fp8", stack="megafp8", params=5),  # no peer run
    ]
    (problem,) = sbs.unequal_models(rows)
    assert problem == "gpt7b fp8: megafp8 built [1825480704] parameters, Megatron-LM [1826004992]"


def test_ours_prints_megatrons_model_lines(capsys):
    """pretrain_gpt.py logs Megatron's padded-vocab and parameter-count lines; the count is
    Megatron's for a GPT: V h + P h + L (12 h^2 + 13 h) + 2 h."""
    from megafp8.train import main

    v, h, layers, pos = 256, 64, 2, 32
    assert main(["--mock-data", "--tokenizer-type", "NullTokenizer", "--vocab-size", str(v),
                 "--num-layers", str(layers), "--hidden-size", str(h),
                 "--num-attention-heads", "4", "--seq-length", str(pos),
                 "--max-position-embeddings", str(pos), "--train-iters", "1"]) == 0  # fmt: skip
    text = "".join(capsys.readouterr())
    assert " > padded vocab (size: 256) with 0 dummy tokens (new size: 256)" in text
    want = v * h + pos * h + layers * (12 * h * h + 13 * h) + 2 * h
    assert sbs.parse(text, 0, False)["params"] == want


def test_fp8_over_bf16_per_stack_and_shape():
    """Each stack's FP8/BF16 from its own rows, rounds averaged; a shape or stack that lacks one
    precision (or whose run failed) gets no line."""
    rows = [
        dict(shape="gpt7b", precision="fp8", stack="megafp8", tokens_per_s=76000.0),
        dict(shape="gpt7b", precision="fp8", stack="megafp8", tokens_per_s=74000.0),
        dict(shape="gpt7b", precision="fp8", stack="megatron-lm", tokens_per_s=64000.0),
        dict(shape="gpt7b", precision="bf16", stack="megafp8", tokens_per_s=50000.0),
        dict(shape="gpt7b", precision="bf16", stack="megatron-lm", tokens_per_s=40000.0),
        dict(shape="llama8b-16", precision="fp8", stack="megafp8", tokens_per_s=29000.0),
        dict(shape="llama8b-16", precision="bf16", stack="megafp8", oom=True),
    ]
    assert sbs.fp8_over_bf16(rows) == [
        "megafp8 gpt7b: FP8/BF16 1.500x (tokens/s)",
        "megatron-lm gpt7b: FP8/BF16 1.600x (tokens/s)",
    ]
