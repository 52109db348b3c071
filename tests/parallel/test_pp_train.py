"""Training through DeepSpeed under pipeline parallelism (1F1B): the losses and clipped gradient
norms of 5 optimizer steps equal one process's (PP x TP x DP up to 8 processes, ZeRO 1 and 2,
tied and untied embeddings, FP8), and a resumed run continues bit-identically."""

import os

import pytest

from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config


def _norms(cfg):
    from megafp8.train import train

    return [(r["lm loss"], r["grad norm"]) for r in train(cfg)]


def _cfg(untie=False, fp8=False, **parallel):
    return tiny_config(
        model=dict(num_layers=4, num_query_groups=2, untie_embeddings_and_output_weights=untie),
        optim=dict(clip_grad=0.05),  # small: clipping is active every step, so is the norm
        fp8=dict(fp8_format="hybrid", fp8_amax_history_len=4) if fp8 else {},
        parallel=parallel,
    )


_REFS: dict = {}


def _reference(untie=False, fp8=False):
    key = (untie, fp8)
    if key not in _REFS:
        _REFS[key] = run_distributed(_norms, 1, _cfg(untie, fp8))[0]
    return _REFS[key]


# (world, zero stage, untied, parallel)
CASES = {
    "pp2-zero1-tied": (2, 1, False, dict(pipeline_model_parallel_size=2)),
    "pp4-zero2-untied": (4, 2, True, dict(pipeline_model_parallel_size=4)),
    "pp2-tp2-dp2-sp-zero1": (
        8,
        1,
        False,
        dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=2, sequence_parallel=True),
    ),  # fmt: skip
    # the interleaved schedule (v 2, one layer per chunk) with TP + SP and ZeRO-2 over dp 2
    "pp2-v2-tp2-dp2-sp-zero2": (
        8,
        2,
        False,
        dict(
            pipeline_model_parallel_size=2,
            virtual_pipeline_model_parallel_size=2,
            tensor_model_parallel_size=2,
            sequence_parallel=True,
        ),
    ),  # fmt: skip
}


@pytest.mark.parametrize("case", list(CASES))
def test_pp_losses_and_grad_norms_match_one_process(case):
    world, stage, untie, parallel = CASES[case]
    cfg = _cfg(untie, **parallel).replace(optim=dict(zero_stage=stage))
    got = run_distributed(_norms, world, cfg)
    assert all(g == got[0] for g in got)  # loss and norm known on every rank, the same
    _check(got[0], _reference(untie))


def _check(got, ref):
    assert len(got) == len(ref) == 5
    # fp32: under PP alone the forward and the gradients equal one process's to the bit except
    # the tied embedding's reassociated sum; DP averaging and TP row-parallel sums reorder fp32
    # sums (~1e-7). Adam's normalized update turns such differences into ~1e-6 of the loss after
    # 5 steps (as test_tp_dp_zero.py); the norm is a sum of squares over every gradient: 1e-5.
    for (l1, n1), (l2, n2) in zip(ref, got, strict=True):
        assert l2 == pytest.approx(l1, rel=2e-5) and n2 == pytest.approx(n1, rel=1e-5)
    assert ref[-1][0] < ref[0][0]


def test_qk_layernorm_under_pp_tp_sp_dp_matches_one_process():
    """--qk-layernorm through the whole run (ZeRO-1, the gradient norm and clipping) at pp 2 x
    tp 2 (SP) x dp 2: the q and k norm weights are replicated over TP, their gradients summed
    over it and counted once in the norm, as one process's."""
    cfg = _cfg().replace(
        model=dict(qk_layernorm=True, position_embedding_type="rope", normalization="RMSNorm")
    )
    ref = run_distributed(_norms, 1, cfg)[0]
    par = cfg.replace(parallel=dict(pipeline_model_parallel_size=2, tensor_model_parallel_size=2,
                                    sequence_parallel=True))  # fmt: skip
    got = run_distributed(_norms, 8, par)
    assert all(g == got[0] for g in got)
    _check(got[0], ref)


def test_pp_fp8_matches_one_process():
    """FP8 (torch backend, emulated GEMM) at pp=2: the scales equal one process's (see
    test_pp_grads.py), so only the tied embedding's fp32 reassociation differs; it can flip an
    FP8 value after the first update (tests/parallel/test_tp.py), so the bound after step 1 is
    half the FP8 noise of the same run (its gap to fp32), plus fp32 slack."""
    fp8, fp32 = _reference(fp8=True), _reference()
    got = run_distributed(_norms, 2, _cfg(fp8=True, pipeline_model_parallel_size=2))[0]
    gap = max(abs(a[0] - b[0]) for a, b in zip(fp8, fp32, strict=True))
    assert gap > 0  # FP8 really ran
    assert got[0][0] == fp8[0][0]  # before any update: the same forward to the bit
    for (l1, _), (l2, _) in zip(fp8, got, strict=True):
        assert abs(l2 - l1) <= 0.5 * gap + 2e-5 * abs(l1)


def test_pp_dp_zero2_matches_one_process_and_resumes_bit_identically(tmp_path):
    """pp2 x dp2, ZeRO 2, tied: the 5 steps equal one process's; each stage saves its own shards
    (DeepSpeed's mp rank = tp + tp x pp rank; the last stage's module state holds its embedding
    copy); resuming after step 3 gives steps 4-5 to the bit."""
    cfg = _cfg(pipeline_model_parallel_size=2).replace(optim=dict(zero_stage=2, lr_decay_iters=5))
    full = run_distributed(_norms, 4, cfg)[0]
    _check(full, _reference())
    ck = str(tmp_path / "ck")
    first = run_distributed(_norms, 4, cfg.replace(train=dict(train_iters=3, save=ck)))[0]
    names = sorted(os.listdir(os.path.join(ck, "iter_0000003")))
    assert "mp_rank_00_model_states.pt" in names and "mp_rank_01_model_states.pt" in names
    assert sum(n.endswith("optim_states.pt") for n in names) == 4  # 2 stages x 2 DP shards
    rest = run_distributed(_norms, 4, cfg.replace(train=dict(load=ck)))[0]
    assert first == full[:3]
    assert rest == full[3:]  # fp32, CPU: data position, optimizer, weights and copy restored
