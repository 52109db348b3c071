"""Activation memory and communication of one transformer layer under TP, with and without SP.

Measured with the machinery of ``bench/tp_memory_comm.py`` (saved-tensor hooks summing unique
storages by the module that saved them; wrapped torch.distributed collectives, gloo's
all-reduce-and-chunk counted as the reduce-scatter it stands for), on tp = 1, 2, 4 processes, and
compared with exact expectations written out here: every figure below is a byte count, no tolerance.
"""

import pytest

from bench import tp_memory_comm as B
from megafp8.parallel.groups import ParallelGroups
from tests.helpers.dist import run_distributed

# Every size distinct, so that a mix-up of s, b, h, heads or ffn changes some count.
S, BATCH, H, HEADS = 24, 3, 32, 4
FFN, E = 4 * H, 4  # fp32
SBH = S * BATCH * H
N = SBH * E  # bytes of one full [s, b, h] activation
DROPOUTS = (0.0, 0.1)


def _cases(tp):
    sps = (False,) if tp == 1 else (False, True)
    return [B.block_config(H, HEADS, S, BATCH, tp, sp, p) for p in DROPOUTS for sp in sps]


@pytest.fixture(scope="module")
def measured():
    """(tp, sp, dropout) -> the list of every rank's measurement."""
    out = {}
    for tp in (1, 2, 4):
        cases = _cases(tp)
        if tp == 1:
            per_rank = [[B.measure_block(c, ParallelGroups.single()) for c in cases]]
        else:
            per_rank = run_distributed(B._rank, tp, cases)
        for i, c in enumerate(cases):
            key = (tp, c.parallel.sequence_parallel, c.model.hidden_dropout)
            out[key] = [r[i] for r in per_rank]
    return out


def expected_saved(t, sp, p):
    """What one layer keeps for backward on one rank, derived from the code (bytes by region):

    LayerNorm keeps its input and mean/rstd ([s, b, 1] each); on the sequence shard under SP.
    The column-parallel GEMMs (qkv, fc1) keep their input: under SP the sequence shard (it is
    all-gathered again in backward).
    Without dropout SDPA (CPU flash kernel) keeps the QKV output (q, k, v are views of it), its
    output (which the proj GEMM then keeps as a view) and the log-sum-exp [b, a/t, s]. With
    dropout it takes the math path: QKV output, scaled copies of q and k, and three [b, a/t, s, s]
    tensors (softmax, fp32 dropout mask, dropped softmax); proj keeps a copy of the output. GELU
    keeps its input, fc2 the GELU output ([s, b, ffn/t] each). Hidden dropout keeps two fp32
    masks [s/ts, b, h].
    """
    ts = t if sp else 1
    norm = E * (SBH + 2 * S * BATCH) // ts
    out = {
        "norm1": norm,
        "norm2": norm,
        "attn.qkv": N // ts,
        "mlp.fc1": N // ts,
        "attn.core": E * (4 * SBH + HEADS * S * BATCH) // t,
        "mlp.act": E * S * BATCH * FFN // t,
        "mlp.fc2": E * S * BATCH * FFN // t,
    }
    if p > 0:
        out["attn.core"] = E * (5 * SBH + 3 * HEADS * S * S * BATCH) // t
        out["attn.proj"] = N // t
        out["residual"] = 2 * N // ts
    return out


def _keys(measured, tp):
    return [k for k in measured if k[0] == tp]


@pytest.mark.parametrize("tp", [1, 2, 4])
def test_saved_bytes_equal_the_derivation(measured, tp):
    for key in _keys(measured, tp):
        for rank, r in enumerate(measured[key]):
            assert r["saved"] == expected_saved(*key), (key, rank)
            assert r["saved"] == B.ours_bytes(S, BATCH, H, HEADS, FFN, *key), key  # bench's column


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_cuts_norm_and_residual_regions_by_exactly_tp(measured, tp):
    for p in DROPOUTS:
        base = measured[(1, False, p)][0]["saved"]
        off = measured[(tp, False, p)][0]["saved"]
        on = measured[(tp, True, p)][0]["saved"]
        for region in B.SEQ_REGIONS:
            assert off.get(region, 0) == base.get(region, 0), (region, p)  # TP alone: replicated
            assert on.get(region, 0) * tp == off.get(region, 0), (region, p)
        if p > 0:
            assert on["residual"] > 0  # the dropout masks are there, on the shard


@pytest.mark.parametrize("tp", [2, 4])
def test_tp_regions_split_by_tp_and_column_inputs_by_sp(measured, tp):
    for p in DROPOUTS:
        base = B.region_sums(measured[(1, False, p)][0]["saved"])
        for sp in (False, True):
            got = B.region_sums(measured[(tp, sp, p)][0]["saved"])
            assert got["tp"] * tp == base["tp"], (sp, p)
            # qkv and fc1 keep their input: whole without SP, the sequence shard under SP
            # (all-gathered again in backward, as Megatron does).
            assert base["col"] == 2 * N
            assert got["col"] * (tp if sp else 1) == base["col"], (sp, p)


@pytest.mark.parametrize("tp", [2, 4])
def test_sp_lowers_the_total_by_the_sharded_regions(measured, tp):
    for p in DROPOUTS:
        off = B.region_sums(measured[(tp, False, p)][0]["saved"])
        on = B.region_sums(measured[(tp, True, p)][0]["saved"])
        assert on["total"] < off["total"]
        assert (off["total"] - on["total"]) * tp == (off["seq"] + off["col"]) * (tp - 1), p


def _activation_events(events, phase):
    return sorted(
        (e["logical"], e["bytes"])
        for e in events
        if e["phase"] == phase and e["logical"] != "param_grad_all_reduce"
    )


def test_no_collectives_at_tp1(measured):
    for key in _keys(measured, 1):
        assert measured[key][0]["comm"] == []


@pytest.mark.parametrize("tp", [2, 4])
def test_comm_per_layer_equals_the_formula(measured, tp):
    for p in DROPOUTS:
        for sp in (False, True):
            for rank, r in enumerate(measured[(tp, sp, p)]):
                ev = r["comm"]
                assert {e["t"] for e in ev} == {tp}
                assert all(not e["logical"].startswith("other") for e in ev), ev
                fwd, bwd = _activation_events(ev, "forward"), _activation_events(ev, "backward")
                grads = [e["bytes"] for e in ev if e["logical"] == "param_grad_all_reduce"]
                if sp:
                    # forward: all-gather before qkv and fc1, reduce-scatter after proj and fc2;
                    # backward: their transposes, plus the re-gather of qkv's and fc1's inputs.
                    want = sorted([("all_gather", N)] * 2 + [("reduce_scatter", N)] * 2)
                    assert fwd == want, (rank, p)
                    assert bwd == sorted(want + [("all_gather", N)] * 2), (rank, p)
                    # norm1/norm2 weight and bias, proj and fc2 bias: replicated, applied to
                    # sequence shards, so their gradients are summed over TP in backward.
                    assert grads == [H * E] * 6
                    assert all(e["phase"] == "backward" for e in ev if e["bytes"] == H * E)
                    # gloo has no reduce-scatter: it ran as an all-reduce of the full tensor.
                    rs = [e for e in ev if e["logical"] == "reduce_scatter"]
                    assert {(e["op"], e["issuer"]) for e in rs} == {
                        ("all_reduce", "_reduce_scatter")
                    }
                else:
                    assert fwd == bwd == [("all_reduce", N)] * 2, (rank, p)
                    assert grads == []
                summary = B.summarize_comm(ev)
                formula = B.comm_formula(S, BATCH, H, tp, sp)
                for ph in ("forward", "backward"):
                    assert summary[ph]["logical"] == formula[ph]
                    # ring convention: forward, SP moves the same bytes per rank as the
                    # all-reduces, 2 x 2(t-1)/t N = 4(t-1)/t N; backward, SP's two re-gathers
                    # add 2(t-1)/t N
                    extra = 2 if (sp and ph == "backward") else 0
                    assert summary[ph]["ring"] * tp == (4 + extra) * (tp - 1) * N
