"""Every shipped run file parses and validates (at a world size its layout fits)."""

import glob
import os

import pytest

from megafp8.cli import parse_args
from megafp8.config import validate

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = sorted(glob.glob(os.path.join(ROOT, "launch", "configs", "*.yaml")))


def test_there_are_run_files():
    assert len(FILES) >= 3


@pytest.mark.parametrize("path", FILES, ids=os.path.basename)
def test_run_file_validates(path):
    cfg = parse_args(["--config", path, "--mock-data"])
    p = cfg.parallel
    world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size * 8
    gbs = cfg.train.global_batch_size
    if gbs and gbs % (cfg.train.micro_batch_size * 8):
        world = p.tensor_model_parallel_size * p.pipeline_model_parallel_size
    assert validate(cfg, world) >= 1
