"""Every test leaves the process environment as it found it: a run inside the test process
(``megafp8.train.init_distributed``) sets the launcher variables (RANK, WORLD_SIZE, MASTER_PORT,
...), which would otherwise reach later tests' subprocesses and Slurm jobs. Compiled helpers
(``megafp8/data/blend_order.py``) go to a directory of the session, not the user's cache."""

import os

import pytest


@pytest.fixture(autouse=True, scope="session")
def _helper_cache(tmp_path_factory):
    os.environ["MEGAFP8_CACHE"] = str(tmp_path_factory.mktemp("megafp8-cache"))


@pytest.fixture(autouse=True)
def _restore_environ():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
