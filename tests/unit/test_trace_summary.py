"""bench/trace_summary.py: busy and idle time and the per-kernel table of a Chrome trace, against
a hand computation."""

import importlib.util
import json
import os

import pytest

HERE = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _load():
    spec = importlib.util.spec_from_file_location(
        "trace_summary", os.path.join(HERE, "bench", "trace_summary.py")
    )
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _ev(name, ts, dur, cat="kernel"):
    return {"ph": "X", "cat": cat, "name": name, "ts": ts, "dur": dur}


def test_busy_idle_and_rows(tmp_path, capsys):
    ts = _load()
    trace = {
        "traceEvents": [
            _ev("gemm", 0, 100),
            _ev("gemm", 50, 100),  # overlaps the first: busy 0..150
            _ev("Memcpy DtoD", 200, 50, cat="gpu_memcpy"),  # idle 150..200
            _ev("mul", 300, 100),  # idle 250..300; span 0..400
            _ev("cpu_op_not_gpu", 0, 10_000, cat="cpu_op"),  # not a GPU event
            {"ph": "i", "cat": "kernel", "name": "instant", "ts": 5},
        ]
    }
    s = ts.summarize(trace, iters=2)
    assert s["span_ms"] == pytest.approx(400 / 1e3 / 2)
    assert s["busy_ms"] == pytest.approx(300 / 1e3 / 2)
    assert s["idle_share"] == pytest.approx(0.25)
    rows = [(k["name"], k["ms_per_iter"], k["calls_per_iter"]) for k in s["kernels"]]
    assert rows == [("gemm", 0.1, 1.0), ("mul", 0.05, 0.5), ("Memcpy DtoD", 0.025, 0.5)]
    assert sum(k["share"] for k in s["kernels"]) == pytest.approx(1.0)
    path = tmp_path / "profile_rank0.json"
    path.write_text(json.dumps(trace))
    ts.main([str(path), "--iters", "2", "--json", str(tmp_path / "s.json")])
    out = capsys.readouterr().out
    assert "idle 25.0 %" in out and "gemm" in out
    assert json.loads((tmp_path / "s.json").read_text())["kernels"][0]["name"] == "gemm"


def test_no_gpu_events_is_one_line():
    with pytest.raises(ValueError, match="no GPU kernel events"):
        _load().summarize({"traceEvents": [_ev("x", 0, 1, cat="cpu_op")]})
