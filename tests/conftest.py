"""Every test leaves the process environment as it found it: a run inside the test process
(``megafp8.train.init_distributed``) sets the launcher variables (RANK, WORLD_SIZE, MASTER_PORT,
...), which would otherwise reach later tests' subprocesses and Slurm jobs."""

import os

import pytest


@pytest.fixture(autouse=True)
def _restore_environ():
    saved = dict(os.environ)
    yield
    os.environ.clear()
    os.environ.update(saved)
