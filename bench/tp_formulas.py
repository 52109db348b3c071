"""The closed forms that ``tp_memory_comm.py`` measures against, per transformer layer and rank:
activation bytes (Korthikanti et al. 2022, its fp32 variant, and what this code saves, by
region) and tensor-parallel communication (logical collectives and ring bytes sent)."""

from __future__ import annotations


def korthikanti_bytes(s, b, h, a, t, sp) -> float:
    """Korthikanti et al. 2022, per layer, 16-bit activations, dropout masks 1 byte, the s x s
    softmax, its dropout mask and output stored (5as^2b): Eq. 1, 2 and the SP case."""
    if t == 1:
        return s * b * h * (34 + 5 * a * s / h)
    if sp:
        return s * b * h * (34 / t + 5 * a * s / (h * t))
    return s * b * h * (10 + 24 / t + 5 * a * s / (h * t))


def korthikanti_fp32(s, b, h, a, t, sp, dropout) -> float:
    """The tensors Korthikanti counts, with 4-byte activations and 1-byte dropout masks.

    Dropout 0 (no masks; an attention that keeps no s x s matrix, like SDPA's flash kernel):
    LN inputs 2, QKV input 1, fc1 input 1 (sbh each, /t under SP); Q, K, V 3, proj input 1,
    GELU input 4, fc2 input 4 (sbh/t): sbh (16 + 48/t) bytes, 64/t under SP. Dropout > 0 adds the
    two hidden-dropout masks (2 sbh, /t under SP) and softmax 4 + mask 1 + dropped softmax 4 bytes
    per entry of the [b, a/t, s, s] scores. Flash attention's log-sum-exp [b, a, s] and
    LayerNorm's mean/rstd [s, b] are in none of these.
    """
    sbh, ts = s * b * h, t if sp else 1
    unsplit = 16 + (2 if dropout > 0 else 0)  # bytes per sbh element, / ts
    split = 48 + (9 * a * s / h if dropout > 0 else 0)  # / t
    return sbh * (unsplit / ts + split / t)


def ours_bytes(s, b, h, a, f, t, sp, dropout=0.0, e=4) -> dict[str, int]:
    """What this code saves per layer and rank (fp32, LayerNorm, GELU, biases, MHA, on the CPU),
    by region, in bytes. ts = t under SP, else 1.

    norm1, norm2: input [s/ts, b, h] + mean and rstd [s/ts, b, 1] each.
    attn.qkv, mlp.fc1: the GEMM input [s/ts, b, h]: under SP the sequence shard, all-gathered
    again in backward for the weight gradient (as Megatron does).
    attn.core, dropout 0 (SDPA's flash kernel): QKV output [s, b, 3h/t] (q, k, v are views of it),
    SDPA output [b, a/t, s, h/a] (laid out as [s, b, a/t, h/a], after its query) and its
    log-sum-exp [b, a/t, s]. attn.proj: nothing new, its input is a view of the SDPA output.
    attn.core, dropout > 0 (SDPA's math path): QKV output, scaled copies of q and k (sbh/t each),
    the softmax, the dropout mask (fp32 on the CPU) and the dropped softmax, [b, a/t, s, s] each;
    attn.proj: the SDPA output [b, a/t, s, h/a] copied to [s, b, h/t].
    mlp.act: GELU input [s, b, f/t]; mlp.fc2: GELU output [s, b, f/t].
    residual, dropout > 0: the two hidden-dropout masks [s/ts, b, h] (fp32 on the CPU).
    """
    ts = t if sp else 1
    sbh = s * b * h
    norm = e * (sbh + 2 * s * b) // ts
    out = {
        "norm1": norm,
        "norm2": norm,
        "attn.qkv": e * sbh // ts,
        "attn.core": e * (3 * sbh + sbh + a * s * b) // t,
        "mlp.fc1": e * sbh // ts,
        "mlp.act": e * s * b * f // t,
        "mlp.fc2": e * s * b * f // t,
    }
    if dropout > 0:
        out["attn.core"] = e * (3 * sbh + 2 * sbh + 3 * a * s * s * b) // t
        out["attn.proj"] = e * sbh // t
        out["residual"] = 2 * e * sbh // ts
    return out


def comm_formula(s, b, h, t, sp, e=4) -> dict[str, dict[str, int]]:
    """Per layer and rank, logical collectives of N = s*b*h*e bytes (Korthikanti 2022, 4.2.2):
    without SP 2 all-reduces forward (after the row GEMMs) and 2 backward (before the column GEMMs);
    with SP, forward 2 all-gathers + 2 reduce-scatters, backward 2 reduce-scatters + 2 all-gathers,
    plus 2 all-gathers that re-gather the column GEMMs' saved input shards (Megatron's trade of
    communication for activation memory). Returns phase -> logical op -> bytes."""
    if t == 1:
        return {"forward": {}, "backward": {}}
    n = s * b * h * e
    if sp:
        return {
            "forward": {"all_gather": 2 * n, "reduce_scatter": 2 * n},
            "backward": {"all_gather": 4 * n, "reduce_scatter": 2 * n},
        }
    return {"forward": {"all_reduce": 2 * n}, "backward": {"all_reduce": 2 * n}}


def ring_sent(op: str, n: int, t: int) -> float:
    """Bytes one rank sends in a ring implementation of ``op`` on N logical bytes."""
    return (2 if op == "all_reduce" else 1) * (t - 1) / t * n
