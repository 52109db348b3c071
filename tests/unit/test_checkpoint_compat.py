"""--load of a checkpoint written by another model shape or layout, or with a foreign record: one
line naming the file and the values, exit status 2, before any process group or file is touched."""

import json
import os

from megafp8.train import main


def _fake_checkpoint(root, config: dict, record: str | None = None) -> str:
    """A ``latest`` and an iteration directory whose record holds ``config`` (no shards: the
    check must come before anything reads them)."""
    d = os.path.join(root, "ck")
    os.makedirs(os.path.join(d, "iter_0000003"))
    with open(os.path.join(d, "latest"), "w") as f:
        f.write("iter_0000003")
    with open(os.path.join(d, "iter_0000003", "megafp8.json"), "w") as f:
        f.write(record if record is not None else json.dumps(
            {"format_version": 1, "iteration": 3, "config": config}))  # fmt: skip
    return d


FLAGS = ["--mock-data", "--num-layers", "2", "--hidden-size", "64", "--num-attention-heads", "4",
         "--seq-length", "32", "--vocab-size", "256", "--train-iters", "4"]  # fmt: skip


def test_another_shape_or_layout_is_one_line(tmp_path, capsys):
    saved = {
        "model": {"num_layers": 2, "hidden_size": 128, "num_attention_heads": 4},
        "parallel": {"tensor_model_parallel_size": 2, "pipeline_model_parallel_size": 1},
        "optim": {"optimizer_group_max_numel": 100_000_000},
    }
    d = _fake_checkpoint(tmp_path, saved)
    before = sorted(os.listdir(d))
    assert main([*FLAGS, "--load", d]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and err.startswith(f"error: {d}/iter_0000003/megafp8.json")
    assert "hidden_size=128, tensor_model_parallel_size=2; this run has hidden_size=64" in err
    assert sorted(os.listdir(d)) == before  # nothing written


def test_another_vocab_is_one_line(tmp_path, capsys):
    """The record holds the resolved vocab: one written with NullTokenizer's legacy meaning
    (--vocab-size 256 then gave 257 ids) is named, where its embedding rows would not fit; with
    --vocab-size left to the tokenizer nothing is compared."""
    from megafp8.checkpoint import check_compatible
    from megafp8.cli import parse_args

    saved = parse_args(FLAGS).to_dict()
    saved["model"]["vocab_size"] = 257
    d = _fake_checkpoint(tmp_path, saved)
    assert main([*FLAGS, "--tokenizer-type", "NullTokenizer", "--load", d]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "vocab_size=257; this run has vocab_size=256" in err
    check_compatible(d, parse_args([*FLAGS, "--vocab-size", "257"]))  # no error
    cfg = parse_args(FLAGS).replace(model={"vocab_size": None})
    check_compatible(d, cfg)  # the tokenizer's vocab: not compared


def test_other_optimizer_groups_need_torch_dist(tmp_path, capsys):
    """The optimizer's groups are the shards' layout too: another --optimizer-group-max-numel is
    one line for a torch-format checkpoint, and no error for a torch_dist one; a record without
    the field (saved before groups were bounded) stands for 0, no bound."""
    from megafp8.checkpoint import check_compatible
    from megafp8.cli import parse_args

    saved = parse_args([*FLAGS, "--optimizer-group-max-numel", "5000"]).to_dict()
    d = _fake_checkpoint(tmp_path / "a", saved)
    assert main([*FLAGS, "--load", d]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "optimizer_group_max_numel=5000; this run has optimizer_group_max_numel=100000000" in err
    saved["train"]["ckpt_format"] = "torch_dist"
    check_compatible(_fake_checkpoint(tmp_path / "b", saved), parse_args(FLAGS))  # no error
    del saved["optim"]["optimizer_group_max_numel"]  # saved before the bound: one group per kind
    saved["train"]["ckpt_format"] = "torch"
    assert main([*FLAGS, "--load", _fake_checkpoint(tmp_path / "c", saved)]) == 2
    assert "optimizer_group_max_numel=0; this run has" in capsys.readouterr().err
    check_compatible(
        _fake_checkpoint(tmp_path / "d", saved),
        parse_args([*FLAGS, "--optimizer-group-max-numel", "0"]),
    )  # no error


def test_foreign_record_is_one_line(tmp_path, capsys):
    d = _fake_checkpoint(tmp_path, {}, record="not json at all")
    assert main([*FLAGS, "--load", d]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "not a readable megafp8 checkpoint record" in err


def test_same_shape_passes_the_check(tmp_path):
    from megafp8.checkpoint import check_compatible
    from megafp8.cli import parse_args

    cfg = parse_args(FLAGS)
    d = _fake_checkpoint(tmp_path, cfg.to_dict())
    check_compatible(d, cfg)  # no error


def test_truncated_or_missing_shard_is_one_line(tmp_path, capsys):
    """The record lists every file of the checkpoint with its size: a shard cut short (a full
    disk, a copy interrupted) or gone is named before anything reads it."""
    ck = str(tmp_path / "ck")
    assert main([*FLAGS, "--save", ck, "--save-interval", "4", "--zero-stage", "1"]) == 0
    tag = os.path.join(ck, "iter_0000004")
    with open(os.path.join(tag, "megafp8.json")) as f:
        record = json.load(f)
    files = record["files"]
    assert record["modules"] == "torch"  # no Transformer Engine on this machine
    shard = next(n for n in files if n.endswith("optim_states.pt"))
    with open(os.path.join(tag, shard), "r+b") as f:
        f.truncate(files[shard] // 2)
    capsys.readouterr()
    assert main([*FLAGS, "--load", ck, "--train-iters", "6"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and shard in err and "truncated" in err, err
    os.remove(os.path.join(tag, shard))
    assert main([*FLAGS, "--load", ck, "--train-iters", "6"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "is missing" in err, err


def test_other_modules_need_torch_dist(tmp_path, capsys):
    """TE's modules (norms fused or not, the MLP as one module or not) name the weights in
    DeepSpeed's torch-format shards differently from ours: a record of another family is one line
    naming the flags; a torch_dist one loads through the one-process names (the reshard path)."""
    from types import SimpleNamespace

    from megafp8.checkpoint import check_compatible
    from megafp8.cli import parse_args
    from megafp8.reshard import layout_changed

    cfg = parse_args(FLAGS)
    d = _fake_checkpoint(tmp_path / "a", cfg.to_dict())
    rec = os.path.join(d, "iter_0000003", "megafp8.json")
    with open(rec) as f:
        record = json.load(f)
    with open(rec, "w") as f:
        json.dump({**record, "modules": "te+fused-norm+fused-mlp", "world_size": 1}, f)
    assert main([*FLAGS, "--load", d]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1
    assert "modules='te+fused-norm+fused-mlp'; this run has modules='torch'" in err
    assert "--fp8-backend" in err
    run = SimpleNamespace(cfg=cfg, groups=SimpleNamespace(layout=SimpleNamespace(world_size=1)))
    assert layout_changed(run, d) is None  # torch format: never resharded
    record["config"]["train"]["ckpt_format"] = "torch_dist"
    with open(rec, "w") as f:
        json.dump({**record, "modules": "te+fused-norm+fused-mlp", "world_size": 1}, f)
    check_compatible(d, cfg)  # no error
    assert layout_changed(run, d) is not None  # by the one-process names
    with open(rec, "w") as f:
        json.dump({**record, "modules": "torch", "world_size": 1}, f)
    assert layout_changed(run, d) is None


def test_bf16_record_older_than_the_family_counts_as_torch():
    """Before ``auto`` picked te without FP8, BF16 ran on our modules: an old record (no
    ``modules``) of a BF16 run is the torch family; of an FP8 run, unknown."""
    from megafp8.checkpoint import recorded_family
    from megafp8.cli import parse_args

    bf16 = parse_args(FLAGS).to_dict()
    assert recorded_family({"config": bf16}) == "torch"
    fp8 = parse_args([*FLAGS, "--fp8-format", "hybrid"]).to_dict()
    assert recorded_family({"config": fp8}) is None
    forced = parse_args([*FLAGS, "--fp8-backend", "te"]).to_dict()
    assert recorded_family({"config": forced}) is None
    assert recorded_family({"config": fp8, "modules": "te"}) == "te"
