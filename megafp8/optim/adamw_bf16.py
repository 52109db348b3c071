"""AdamW on an fp32 master partition from bf16 gradients, writing the bf16 weights in the same
pass: one Triton kernel per gradient tensor on CUDA, the same arithmetic in torch ops elsewhere.

DeepSpeed's ZeRO 1/2 step for bf16 parameters with fp32 masters moves, per parameter, the bf16
gradient widened to fp32 (read 2 bytes, write 4), torch's fused AdamW over the fp32 weight,
gradient and both moments (read 16, write 12) and the updated weight narrowed into the bf16
partition (read 4, write 2): 40 bytes. Here one kernel reads the bf16 gradient, the fp32 weight
and both moments and writes those three and the bf16 weight: 28 bytes, and no fp32 gradient
partition is ever allocated.

The update is torch's AdamW (``torch._fused_adamw_``): weight decay ``p -= lr * wd * p``, the
moments ``m = b1 m + (1 - b1) g``, ``v = b2 v + (1 - b2) g^2``, then
``p -= lr / (1 - b1^t) * m / (sqrt(v) / sqrt(1 - b2^t) + eps)``, with ``g`` divided by
``grad_scale`` as it is read and nothing changed where ``found_inf`` is set. The bias
corrections are taken in float64 on the device from the step count, as torch's kernel does.
The optimizer state is torch's (``step``, ``exp_avg``, ``exp_avg_sq`` in ``opt.state``), so
checkpoints and DeepSpeed's links to it are unchanged.
"""

from __future__ import annotations

import importlib.util

import torch

_HAVE_TRITON = importlib.util.find_spec("triton") is not None
if _HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _adamw_kernel(
        p_ptr,
        g_ptr,
        m_ptr,
        v_ptr,
        out_ptr,
        n,
        scal_ptr,
        scale_ptr,
        found_ptr,
        lr_wd,
        beta1,
        one_minus_beta1,
        beta2,
        one_minus_beta2,
        eps,
        HAS_SCALE: tl.constexpr,
        HAS_FOUND: tl.constexpr,
        BLOCK: tl.constexpr,
    ):
        offs = tl.program_id(0).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
        if HAS_FOUND:  # found_inf: no element is read or written
            n = tl.where(tl.load(found_ptr) == 0.0, n, 0)
        mask = offs < n
        g = tl.load(g_ptr + offs, mask=mask, other=0.0).to(tl.float32)
        if HAS_SCALE:
            g = tl.div_rn(g, tl.load(scale_ptr))
        p = tl.load(p_ptr + offs, mask=mask, other=0.0)
        m = tl.load(m_ptr + offs, mask=mask, other=0.0)
        v = tl.load(v_ptr + offs, mask=mask, other=0.0)
        step_size = tl.load(scal_ptr)
        bc2_sqrt = tl.load(scal_ptr + 1)
        p = p - lr_wd * p
        m = beta1 * m + one_minus_beta1 * g
        v = beta2 * v + one_minus_beta2 * (g * g)
        denom = tl.div_rn(tl.sqrt_rn(v), bc2_sqrt) + eps
        p = p - step_size * tl.div_rn(m, denom)
        tl.store(p_ptr + offs, p, mask=mask)
        tl.store(m_ptr + offs, m, mask=mask)
        tl.store(v_ptr + offs, v, mask=mask)
        tl.store(out_ptr + offs, p.to(out_ptr.dtype.element_ty), mask=mask)


# the launch: elements per program and warps (``bench/kernel_probes.py --probes adamw`` times
# the alternatives on the card at hand)
LAUNCH = {"BLOCK": 2048, "WARPS": 8}


def available(device: torch.device) -> bool:
    """Whether the update runs on ``device``: the Triton kernel on CUDA, torch ops on the CPU."""
    return device.type == "cpu" or (device.type == "cuda" and _HAVE_TRITON)


def _scalars(step: torch.Tensor, lr: float, beta1: float, beta2: float) -> torch.Tensor:
    """``[lr / (1 - b1^t), sqrt(1 - b2^t)]`` in fp32, from the step count in float64 on its
    device (no host wait)."""
    t = step.double()
    bc1 = 1.0 - torch.pow(beta1, t)
    bc2 = 1.0 - torch.pow(beta2, t)
    return torch.stack([lr / bc1, bc2.sqrt()]).float()


def _reference(p, g, m, v, out, scal, scale, found, k) -> None:
    """The kernel's arithmetic in torch ops (fp32, the same order)."""
    if found is not None and bool(found != 0):
        return
    g = g.float()
    if scale is not None:
        g = g / scale
    p.sub_(p * k["lr_wd"])
    m.mul_(k["beta1"]).add_(g * k["one_minus_beta1"])
    v.mul_(k["beta2"]).add_((g * g) * k["one_minus_beta2"])
    denom = v.sqrt() / scal[1] + k["eps"]
    p.sub_(scal[0] * (m / denom))
    out.copy_(p)


def _update(p, g, m, v, out, scal, scale, found, k) -> None:
    if p.device.type != "cuda":
        return _reference(p, g, m, v, out, scal, scale, found, k)
    n = p.numel()
    block = LAUNCH["BLOCK"]
    _adamw_kernel[(triton.cdiv(n, block),)](
        p,
        g,
        m,
        v,
        out,
        n,
        scal,
        scal if scale is None else scale,  # any pointer where the flag says it is not read
        scal if found is None else found,
        k["lr_wd"],
        k["beta1"],
        k["one_minus_beta1"],
        k["beta2"],
        k["one_minus_beta2"],
        k["eps"],
        HAS_SCALE=scale is not None,
        HAS_FOUND=found is not None,
        BLOCK=block,
        num_warps=LAUNCH["WARPS"],
    )


@torch.no_grad()
def step(opt: torch.optim.Optimizer, grads: list, out: torch.Tensor, *, grad_scale=None,
         found_inf=None) -> None:  # fmt: skip
    """One AdamW step of ``opt``'s single parameter group holding one flat fp32 partition
    ``p`` (DeepSpeed swaps the group in): ``grads`` lie end to end from element 0 of ``p``
    (together at most ``p``'s size; pieces marked ``_zero_padding`` and the rest beyond them are
    ZeRO's padding, left as they are, where a zero gradient would change nothing), ``out`` is the
    bf16 partition the new weights are written to. ``grad_scale``: a 0-d tensor the gradients are
    divided by; ``found_inf``: a 0-d float tensor, nonzero withholds the update and the step
    count (torch's fused semantics)."""
    (group,) = opt.param_groups
    (p,) = group["params"]
    if out.numel() != p.numel():
        raise ValueError(f"bf16 partition of {out.numel()} elements for {p.numel()} fp32 ones")
    state = opt.state[p]
    if not state:  # torch's fused AdamW's initial state
        state["step"] = torch.zeros((), dtype=torch.float32, device=p.device)
        state["exp_avg"] = torch.zeros_like(p, memory_format=torch.preserve_format)
        state["exp_avg_sq"] = torch.zeros_like(p, memory_format=torch.preserve_format)
    if state["step"].device != p.device:  # a checkpoint of the unfused optimizer
        state["step"] = state["step"].to(p.device, torch.float32)
    lr, wd, eps = float(group["lr"]), float(group["weight_decay"]), float(group["eps"])
    beta1, beta2 = (float(b) for b in group["betas"])
    k = {
        "lr_wd": lr * wd,
        "beta1": beta1,
        "one_minus_beta1": 1.0 - beta1,
        "beta2": beta2,
        "one_minus_beta2": 1.0 - beta2,
        "eps": eps,
    }
    st = state["step"]
    st.add_(1)
    scal = _scalars(st, lr, beta1, beta2)
    scale = None if grad_scale is None else grad_scale.reshape(()).float()
    found = None if found_inf is None else found_inf.reshape(()).float()
    flat_p, flat_m = p.view(-1), state["exp_avg"].view(-1)
    flat_v, flat_out = state["exp_avg_sq"].view(-1), out.view(-1)
    offset = 0
    for g in grads:
        n = g.numel()
        if offset + n > p.numel():
            raise ValueError(f"gradients of {offset + n} elements for a partition of {p.numel()}")
        if n and not getattr(g, "_zero_padding", False):
            sl = slice(offset, offset + n)
            _update(flat_p[sl], g.reshape(-1), flat_m[sl], flat_v[sl], flat_out[sl], scal,
                    scale, found, k)  # fmt: skip
        offset += n
    if found is not None:
        st.sub_(found)
