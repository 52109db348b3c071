"""The training loop's data interface: batch layout, Megatron DP order, resume, eval iterators."""

import itertools

import numpy as np
import pytest
import torch

from megafp8.config import Config
from megafp8.data import build_data_iterators, build_tokenizer
from megafp8.data.indexed import IndexedDatasetWriter
from megafp8.data.loader import build_datasets, rank_sample_ids, split_sample_counts


def mock_cfg(**train):
    t = {
        "micro_batch_size": 2,
        "global_batch_size": 8,
        "train_iters": 6,
        "eval_interval": 3,
        "eval_iters": 2,
        "seed": 7,
    }
    t.update(train)
    return Config().replace(
        data={"mock_data": True}, model={"vocab_size": 256, "seq_length": 32}, train=t
    )


def test_null_tokenizer_for_mock_data():
    cfg = mock_cfg()
    tok = build_tokenizer(cfg.data, 256)
    assert (tok.vocab_size, tok.eod, tok.pad) == (256, 255, None)
    assert tok.tokenize("3 1 4") == [3, 1, 4] and tok.detokenize([3, 1, 4]) == "3 1 4"
    assert build_tokenizer(cfg.data).vocab_size == 512  # mock default
    with pytest.raises(ValueError, match="outside"):
        tok.tokenize("300")


def test_batch_layout_and_mock_content():
    it = build_data_iterators(mock_cfg(), dp_rank=0, dp_size=2)
    b = next(it.train)
    assert set(b) == {"tokens", "labels", "loss_mask"}
    assert b["tokens"].dtype == torch.int64 and b["tokens"].shape == (2, 32)
    assert b["labels"].dtype == torch.int64 and b["labels"].shape == (2, 32)
    assert b["loss_mask"].dtype == torch.float32 and torch.all(b["loss_mask"] == 1)
    assert torch.equal(b["tokens"][:, 1:], b["labels"][:, :-1])
    full = torch.cat([b["tokens"], b["labels"][:, -1:]], 1).numpy()
    assert full.max() < 256 and full.min() >= 0
    # Within a document the tokens count up by one modulo the vocab (256); a document ends with
    # EOD (255) and the next starts at 1.
    for row in full:
        for a, c in zip(row[:-1], row[1:], strict=True):
            assert c == (a + 1) % 256 or c == 1 or c == 255


def test_sample_counts():
    cfg = mock_cfg()
    assert split_sample_counts(cfg, 2) == {"train": 48, "valid": 48, "test": 16}
    cfg = mock_cfg(eval_interval=None, global_batch_size=None)
    assert split_sample_counts(cfg, 2) == {"train": 24, "valid": 8, "test": 8}
    it = build_data_iterators(mock_cfg(), dp_rank=1, dp_size=2)
    assert sum(1 for _ in it.train) == 48 // 4
    assert sum(1 for _ in it.valid_iterator()) == 48 // 4


def test_mock_samples_are_megatrons():
    """Megatron-LM cuts its mock documents in three even splits whatever ``--split`` says (the
    train split is documents 0..33332 of 100000); the first shuffled documents of its train
    split below, and the split sizes, are Megatron-LM d98e8a64's for vocab 1024, seq 64, 64
    train samples, seed 1234."""
    cfg = Config().replace(
        data={"mock_data": True, "split": "99,1,0"},
        model={"vocab_size": 1024, "seq_length": 64},
        train={"micro_batch_size": 8, "global_batch_size": 8, "train_iters": 8, "seed": 1234,
               "eval_interval": 4, "eval_iters": 1},
    )  # fmt: skip
    ds = build_datasets(cfg, dp_size=1)
    assert ds["train"].document_index[:5].tolist() == [30903, 11571, 3134, 32473, 27454]
    assert len(ds["train"].document_index) == 33333
    assert sorted(set(ds["valid"].document_index.tolist())) == list(range(33333, 66667))
    assert set(ds["test"].document_index.tolist()) <= set(range(66667, 100000))


def test_rank_sample_ids_is_megatron_order():
    # gbs 8, micro 2, dp 2: rounds of 4 ids; rank 1 takes ids 2,3 then 6,7 ...
    ids = list(rank_sample_ids(0, 16, 2, 1, 2))
    assert ids == [[2, 3], [6, 7], [10, 11], [14, 15]]
    assert list(rank_sample_ids(8, 16, 2, 0, 2)) == [[8, 9], [12, 13]]


def _rows(iterator, n):
    return [torch.cat([b["tokens"], b["labels"][:, -1:]], 1) for b in itertools.islice(iterator, n)]


def test_dp_ranks_partition_each_global_batch():
    cfg = mock_cfg()
    single = build_data_iterators(cfg.replace(train={"micro_batch_size": 8}), dp_rank=0, dp_size=1)
    ranks = [build_data_iterators(cfg, dp_rank=r, dp_size=2) for r in range(2)]
    ref = next(single.train)  # one micro-batch of 8 = the whole first global batch
    per_rank = [_rows(r.train, 2) for r in ranks]  # 2 micro-batches of 2 per rank = 8 samples
    order = [per_rank[0][0], per_rank[1][0], per_rank[0][1], per_rank[1][1]]
    assert torch.equal(torch.cat(order), torch.cat([ref["tokens"], ref["labels"][:, -1:]], 1))


@pytest.mark.parametrize("dp_rank", [0, 1])
def test_resume_gives_identical_batches(dp_rank):
    cfg = mock_cfg()
    full = _rows(build_data_iterators(cfg, dp_rank=dp_rank, dp_size=2).train, 12)
    consumed = 2 * 8  # two global batches
    resumed = _rows(
        build_data_iterators(
            cfg, dp_rank=dp_rank, dp_size=2, consumed_train_samples=consumed
        ).train,
        8,
    )
    assert all(torch.equal(a, b) for a, b in zip(full[4:], resumed, strict=True))
    assert len(resumed) == 8
    with pytest.raises(ValueError, match="multiple"):
        build_data_iterators(cfg, dp_rank=0, dp_size=2, consumed_train_samples=3)


def test_valid_iterator_restarts_and_seed_changes_data():
    it = build_data_iterators(mock_cfg(), dp_rank=0, dp_size=1)
    a, b = _rows(it.valid_iterator(), 3), _rows(it.valid_iterator(), 3)
    assert len(a) == 3
    assert all(torch.equal(x, y) for x, y in zip(a, b, strict=True))
    other = build_data_iterators(mock_cfg(seed=8), dp_rank=0, dp_size=1)
    assert not torch.equal(_rows(other.train, 1)[0], _rows(it.train, 1)[0])


def test_empty_split_is_none(tmp_path):
    prefix = str(tmp_path / "d_text_document")
    with IndexedDatasetWriter(prefix, np.uint16) as w:
        for k in range(40):
            w.add_document(np.arange(1, 10 + k % 7, dtype=np.uint16))
    cfg = mock_cfg().replace(data={"mock_data": False, "data_path": (prefix,), "split": "100,0,0"})
    it = build_data_iterators(cfg, dp_rank=0, dp_size=1)
    assert it.train is not None and it.valid is None and it.test is None
    assert it.valid_iterator() is None


def test_num_workers_matches_in_process():
    cfg = mock_cfg()
    a = _rows(build_data_iterators(cfg, dp_rank=1, dp_size=2).train, 3)
    cfg_w = cfg.replace(data={"mock_data": True, "num_workers": 1})
    b = _rows(build_data_iterators(cfg_w, dp_rank=1, dp_size=2).train, 3)
    assert len(a) == 3
    assert all(np.array_equal(x.numpy(), y.numpy()) for x, y in zip(a, b, strict=True))


def test_eod_mask_loss_drops_the_positions_whose_input_is_eod():
    """--eod-mask-loss (Megatron's): no loss where the input token is the EOD (255 here), on
    every split and after a resume; elsewhere the mask is 1."""
    from megafp8.cli import parse_args

    assert parse_args(["--mock-data", "--eod-mask-loss"]).data.eod_mask_loss is True
    plain = build_data_iterators(mock_cfg(), dp_rank=0, dp_size=1)
    it = build_data_iterators(mock_cfg(), dp_rank=0, dp_size=1, eod_mask_id=255)
    masked = 0
    for b, p in zip(itertools.islice(it.train, 20), itertools.islice(plain.train, 20), strict=True):
        assert torch.equal(b["tokens"], p["tokens"]) and torch.all(p["loss_mask"] == 1)
        assert torch.equal(b["loss_mask"], (b["tokens"] != 255).float())
        masked += int((b["loss_mask"] == 0).sum())
    assert masked > 0  # the mock documents end in EOD inside these samples
    v = next(it.valid_iterator())
    assert torch.equal(v["loss_mask"], (v["tokens"] != 255).float())
    again = build_data_iterators(
        mock_cfg(), dp_rank=0, dp_size=1, consumed_train_samples=8, eod_mask_id=255
    )
    assert again.eod_mask_id == 255 and torch.all(next(again.train)["loss_mask"] <= 1)
