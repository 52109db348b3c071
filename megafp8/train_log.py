"""What the training loop logs at each log interval: the console line (Megatron's layout), its
TensorBoard scalars, and the FP8 statistics gathered from every pipeline stage."""

from __future__ import annotations

import logging

import torch.distributed as dist

from megafp8 import metrics

log = logging.getLogger("megafp8")


def gather_pp(run, stats: dict) -> dict:
    """Every pipeline stage's entries of ``stats`` (a dict per rank), on every rank."""
    if run.groups.pp == 1:
        return stats
    every = [None] * run.groups.pp
    dist.all_gather_object(every, stats, group=run.groups.pp_group)
    return {k: v for s in every for k, v in s.items()}


def fp8_stats(run) -> dict:
    """This rank's FP8 statistics and, under PP, every stage's (gathered over the pipeline
    group), as TensorBoard tags: "layers.3.attn.qkv.x/amax" is "fp8/layers.3.attn.qkv/x/amax"."""
    stats = gather_pp(run, run.backend.fp8_stats(run.model))
    out = {}
    for k, v in stats.items():
        name, stat = k.split("/")
        gemm, role = name.rsplit(".", 1)
        out[f"fp8/{gemm}/{role}/{stat}"] = v
    return out


def params_norm(run) -> float:
    """Megatron's ``--log-params-norm``: the L2 norm of all the model's weights, each element
    counted once over the job: a TP shard on its rank, a weight replicated over TP on TP rank 0
    (the selection gradient clipping uses), every stage's over PP, every EP rank's experts;
    summed in fp32 from the weights as held (bf16 under ``--bf16``). Every rank gets it."""
    import torch

    g = run.groups
    sums = torch.zeros(2, dtype=torch.float32, device=run.device)  # dense, experts
    for p in run.model.parameters():
        if getattr(p, "tensor_model_parallel", False) or g.coords.tp == 0:
            sums[int(bool(getattr(p, "expert", False)))] += p.detach().float().square().sum()
    if dist.is_initialized():
        dist.all_reduce(sums, group=g.mp_group)  # over TP and PP
        if g.ep > 1:
            dist.all_reduce(sums[1:], group=g.ep_group)
    return float(sums.sum().sqrt())


def log_line(run, rec: dict, gbs: int, tb, rank0: bool, reset: bool = True) -> None:
    """The console line and TensorBoard scalars of ``rec``; ``reset`` False (the extra line of a
    run's first iteration) leaves the interval's skipped / NaN counts to the next line."""
    cfg = run.cfg
    vals = {
        "consumed samples": run.consumed,
        **{k: rec.get(k) for k in ("elapsed time per iteration (ms)", "learning rate")},
        "global batch size": gbs,
        # as Megatron-LM's line: the mean over the interval's iterations (skipped ones left
        # out); the grad norm is the last iteration's. TensorBoard gets each logged iteration's
        "lm loss": rec.get("interval lm loss", rec["lm loss"]),
        "grad norm": rec["grad norm"],
        "params norm": params_norm(run) if cfg.logging.log_params_norm else None,
    }
    rec["params norm"] = vals["params norm"]
    skipped, nans = run.policy.take_interval(reset) if run.policy else (None, None)
    vals["number of skipped iterations"], vals["number of nan iterations"] = skipped, nans
    for k in (
        "tokens per second",
        "throughput per GPU (TFLOP/s/GPU)",
        "MFU (%)",
        "peak memory (GB)",
    ):
        vals[k] = rec.get(k)
    if rank0:
        log.info(metrics.format_line(run.iteration, cfg.train.train_iters, vals))
        tb.scalars(
            {
                "lm loss": rec["lm loss"],
                "learning-rate": rec["learning rate"],
                "grad-norm": rec["grad norm"],
                "params-norm": vals["params norm"],
                "tokens-per-second": rec.get("tokens per second"),
                "tflops-per-gpu": rec.get("throughput per GPU (TFLOP/s/GPU)"),
                "mfu": rec.get("MFU (%)"),
                "peak-memory-gb": rec["peak memory (GB)"],
                "consumed-samples": run.consumed,
                "skipped-iterations": skipped,
                "nan-iterations": nans,
            },
            run.iteration,
        )
