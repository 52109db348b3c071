#!/usr/bin/env python3
"""Kernel probes on the Llama-3-8B shape (one GPU, TE): alternatives for three places where the
side-by-side profiles differ, each timed with CUDA events (mean ms per call after 3 warm-ups).

- ``rope``: the grouped QKV output [8192, 1, 8, 6 x 128] to q, k, v with RoPE on q and k,
  forward and backward: megafp8's Triton kernels (the te backend's ``split_qkv``), TE's fused
  QKV-split RoPE, and a split, the grouped-query q copy and TE's RoPE on q and on k
  (Megatron-LM's way); besides the wall time per call, the GPU time of the kernels alone
  (``torch.profiler``: a loop of small launches can be bound by the host).
- ``embedding``: the word embedding's gradient over 8 micro-batches of 8192 tokens (vocab
  128256 x 4096): autograd's dense per-micro-batch gradient added into ``.grad`` against
  megafp8's rows added into ``.grad`` in place (``parallel/grad_in_place.py``) and against
  ``index_add_`` of the rows into one buffer (atomics: not deterministic).
- ``output``: the output layer's three bf16 GEMMs (8192 x 4096 x 128256), the backward ones with
  the logits gradient from megafp8's Triton loss, from torch's cross-entropy, and random values
  of the same spread, in two rounds (at a power limit a GEMM's time depends on its data).
- ``adamw``: one AdamW step of 1e9 fp32 masters from bf16 gradients in 10 tensors of 1e8,
  writing the bf16 weights: the ZeRO 1/2 step's way before ``adamw_bf16`` (the gradients
  widened into one fp32 buffer by a multi-tensor copy, torch's fused AdamW, the fp32 -> bf16
  copy) against ``adamw_bf16.step`` (one kernel per gradient tensor, 28 bytes per parameter).
- ``dswiglu``: the gradient of fc1's output in te.LayerNormMLP's FP8 backward (fc2's dgrad
  [8192, 14336], fc1's output [8192, 28672]): TE's ``dswiglu`` then ``bgrad_quantize`` against
  megafp8's one kernel (``fp8/dswiglu.py``), the bytes compared, and the kernel's tile sizes.
- ``swiglu``: fc2's FP8 input in te.LayerNormMLP's FP8 forward (fc1's output [8192, 28672]):
  TE's ``swiglu`` (the activation and FP8 cast, then a transpose for the column-wise copy)
  against megafp8's one kernel (``fp8/swiglu_fwd.py``), the bytes compared, and its launches.

    python bench/kernel_probes.py --json probes.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch
import torch.nn.functional as F

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

S, H, V, GROUPS, HPG, HD = 8192, 4096, 128256, 8, 4, 128


def timed(fn, reps: int = 20) -> float:
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(reps):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / reps


def kernel_ms(fn, reps: int = 20) -> float:
    """GPU time of the kernels ``fn`` launches, ms per call (the profiler's device time)."""
    from torch.profiler import ProfilerActivity, profile

    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    return sum(e.self_device_time_total for e in prof.key_averages()) / reps / 1e3


def rope() -> dict:
    from transformer_engine.pytorch.attention.rope import (
        apply_fused_qkv_rotary_pos_emb,
        apply_rotary_pos_emb,
    )
    from transformer_engine.pytorch.utils import SplitAlongDim

    from megafp8.fp8.plain_ops import rope_angles
    from megafp8.fp8.qkv_rope import split_qkv_rope

    freqs = rope_angles(S, HD, 500000.0, "cuda")
    qkv = torch.randn(S, 1, GROUPS, (HPG + 2) * HD, device="cuda", dtype=torch.bfloat16)
    qkv.requires_grad_(True)
    grads = [torch.randn(S, 1, n, HD, device="cuda", dtype=torch.bfloat16)
             for n in (GROUPS * HPG, GROUPS, GROUPS)]  # fmt: skip

    def backward(outs):  # the gradient of qkv, not accumulated into .grad
        torch.autograd.grad([t.reshape(S, 1, -1, HD) for t in outs], qkv, grads)

    def triton():
        backward(split_qkv_rope(qkv, freqs, HPG))

    def fused():
        backward(apply_fused_qkv_rotary_pos_emb(
            qkv, freqs, freqs, [HPG * HD, HD, HD], tensor_format="sbhd"
        ))  # fmt: skip

    def split_then_rope():
        q, k, v = SplitAlongDim.apply(qkv.view(S, 1, GROUPS, HPG + 2, HD), 3, [HPG, 1, 1])
        q = apply_rotary_pos_emb(
            q.reshape(S, 1, GROUPS * HPG, HD), freqs, tensor_format="sbhd", fused=True
        )
        k = apply_rotary_pos_emb(k.squeeze(3), freqs, tensor_format="sbhd", fused=True)
        backward([q, k, v.squeeze(3)])

    out = {}
    for name, fn in (("triton_qkv_rope", triton), ("te_fused_qkv_rope", fused),
                     ("split_and_two_ropes", split_then_rope)):  # fmt: skip
        out[name + "_ms"] = timed(fn)
        out[name + "_kernels_ms"] = kernel_ms(fn)
    return out


def embedding() -> dict:
    w = (0.02 * torch.randn(V, H, device="cuda")).bfloat16().requires_grad_(True)
    tokens = torch.randint(0, V, (1, S), device="cuda")
    g = torch.randn(1, S, H, device="cuda", dtype=torch.bfloat16)

    def dense():
        w.grad = None
        for _ in range(8):
            F.embedding(tokens, w).backward(g)

    def in_place():
        from megafp8.parallel.grad_in_place import embedding as emb

        w.grad = None
        for _ in range(8):
            emb(tokens, w, True).backward(g)

    def index_add():
        buf = torch.zeros_like(w)
        for _ in range(8):
            buf.index_add_(0, tokens.view(-1), g.view(-1, H))

    return {"dense_8_microbatches_ms": timed(dense, 5),
            "in_place_8_microbatches_ms": timed(in_place, 5),
            "index_add_8_microbatches_ms": timed(index_add, 5)}  # fmt: skip


def output() -> dict:
    from megafp8.parallel.fused_cross_entropy import fused_vocab_parallel_cross_entropy
    from megafp8.parallel.mappings import SOLO

    x = F.rms_norm(torch.randn(S, H, device="cuda"), (H,)).bfloat16()
    w = (0.02 * torch.randn(V, H, device="cuda")).bfloat16()
    logits = x @ w.t()
    target = (torch.arange(S, device="cuda") + 1) % V
    g = torch.full((S,), 1.0 / (S * 8), device="cuda")
    ours = logits.clone().requires_grad_(True)
    loss = fused_vocab_parallel_cross_entropy(ours.view(S, 1, V), target.view(S, 1), SOLO, 0)
    (gy_ours,) = torch.autograd.grad(loss, ours, g.view(S, 1))
    ref = logits.float().requires_grad_(True)
    (gy_torch,) = torch.autograd.grad(F.cross_entropy(ref, target, reduction="none"), ref, g)
    gy_torch = gy_torch.bfloat16()
    gy_rand = (torch.randn(S, V, device="cuda") * gy_torch.float().std()).bfloat16()
    out = {"gradients_differ_share": (gy_ours != gy_torch).float().mean().item()}
    for r in range(2):
        out[f"forward_ms_{r}"] = timed(lambda: F.linear(x, w))
        for name, gy in (("ours", gy_ours), ("torch", gy_torch), ("random", gy_rand)):
            out[f"dgrad_{name}_ms_{r}"] = timed(lambda gy=gy: gy.mm(w))
            out[f"wgrad_{name}_ms_{r}"] = timed(lambda gy=gy: gy.t().mm(x))
    return out


def adamw() -> dict:
    from megafp8.optim import adamw_bf16

    n, k = 10**9, 10
    p0 = torch.randn(n, device="cuda") * 0.02
    grads = [(torch.randn(n // k, device="cuda") * 1e-3).bfloat16() for _ in range(k)]
    w16 = p0.bfloat16()

    def optimizer():
        p = torch.nn.Parameter(p0.clone())
        return p, torch.optim.AdamW([p], lr=1e-4, weight_decay=0.1, fused=True)

    def widen_adamw_copy(p, opt):
        wide = torch.empty(n, device="cuda")
        torch._foreach_copy_(list(wide.split(n // k)), grads)
        p.grad = wide
        opt.step()
        p.grad = None
        w16.copy_(p.detach())

    out = {}
    p, opt = optimizer()
    out["widen_fused_adamw_copy_ms"] = timed(lambda: widen_adamw_copy(p, opt), 10)
    p, opt = optimizer()
    torch.cuda.empty_cache()
    out["adamw_bf16_ms"] = timed(lambda: adamw_bf16.step(opt, grads, w16), 10)
    out["adamw_bf16_GB_per_s"] = 28 * n / out["adamw_bf16_ms"] / 1e6
    # the launch's variants (elements per program, warps), kernel time from the profiler
    default = dict(adamw_bf16.LAUNCH)
    try:
        for block, warps in ((1024, 4), (2048, 4), (2048, 8), (4096, 4), (4096, 8), (4096, 16),
                             (8192, 8), (8192, 16), (16384, 16)):  # fmt: skip
            adamw_bf16.LAUNCH.update(BLOCK=block, WARPS=warps)
            ms = kernel_ms(lambda: adamw_bf16.step(opt, grads, w16))
            out[f"variant_{block}_w{warps}"] = dict(kernels_ms=ms, GB_per_s=28 * n / ms / 1e6)
    finally:
        adamw_bf16.LAUNCH.update(default)
    return out


def dswiglu() -> dict:
    import transformer_engine.pytorch  # noqa: F401 (loads TE's core library first)
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    from megafp8.fp8 import dswiglu as dsw

    m, n = S, 14336  # Llama-3-8B: fc2's dgrad [8192, 14336], fc1's output [8192, 28672]
    g = (torch.randn(m, n, device="cuda") * 1e-4).bfloat16()
    x = (torch.randn(m, 2 * n, device="cuda") * 2).bfloat16()

    def quantizer():
        scale = torch.full((1,), 2.0**15, device="cuda")
        return Float8Quantizer(scale, torch.zeros(1, device="cuda"), tex.DType.kFloat8E5M2)

    qt, qo = quantizer(), quantizer()

    def te_two_kernels():
        return tex.bgrad_quantize(tex.dswiglu(g, x, None), qt)

    def ours():  # the kernel itself (the entry point's first-call check aside)
        return dsw._fused(g, x, qo)

    (bt, _), (bo, _) = te_two_kernels(), ours()
    out = {  # the entry point's own first-call comparison: row-, column-wise, scale_inv, amax
        "differing_from_te": dsw._same_bytes(g, x, quantizer()) or "nothing",
        "dbias_max_abs_diff": float((bt.float() - bo.float()).abs().max()),
    }
    for name, fn in (("te_dswiglu_bgrad_quantize", te_two_kernels), ("triton_fused", ours)):
        out[name + "_ms"] = timed(fn)
        out[name + "_kernels_ms"] = kernel_ms(fn)
    # the launch's variants: tiles and warps, the reciprocal (rcp_rn or div_rn), the transposed
    # store (from tl.trans or Triton's own layout change), with and without the bias gradient;
    # each compared with TE's bytes as the first-call check does, then timed
    # (on an H100 the short, wide tiles led: 32 x 128 with 4 warps; BENCHMARKS.md)
    tiles = ((32, 128, 4), (32, 128, 2), (32, 64, 2), (32, 256, 4), (16, 128, 2), (16, 256, 4),
             (64, 64, 4), (64, 64, 8), (64, 128, 4), (64, 128, 8), (128, 64, 4), (128, 64, 8),
             (128, 128, 8), (128, 128, 16), (128, 32, 4), (256, 64, 8), (64, 256, 8))  # fmt: skip
    # every tile with rcp_rn, the saturation and no bias gradient, both stores; then one knob
    # at a time at 64 x 64: div_rn, no saturation before the cast, the bias gradient
    variants = [(t, True, trans, True, False) for t in tiles for trans in (False, True)]
    variants += [((64, 64, 4), False, False, True, False), ((64, 64, 4), True, False, False, False),
                 ((64, 64, 4), True, False, True, True)]  # fmt: skip
    for (bm, bn, w), rcp, trans, clamp, bias in variants:
        cfg = {"BM": bm, "BN": bn, "WARPS": w, "RCP": rcp, "TRANS": trans, "CLAMP": clamp}
        name = f"{bm}x{bn}_w{w}{'_rcp' if rcp else '_div'}{'_trans' if trans else ''}"
        name += ("" if clamp else "_noclamp") + ("_dbias" if bias else "")
        try:
            diff = dsw._same_bytes(g, x, quantizer(), bias_grad=bias, config=cfg) or "nothing"
            ms = kernel_ms(lambda c=cfg, b=bias: dsw._fused(g, x, qo, bias_grad=b, config=c))
            out["variant_" + name] = dict(kernels_ms=ms, differing_from_te=diff,
                                          launch=dsw.launch_spec(cfg), bias_grad=bias)  # fmt: skip
        except Exception as e:  # a variant Triton cannot build
            out["variant_" + name] = f"{type(e).__name__}: {str(e)[:200]}"
    same = [v for v in out.values() if isinstance(v, dict) and v["differing_from_te"] == "nothing"]
    best = min((v for v in same if not v["bias_grad"]), key=lambda v: v["kernels_ms"], default=None)
    # the fastest launch with TE's bytes, as dswiglu.LAUNCH_ENV takes it
    out["fastest_launch"] = best["launch"] if best else None
    return out


def swiglu() -> dict:
    import transformer_engine.pytorch  # noqa: F401 (loads TE's core library first)
    import transformer_engine_torch as tex
    from transformer_engine.pytorch.tensor.float8_tensor import Float8Quantizer

    from megafp8.fp8 import dswiglu as dsw
    from megafp8.fp8 import swiglu_fwd as sw

    x = (torch.randn(S, 2 * 14336, device="cuda") * 2).bfloat16()  # Llama-3-8B fc1's output

    def quantizer():
        scale = torch.full((1,), 2.0**4, device="cuda")
        return Float8Quantizer(scale, torch.zeros(1, device="cuda"), tex.DType.kFloat8E4M3)

    qt, qo = quantizer(), quantizer()
    out = {"differing_from_te": sw._same_bytes(x, quantizer()) or "nothing"}
    te_fn, ours = (lambda: tex.swiglu(x, qt)), (lambda: sw._fused(x, qo))
    for name, fn in (("te_swiglu", te_fn), ("triton_fused", ours)):
        out[name + "_ms"] = timed(fn)
        out[name + "_kernels_ms"] = kernel_ms(fn)
    tiles = ((32, 128, 4), (32, 128, 2), (32, 256, 4), (16, 256, 4), (64, 64, 4), (64, 64, 8),
             (64, 128, 4), (64, 128, 8), (128, 64, 4), (128, 64, 8), (128, 128, 8))  # fmt: skip
    variants = [(t, True, trans, True) for t in tiles for trans in (False, True)]
    variants += [((32, 128, 4), False, False, True), ((32, 128, 4), True, False, False)]
    for (bm, bn, w), rcp, trans, clamp in variants:
        cfg = {"BM": bm, "BN": bn, "WARPS": w, "RCP": rcp, "TRANS": trans, "CLAMP": clamp}
        name = f"{bm}x{bn}_w{w}{'_rcp' if rcp else '_div'}{'_trans' if trans else ''}"
        name += "" if clamp else "_noclamp"
        try:
            diff = sw._same_bytes(x, quantizer(), config=cfg) or "nothing"
            ms = kernel_ms(lambda c=cfg: sw._fused(x, qo, config=c))
            out["variant_" + name] = dict(kernels_ms=ms, differing_from_te=diff,
                                          launch=dsw.launch_spec(cfg))  # fmt: skip
        except Exception as e:  # a variant Triton cannot build
            out["variant_" + name] = f"{type(e).__name__}: {str(e)[:200]}"
    same = [v for v in out.values() if isinstance(v, dict) and v["differing_from_te"] == "nothing"]
    best = min(same, key=lambda v: v["kernels_ms"], default=None)
    out["fastest_launch"] = best["launch"] if best else None  # as swiglu_fwd.LAUNCH_ENV takes it
    return out


PROBES = {
    "rope": rope,
    "embedding": embedding,
    "output": output,
    "adamw": adamw,
    "dswiglu": dswiglu,
    "swiglu": swiglu,
}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawTextHelpFormatter)
    ap.add_argument("--probes", nargs="+", default=list(PROBES), choices=list(PROBES))
    ap.add_argument("--json", help="write the figures here")
    a = ap.parse_args()
    if not torch.cuda.is_available():
        print("error: the kernel probes need a CUDA GPU", file=sys.stderr)
        return 1
    torch.manual_seed(0)
    res = {name: PROBES[name]() for name in a.probes}
    print(json.dumps(res, indent=1))
    if a.json:
        with open(a.json, "w") as f:
            json.dump(res, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
