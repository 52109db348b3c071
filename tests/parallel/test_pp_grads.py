"""Pipeline parallelism (1F1B) equals one process with the same weights: the iteration's loss,
every weight gradient of every stage, the FP8 scaling state, and the schedule's order of events.

The schedule runs here with a plain engine (forward, ``backward(loss, scale_wrt_gas)`` as
DeepSpeed's, a no-op step), so the gradients are read before any optimizer; the DeepSpeed runs
are in test_pp_train.py. The reference is ``no_pipelining`` on one process, with the same
micro-batches.
"""

from types import SimpleNamespace

import pytest
import torch

from tests.helpers.dist import run_distributed
from tests.helpers.engine import PlainEngine
from tests.helpers.tiny import tiny_config

# Under PP alone every stage computes exactly the single-process ops on the same inputs, the
# surrogate's gradient is the received gradient exactly, and micro-batch gradients accumulate in
# the same order: bit-identical. Two exceptions: the tied word embedding's gradient on the first
# stage is sum(input-side grads) + sum(output-side grads) where one process adds the two sides
# per micro-batch (a reassociated fp32 sum of 2m terms: a few ulp), and under TP the row-parallel
# sums run in another order (~1e-7 relative per sum, ~1e-5 at worst through the blocks: as in
# test_tp.py).
FP32_TOL = dict(rtol=1e-4, atol=1e-5)


def _run(cfg, groups, stage, m):
    from megafp8.fp8.backend import build_backend
    from megafp8.model.gpt import GPTModel

    backend = build_backend(cfg.fp8, amax_group=groups.tp_dp_group, tp_group=groups.tp_group)
    model = GPTModel(
        cfg, backend=backend, groups=groups, vocab_size=cfg.model.vocab_size, stage=stage
    )
    eng = PlainEngine(model, m)
    return SimpleNamespace(cfg=cfg, groups=groups, model=model, engine=eng, backend=backend,
                           device=torch.device("cpu"))  # fmt: skip


def _batches(cfg, m):
    g = torch.Generator().manual_seed(5)
    b, s = cfg.train.micro_batch_size, cfg.model.seq_length
    out = []
    for _ in range(m):
        t = torch.randint(0, cfg.model.vocab_size, (b, s + 1), generator=g)
        mask = (torch.rand(b, s, generator=g) > 0.3).float()  # micro-batches count differently
        out.append({"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": mask})
    return out


def _compare(cfg, m):
    from megafp8.parallel.groups import ParallelGroups
    from megafp8.parallel.pipeline.schedules import no_pipelining, one_f_one_b
    from megafp8.parallel.pipeline.stages import stage_of

    p = cfg.parallel
    groups = ParallelGroups.build(
        p.tensor_model_parallel_size, p.pipeline_model_parallel_size, kv_heads=cfg.model.kv_heads
    )
    stage = stage_of(cfg, groups.coords.pp)
    par = _run(cfg, groups, stage, m)
    record = {}
    loss, _ = one_f_one_b(par, iter(_batches(cfg, m)), record=record)
    ref_cfg = cfg.replace(parallel=dict(tensor_model_parallel_size=1, sequence_parallel=False,
                                        pipeline_model_parallel_size=1))  # fmt: skip
    ref = _run(ref_cfg, ParallelGroups.single(), None, m)
    ref_loss, _ = no_pipelining(ref, iter(_batches(cfg, m)))
    ref_params = {getattr(q, "full_name", n): q for n, q in ref.model.named_parameters()}
    grads = {}
    for name, q in par.model.named_parameters():
        r = ref_params[getattr(q, "full_name", name)]
        full = r.grad
        if hasattr(q, "full_index"):  # this rank's TP shard of the full gradient
            full = full.index_select(q.partition_dim, q.full_index)
        grads[name] = (q.grad, full)
    copy = None
    if hasattr(par.model, "tied_output_weight"):  # the last stage's copy of the embedding
        w = ref.model.embedding.weight
        copy = (
            par.model.tied_output_weight.detach(),
            w.detach().chunk(groups.tp)[groups.coords.tp],
        )
        assert par.model.tied_output_weight.grad is None  # sent to the first stage
    fp8 = (par.backend.state_dict(), ref.backend.state_dict()) if cfg.fp8.enabled else None
    return dict(loss=(loss, ref_loss), grads=grads, copy=copy, fp8=fp8, stage=stage, **record)


def _cfg(pp, tp=1, layers=4, untie=False, fp8=False, sp=False, **par):
    return tiny_config(
        model=dict(num_layers=layers, untie_embeddings_and_output_weights=untie,
                   num_query_groups=2),
        parallel=dict(pipeline_model_parallel_size=pp, tensor_model_parallel_size=tp,
                      sequence_parallel=sp, **par),
        fp8=dict(fp8_format="hybrid", fp8_amax_history_len=4) if fp8 else {},
    )  # fmt: skip


CASES = {
    "pp2-tied": (_cfg(2), 2, 5),
    "pp4-untied-uneven": (
        _cfg(
            4,
            layers=6,
            untie=True,
            decoder_first_pipeline_num_layers=1,
            decoder_last_pipeline_num_layers=1,
        ),
        4,
        6,
    ),  # fmt: skip
    "pp4-tied-m2": (_cfg(4), 4, 2),  # fewer micro-batches than stages
    "pp2-tp2-sp": (_cfg(2, tp=2, sp=True), 4, 4),
    "pp2-per-token-loss": (_cfg(2).replace(train=dict(calculate_per_token_loss=True)), 2, 3),
}


@pytest.mark.parametrize("case", list(CASES))
def test_pp_gradients_match_one_process(case):
    cfg, world, m = CASES[case]
    tp, pp = cfg.parallel.tensor_model_parallel_size, cfg.parallel.pipeline_model_parallel_size
    exact = tp == 1
    results = run_distributed(_compare, world, cfg, m)
    n_params = 0
    for res in results:
        st = res["stage"]
        (loss, ref_loss) = res["loss"]
        assert loss == pytest.approx(ref_loss, rel=0 if exact else 1e-5)  # every rank has it
        for name, (g, ref) in res["grads"].items():
            n_params += 1
            tied = name == "embedding.weight" and not cfg.model.untie_embeddings_and_output_weights
            if exact and not tied:
                assert torch.equal(g, ref), name
            else:
                torch.testing.assert_close(g, ref, **FP32_TOL, msg=name)
        if st.last and not st.first and not cfg.model.untie_embeddings_and_output_weights:
            assert torch.equal(*res["copy"])
        # the published order (tests/unit/test_pipeline_stages.py) and its memory bound
        assert res["events"] == _order(pp, st.rank, m)
        assert res["max_in_flight"] == min(pp - st.rank, m) <= pp
    assert n_params > 0


def _order(pp, rank, m):
    from megafp8.parallel.pipeline.schedules import one_f_one_b_order

    return one_f_one_b_order(pp, rank, m)


def test_pp_fp8_uses_the_one_process_scales():
    """FP8 delayed scaling (history 4) over 6 micro-batches, 3 in flight on stage 0 at pp=3: the
    losses, the gradients and every scale and amax history equal one process's to the bit (the
    emulated FP8 GEMM is exact), except the tied embedding's reassociated sum (fp32 ulps; it is
    no FP8 input). Updating every role only after each backward would give the forwards in
    flight stale scales and fail this."""
    cfg = _cfg(3, layers=3, fp8=True)
    for res in run_distributed(_compare, 3, cfg, 6):
        loss, ref_loss = res["loss"]
        assert loss == ref_loss
        for name, (g, ref) in res["grads"].items():
            if name == "embedding.weight":
                torch.testing.assert_close(g, ref, **FP32_TOL)
            else:
                assert torch.equal(g, ref), name
        state, ref_state = res["fp8"]
        assert state, "this stage has FP8 layers"
        for key, v in state.items():
            assert torch.equal(v["scale"], ref_state[key]["scale"]), key
            assert torch.equal(v["amax_history"], ref_state[key]["amax_history"]), key
        assert any(float(v["scale"]) != 1.0 for v in state.values())  # scales did move
