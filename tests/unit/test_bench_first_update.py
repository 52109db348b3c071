"""bench/first_update.py on megafp8 (one CPU process, fp32): Adam's first update is lr x sign(g)
on every tensor (eps out of the way), and the comparison table reads the file it wrote. The peer
side runs on the GPU machine only (Megatron-LM needs CUDA)."""

import json
import os
import subprocess
import sys

ROOT = os.path.join(os.path.dirname(__file__), "../..")
SCRIPT = os.path.join(ROOT, "bench/first_update.py")
TINY = (
    "--num-layers 2 --hidden-size 64 --num-attention-heads 4 --seq-length 32 "
    "--max-position-embeddings 32 --micro-batch-size 2 --global-batch-size 4 --vocab-size 256 "
    "--mock-data --tokenizer-type NullTokenizer --train-iters 2 --lr 1e-4 --weight-decay 0 "
    "--clip-grad 1.0 --log-interval 1 --adam-eps 1e-30"
).split()


def test_first_update_is_lr_times_sign(tmp_path):
    out = tmp_path / "ours.json"
    p = subprocess.run(
        [sys.executable, SCRIPT, "--json", str(out), "--", *TINY],
        capture_output=True, text=True, timeout=300, cwd=tmp_path,
    )  # fmt: skip
    assert p.returncode == 0, p.stderr[-3000:]
    stats = json.load(open(out))
    assert "layers.0.attn.qkv.linear.weight" in stats and len(stats) > 20
    for name, s in stats.items():
        if name.endswith("qkv.linear.bias"):  # the key bias: its gradient is 0 (a key shift
            continue  # moves a query's logits alike: softmax cancels it), only rounding is left
        # |delta| = lr |g| / (|g| + eps): with eps 1e-30 it is lr wherever g != 0; fp32 weights
        # of |w| <= ~1 round w - delta by under 1e-3 of lr
        assert s["changed"] > 0.999, (name, s)
        assert 0.999 < s["abs_delta_over_lr"] < 1.001, (name, s)
        assert s["over_1.5_lr"] == 0.0, (name, s)
    t = subprocess.run(
        [sys.executable, SCRIPT, "--compare", str(out)], capture_output=True, text=True, check=True
    ).stdout
    row = next(line for line in t.splitlines() if line.startswith("L.mlp.fc1.linear.weight"))
    assert row.split()[1] == str(2 * 64 * 256)  # two layers' fc1, h x 4h each
