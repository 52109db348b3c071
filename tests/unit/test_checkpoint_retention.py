"""Checkpoint retention (--most-recent-k, --save-retain-interval) and crash safety under kill -9
during saves, re-saves and retention deletions."""

import os
import random
import signal
import subprocess
import sys
import time

import pytest

from megafp8 import checkpoint as ck

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
FILES = ("model.pt", "optim_0.pt", "optim_1.pt")
SIZE = 256 * 1024


class FakeEngine:
    """Writes what DeepSpeed's save_checkpoint writes in shape: a few files under ``dir/tag``,
    each filled with a byte derived from the iteration, so a torn file is detectable."""

    def save_checkpoint(self, save_dir, tag, client_state, save_latest):
        d = os.path.join(save_dir, tag)
        os.makedirs(d, exist_ok=True)
        fill = bytes([client_state["iteration"] % 251]) * SIZE
        for name in FILES:
            with open(os.path.join(d, name), "wb") as f:
                f.write(fill)


def complete(save_dir, it):
    d = os.path.join(save_dir, ck.tag_for(it))
    fill = bytes([it % 251]) * SIZE
    if not os.path.isfile(os.path.join(d, "megafp8.json")):
        return False
    return all(open(os.path.join(d, n), "rb").read() == fill for n in FILES)


def test_what_retention_keeps():
    its = [1, 2, 3, 4, 5, 6, 7]
    assert ck.to_delete(its, 7, None, None) == []  # default: keep all
    assert ck.to_delete(its, 7, 2, None) == [1, 2, 3, 4, 5]
    assert ck.to_delete(its, 7, 2, 3) == [1, 2, 4, 5]  # 3 and 6 kept for ever
    assert ck.to_delete(its, 4, 2, None) == [1, 2, 3, 5]  # never what latest names
    assert ck.to_delete([], None, 1, 2) == []


def test_saves_keep_the_newest_and_the_multiples(tmp_path):
    d = str(tmp_path / "ck")
    for it in range(1, 8):
        ck.save(FakeEngine(), d, it, {"iteration": it}, {}, most_recent_k=2, retain_interval=3)
    assert ck.list_checkpoints(d) == [3, 6, 7]
    assert ck.latest_tag(d) == "iter_0000007" and all(complete(d, i) for i in (3, 6, 7))
    assert not [n for n in os.listdir(d) if n.startswith(".")]  # no leftovers


def test_resave_crash_between_the_moves_loads_the_old_copy(tmp_path):
    d = str(tmp_path / "ck")
    ck.save(FakeEngine(), d, 5, {"iteration": 5}, {})
    os.rename(os.path.join(d, "iter_0000005"), os.path.join(d, ".old-iter_0000005"))
    assert ck.latest_tag(d) == "iter_0000005" and complete(d, 5)


CHILD = r"""
import os, sys
sys.path.insert(0, {root!r})
from tests.unit.test_checkpoint_retention import FakeEngine
from megafp8 import checkpoint as ck
d = {d!r}
tag = ck.latest_tag(d) if os.path.isfile(os.path.join(d, "latest")) else None
it = int(tag[5:]) if tag else 0
print("ready", flush=True)
while True:
    it += 1
    ck.save(FakeEngine(), d, it, {{"iteration": it}}, {{}}, most_recent_k=2, retain_interval=5)
    if it % 3 == 0:  # re-save the same iteration now and then
        ck.save(FakeEngine(), d, it, {{"iteration": it}}, {{}}, most_recent_k=2, retain_interval=5)
"""


@pytest.mark.slow
def test_twenty_kills_never_leave_latest_on_an_incomplete_checkpoint(tmp_path):
    d = str(tmp_path / "ck")
    rng = random.Random(1234)
    script = CHILD.format(root=ROOT, d=d)
    newest = 0
    for _ in range(20):
        p = subprocess.Popen(
            [sys.executable, "-c", script], cwd=ROOT, stdout=subprocess.PIPE, text=True
        )
        assert p.stdout.readline().strip() == "ready"  # imports done (and any recovery)
        time.sleep(rng.uniform(0.0, 0.4))  # then the kill falls among saves in flight
        p.send_signal(signal.SIGKILL)
        p.wait()
        tag = ck.latest_tag(d) if os.path.isfile(os.path.join(d, "latest")) else None
        if tag is None:
            continue
        it = int(tag[5:])
        assert complete(d, it), f"latest names {tag}, which is not complete"
        assert it >= newest  # progress is never lost
        newest = it
        for i in ck.list_checkpoints(d):  # every directory under a checkpoint's name is whole
            assert complete(d, i), f"{ck.tag_for(i)} is torn"
    assert newest > 20  # the kills fell among many saves
