"""--fp8-overflow-fallback-steps K: a layer whose FP8 casts overflow (a NaN/inf, or more than
--fp8-overflow-saturated-share of the values clamped) in K iterations in a row leaves FP8: its
GEMMs run plainly from the next iteration on, rank 0 logs it once naming the layer, and the
checkpoint keeps it out of FP8 across a resume. Torch backend, on the CPU."""

import logging
import math

from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config
from tests.unit.bad_steps_util import Capture

# the input of layers.1.mlp.fc1, forward value only (its gradient passes unscaled), at iterations
# 2 and 3: x 1e2 then x 1e4 against a delayed scale from the history, so most values clamp
FACTORS = {2: 1e2, 3: 1e4}


def _cfg(**train):
    return tiny_config(
        fp8=dict(fp8_format="hybrid", fp8_amax_history_len=4, fp8_overflow_fallback_steps=2),
        train=dict(micro_batch_size=2, global_batch_size=4, **train),
    )


def _fp8_flags(run):
    from megafp8.fp8.torch_backend import Fp8Linear

    return {m.name: m.fp8 for m in run.model.modules() if isinstance(m, Fp8Linear)}


def _train(cfg, inject: bool):
    import megafp8.train as T

    groups, device = T.init_distributed(cfg)
    run = T.build_run(cfg, groups, device)
    if inject:
        (fc1,) = [m for m in run.model.modules() if getattr(m, "name", "") == "layers.1.mlp.fc1"]
        orig = fc1.forward

        def forward(x):
            f = FACTORS.get(run.iteration + 1, 1.0)
            return orig(x + (x * (f - 1.0)).detach())

        fc1.forward = forward
    cap = Capture()
    lg = logging.getLogger("megafp8")
    lg.setLevel(logging.INFO)
    lg.addHandler(cap)
    after = {}
    step = T.train_step

    def train_step(r, it, hooks=None):
        out = step(r, it, hooks)
        after[r.iteration + 1] = dict(_fp8_flags(r))
        return out

    T.train_step = train_step
    try:
        hist = T.train(cfg, run)
    finally:
        T.train_step = step
        lg.removeHandler(cap)
    return after, cap.lines, all(math.isfinite(r["lm loss"]) for r in hist)


def test_overflowing_layer_falls_back_and_stays_after_resume(tmp_path):
    ck = str(tmp_path / "ck")
    after, lines, finite = run_distributed(_train, 1, _cfg(train_iters=4, save=ck), True)[0]
    assert finite
    layer1 = {"layers.1.attn.qkv", "layers.1.attn.proj", "layers.1.mlp.fc1", "layers.1.mlp.fc2"}
    # during iteration 3 (the second in a row) still FP8; from iteration 4 on layers.1 is plain
    assert all(after[3].values())
    assert {k for k, v in after[4].items() if not v} == layer1
    warned = [x for x in lines if "FP8 overflow" in x]
    assert len(warned) == 1 and "layers.1 " in warned[0] and "iteration 4 on" in warned[0]
    # resume: layers.1 stays out of FP8 although nothing overflows any more
    after2, lines2, _ = run_distributed(_train, 1, _cfg(train_iters=6, load=ck), False)[0]
    assert {k for k, v in after2[5].items() if not v} == layer1
    assert {k for k, v in after2[6].items() if not v} == layer1
    assert any("layers.1" in x and "FP8 off" in x for x in lines2)


def test_no_fallback_without_overflow():
    after, lines, _ = run_distributed(_train, 1, _cfg(train_iters=3), False)[0]
    assert all(all(v.values()) for v in after.values())
    assert not [x for x in lines if "FP8 overflow" in x]
