"""bench/scale.py (launch/bench.sbatch's code) on one CPU process: the weak-scaling batch, the
table and its JSON; the Slurm run is in tests/slurm."""

import importlib.util
import json
import os
import sys

_path = os.path.join(os.path.dirname(__file__), "../../bench/scale.py")
sys.path.insert(0, os.path.dirname(_path))
_spec = importlib.util.spec_from_file_location("scale", _path)
scale = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(scale)

TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --vocab-size 256"
)


def test_global_batch_grows_with_data_parallel_ranks():
    argv = scale.case_flags(TINY + " --train-iters 99", tp=2, pp=1, dp=4, iters=5)
    val = {argv[i]: argv[i + 1] for i in range(len(argv) - 1)}
    assert val["--global-batch-size"] == "16"  # micro 2 x dp 4 x 2 micro-batches per rank
    assert val["--train-iters"] == "5" and argv.count("--train-iters") == 1
    assert val["--tensor-model-parallel-size"] == "2" and "--sequence-parallel" in argv


def test_one_process_table(tmp_path):
    rc = scale.main(["--launcher", "local", "--flags", TINY, "--precision", "fp8", "--iters", "4",
                     "--skip", "1", "--out", str(tmp_path)])  # fmt: skip
    assert rc == 0
    rows = json.loads((tmp_path / "scale.json").read_text())["rows"]
    assert len(rows) == 1 and rows[0]["iters_logged"] == 4
    assert rows[0]["tokens_per_s_per_gpu"] > 0 and rows[0]["scaling_efficiency"] == 1.0
    md = (tmp_path / "scale.md").read_text()
    assert md.count("| custom | 1 | 1 | 1 | 1 | 4 |") == 1
