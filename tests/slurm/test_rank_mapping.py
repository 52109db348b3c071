"""Where a process sits (torchrun, srun task, alone) and the launch checks; no Slurm needed."""

import os
import subprocess
import sys

import pytest

from megafp8.run_hooks import EXIT_REQUEUE, LaunchEnv, check_launch, launch_env
from tests.helpers.tiny import tiny_config

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

SRUN = {
    "SLURM_STEP_ID": "0",
    "SLURM_PROCID": "3",
    "SLURM_NTASKS": "4",
    "SLURM_STEP_NUM_TASKS": "4",
    "SLURM_LOCALID": "1",
    "SLURM_NODEID": "1",
    "SLURM_STEP_TASKS_PER_NODE": "2(x2)",
}


def test_srun_task():
    assert launch_env(SRUN) == LaunchEnv(3, 4, 1, 2, "slurm")
    uneven = dict(SRUN, SLURM_STEP_TASKS_PER_NODE="3,1", SLURM_NODEID="0")
    assert launch_env(uneven).local_world == 3


def test_torchrun_variables_win_over_slurm():
    env = dict(SRUN, RANK="5", WORLD_SIZE="8", LOCAL_RANK="1", LOCAL_WORLD_SIZE="4")
    assert launch_env(env) == LaunchEnv(5, 8, 1, 4, "torchrun")


def test_one_process_and_a_batch_script_without_srun():
    assert launch_env({}) == LaunchEnv(0, 1, 0, 1, "single")
    assert launch_env({"SLURM_NTASKS": "1", "SLURM_PROCID": "0"}).world == 1
    with pytest.raises(ValueError, match=r"^SLURM_NTASKS=4 but this process was not started"):
        launch_env({"SLURM_NTASKS": "4", "SLURM_PROCID": "0"})  # the batch shell itself


def test_task_count_and_gpus_per_node():
    cfg = tiny_config(parallel=dict(tensor_model_parallel_size=2))
    check_launch(cfg, LaunchEnv(0, 4, 0, 2, "slurm"), gpus=0)
    with pytest.raises(ValueError, match=r"3 processes \(slurm\) cannot be laid out as tp=2"):
        check_launch(cfg, LaunchEnv(0, 3, 0, 3, "slurm"), gpus=0)
    with pytest.raises(ValueError, match="8 tasks on node .* but 4 GPUs visible"):
        check_launch(cfg, LaunchEnv(0, 8, 0, 8, "slurm"), gpus=4)
    check_launch(cfg, LaunchEnv(0, 8, 0, 4, "slurm"), gpus=4)


def test_requeue_status_is_tempfail():
    assert EXIT_REQUEUE == 75


def test_unreachable_master_is_one_line(tmp_path):
    """A rank that cannot resolve or reach MASTER_ADDR stops with one line naming it, before any
    process group (not a hang until the collective timeout)."""
    import socket

    from megafp8.run_hooks import reach_master

    with pytest.raises(ValueError, match=r"^MASTER_ADDR=no-such-host.invalid does not resolve"):
        reach_master("no-such-host.invalid", 29500, rank=1)
    with socket.socket() as s:  # a port nothing listens on
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    unreachable = rf"MASTER_ADDR=127.0.0.1:{port} is not reachable from rank 1"
    with pytest.raises(ValueError, match=unreachable):
        reach_master("127.0.0.1", port, rank=1, timeout_s=2)
    reach_master("127.0.0.1", port, rank=0)  # rank 0 hosts it: only the name must resolve
    env = dict(os.environ, RANK="1", WORLD_SIZE="2", LOCAL_RANK="1",
               MASTER_ADDR="no-such-host.invalid", MASTER_PORT="29500")  # fmt: skip
    r = subprocess.run([sys.executable, "pretrain_gpt.py", "--mock-data", "--num-layers", "2"],
                       cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)  # fmt: skip
    assert r.returncode == 2 and r.stderr.strip().startswith("error: MASTER_ADDR=no-such-host")
    assert len(r.stderr.strip().splitlines()) == 1
