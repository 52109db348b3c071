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


def _launch(corr, ts, tid=1):
    return {"ph": "X", "cat": "cuda_runtime", "name": "cudaLaunchKernel", "ts": ts, "dur": 2,
            "tid": tid, "args": {"correlation": corr}}  # fmt: skip


def _range(name, ts, dur, tid=1):
    return {"ph": "X", "cat": "user_annotation", "name": name, "ts": ts, "dur": dur, "tid": tid}


def test_idle_gaps_charged_to_the_launching_phase(capsys, tmp_path):
    """Each gap goes to the innermost range around the launch of the kernel that ends it: on the
    launching thread, else (autograd's own thread) on any thread."""
    ts = _load()

    def k(name, t, dur, corr):
        return {**_ev(name, t, dur), "args": {"correlation": corr}}

    trace = {
        "traceEvents": [
            _range("megafp8.forward", 0, 300),
            _range("inner", 150, 20),  # innermost around the launch at 160
            _range("megafp8.backward", 300, 500),  # main thread waits; autograd (tid 2) launches
            _range("megafp8.step", 800, 400),
            k("a", 0, 100, 1), _launch(1, 0),
            k("b", 130, 70, 2), _launch(2, 160),  # gap 100..130 (30): inner
            k("c", 200, 50, 3), _launch(3, 190),  # no gap
            k("d", 400, 100, 4), _launch(4, 390, tid=2),  # gap 250..400 (150): backward
            k("e", 460, 20, 5), _launch(5, 450, tid=2),  # inside d: no gap
            k("f", 900, 100, 6), _launch(6, 890),  # gap 500..900 (400): step
            k("g", 1010, 10, 7),  # gap 1000..1010 (10): launch unknown -> (none)
        ]
    }  # fmt: skip
    s = ts.summarize(trace)
    by = {n: v["ms_per_iter"] for n, v in s["idle_by_phase"].items()}
    assert by == pytest.approx({"megafp8.step": 0.4, "megafp8.backward": 0.15, "inner": 0.03,
                                "(none)": 0.01})  # fmt: skip
    assert list(s["idle_by_phase"])[0] == "megafp8.step"  # largest first
    assert s["idle_share"] == pytest.approx(590 / 1020)
    g = s["gaps"][0]
    assert (g["at_ms"], g["ms"]) == pytest.approx((0.5, 0.4))
    assert (g["phase"], g["before"], g["after"]) == ("megafp8.step", "d", "f")
    assert [x["after"] for x in s["gaps"]] == ["f", "d", "b", "g"]
    # kernel time charged the same way: a (forward) 100, b (inner) 70, c (forward) 50, d and e
    # (backward) 120, f (step) 100, g (none) 10
    work = {n: v["ms_per_iter"] for n, v in s["work_by_phase"].items()}
    assert work == pytest.approx({"megafp8.forward": 0.15, "megafp8.backward": 0.12,
                                  "megafp8.step": 0.1, "inner": 0.07, "(none)": 0.01})  # fmt: skip
    assert s["work_by_phase"]["megafp8.backward"]["top"] == [
        {"name": "d", "ms_per_iter": pytest.approx(0.1)},
        {"name": "e", "ms_per_iter": pytest.approx(0.02)},
    ]
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    ts.main([str(path), "--gaps", "2", "--phase", "megafp8.backward"])
    out = capsys.readouterr().out
    assert "megafp8.step" in out and out.count("  gap ") == 2
    assert "0.12 ms/iter,      2 launched: megafp8.backward" in out
    assert out.count("      ") >= 2 and "ms  d" in out and "ms  e" in out


def test_who_names_the_operators_that_launched_a_kernel(capsys, tmp_path):
    """``--who``: the chain of CPU operators around each matching kernel's launch, innermost
    first, with the innermost one's input shapes; other kernels are left out."""
    ts = _load()

    def op(name, t, dur, dims=None, tid=1):
        e = {"ph": "X", "cat": "cpu_op", "name": name, "ts": t, "dur": dur, "tid": tid}
        if dims is not None:
            e["args"] = {"Input Dims": dims}
        return e

    def k(name, t, dur, corr):
        return {**_ev(name, t, dur), "args": {"correlation": corr}}

    trace = {
        "traceEvents": [
            op("MulBackward0", 0, 100), op("aten::mul", 10, 20, [[8, 4], []]),
            op("aten::add", 200, 20, [[8, 4], [8, 4]], tid=2),
            k("mul_kernel", 50, 30, 1), _launch(1, 15),
            k("mul_kernel", 90, 10, 2), _launch(2, 15),
            k("add_kernel", 300, 36, 3), _launch(3, 210, tid=2),
            k("add_kernel", 400, 20, 4), _launch(4, 500),  # outside every op
            k("gemm", 500, 90, 5), _launch(5, 12),
        ]
    }  # fmt: skip
    rows = ts.launchers(trace, ["mul_", "add_"], iters=2)
    assert [(r["kernel"], r["ops"], r["dims"], r["calls_per_iter"]) for r in rows] == [
        ("mul_kernel", "aten::mul < MulBackward0", "[[8, 4], []]", 1.0),
        ("add_kernel", "aten::add", "[[8, 4], [8, 4]]", 0.5),
        ("add_kernel", "(no cpu op)", "", 0.5),
    ]
    assert rows[0]["ms_per_iter"] == pytest.approx(0.02)
    path = tmp_path / "t.json"
    path.write_text(json.dumps(trace))
    ts.main([str(path), "--who", "mul_"])
    out = capsys.readouterr().out
    assert "mul_kernel <- aten::mul < MulBackward0 [[8, 4], []]" in out
    assert "add_kernel <-" not in out
