"""The interleaved 1F1B schedule (virtual pipeline stages) equals one process with the same
weights: the iteration's loss, every weight gradient of every chunk, the FP8 scaling state
(test_pp_grads.py's pattern, plain engine, no optimizer), then 5 DeepSpeed steps at pp 2 x v 2 x
dp 2 (ZeRO 1) and a bit-identical resume (test_pp_train.py's pattern)."""

import os

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.engine import PlainEngine
from tests.helpers.tiny import tiny_config
from tests.parallel.test_pp_grads import FP32_TOL, _batches, _run


class BoundaryEngine(PlainEngine):
    """PlainEngine plus DeepSpeed's manual accumulation boundary, recorded per backward."""

    def __init__(self, module, gas):
        super().__init__(module, gas)
        self.boundaries = []

    def set_gradient_accumulation_boundary(self, flag):
        self.boundaries.append(flag)


def _compare(cfg, m):
    from types import SimpleNamespace

    from megafp8.fp8.backend import build_backend
    from megafp8.model.gpt import build_model
    from megafp8.parallel.groups import ParallelGroups
    from megafp8.parallel.pipeline.interleaved import interleaved_one_f_one_b
    from megafp8.parallel.pipeline.schedules import no_pipelining

    groups = ParallelGroups.build(1, cfg.parallel.pipeline_model_parallel_size)
    backend = build_backend(cfg.fp8, amax_group=groups.tp_dp_group, tp_group=groups.tp_group)
    model = build_model(cfg, backend=backend, groups=groups, vocab_size=cfg.model.vocab_size)
    eng = BoundaryEngine(model, m)
    par = SimpleNamespace(cfg=cfg, groups=groups, model=model, engine=eng, backend=backend,
                          device=torch.device("cpu"))  # fmt: skip
    record = {}
    loss, _ = interleaved_one_f_one_b(par, iter(_batches(cfg, m)), record=record)
    ref_cfg = cfg.replace(parallel=dict(pipeline_model_parallel_size=1,
                                        virtual_pipeline_model_parallel_size=None))  # fmt: skip
    ref = _run(ref_cfg, ParallelGroups.single(), None, m)
    ref_loss, _ = no_pipelining(ref, iter(_batches(cfg, m)))
    ref_params = dict(ref.model.named_parameters())
    grads = {}
    for name, q in model.named_parameters():  # "chunks.<c>." + the one-process name
        grads[name] = (q.grad, ref_params[name.split(".", 2)[2]].grad)
    copy = None
    if hasattr(model.chunks[-1], "tied_output_weight"):
        w = model.chunks[-1].tied_output_weight
        assert w.grad is None  # sent to rank 0 chunk 0
        copy = (w.detach(), ref.model.embedding.weight.detach())
    fp8 = (backend.state_dict(), ref.backend.state_dict()) if cfg.fp8.enabled else None
    stages = [(c.stage.rank, c.stage.layers) for c in model.chunks]
    return dict(loss=(loss, ref_loss), grads=grads, copy=copy, fp8=fp8, stages=stages,
                boundaries=eng.boundaries, rank=groups.coords.pp, **record)  # fmt: skip


def _cfg(pp, v, layers, fp8=False, untie=False):
    return tiny_config(
        model=dict(num_layers=layers, num_query_groups=2,
                   untie_embeddings_and_output_weights=untie),
        parallel=dict(pipeline_model_parallel_size=pp, virtual_pipeline_model_parallel_size=v),
        fp8=dict(fp8_format="hybrid", fp8_amax_history_len=4) if fp8 else {},
    )  # fmt: skip


# (config, world = pp, micro-batches m)
CASES = {
    "pp2-v2-tied": (_cfg(2, 2, 4), 4),
    "pp4-v2-untied": (_cfg(4, 2, 8, untie=True), 8),
}


@pytest.mark.parametrize("case", list(CASES))
def test_interleaved_gradients_match_one_process(case):
    from megafp8.parallel.pipeline.interleaved import interleaved_order

    cfg, m = CASES[case]
    pp, v = cfg.parallel.pipeline_model_parallel_size, 2
    tied = not cfg.model.untie_embeddings_and_output_weights
    n = 0
    for res in run_distributed(_compare, pp, cfg, m):
        r = res["rank"]
        # Megatron's assignment: chunk c of rank r is virtual stage c x pp + r, the block of
        # layers of that index (one layer per block here: 4 / (2 x 2), 8 / (4 x 2))
        assert res["stages"] == [(c * pp + r, (c * pp + r,)) for c in range(v)]
        loss, ref_loss = res["loss"]
        assert loss == ref_loss  # every rank has it, to the bit
        for name, (g, ref) in res["grads"].items():
            n += 1
            if tied and name == "chunks.0.embedding.weight":  # reassociated sum (test_pp_grads)
                torch.testing.assert_close(g, ref, **FP32_TOL, msg=name)
            else:
                assert torch.equal(g, ref), name
        if res["copy"] is not None:
            assert r == pp - 1 and torch.equal(*res["copy"])
        assert res["events"] == interleaved_order(pp, r, v, m)  # the table: test_pipeline_stages
        # memory bound: warm-up + 1 (chunk, micro-batch) activations at most
        warmup = min((pp - r - 1) * 2 + (v - 1) * pp, m * v)
        assert res["max_in_flight"] == min(warmup + 1, m * v)
        # one accumulation boundary per iteration: the rank's last backward
        assert res["boundaries"] == [False] * (m * v - 1) + [True]
    assert n > 0


def test_interleaved_fp8_uses_the_one_process_scales():
    """FP8 delayed scaling (history 4), pp 2 x v 2, 4 micro-batches (up to 4 chunk-forwards in
    flight on rank 0): losses, gradients, every scale and amax history equal one process's."""
    cfg, m = _cfg(2, 2, 4, fp8=True), 4
    for res in run_distributed(_compare, 2, cfg, m):
        loss, ref_loss = res["loss"]
        assert loss == ref_loss
        for name, (g, ref) in res["grads"].items():
            if name == "chunks.0.embedding.weight":
                torch.testing.assert_close(g, ref, **FP32_TOL)
            else:
                assert torch.equal(g, ref), name
        state, ref_state = res["fp8"]
        assert len(state) == 2 * 4 * 3  # this rank's 2 layers (1 per chunk) x 4 GEMMs x 3 roles
        for key, val in state.items():
            assert torch.equal(val["scale"], ref_state[key]["scale"]), key
            assert torch.equal(val["amax_history"], ref_state[key]["amax_history"]), key
        assert any(float(val["scale"]) != 1.0 for val in state.values())  # scales did move


def _norms(cfg):
    from megafp8.train import train

    return [(r["lm loss"], r["grad norm"]) for r in train(cfg)]


def _train_cfg(**parallel):
    return tiny_config(
        model=dict(num_layers=4, num_query_groups=2),
        optim=dict(clip_grad=0.05, zero_stage=1, lr_decay_iters=5),  # clipping active each step
        parallel=parallel,
    )


def test_interleaved_dp_zero1_matches_one_process_and_resumes_bit_identically(tmp_path):
    """pp 2 x v 2 x dp 2, ZeRO 1, tied: 5 steps equal one process's (losses 2e-5, clipped grad
    norms 1e-5: DP averaging and Adam, as test_pp_train.py); resuming from the checkpoint of
    step 3 gives steps 4-5 to the bit (weights of both chunks, embedding copy, optimizer shards,
    data position, FP8-free fp32 on the CPU)."""
    ref = run_distributed(_norms, 1, _train_cfg())[0]
    ck = str(tmp_path / "ck")
    cfg = _train_cfg(pipeline_model_parallel_size=2, virtual_pipeline_model_parallel_size=2)
    full = run_distributed(_norms, 4, cfg.replace(train=dict(save=ck, save_interval=3)))
    assert all(f == full[0] for f in full)
    full = full[0]
    assert len(full) == len(ref) == 5 and ref[-1][0] < ref[0][0]
    for (l1, n1), (l2, n2) in zip(ref, full, strict=True):
        assert l2 == pytest.approx(l1, rel=2e-5) and n2 == pytest.approx(n1, rel=1e-5)
    names = sorted(os.listdir(os.path.join(ck, "iter_0000003")))
    assert "mp_rank_00_model_states.pt" in names and "mp_rank_01_model_states.pt" in names
    assert sum(n.endswith("optim_states.pt") for n in names) == 4  # 2 ranks x 2 DP shards
    with open(os.path.join(ck, "latest"), "w") as f:  # resume from step 3 (saved on the way)
        f.write("iter_0000003")
    rest = run_distributed(_norms, 4, cfg.replace(train=dict(load=ck)))[0]
    assert rest == full[3:]
