"""Every shipped run file parses to the Config its YAML describes and validates at a world size
that fits its layout (with the data-parallel size that world size implies)."""

import dataclasses
import glob
import os

import pytest
import yaml

from megafp8.cli import parse_args
from megafp8.config import Config
from megafp8.validate import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = sorted(glob.glob(os.path.join(ROOT, "launch", "configs", "*.yaml")))


def test_there_are_run_files():
    assert len(FILES) >= 3


def _largest_dp(cfg, limit=8):
    """The largest dp <= limit for which the global batch splits into micro-batches over dp."""
    t = cfg.train
    return max(
        dp
        for dp in range(1, limit + 1)
        if t.global_batch_size is None or t.global_batch_size % (t.micro_batch_size * dp) == 0
    )


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_run_file_parses_to_its_values(path):
    """Each YAML value lands in its Config field, and every field the file does not name keeps
    its default (only --mock-data, given on the command line, differs)."""
    cfg = parse_args(["--config", path, "--mock-data"])
    with open(path) as f:
        raw = yaml.safe_load(f)
    default = Config()
    named = set()
    for section, values in raw.items():
        assert isinstance(values, dict), f"{path}: section {section} is not a mapping"
        for key, value in values.items():
            got = getattr(getattr(cfg, section), key)
            assert got == value, (section, key, got, value)
            named.add((section, key))
    for sec in dataclasses.fields(Config):
        for fld in dataclasses.fields(sec.default_factory):
            if (sec.name, fld.name) in named or (sec.name, fld.name) == ("data", "mock_data"):
                continue
            want = getattr(getattr(default, sec.name), fld.name)
            assert getattr(getattr(cfg, sec.name), fld.name) == want, (sec.name, fld.name)
    assert cfg.data.mock_data is True


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_run_file_validates(path):
    """validate() accepts the file at world = tp * pp * dp and returns that dp; a world size that
    tp * pp does not divide (when tp * pp > 1), or a dp that does not divide the global batch into
    micro-batches, is rejected."""
    cfg = parse_args(["--config", path, "--mock-data"])
    p = cfg.parallel
    mp = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    dp = _largest_dp(cfg)
    assert validate(cfg, mp * dp) == dp
    if mp > 1:
        with pytest.raises(ValueError, match="not divisible by tensor_model_parallel_size"):
            validate(cfg, mp * dp + 1)
    gbs, mbs = cfg.train.global_batch_size, cfg.train.micro_batch_size
    bad = next(d for d in range(2, 64) if gbs % (mbs * d))
    with pytest.raises(ValueError, match="global_batch_size"):
        validate(cfg, mp * bad)
