"""The tokenizer sidecar beside a dataset and the training-start check: the run's tokenizer must
give the data's ids and EOD (sidecar fingerprint, else the data's largest token id), with
one-line errors before anything expensive."""

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from megafp8.config import Config
from megafp8.data.indexed import IndexedDatasetWriter
from megafp8.data.tokenizer import (
    check_run_tokenizer,
    make_tokenizer,
    read_sidecar,
    sidecar_path,
    write_sidecar,
)
from megafp8.data.tokenizer.sidecar import sampled_max_token_id
from tests.unit.tiny_tokenizers import SP_SIZE, write_sp_model

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TOOL = os.path.join(ROOT, "data_tools", "preprocess_data.py")


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    """The same text preprocessed with current (``c``) and legacy (``l``) SentencePiece."""
    d = tmp_path_factory.mktemp("side")
    model = write_sp_model(str(d / "tiny.model"))
    with open(d / "in.jsonl", "w") as f:
        for t in ["hello world", "hello<EOD>world </s>", "héllo"] * 50:
            f.write(json.dumps({"text": t}) + "\n")
    for tag, extra in (("c", []), ("l", ["--tokenizer-sentencepiece-legacy"])):
        r = subprocess.run(
            [
                sys.executable,
                TOOL,
                "--input",
                str(d / "in.jsonl"),
                "--append-eod",
                "--tokenizer-type",
                "SentencePieceTokenizer",
                "--tokenizer-model",
                model,
                "--output-prefix",
                str(d / tag),
                "--workers",
                "1",
                *extra,
            ],
            capture_output=True,
            text=True,
        )
        assert r.returncode == 0, r.stderr
    return d, model


def run_cfg(prefix, model, **data):
    d = {"data_path": (str(prefix),), "tokenizer_model": model, **data}
    return Config().replace(data=d)


def test_sidecar_is_written_atomically_beside_the_pair(data):
    d, _ = data
    names = sorted(os.listdir(d))
    assert "c_text_document.tokenizer.json" in names and not [n for n in names if ".tmp" in n]
    side = read_sidecar(str(d / "c_text_document"))
    assert side["format"] == "megafp8-tokenizer-sidecar" and side["files"].keys() == {"tiny.model"}


def test_matching_tokenizer_passes(data):
    d, model = data
    check_run_tokenizer(run_cfg(d / "c_text_document", model))
    legacy = run_cfg(d / "l_text_document", model, tokenizer_sentencepiece_legacy=True)
    assert check_run_tokenizer(legacy).eod == SP_SIZE + 2
    # Another type that gives the same ids and EOD is fine.
    check_run_tokenizer(
        run_cfg(d / "c_text_document", model, tokenizer_type="GPTSentencePieceTokenizer")
    )


def test_legacy_flag_mismatch_is_caught(data):
    d, model = data
    with pytest.raises(ValueError) as err:
        check_run_tokenizer(run_cfg(d / "l_text_document", model))
    msg = str(err.value)
    assert "\n" not in msg
    assert "l_text_document: tokenized with SentencePieceTokenizer legacy" in msg
    assert "EOD 279, vocab 282" in msg and "this run uses SentencePieceTokenizer (" in msg
    assert "EOD 2, vocab 277" in msg
    with pytest.raises(ValueError, match="tokenized with SentencePieceTokenizer \\(.*EOD 2"):
        check_run_tokenizer(
            run_cfg(d / "c_text_document", model, tokenizer_sentencepiece_legacy=True)
        )


def test_other_model_file_is_caught(data, tmp_path):
    d, _ = data
    other = write_sp_model(str(tmp_path / "other.model"), eos_piece="<EOD>")  # other bytes
    with pytest.raises(ValueError, match="tiny.model sha256 .*other.model sha256"):
        check_run_tokenizer(run_cfg(d / "c_text_document", other))


def test_without_sidecar_the_largest_id_decides(data, tmp_path):
    d, model = data
    for tag in ("c", "l"):  # data made by Megatron: no sidecar
        for ext in (".bin", ".idx"):
            os.link(d / f"{tag}_text_document{ext}", tmp_path / f"{tag}{ext}")
    check_run_tokenizer(run_cfg(tmp_path / "c", model))
    with pytest.raises(ValueError) as err:
        check_run_tokenizer(
            run_cfg(tmp_path / "l", model).replace(model={"make_vocab_size_divisible_by": 64})
        )
    assert "holds token id 279, outside the vocab of SentencePieceTokenizer" in str(err.value)
    assert "padded 320: the data was tokenized with another tokenizer" in str(err.value)


def test_sampled_max_reads_windows_across_the_file(tmp_path):
    tokens = np.ones(100_000, np.uint16)
    tokens[0], tokens[-1] = 7, 9
    with IndexedDatasetWriter(str(tmp_path / "big"), np.uint16) as w:
        w.add_document(tokens)
    assert sampled_max_token_id(str(tmp_path / "big")) == (9, True)
    assert sampled_max_token_id(str(tmp_path / "big"), budget=1600) == (9, False)
    with IndexedDatasetWriter(str(tmp_path / "empty"), np.uint16):
        pass
    assert sampled_max_token_id(str(tmp_path / "empty")) == (-1, True)


def test_bad_run_inputs(data, tmp_path):
    d, model = data
    with pytest.raises(ValueError, match="vocab_size=100 is smaller than the vocab"):
        check_run_tokenizer(
            run_cfg(d / "c_text_document", model).replace(model={"vocab_size": 100})
        )
    with pytest.raises(ValueError, match="tokenizer_type='Bert' must be one of"):
        check_run_tokenizer(run_cfg(d / "c_text_document", model, tokenizer_type="Bert"))
    (tmp_path / "x.tokenizer.json").write_text("{")
    with pytest.raises(ValueError, match="x.tokenizer.json: unreadable tokenizer sidecar"):
        check_run_tokenizer(run_cfg(tmp_path / "x", model))
    tok = make_tokenizer("NullTokenizer", vocab_size=11)
    write_sidecar(str(tmp_path / "n"), tok, 10, 5)
    assert json.loads(open(sidecar_path(str(tmp_path / "n"))).read())["eod"] == 10
    # ids written with EOD 10 (11 ids): a run with --vocab-size 10 (EOD 9) is told the value
    null = Config().replace(
        data={"data_path": (str(tmp_path / "n"),), "tokenizer_type": "NullTokenizer"},
        model={"vocab_size": 10},
    )
    with pytest.raises(ValueError, match=r"EOD 10, vocab 11\), but .*EOD 9, vocab 10\); pass "
                       r"--vocab-size 11 used by preprocess_data.py"):  # fmt: skip
        check_run_tokenizer(null)
    assert check_run_tokenizer(null.replace(model={"vocab_size": 11})).eod == 10


def test_loader_and_train_check_the_data(data):
    from megafp8.data.loader import build_datasets
    from megafp8.train import check_inputs, main

    d, model = data
    wrong = run_cfg(d / "l_text_document", model)
    with pytest.raises(ValueError, match="tokenized with SentencePieceTokenizer legacy"):
        build_datasets(wrong, 1, make_tokenizer(None, model))
    with pytest.raises(ValueError, match="tokenized with SentencePieceTokenizer legacy"):
        check_inputs(wrong)
    assert main(["--data-path", str(d / "l_text_document"), "--tokenizer-model", model]) == 2
