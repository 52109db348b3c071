"""``run_hooks.end_process``: how the entry points exit once their work is done.

A collective library's C++ thread (here gloo's worker, running a future's callback) that needs
the GIL while the interpreter finalizes kills the process with SIGABRT, after the run itself
succeeded. ``end_process`` does what Python's exit does (threads joined, atexit handlers, streams
flushed) but not the finalization, so the exit status is the run's."""

import os
import signal
import subprocess
import sys
import textwrap

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

# The worker thread is inside the callback (sleeping, GIL released) when the main thread exits;
# finalization destroys the process group, which joins that worker, which wakes and asks for
# the GIL: always after finalization started.
BUSY_COLLECTIVE_THREAD = """
import sys, time
import torch, torch.distributed as dist
from megafp8.run_hooks import end_process

dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
started = []

def slow(fut):
    started.append(1)
    time.sleep(1.0)
    return fut.value()

work = dist.all_reduce(torch.ones(4), async_op=True)
chained = work.get_future().then(slow)
while not started:
    time.sleep(0.01)
print("run done", flush=True)
if sys.argv[1] == "sys.exit":
    sys.exit(3)
end_process(3)
"""


def _python(code: str, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = {**os.environ, "PYTHONPATH": ROOT, "OMP_NUM_THREADS": "1"}
    return subprocess.run(
        [sys.executable, "-c", textwrap.dedent(code), *args],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )


def test_a_collective_thread_busy_at_exit_leaves_the_status_alone():
    p = _python(BUSY_COLLECTIVE_THREAD, "end_process")
    assert p.returncode == 3, p.stdout + p.stderr
    assert "run done" in p.stdout
    assert "Fatal Python error" not in p.stderr and "terminate called" not in p.stderr


@pytest.mark.skipif(sys.version_info >= (3, 14), reason="3.14 parks such a thread instead")
def test_the_same_exit_through_sys_exit_dies_of_sigabrt():
    """What the entry points no longer do: the hazard is real on this interpreter."""
    p = _python(BUSY_COLLECTIVE_THREAD, "sys.exit")
    assert p.returncode == -signal.SIGABRT, (p.returncode, p.stderr[-2000:])
    assert "run done" in p.stdout


def test_threads_atexit_handlers_and_buffered_output_all_finish(tmp_path):
    marker = tmp_path / "atexit.txt"
    code = f"""
    import atexit, logging, sys, threading, time
    from megafp8.run_hooks import end_process

    logging.basicConfig(stream=sys.stdout, level=logging.INFO, format="%(message)s")
    atexit.register(lambda: open({str(marker)!r}, "w").write("ran"))

    def late():
        time.sleep(0.3)
        sys.stdout.write("thread finished")  # no newline: still in the buffer at exit

    threading.Thread(target=late).start()
    logging.info("logged")
    sys.stderr.write("to stderr")
    end_process(int(sys.argv[1]) if sys.argv[1] != "None" else None)
    """
    for arg, status in (("75", 75), ("None", 0), ("0", 0)):
        p = _python(code, arg)
        assert p.returncode == status, p.stdout + p.stderr
        assert p.stdout.startswith("logged\n") and p.stdout.endswith("thread finished")
        assert p.stderr.endswith("to stderr")
        assert marker.read_text() == "ran"
        marker.unlink()


def test_the_entry_points_exit_through_it():
    """Every script that starts a process group ends through ``end_process``."""
    for path in (
        "pretrain_gpt.py",
        "megafp8/train.py",
        "data_tools/convert_checkpoint.py",
        "megafp8/hf/convert.py",
        "megafp8/verify/spawn.py",
        "bench/gpu_step.py",
        "bench/ckpt_formats.py",
        "bench/gc_pass.py",
    ):
        with open(os.path.join(ROOT, path)) as f:
            src = f.read()
        assert "end_process(" in src and "sys.exit(main" not in src, path
