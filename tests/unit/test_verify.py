"""megafp8-verify without processes: the shrunk model keeps the layout's splits and validates,
the reference is the same run on one process, and the bounds and verdicts follow the arithmetic
(tests/parallel/test_verify.py runs the command)."""

import math
import tomllib
from pathlib import Path

import pytest

from megafp8.cli import parse_args
from megafp8.config_values import global_batch_size
from megafp8.validate import validate
from megafp8.verify import _agree, report
from megafp8.verify.shrink import comparable, fp32, reference, shrink

ROOT = Path(__file__).resolve().parents[2]
CONFIGS = ROOT / "launch" / "configs"

# (run file or None, extra flags, dp)
LAYOUTS = {
    "llama8b-tp2-sp-pp2-dp2": ("llama-8b.yaml", ["--pipeline-model-parallel-size", "2"], 2),
    "llama8b-tp8-sp-kv8": ("llama-8b.yaml", ["--tensor-model-parallel-size", "8"], 1),
    "llama8b-tp4-kv2-replicated": (
        "llama-8b.yaml", ["--tensor-model-parallel-size", "4", "--num-query-groups", "2"], 1,
    ),
    "llama8b-tp8-mqa": (
        "llama-8b.yaml", ["--tensor-model-parallel-size", "8", "--num-query-groups", "1"], 1,
    ),
    "gpt1.3b-tp2-pp4-uneven": (
        "gpt-1.3b.yaml",
        ["--tensor-model-parallel-size", "2", "--pipeline-model-parallel-size", "4",
         "--decoder-first-pipeline-num-layers", "3", "--decoder-last-pipeline-num-layers", "3"],
        1,
    ),
    "gpt1.3b-bf16-first-last-dp4": (
        "gpt-1.3b.yaml",
        ["--first-last-layers-bf16", "--num-layers-at-start-in-bf16", "2"],
        4,
    ),
    "tiny-pp2-interleaved-v2-dp2": (
        "tiny.yaml",
        ["--pipeline-model-parallel-size", "2", "--virtual-pipeline-model-parallel-size", "2",
         "--num-layers", "8"],
        2,
    ),
    "fp32-tp2-dropout": (
        None, ["--tensor-model-parallel-size", "2", "--hidden-dropout", "0.1", "--mock-data"], 1,
    ),
}  # fmt: skip


def _user(name):
    run_file, flags, dp = LAYOUTS[name]
    argv = (["--config", str(CONFIGS / run_file)] if run_file else []) + flags
    return parse_args(argv, notices=[]), dp


@pytest.mark.parametrize("name", list(LAYOUTS))
def test_shrunk_model_keeps_the_layout(name):
    user, dp = _user(name)
    tp = user.parallel.tensor_model_parallel_size
    pp = user.parallel.pipeline_model_parallel_size
    cfg, _ = comparable(user, steps=5, on_cpu=True)
    validate(cfg, tp * pp * dp)
    small, changes = shrink(cfg, tp, pp, dp)
    validate(small, tp * pp * dp)  # every TP/SP/PP/FP8 rule of the layout still holds
    validate(reference(small, dp), 1)
    m, um = small.model, user.model
    assert m.hidden_size <= 512 and m.seq_length <= 128 and m.num_layers <= 8 and changes
    assert m.num_attention_heads % tp == 0
    if um.num_query_groups is None:
        assert m.num_query_groups is None
    elif um.num_query_groups < tp:  # replicated kv heads stay replicated, as many as before
        assert m.num_query_groups == um.num_query_groups
    else:  # split over TP, and still grouped
        assert m.num_query_groups % tp == 0 and m.num_query_groups < m.num_attention_heads
    assert m.ffn / m.hidden_size == pytest.approx(um.ffn / um.hidden_size, rel=0.35)
    micro = small.train.micro_batch_size
    assert global_batch_size(small, dp) // (micro * dp) >= max(pp, 2)
    assert small.fp8 == cfg.fp8 and small.parallel == cfg.parallel or pp > 1


def test_uneven_stages_stay_uneven_and_fp8_blocks_remain():
    small, _ = shrink(comparable(_user("gpt1.3b-tp2-pp4-uneven")[0], 5, True)[0], 2, 4, 1)
    p = small.parallel
    assert (p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers) == (1, 1)
    assert small.model.num_layers == 4  # 1 + 1 + one per middle stage
    small, _ = shrink(comparable(_user("gpt1.3b-bf16-first-last-dp4")[0], 5, True)[0], 1, 1, 4)
    assert small.model.num_layers == 4  # 2 bf16 at the start, 1 at the end, 1 left in FP8
    small, _ = shrink(comparable(_user("tiny-pp2-interleaved-v2-dp2")[0], 5, True)[0], 1, 2, 2)
    assert small.model.num_layers == 4  # one layer per virtual stage
    assert global_batch_size(small, 2) // (small.train.micro_batch_size * 2) == 4  # 2 x pp


def test_comparable_turns_off_what_no_layout_can_match():
    user, _ = _user("gpt1.3b-bf16-first-last-dp4")
    user = user.replace(model=dict(hidden_dropout=0.1), train=dict(save="/x", load="/y"))
    cfg, notes = comparable(user, steps=3, on_cpu=True)
    t = cfg.train
    assert (t.train_iters, t.bf16, t.save, t.load) == (3, False, None, None)
    assert cfg.model.hidden_dropout == 0
    assert cfg.optim.lr_warmup_iters == 0 and cfg.data.mock_data
    assert cfg.fp8.fp8_backend == "torch" and cfg.fp8.fp8_format == "hybrid"
    text = " ".join(notes)
    assert "dropout off" in text and "bf16 off" in text and "lr_warmup_iters 2000 -> 0" in text
    with pytest.raises(ValueError, match="--steps=0"):
        comparable(user, steps=0, on_cpu=True)
    with pytest.raises(ValueError, match="mxfp8"):
        comparable(user.replace(fp8=dict(fp8_recipe="mxfp8")), steps=3, on_cpu=True)


def test_reference_is_the_same_run_on_one_process():
    user, dp = _user("llama8b-tp2-sp-pp2-dp2")
    small, _ = shrink(comparable(user, 5, True)[0], 2, 2, dp)
    ref = reference(small, dp)
    assert ref.parallel.tensor_model_parallel_size == ref.parallel.pipeline_model_parallel_size == 1
    assert not ref.parallel.sequence_parallel
    assert global_batch_size(ref, 1) == global_batch_size(small, dp)
    assert ref.model == small.model and ref.fp8 == small.fp8 and ref.train.seed == small.train.seed
    assert reference(small, dp, seed=9).train.seed == 9
    assert fp32(ref).fp8.fp8_format is None and fp32(ref).model == ref.model


REF = [(5.0, 1.0), (4.9, 1.1), (4.8, 0.9)]


def test_fp32_bound_passes_reordering_and_fails_a_bug():
    limits, why = report.bounds(REF, None, None)
    assert limits == [1e-5, 1e-5] and "1e-05" in why[0]
    near = [(lo * (1 + 5e-6), g * (1 - 5e-6)) for lo, g in REF]
    assert report.verdict(REF, near, limits).ok
    bug = [(lo, g * (1 + 1e-3)) for lo, g in REF]
    v = report.verdict(REF, bug, limits)
    assert not v.ok and "grad norm at step 1" in v.lines[-1] and v.lines[-1].startswith("FAIL")


def test_fp8_bound_is_half_the_noise_plus_fp32():
    ref32 = [(lo * (1 + 1e-3), g * (1 - 2e-2)) for lo, g in REF]  # FP8 noise 1e-3 / 2e-2
    limits, why = report.bounds(REF, ref32, None)
    assert limits[0] == pytest.approx(0.5 * 1e-3 / (1 + 1e-3) + 1e-5, rel=1e-6)
    assert limits[1] == pytest.approx(0.5 * 2e-2 / (1 - 2e-2) + 1e-5, rel=1e-6)
    assert any("FP8 noise of the loss" in ln for ln in why)
    inside = [(lo * (1 + 4e-4), g) for lo, g in REF]
    outside = [(lo * (1 + 6e-4), g) for lo, g in REF]
    assert report.verdict(REF, inside, limits).ok
    assert not report.verdict(REF, outside, limits).ok
    assert report.bounds(REF, ref32, 0.5)[0] == [0.5, 0.5]  # --tolerance replaces the bound


def test_nan_missing_steps_and_missing_norms():
    limits = [1e-5, 1e-5]
    assert not report.verdict(REF, [(math.nan, 1.0)] + REF[1:], limits).ok
    assert not report.verdict(REF, REF[:2], limits).ok
    no_norm = [(lo, None) for lo, _ in REF]  # clipping off: no norm on either side
    assert report.verdict(no_norm, no_norm, limits).ok
    assert not report.verdict(REF, no_norm, limits).ok


def test_table_and_rank_agreement():
    lines = report.table(REF, REF)
    assert len(lines) == 4 and len({len(ln) for ln in lines}) == 1
    assert lines[0].split(" | ")[0].strip() == "step" and lines[1].split("|")[1].strip() == "5"
    assert _agree([REF, REF]) == []
    assert _agree([REF, REF[:1] + REF[1:]]) == []
    assert _agree([REF, [(5.0, 1.0)] * 3])[0].startswith("FAIL: rank 1")


def test_console_script_is_declared():
    scripts = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["scripts"]
    assert scripts["megafp8-verify"] == "megafp8.verify:main"
