"""``slurm_cluster``: a private slurmctld and two slurmd on this machine, for the session."""

import os
import platform

import pytest

from tests.slurm.cluster import Cluster, install, missing


@pytest.fixture(scope="session")
def slurm_cluster(tmp_path_factory):
    if platform.system() != "Linux":
        pytest.skip(f"a local Slurm needs Linux (this is {platform.system()})")
    if missing():
        why = install()
        if why:
            pytest.skip(why)
    if os.geteuid() != 0:
        pytest.skip("slurmd runs jobs as their owner and needs root here: not root")
    cluster = Cluster(str(tmp_path_factory.mktemp("slurm")))
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()
