"""Splits, blend proportions, and blended real datasets through the loader (cache, resume)."""

import os
import subprocess
import sys

import numpy as np
import pytest
import torch

import megafp8.data.blend_order as bo
from megafp8.config import Config
from megafp8.data import build_data_iterators
from megafp8.data.blend import (
    BlendedDataset,
    normalized,
    parse_data_path,
    parse_split,
    split_ranges,
)
from megafp8.data.blend_order import blend_order
from megafp8.data.indexed import IndexedDatasetWriter

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# (elements, --split, the bounds): Megatron-LM main's rule, the bounds of the cumulative
# fractions rounded half to even; (100000, "1,1,1") as its mock data is split
SPLITS = [
    (1000, "1,1,1", [0, 333, 667, 1000]),
    (100000, "1,1,1", [0, 33333, 66667, 100000]),
    (12345, "969,30,1", [0, 11962, 12333, 12345]),
    (10, "8,2", [0, 8, 10, 10]),
    (1, "1,1,1", [0, 0, 1, 1]),
    (2, "1,1,2", [0, 0, 1, 2]),  # 0.5 rounds to 0
    (6, "1,1,2", [0, 2, 3, 6]),  # 1.5 rounds to 2
    (400, "100,0,0", [0, 400, 400, 400]),
]


@pytest.mark.parametrize(("num", "split", "bounds"), SPLITS)
def test_split_ranges_match_megatron(num, split, bounds):
    ranges = split_ranges(num, parse_split(split))
    assert [r[0] for r in ranges] + [ranges[-1][1]] == bounds
    assert all(r[1] == n[0] for r, n in zip(ranges, ranges[1:], strict=False))


def test_parse_errors():
    assert parse_data_path(("A",)) == [(1.0, "A")]
    assert parse_data_path(("3", "A", "1", "B")) == [(0.75, "A"), (0.25, "B")]
    # prefixes alone: Megatron-LM's unweighted blend
    assert parse_data_path(("x", "A")) == [(None, "x"), (None, "A")]
    assert parse_data_path(("A", "B", "C")) == [(None, "A"), (None, "B"), (None, "C")]
    for bad, msg in [
        (("0.5", "A", "B"), "pairs"),
        (("x", "A", "1", "B"), "not a number"),
        (("A", "0.5"), "not a number"),
        (("-1", "A", "1", "B"), "negative"),
        (("0", "A", "0", "B"), "sum to zero"),
    ]:
        with pytest.raises(ValueError, match=msg):
            parse_data_path(bad)
    with pytest.raises(ValueError):
        parse_split("1,2,3,4")


# Megatron-LM d98e8a64's blending helper (build_blending_indices) on these normalized weights:
# the dataset index of the first samples, the last six entries of the dataset sample index
MEGATRON_ORDER = [
    ([0.2, 0.45, 0.35], 40,
     [1, 2, 0, 1, 2, 1, 0, 2, 1, 2, 1, 0, 1, 2, 1, 2, 0, 1, 2, 1, 0, 1, 2, 1, 2, 1, 0, 2, 1, 2,
      1, 0, 1, 2, 1, 2, 0, 1, 2, 1], [15, 12, 7, 16, 13, 17]),
    ([0.5, 0.5], 12, [0, 1, 0, 1, 0, 1, 0, 1, 0, 1, 0, 1], [3, 3, 4, 4, 5, 5]),  # ties: the first
    ([0.1, 0.6, 0.3], 30,
     [1, 2, 0, 1, 1, 2, 1, 1, 2, 1, 0, 1, 2, 1, 1, 2, 1, 1, 2, 1, 0, 1, 2, 1, 1, 2, 1, 1, 2, 1],
     [14, 7, 15, 16, 8, 17]),
]  # fmt: skip


@pytest.mark.parametrize("compiled", [True, False], ids=["c", "python"])
@pytest.mark.parametrize("case", MEGATRON_ORDER, ids=lambda c: str(len(c[0])))
def test_blend_order_is_megatrons(case, compiled):
    weights, n, head, tail = case
    if compiled and bo._compiled() is None:
        pytest.skip("no C compiler here: the Python loop is tested alone")
    di, dsi = blend_order(normalized(weights), n, compiled=compiled)
    assert di.dtype == np.int16 and dsi.dtype == np.int64
    assert di.tolist() == head and dsi[-6:].tolist() == tail


@pytest.mark.parametrize("seed", range(5))
def test_blend_order_compiled_equals_python_and_keeps_shares(seed):
    if bo._compiled() is None:
        pytest.skip("no C compiler here: the Python loop is tested alone")
    rng = np.random.default_rng(seed)
    k = int(rng.integers(1, 7))
    w = normalized(rng.random(k) + 0.01)
    n = int(rng.integers(500, 5000))
    di, dsi = blend_order(w, n)
    pdi, pdsi = blend_order(w, n, compiled=False)
    assert np.array_equal(di, pdi) and np.array_equal(dsi, pdsi)
    seen = np.zeros((n, k))
    seen[np.arange(n), di.astype(int)] = 1
    prefix = np.cumsum(seen, 0)
    share = np.arange(1, n + 1)[:, None] * np.asarray(w)[None, :]
    assert np.abs(prefix - share).max() < 1.5  # every prefix: about one sample off each share
    for d in range(k):  # each dataset's samples used once, in order
        assert dsi[di == d].tolist() == list(range(int((di == d).sum())))


def test_blend_order_compiles_into_its_cache_or_runs_in_python(tmp_path, monkeypatch, caplog):
    monkeypatch.setattr(bo, "_lib", None)
    ref = blend_order(normalized([0.3, 0.7]), 500, compiled=False)
    monkeypatch.setenv("MEGAFP8_CACHE", str(tmp_path / "c"))
    if bo._compiled() is not None:  # one library in the cache, nothing left beside it
        assert [p.name.endswith(".so") for p in (tmp_path / "c").iterdir()] == [True]
        got = blend_order(normalized([0.3, 0.7]), 500)
        assert all(np.array_equal(a, b) for a, b in zip(ref, got, strict=True))
        # in new processes (this one keeps the library it loaded): a corrupt library is built
        # anew in place, and so is one that others could have written
        lib = next((tmp_path / "c").iterdir())
        load = [sys.executable, "-c", "import megafp8.data.blend_order as b; assert b._compiled()"]
        (tmp_path / "x").write_bytes(b"not a library")
        os.replace(tmp_path / "x", lib)
        subprocess.run(load, check=True, env=dict(os.environ), cwd=ROOT)
        assert lib.stat().st_size > 100
        lib.chmod(0o775)
        subprocess.run(load, check=True, env=dict(os.environ), cwd=ROOT)
        assert lib.stat().st_mode & 0o777 == 0o755
        monkeypatch.setattr(bo, "_lib", None)  # a cache others can write is not used
        (tmp_path / "c").chmod(0o777)
        assert bo._compiled() is not None  # built privately instead
        assert len(list((tmp_path / "c").iterdir())) == 1
    monkeypatch.setattr(bo, "_lib", None)  # no compiler anywhere: the Python loop, with a warning
    monkeypatch.setenv("CC", f"{tmp_path / 'no-such-cc'} -O2")
    monkeypatch.setenv("MEGAFP8_CACHE", str(tmp_path / "d"))
    assert bo._compiled() is None and "the Python loop runs" in caplog.text
    got = blend_order(normalized([0.3, 0.7]), 500)
    assert all(np.array_equal(a, b) for a, b in zip(ref, got, strict=True))
    monkeypatch.setattr(bo, "_lib", None)


def test_weights_normalize_as_megatron():
    """Nine weights: numpy's pairwise sum, not Python's left-to-right one."""
    raw = [3, 1, 7, 0.1, 2, 5, 1.3, 0.7, 2.2]
    items = [x for i, w in enumerate(raw) for x in (str(w), f"P{i}")]
    assert [w for w, _ in parse_data_path(items)] == (np.array(raw) / np.sum(raw)).tolist()


def write_dataset(prefix, base, ndocs, seed):
    """Document k of this dataset holds only the token ``base + k``."""
    rng = np.random.default_rng(seed)
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for k in range(ndocs):
            w.add_document(np.full(int(rng.integers(1, 30)), base + k, np.uint16))


def blend_cfg(tmp_path, **train):
    a, b = str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")
    if not os.path.exists(a + ".idx"):
        write_dataset(a, 0, 400, 1)
        write_dataset(b, 1000, 300, 2)
    t = {
        "micro_batch_size": 2,
        "global_batch_size": 8,
        "train_iters": 25,
        "eval_interval": 10,
        "eval_iters": 2,
        "seed": 3,
    }
    t.update(train)
    return Config().replace(
        data={"data_path": ("0.7", a, "0.3", b), "split": "80,15,5"},
        model={"seq_length": 16, "vocab_size": 2000},
        train=t,
    )


def test_blended_real_data_through_the_loader(tmp_path):
    cfg = blend_cfg(tmp_path)
    it = build_data_iterators(cfg, dp_rank=0, dp_size=1)
    train = it.datasets["train"]
    assert isinstance(train, BlendedDataset) and len(train) == 200
    assert train.counts.tolist() == [140, 60]
    # Megatron-LM d98e8a64 on the same files and flags: its blend order, its samples
    assert train.dataset_index[:12].tolist() == [0, 1, 0, 0, 1, 0, 0, 1, 0, 0, 0, 1]
    assert train.dataset_sample_index[:12].tolist() == [0, 0, 1, 2, 1, 3, 4, 2, 5, 6, 7, 3]
    firsts = [int(train[i][0]) for i in (0, 1, 2, 199)]
    assert firsts == [306, 1231, 41, 251]
    assert [len(it.datasets[s]) for s in ("valid", "test")] == [49, 17]  # ceil(48 w) + ceil(48 w')
    assert [int(it.datasets["valid"][i][0]) for i in (0, 47)] == [361, 1280]
    assert [int(it.datasets["test"][i][0]) for i in (0, 15)] == [381, 384]
    # Samples come from the right dataset and only from that split's documents.
    a_split = {"train": (0, 320), "valid": (320, 380), "test": (380, 400)}
    b_split = {"train": (1000, 1240), "valid": (1240, 1285), "test": (1285, 1300)}
    for name in ("train", "valid", "test"):
        ds = it.datasets[name]
        for i in range(len(ds)):
            toks = ds[i]
            src = int(ds.dataset_index[i])
            lo, hi = (a_split if src == 0 else b_split)[name]
            assert toks.min() >= lo and toks.max() < hi, (name, i, src)
    cache = tmp_path / "cache" / "GPTDataset_indices"
    assert len(list(cache.glob("*-description.json"))) == 9  # 3 splits x (2 parts + 1 blend)
    again = build_data_iterators(cfg, dp_rank=0, dp_size=1)
    assert isinstance(again.datasets["train"].dataset_index, np.memmap)
    assert len(list(cache.glob("*-description.json"))) == 9


def test_three_weights_blend_as_megatron(tmp_path):
    """0.1 A 0.4 B 0.1 C: weights that change when normalized a second time, so the sizes
    (from the weights normalized once) and the order (normalized twice) are Megatron-LM's only
    if each normalization happens where it does there. Megatron-LM d98e8a64 on the same files
    and flags asked for 34 + 134 + 34 = 202 train samples (ceil of 200 w; the blend is that long)
    and gave the order and first tokens below."""
    cfg = blend_cfg(tmp_path)
    a, b = str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")
    c = str(tmp_path / "c_text_document")
    write_dataset(c, 1500, 100, 3)
    cfg = cfg.replace(data={"data_path": ("0.1", a, "0.4", b, "0.1", c)})
    ds = build_data_iterators(cfg, dp_rank=0, dp_size=1).datasets
    train = ds["train"]
    assert len(train) == 202 and train.counts.tolist() == [34, 134, 34]
    assert train.dataset_index[:16].tolist() == [1, 0, 2, 1, 1, 1, 0, 1, 2, 1, 1, 1, 0, 1, 2, 1]
    assert train.dataset_sample_index[:10].tolist() == [0, 0, 0, 1, 2, 3, 1, 4, 1, 5]
    assert [int(train[i][0]) for i in (0, 1, 2, 199)] == [1231, 306, 1578, 1111]
    assert [len(ds["valid"]), len(ds["test"])] == [48, 17]
    assert [int(ds["valid"][i][0]) for i in (0, 47)] == [1266, 1265]
    assert [int(ds["test"][i][0]) for i in (0, 15)] == [1287, 1297]


def test_blended_resume_is_bit_identical(tmp_path):
    cfg = blend_cfg(tmp_path)
    full = [b["tokens"] for b in build_data_iterators(cfg, dp_rank=1, dp_size=2).train]
    resumed = [
        b["tokens"]
        for b in build_data_iterators(cfg, dp_rank=1, dp_size=2, consumed_train_samples=80).train
    ]
    assert len(full) == 50 and len(resumed) == 30
    assert all(torch.equal(x, y) for x, y in zip(full[20:], resumed, strict=True))


def test_data_cache_path_is_used(tmp_path):
    cfg = blend_cfg(tmp_path)
    cfg = cfg.replace(data={"data_cache_path": str(tmp_path / "elsewhere")})
    build_data_iterators(cfg, dp_rank=0, dp_size=1)
    assert len(list((tmp_path / "elsewhere").glob("*-description.json"))) == 9
    assert not (tmp_path / "cache").exists()


def test_per_split_blends(tmp_path):
    """--train-data-path 0.7 A 0.3 B --valid-data-path C (Megatron's per-split blends): train
    samples come from A and B with any of their documents, valid samples from C alone, no test
    split; --split plays no part."""
    blend_cfg(tmp_path)  # writes A and B
    a, b = str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")
    c = str(tmp_path / "c_text_document")
    write_dataset(c, 1500, 100, 3)
    cfg = blend_cfg(tmp_path).replace(
        data={"data_path": (), "train_data_path": ("0.7", a, "0.3", b), "valid_data_path": (c,)}
    )
    it = build_data_iterators(cfg, dp_rank=0, dp_size=1)
    train, valid = it.datasets["train"], it.datasets["valid"]
    assert it.datasets["test"] is None
    assert isinstance(train, BlendedDataset) and train.counts.tolist() == [140, 60]
    seen = {0: set(), 1: set()}
    for i in range(len(train)):
        src, toks = int(train.dataset_index[i]), train[i]
        assert (0 <= toks.min() and toks.max() < 400) if src == 0 else (1000 <= toks.min() < 1300)
        seen[src].update(np.unique(toks).tolist())
    assert max(seen[0]) >= 320 and max(seen[1]) >= 1240  # beyond the split's train range
    tokens = np.concatenate([valid[i] for i in range(len(valid))])
    assert tokens.min() >= 1500 and tokens.max() < 1600


def test_per_split_blends_bad_input(tmp_path):
    from megafp8.train import check_inputs
    from megafp8.validate import validate

    cfg = blend_cfg(tmp_path)
    a = str(tmp_path / "a_text_document")
    both = cfg.replace(data={"train_data_path": (a,)})
    with pytest.raises(ValueError, match="train_data_path and data_path: give one"):
        validate(both, 1)
    valid_only = cfg.replace(data={"data_path": (), "valid_data_path": (a,)})
    with pytest.raises(ValueError, match="without train_data_path"):
        validate(valid_only, 1)
    nope = str(tmp_path / "nope")
    missing = cfg.replace(
        data={"data_path": (), "train_data_path": (a,), "test_data_path": ("0.5", a, "0.5", nope)}
    )
    with pytest.raises(ValueError, match="^test_data_path: .*nope.bin does not exist"):
        check_inputs(missing)


def test_unweighted_blend_as_megatron(tmp_path):
    """--data-path A B (no weights): one epoch of each dataset's split, mixed in proportion to
    their sample counts, min(needed, their sum) samples long. Megatron-LM d98e8a64 on the same
    files and flags gave the same lengths, order and tokens (asserted below)."""
    cfg = blend_cfg(tmp_path)
    a, b = str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")
    cfg = cfg.replace(data={"data_path": (a, b)})
    ds = build_data_iterators(cfg, dp_rank=0, dp_size=1).datasets
    train, valid, test = ds["train"], ds["valid"], ds["test"]
    assert [len(d) for d in train.datasets] == [310, 229]  # one epoch each
    assert [len(train), len(valid), len(test)] == [200, 48, 16]
    assert train.counts.tolist() == [115, 85]
    assert train.dataset_index[:16].tolist() == [0, 1, 0, 1, 0, 1, 0, 0, 1, 0, 1, 0, 1, 0, 0, 1]
    assert train.dataset_sample_index[:10].tolist() == [0, 0, 1, 1, 2, 2, 3, 4, 3, 5]
    assert [int(train[i][0]) for i in (0, 1, 2, 199)] == [306, 1231, 41, 238]
    assert [int(valid[i][0]) for i in (0, 1, 2, 47)] == [361, 1266, 370, 1259]
    assert [int(test[i][0]) for i in (0, 1, 2, 15)] == [381, 1287, 387, 399]


def test_unweighted_blend_short_splits(tmp_path, caplog):
    """Three datasets; evaluations that want more than one epoch of the valid and test splits
    read what there is (Megatron-LM d98e8a64: 200, 118 and 36 samples, the same tokens)."""
    cfg = blend_cfg(tmp_path, eval_iters=8, seed=5)
    a, b = str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")
    c = str(tmp_path / "c_text_document")
    write_dataset(c, 1500, 100, 3)
    cfg = cfg.replace(data={"data_path": (a, b, c)})
    with caplog.at_level("WARNING"):
        ds = build_data_iterators(cfg, dp_rank=0, dp_size=1).datasets
    assert "holds 36 of the 64 samples" in caplog.text
    assert [len(ds[s]) for s in ("train", "valid", "test")] == [200, 118, 36]
    assert ds["train"].counts.tolist() == [101, 75, 24]
    assert [int(ds["train"][i][0]) for i in (0, 1, 2, 199)] == [155, 1037, 1544, 1051]
    assert [int(ds["valid"][i][0]) for i in (0, 1, 2, 117)] == [377, 1262, 1588, 358]
    assert [int(ds["test"][i][0]) for i in (0, 1, 2, 35)] == [387, 1293, 1597, 396]


def test_unweighted_blend_needs_one_epoch_for_training(tmp_path):
    """Training on more than one epoch of an unweighted blend stops before any model is built
    (539 samples: 310 + 229 above); the per-split form reads each dataset whole."""
    from megafp8.train import check_inputs

    cfg = blend_cfg(tmp_path)
    a, b = str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")
    cfg = cfg.replace(data={"data_path": (a, b)})
    check_inputs(cfg.replace(train={"train_iters": 67}))  # 536 samples
    with pytest.raises(ValueError, match=r"^train: .* 539 samples .* needs 544 "):
        check_inputs(cfg.replace(train={"train_iters": 68}))
    by_dp = cfg.replace(train={"train_iters": 34, "global_batch_size": None, "micro_batch_size": 8})
    check_inputs(by_dp)  # one DP rank: 34 x 8 samples
    with pytest.raises(ValueError, match="needs 544"):
        check_inputs(by_dp, world=2)  # two: the global batch is 16
    per_split = cfg.replace(data={"data_path": (), "train_data_path": (a, b)})
    train = build_data_iterators(per_split, dp_rank=0, dp_size=1).datasets["train"]
    assert [len(d) for d in train.datasets] == [388, 285] and len(train) == 200
    with pytest.raises(ValueError, match="needs 680"):
        check_inputs(per_split.replace(train={"train_iters": 85}))


def test_unweighted_blend_too_short_is_one_line(tmp_path):
    blend_cfg(tmp_path)  # writes A and B
    a, b = str(tmp_path / "a_text_document"), str(tmp_path / "b_text_document")
    argv = ["--data-path", a, b, "--split", "80,15,5", "--num-layers", "2", "--hidden-size", "64",
            "--num-attention-heads", "4", "--seq-length", "16", "--vocab-size", "2000",
            "--micro-batch-size", "8", "--train-iters", "68",
            "--tokenizer-type", "NullTokenizer"]  # fmt: skip
    p = subprocess.run(
        [sys.executable, "pretrain_gpt.py", *argv],
        capture_output=True,
        text=True,
        timeout=120,
        cwd=ROOT,
    )
    assert p.returncode == 2, p.stderr
    assert p.stdout == ""  # nothing started
    err = p.stderr.strip()
    assert len(err.splitlines()) == 1, err
    assert err.startswith("error: train: data without weights is one epoch") and "544" in err
