"""Config validation names the fields; the CLI parses Megatron flags and run files."""

import subprocess
import sys

import pytest

from megafp8.cli import dump_yaml, parse_args
from megafp8.config import Config, all_fields
from megafp8.validate import validate
from tests.helpers.tiny import tiny_config

TP2, TP4 = dict(tensor_model_parallel_size=2), dict(tensor_model_parallel_size=4)
BAD = [
    (
        dict(model=dict(num_attention_heads=6, hidden_size=96), parallel=TP4),
        4,
        "num_attention_heads=6 is not divisible by tensor_model_parallel_size=4",
    ),
    (
        dict(model=dict(num_query_groups=3)),
        1,
        "num_attention_heads=4 is not divisible by num_query_groups=3",
    ),
    (
        dict(model=dict(ffn_hidden_size=202), parallel=TP4),
        4,
        "ffn_hidden_size=202 is not divisible",
    ),
    (
        dict(parallel=dict(sequence_parallel=True)),
        1,
        "sequence_parallel=True needs tensor_model_parallel_size > 1",
    ),
    (
        dict(train=dict(global_batch_size=6)),
        4,
        "global_batch_size=6 is not divisible by micro_batch_size=2",
    ),
    (dict(parallel=TP2), 3, "world_size=3 is not divisible by tensor_model_parallel_size=2"),
    (
        dict(fp8=dict(fp8_format="hybrid"), model=dict(hidden_size=72, num_attention_heads=4)),
        1,
        "FP8 GEMM dims must be divisible by 16",
    ),
    (
        dict(model=dict(num_layers=3), parallel=dict(pipeline_model_parallel_size=2)),
        2,
        "num_layers=3 is not divisible by pipeline_model_parallel_size=2",
    ),
    (
        dict(model=dict(num_query_groups=3, num_attention_heads=6, hidden_size=96), parallel=TP2),
        2,
        "num_query_groups=3 and tensor_model_parallel_size=2: one must divide the other",
    ),
    (dict(data=dict(mock_data=False)), 1, "no data"),
    (dict(data=dict(split="a,b")), 1, "split='a,b'"),
    (dict(data=dict(split="1,2,3,4")), 1, "split='1,2,3,4': up to three"),
    (dict(data=dict(data_path=("0", "A", "0", "B"))), 1, "the weights sum to zero"),
    (dict(data=dict(data_path=("0.5", "A", "B"))), 1, "a blend is 'weight prefix' pairs"),
    (dict(optim=dict(lr_wsd_decay_style="cubic")), 1, "lr_wsd_decay_style='cubic' must be one"),
    (dict(train=dict(most_recent_k=0)), 1, "most_recent_k=0 must be >= 1"),
    (dict(train=dict(exit_interval=0)), 1, "exit_interval=0 must be >= 1"),
    (dict(train=dict(finetune=True)), 1, "finetune needs load (--load DIR)"),
    (dict(train=dict(ckpt_step=5)), 1, "ckpt_step=5 needs load (--load DIR)"),
    (
        dict(logging=dict(log_params_norm=True), optim=dict(zero_stage=3)),
        1,
        "log_params_norm with zero_stage=3",
    ),
    (dict(optim=dict(min_lr=1.0)), 1, "min_lr <= lr"),
    (dict(optim=dict(lr_warmup_init=1.0)), 1, "lr_warmup_init <= lr, got lr_warmup_init=1.0"),
    (
        dict(optim=dict(lr_decay_style="inverse-square-root", lr_warmup_iters=0)),
        1,
        "needs lr_warmup_iters > 0, got 0",
    ),
    (dict(model=dict(use_rope_scaling=True)), 1, "use_rope_scaling needs rope, got learned"),
    (dict(model=dict(swiglu=True, squared_relu=True)), 1, "the MLP has one activation"),
    (
        dict(
            model=dict(
                position_embedding_type="rope", use_rope_scaling=True, rope_scaling_factor=0.5
            )
        ),
        1,
        "rope_scaling_factor=0.5 must be >= 1",
    ),  # fmt: skip
    (dict(optim=dict(optimizer_group_max_numel=-1)), 1, "optimizer_group_max_numel=-1: give"),
    (dict(fp8=dict(fp8_recipe="bogus")), 1, "fp8_recipe='bogus' must be one of"),
    (
        dict(model=dict(seq_length=30), parallel=dict(sequence_parallel=True, **TP4)),
        4,
        "seq_length=30 is not divisible by tensor_model_parallel_size=4",
    ),
]


@pytest.mark.parametrize("change,world,message", BAD)
def test_validate_names_fields(change, world, message):
    cfg = tiny_config(**change)
    if world > 1 and "global_batch_size" not in str(change):
        cfg = cfg.replace(train=dict(global_batch_size=None))
    with pytest.raises(ValueError, match=message.replace("(", r"\(").replace(")", r"\)")):
        validate(cfg, world)


def test_kv_heads_replicated_when_tp_exceeds_them_is_valid():
    cfg = tiny_config(
        model=dict(num_query_groups=2), parallel=TP4, train=dict(global_batch_size=None)
    )
    assert validate(cfg, 4) == 1


def test_valid_layout_returns_dp():
    cfg = tiny_config(parallel=dict(tensor_model_parallel_size=2))
    assert validate(cfg, 8) == 4


def test_megatron_flags(tmp_path):
    cfg = parse_args(
        [
            "--num-layers",
            "4",
            "--hidden-size",
            "256",
            "--num-attention-heads",
            "8",
            "--num-query-groups",
            "2",
            "--swiglu",
            "--normalization",
            "RMSNorm",
            "--position-embedding-type",
            "rope",
            "--tensor-model-parallel-size",
            "2",
            "--sequence-parallel",
            "--fp8-format",
            "hybrid",
            "--fp8-amax-history-len",
            "16",
            "--data-path",
            "0.7",
            "a",
            "0.3",
            "b",
            "--disable-bias-linear",
            "--bf16",
            "--zero-stage",
            "2",
            "--lr",
            "1e-4",
        ]
    )
    assert cfg.model.num_layers == 4 and cfg.model.swiglu and cfg.model.normalization == "RMSNorm"
    assert cfg.model.add_bias_linear is False and cfg.train.bf16 and cfg.optim.zero_stage == 2
    assert cfg.parallel.sequence_parallel and cfg.fp8.fp8_amax_history_len == 16
    assert cfg.data.data_path == ("0.7", "a", "0.3", "b") and cfg.optim.lr == 1e-4


def test_run_file_and_precedence(tmp_path):
    f = tmp_path / "run.yaml"
    f.write_text("model:\n  num_layers: 3\nhidden-size: 96\nlr: 0.01\n")
    cfg = parse_args(["--config", str(f), "--lr", "0.02"])
    assert cfg.model.num_layers == 3 and cfg.model.hidden_size == 96 and cfg.optim.lr == 0.02
    f.write_text("model:\n  num_layerz: 3\n")
    with pytest.raises(ValueError, match="unknown key 'num_layerz' in section 'model'"):
        parse_args(["--config", str(f)])
    f.write_text("bogus: 1\n")
    with pytest.raises(ValueError, match="unknown key 'bogus'"):
        parse_args(["--config", str(f)])


def test_dump_round_trip():
    import yaml

    cfg = tiny_config(data=dict(data_path=("0.5", "x", "0.5", "y")))
    assert Config.from_dict(yaml.safe_load(dump_yaml(cfg))) == cfg


@pytest.mark.parametrize(
    "argv,msg",
    [
        (
            ["--mock-data", "--num-attention-heads", "5"],
            "hidden_size=128 is not divisible by num_attention_heads=5",
        ),
        (["--data-path", "/nonexistent/prefix"], "/nonexistent/prefix.bin does not exist"),
        (["--mock-data", "--no-such-flag"], "unrecognized arguments: --no-such-flag"),
        (["--mock-data", "--fp8-format", "e5m2"], "invalid choice: 'e5m2'"),
        (["--mock-data", "--split", "1,2,3,4"], "split='1,2,3,4': up to three"),
        (["--data-path", "0", "A", "0", "B"], "the weights sum to zero"),
        (["--mock-data", "--lr-wsd-decay-style", "cubic"], "invalid choice: 'cubic'"),
    ],
)
def test_entry_point_rejects_bad_input_with_exit_2(argv, msg):
    p = subprocess.run(
        [sys.executable, "pretrain_gpt.py", *argv], capture_output=True, text=True, timeout=120
    )
    assert p.returncode == 2, p.stderr
    assert msg in p.stderr
    assert p.stdout == ""  # nothing started
    assert len(p.stderr.strip().splitlines()[-1]) > 0 and "Traceback" not in p.stderr


def test_every_field_is_described_in_help_with_its_default():
    out = subprocess.run(
        [sys.executable, "pretrain_gpt.py", "--help"], capture_output=True, text=True, timeout=120
    ).stdout
    text = " ".join(out.split())  # argparse wraps lines
    for name, (_, f) in all_fields().items():
        desc = " ".join(f.metadata["help"].split())
        assert desc, name
        assert "--" + name.replace("_", "-") in text, name
        assert desc in text, (name, desc)
        if f.default not in (None, False, True, ()):
            assert f"{desc} (default: {f.default!r})" in text, name


def test_cli_choices_are_the_config_choices():
    """One list per field: the CLI's choices and validate()'s come from the field itself."""
    from megafp8.cli import build_parser

    actions = {a.dest: a for a in build_parser()._actions}
    with_choices = {n: f for n, (_, f) in all_fields().items() if f.metadata["choices"]}
    assert "lr_wsd_decay_style" in with_choices and "zero_stage" in with_choices
    for name, f in with_choices.items():
        assert list(actions[name].choices) == [c for c in f.metadata["choices"] if c is not None]


def test_default_true_switches_take_both_forms():
    assert parse_args(["--mock-data"]).model.cross_entropy_loss_fusion is True
    assert parse_args(
        ["--mock-data", "--cross-entropy-loss-fusion"]
    ).model.cross_entropy_loss_fusion
    off = parse_args(["--mock-data", "--no-cross-entropy-loss-fusion", "--no-te-weight-cache"])
    assert off.model.cross_entropy_loss_fusion is False and off.fp8.te_weight_cache is False
