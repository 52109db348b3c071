"""bench/gc_pass.py builds a tiny run and reports its tracked objects, the frozen count and the
full-pass times before and after the freeze (the times themselves are not judged here)."""

import os
import re
import subprocess
import sys

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_gc_pass_freezes_the_built_run():
    env = dict(os.environ, DS_ACCELERATOR="cpu")
    p = subprocess.run([sys.executable, os.path.join(HERE, "bench", "gc_pass.py")],
                       capture_output=True, text=True, env=env, timeout=600)  # fmt: skip
    assert p.returncode == 0, p.stderr[-2000:]
    m = re.search(r"tracked objects after the build: (\d+); frozen: (\d+)", p.stdout)
    assert m, p.stdout
    tracked, frozen = int(m.group(1)), int(m.group(2))
    assert tracked > 10_000  # torch, DeepSpeed and the model are tracked
    assert frozen >= tracked * 0.9  # the freeze took (nearly) all of them
    for when in ("before", "after"):
        line = re.search(rf"full pass \(ms\), {when} freeze: +([0-9. ]+)", p.stdout)
        assert line and len(line.group(1).split()) == 3, p.stdout
