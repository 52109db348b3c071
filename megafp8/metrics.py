"""FLOPs, MFU, the console line and TensorBoard scalars.

FLOPs per iteration use Megatron's formula (fwd + bwd = 3x fwd, 2 FLOPs per multiply-add), with the
attention scores counted *causal* (half of the s x s products), as Megatron-LM's reports do:

    F = 12 * B * s * L * h^2 * ((1 + kv/heads + 0.5 * s/h) + (ffn/h) * (1.5 if swiglu else 1)
                               + V / (2 * L * h))

B is the global batch in sequences, V the padded vocab. MFU = achieved / dense peak of the GEMM
precision in use (FP8 peak when FP8 GEMMs are on, else BF16).
"""

from __future__ import annotations

import time

import torch

# Dense (no sparsity) peak TFLOP/s per GPU.
PEAK_TFLOPS = {
    "H100": {"bf16": 989.0, "fp8": 1979.0},
    "H200": {"bf16": 989.0, "fp8": 1979.0},
    "H800": {"bf16": 989.0, "fp8": 1979.0},
    "A100": {"bf16": 312.0, "fp8": None},
    "B200": {"bf16": 2250.0, "fp8": 4500.0},
}


def flops_per_iteration(m, global_batch: int, padded_vocab: int, causal: bool = True) -> float:
    h, L, s = m.hidden_size, m.num_layers, m.seq_length
    attn_scores = (0.5 if causal else 1.0) * s / h
    gated = 1.5 if m.swiglu else 1.0
    # MoE layers count their active experts: k experts of moe_ffn per token, plus the shared
    # expert; the router's GEMM (h x E per token, E experts << ffn) is left out
    n_moe = sum(m.is_moe_layer(i) for i in range(L))
    moe_ffn = m.moe_router_topk * m.moe_ffn + (m.moe_shared_expert_intermediate_size or 0)
    ffn = ((L - n_moe) * m.ffn + n_moe * moe_ffn) / L
    return (
        12.0
        * global_batch
        * s
        * L
        * h
        * h
        * (
            (1.0 + m.kv_heads / m.num_attention_heads + attn_scores)
            * (m.head_dim * m.num_attention_heads / h)
            + (ffn / h) * gated
            + padded_vocab / (2.0 * L * h)
        )
    )


def peak_tflops(fp8: bool) -> float | None:
    if not torch.cuda.is_available():
        return None
    name = torch.cuda.get_device_name()
    for key, peaks in PEAK_TFLOPS.items():
        if key in name:
            return peaks["fp8" if fp8 else "bf16"]
    return None


def peak_memory_gb() -> float:
    if torch.cuda.is_available():
        return torch.cuda.max_memory_allocated() / 2**30
    try:
        import resource

        return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 2**20  # KiB -> GiB
    except ImportError:  # pragma: no cover
        return 0.0


def format_line(it: int, total: int, values: dict) -> str:
    """Megatron's layout: `iteration       10/     100 | consumed samples: 640 | ... |`."""
    parts = [f" iteration {it:8d}/{total:8d}"]
    fmt = {
        "consumed samples": "{:12d}",
        "elapsed time per iteration (ms)": "{:.1f}",
        "learning rate": "{:.6E}",
        "global batch size": "{:5d}",
        "lm loss": "{:.6E}",
        "grad norm": "{:.3f}",
        "params norm": "{:.3f}",
        "tokens per second": "{:.1f}",
        "throughput per GPU (TFLOP/s/GPU)": "{:.1f}",
        "MFU (%)": "{:.2f}",
        "peak memory (GB)": "{:.2f}",
        "number of skipped iterations": "{:3d}",
        "number of nan iterations": "{:3d}",
    }
    for k, v in values.items():
        if v is None:
            continue
        parts.append(f" {k}: " + fmt.get(k, "{}").format(v))
    return " |".join(parts) + " |"


class Timer:
    """Wall time of an interval of iterations. ``start(sync=True)`` waits for the GPU first (the
    loop's first start, after the build). Otherwise it does not: the loop reads every iteration's
    loss (and grad norm) before it asks, and those reads already wait for the GPU up to the
    point where the iteration's numbers exist (``HostScalar``). An interval measured between
    such points has the GPU's period in the steady state, and the optimizer update queued after
    them runs while the host starts the next iteration."""

    def __init__(self):
        self.t0 = None

    def start(self, sync: bool = False):
        if sync and torch.cuda.is_available():
            torch.cuda.synchronize()
        self.t0 = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t0


class HostScalar:
    """The value of a 0-d tensor as it is when this is made: on a GPU, copied into pinned host
    memory on the current stream with an event after it, so ``float()`` waits only for the work
    queued before it (not for what is queued later, such as the optimizer's update). On the CPU
    the value itself."""

    def __init__(self, t: torch.Tensor):
        self.event = None
        if t.device.type == "cuda":
            self.value = torch.empty((), dtype=t.dtype, pin_memory=True)
            self.value.copy_(t.detach().reshape(()), non_blocking=True)
            self.event = torch.cuda.Event()
            self.event.record()
        else:
            self.value = t.detach().clone()

    def __float__(self) -> float:
        if self.event is not None:
            self.event.synchronize()
        return float(self.value)


class TensorBoard:
    """SummaryWriter on one rank; a no-op elsewhere or when no directory is given."""

    def __init__(self, log_dir: str | None, enabled: bool):
        self.w = None
        if log_dir and enabled:
            from torch.utils.tensorboard import SummaryWriter

            self.w = SummaryWriter(log_dir=log_dir, max_queue=100)

    def scalars(self, values: dict, step: int) -> None:
        if self.w is None:
            return
        for k, v in values.items():
            if isinstance(v, (int, float)) and v is not None:
                self.w.add_scalar(k, v, step)

    def text(self, tag: str, s: str) -> None:
        if self.w is not None:
            self.w.add_text(tag, s)

    def close(self):
        if self.w is not None:
            self.w.flush()
            self.w.close()
