"""launch/*.sbatch on a real Slurm (slurmctld + two slurmd on this machine, tests/slurm/cluster.py).

- pretrain.sbatch on 2 nodes x 2 tasks (TP 2 x DP 2, gloo, mock data) gives one process's losses;
- the same job sent USR1 mid-run saves, exits 75, requeues itself, resumes from ``latest`` and
  ends with the uninterrupted job's losses, bit for bit;
- preprocess.sbatch (an array task per JSONL file, then a dependent merge) writes the bytes of
  one preprocess_data.py run over all the files.
"""

import json
import os
import re
import subprocess
import sys
import time

import pytest
import torch

pytestmark = [pytest.mark.slurm, pytest.mark.slow]

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
RUN_FILE = os.path.join(ROOT, "tests", "slurm", "tiny.yaml")
LINE = re.compile(r"iteration\s+(\d+)/\s*\d+ \|.*?\| lm loss: ([-+.\dEe]+) \|")
JOB = ["-N2", "--ntasks-per-node=2", "--gpus-per-node=0", "--cpus-per-task=1", "--time=30"]


def losses(text: str) -> dict[int, str]:
    """Iteration -> the logged lm loss (as printed); a later line for an iteration wins."""
    return {int(i): v for i, v in LINE.findall(text)}


def submit_env(tmp, name):
    return {
        "RUN_FILE": RUN_FILE,
        "EXTRA_FLAGS": "--tensor-model-parallel-size 2",
        "CKPT_DIR": str(tmp / f"{name}-ckpt"),
        "LOG_DIR": str(tmp / f"{name}-logs"),
        "MASTER_ADDR": "127.0.0.1",  # the node names n1/n2 resolve nowhere: both are this host
        "DS_ACCELERATOR": "cpu",
        "OMP_NUM_THREADS": "1",
    }


def read(path) -> str:
    with open(path) as f:
        return f.read()


@pytest.fixture(scope="module")
def one_process():
    """The same run file in one plain process (no Slurm variables)."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "RANK", "WORLD_"))}
    env.update(DS_ACCELERATOR="cpu", OMP_NUM_THREADS="1")
    r = subprocess.run(
        [sys.executable, "pretrain_gpt.py", "--config", RUN_FILE],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert r.returncode == 0, r.stderr[-2000:]
    got = losses(r.stdout)
    assert sorted(got) == list(range(1, 21))
    return got


@pytest.fixture(scope="module")
def uninterrupted(slurm_cluster, tmp_path_factory):
    """``sbatch --wait launch/pretrain.sbatch`` on 2 nodes x 2 tasks; its log's losses."""
    tmp = tmp_path_factory.mktemp("pretrain")
    out = tmp / "job.out"
    r = slurm_cluster.run(
        "sbatch", "--wait", "--parsable", *JOB, f"--output={out}", "launch/pretrain.sbatch",
        env=submit_env(tmp, "a"), cwd=ROOT, check=False,
    )  # fmt: skip
    job = r.stdout.strip().split(";")[0]
    log = tmp / "a-logs" / job / "train.log"
    train_log = read(log) if log.exists() else "(no train.log)"
    assert r.returncode == 0, f"{r.stderr}\n{read(out)}\n{train_log[-3000:]}"
    assert slurm_cluster.job(job)["NumNodes"] == "2"
    return losses(train_log), train_log


def test_pretrain_two_nodes_matches_one_process(uninterrupted, one_process):
    got, log = uninterrupted
    assert sorted(got) == list(range(1, 21)), log[-3000:]
    assert "data-parallel size 2, tp 2, pp 1" in log
    # Cross-rank sums (row-parallel reductions over TP, gradient averaging over DP) change the
    # fp32 summation order; tests/parallel/test_tp_dp_zero.py's bound for that, 2e-5 relative
    # (Adam's update ~ lr * sign(g) amplifies tiny gradient differences near zero), holds here over
    # all 20 steps (observed: <= 3e-7, the printed precision).
    a = torch.tensor([float(got[i]) for i in range(1, 21)], dtype=torch.float64)
    b = torch.tensor([float(one_process[i]) for i in range(1, 21)], dtype=torch.float64)
    torch.testing.assert_close(a, b, rtol=2e-5, atol=2e-5)


def test_usr1_saves_requeues_and_resumes(slurm_cluster, uninterrupted, tmp_path):
    ref, _ = uninterrupted
    out = tmp_path / "job.out"
    r = slurm_cluster.run(
        "sbatch", "--parsable", *JOB, f"--output={out}", "launch/pretrain.sbatch",
        env=submit_env(tmp_path, "b"), cwd=ROOT,
    )  # fmt: skip
    job = r.stdout.strip().split(";")[0]
    log = tmp_path / "b-logs" / job / "train.log"
    deadline = time.monotonic() + 240
    while not (log.exists() and losses(read(log))):  # training has started: handlers are set
        assert time.monotonic() < deadline, f"no iteration logged: {read(out)}"
        assert slurm_cluster.job(job)["JobState"] in ("PENDING", "RUNNING"), read(out)
        time.sleep(0.2)
    slurm_cluster.run("scancel", "--signal=USR1", job)  # to every task of the job's steps
    info = slurm_cluster.wait(job, timeout=300)
    text, batch = read(log), read(out)
    assert info["JobState"] == "COMPLETED", f"{info}\n{batch}\n{text[-3000:]}"
    assert info["Restarts"] == "1", batch
    m = re.search(r"saved at iteration (\d+) on a signal: requeueing", batch)
    assert m and 1 <= int(m.group(1)) < 20, batch
    assert f"resumed from {tmp_path / 'b-ckpt'} at iteration {m.group(1)}" in text
    # the resumed run continues bit-identically: every loss as the uninterrupted job printed it
    assert losses(text) == ref


def test_preprocess_array_job_matches_one_process(slurm_cluster, tmp_path):
    corpus = tmp_path / "corpus"
    (corpus / "sub").mkdir(parents=True)
    rows = [" ".join(str((7 * d + k) % 997) for k in range(d % 13)) for d in range(90)]
    shards = ["a.jsonl", "b.jsonl", "sub/c.jsonl"]  # sorted order: a, b, sub/c
    for s, part in zip(shards, (rows[:40], rows[40:41], rows[41:]), strict=True):
        with open(corpus / s, "w") as f:
            f.writelines(json.dumps({"text": t}) + "\n" for t in part)
    tok = "--tokenizer-type NullTokenizer --vocab-size 1000"
    one = subprocess.run(
        [sys.executable, "data_tools/preprocess_data.py", "--input", str(corpus),
         "--output-prefix", str(tmp_path / "one"), *tok.split(), "--append-eod",
         "--workers", "1"],
        cwd=ROOT, capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert one.returncode == 0, one.stderr
    env = {
        "INPUT": str(corpus),
        "OUTPUT_PREFIX": str(tmp_path / "arr"),
        "TOKENIZER_FLAGS": tok,
        "SBATCH_FLAGS": f"--cpus-per-task=1 --output={tmp_path}/prep-%A_%a.out",
    }
    r = slurm_cluster.run("bash", "launch/preprocess.sbatch", env=env, cwd=ROOT)
    m = re.search(r"array job (\d+) \(3 files\), merge job (\d+)", r.stdout)
    assert m, r.stdout + r.stderr
    info = slurm_cluster.wait(m.group(2), timeout=240)
    logs = "".join(read(tmp_path / f) for f in sorted(os.listdir(tmp_path)) if "prep-" in f)
    assert info["JobState"] == "COMPLETED", f"{info}\n{logs}"
    for i in range(3):  # one array task per file
        assert slurm_cluster.job(f"{m.group(1)}_{i}")["JobState"] == "COMPLETED"
    for ext in (".bin", ".idx", ".tokenizer.json"):
        a = (tmp_path / f"one_text_document{ext}").read_bytes()
        b = (tmp_path / f"arr_text_document{ext}").read_bytes()
        assert a == b, ext


BENCH_SHAPE = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --vocab-size 256"
)


def test_bench_sbatch_one_node_and_two(slurm_cluster, tmp_path):
    """launch/bench.sbatch on the 2 nodes x 2 tasks: the shape on 1 node and on 2 (weak scaling:
    the global batch doubles with the DP ranks), one table with its scaling efficiency."""
    out = tmp_path / "bench"
    env = {"FLAGS": BENCH_SHAPE, "LAYOUTS": "1,1", "ITERS": "4", "SKIP": "1", "OUT": str(out),
           "MASTER_ADDR": "127.0.0.1", "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}  # fmt: skip
    r = slurm_cluster.run(
        "sbatch", "--wait", "--parsable", *JOB, f"--output={tmp_path / 'job.out'}",
        "launch/bench.sbatch", env=env, cwd=ROOT, check=False,
    )  # fmt: skip
    assert r.returncode == 0, f"{r.stderr}\n{read(tmp_path / 'job.out')[-3000:]}"
    rows = json.loads(read(out / "scale.json"))["rows"]
    assert [(x["nodes"], x["gpus"], x["dp"]) for x in rows] == [(1, 2, 2), (2, 4, 4)]
    assert all(x["rc"] == 0 and x["iters_logged"] == 4 for x in rows)
    assert rows[1]["global_batch"] == 2 * rows[0]["global_batch"]
    assert rows[0]["scaling_efficiency"] == 1.0 and rows[1]["scaling_efficiency"] > 0
    assert "| custom | 1 | 1 | 4 | 2 |" in read(out / "scale.md")
