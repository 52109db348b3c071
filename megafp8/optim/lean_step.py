"""DeepSpeed's ZeRO 1/2 step without host waits and without per-tensor fp64 copies.

At the accumulation boundary DeepSpeed's ``DeepSpeedZeroOptimizer.step`` takes, for every
optimizer group (``bound_groups`` makes ~30 on a 7B model), the L2 norm of each gradient by
casting it to fp64 (a copy of 8 bytes per parameter, one norm kernel per tensor), builds a
``-1`` tensor from host memory to mask a non-finite norm (a host-to-device copy from pageable
memory, which waits for the GPU), and before clipping asks ``bool()`` whether the norm is valid
(another wait). After each wait the GPU idles while the host launches the next small kernels.
Measured on the 7B shape: ~13 ms of norm kernels and ~14 ms of idle per step (BENCHMARKS.md).

``install(optimizer)`` replaces four methods on that one instance, with the same results:

- ``scaled_global_norm``: the step's norm over all groups in one pass (one multi-tensor kernel,
  one all-reduce per parallel group) instead of one per group; DeepSpeed's own under MoE.
- ``get_grad_norm_direct`` (L2): the same gradients counted (no ZeRO padding, no pipeline-
  replicated copy, a non-model-parallel one on model-parallel rank 0 only), their norms in one
  multi-tensor kernel accumulating in fp32 (as Megatron-LM's ``multi_tensor_l2norm``), the same
  all-reduces over the data- and model-parallel groups, and a non-finite norm set to -1 on the
  device. Other norm types go to DeepSpeed's own method.
- ``unscale_and_clip_grads``: the clip factor ``max(1, (norm / loss_scale + 1e-6) / clip)`` with
  an invalid norm taken as infinite (DeepSpeed's rule) chosen on the device instead of the host,
  once per step (every group is passed the same norm).
  With a fused AdamW under ``StepGuard`` the factor goes to the kernel as its ``grad_scale``
  (it divides each gradient as it reads it) instead of a separate pass over the fp32 gradients;
  otherwise the gradients are multiplied in place as DeepSpeed does.
- ``_get_preflattened_grad_partition``: the flat gradient partition of a group handed to the
  step already in the fp32 of the master weights, built by one multi-tensor copy, so DeepSpeed
  neither concatenates the bf16 gradients nor widens them with ``.to(float32)`` (it finds
  nothing left to do). A dtype-changing ``Tensor.to`` runs PyTorch's unrolled (non-vectorized)
  copy kernel: 1.28 ms per 450 M elements on an H200 against 0.84 ms for
  ``torch._foreach_copy_``. The values are the same bits.

- ``reduce_gradients`` (ZeRO-1, at the accumulation boundary): with one data-parallel rank in
  every group there is nothing to reduce, yet DeepSpeed copies every gradient into its bucket,
  divides the bucket by the world size (1), "reduces" it, and copies it again into a contiguous
  partition buffer: two copies of every gradient and a pass over them, ~10 ms per step on a
  4.5 B-parameter model (H100 profile, BENCHMARKS.md). There the gradients go to the step where
  autograd left them (DeepSpeed's own epilogue lists them); the same values, so the same bits.
  More than one rank, or MoE, offload, overlap, fp32 accumulation, sequence-parallel or
  pre-divided averaging: DeepSpeed's own.

With ``--use-precision-aware-optimizer`` (Megatron-LM's flag for its optimizer that reads the
bf16 gradients and keeps the fp32 master weights itself), ``step`` itself (``bf16_step_ok``:
bf16 weights with fp32 masters, a fused AdamW under ``StepGuard`` that skips on the norm, no
overflow scan, no offload, MoE, Muon or ZenFlow): DeepSpeed's step for that case, the same
norm, clip factor, update, all-gather and copies into the model, except that each group's
update is ``adamw_bf16.step``. It reads the group's bf16 gradients where they lie and writes the
bf16 partition in the same pass, so neither the fp32 gradient partition nor the fp32 -> bf16
copy of the weights is made (40 -> 28 bytes moved per parameter). The gradients are freed after
the update instead of before it (DeepSpeed frees them once it holds the fp32 copy): the same
peak, less the fp32 copy. Its gradient norm goes to the host (``early_grad_norm``, a
``HostScalar``) before the update is queued, so the loop reads it without waiting for the update.
"""

from __future__ import annotations

import functools
import math

import torch

from megafp8.metrics import HostScalar


def install(optimizer, bf16_step: bool = False) -> bool:
    """Swap the four methods on ``optimizer`` when it is DeepSpeed's ZeRO 1/2 optimizer without
    CPU offload, and with ``bf16_step`` (``--use-precision-aware-optimizer``) its ``step``;
    returns whether it did."""
    from deepspeed.runtime.zero.stage_1_and_2 import DeepSpeedZeroOptimizer

    if not isinstance(optimizer, DeepSpeedZeroOptimizer) or optimizer.cpu_offload:
        return False
    optimizer.get_grad_norm_direct = functools.partial(
        grad_norm, optimizer, optimizer.get_grad_norm_direct
    )
    optimizer.scaled_global_norm = functools.partial(
        global_norm, optimizer, optimizer.scaled_global_norm
    )
    optimizer.unscale_and_clip_grads = functools.partial(
        unscale_and_clip, optimizer, optimizer.unscale_and_clip_grads
    )
    flat = getattr(optimizer, "_get_preflattened_grad_partition", None)  # DeepSpeed >= 0.18
    if flat is not None:
        optimizer._get_preflattened_grad_partition = functools.partial(
            widened_partition, optimizer, flat
        )
    optimizer.reduce_gradients = functools.partial(
        reduce_gradients, optimizer, optimizer.reduce_gradients
    )
    if bf16_step:
        optimizer.step = functools.partial(step, optimizer, optimizer.step)
    return True


def alone(zopt) -> bool:
    """Whether ZeRO-1's gradient reduction has nothing to do: one data-parallel rank in every
    group, and none of the paths (MoE, offload, overlap, fp32 accumulation, sequence-parallel or
    pre-divided averaging) whose reduction does more than add and divide by the world size."""
    from deepspeed import comm as dist

    groups = [zopt.dp_process_group, *zopt.real_dp_process_group]
    return bool(
        not zopt.partition_gradients
        and not zopt.overlap_comm
        and not zopt.cpu_offload
        and not zopt.has_moe_layers
        and not getattr(zopt, "zenflow", False)
        and not getattr(zopt, "use_grad_accum_attribute", False)
        and getattr(zopt, "autoep_folding_tp_group", None) is None
        and getattr(zopt, "sequence_parallel_size", 1) == 1
        and getattr(zopt, "gradient_predivide_factor", 1.0) == 1.0
        and getattr(zopt, "gradient_accumulation_dtype", zopt.dtype) == zopt.dtype
        and all(dist.get_world_size(group=g) == 1 for g in groups)
    )


def reduce_gradients(zopt, fallback, pipeline_parallel=False):
    """ZeRO-1's reduction at the accumulation boundary: on one rank (``alone``) only DeepSpeed's
    epilogue, which lists each partition's gradients for the step; else DeepSpeed's own."""
    if pipeline_parallel or not alone(zopt):
        return fallback(pipeline_parallel=pipeline_parallel)
    zopt.overlapping_partition_gradients_reduce_epilogue()
    return None


def bf16_step_ok(zopt) -> bool:
    """Whether ``step`` takes this step through ``adamw_bf16`` (else DeepSpeed's own)."""
    from megafp8.optim import adamw_bf16

    guard = _fused_guard(zopt)
    inner = getattr(zopt, "optimizer", None)
    if guard is None or guard.norm_of is None or not isinstance(inner, torch.optim.AdamW):
        return False
    if any(g.get("amsgrad") or g.get("maximize") for g in inner.param_groups):
        return False
    n = len(zopt.bit16_groups)
    lacks = getattr(zopt, "_muon_update_lacks_loss_scale", lambda i: False)
    fp32 = zopt.single_partition_of_fp32_groups
    return bool(
        zopt.dtype == torch.bfloat16
        and not getattr(zopt, "custom_loss_scaler", False)
        and not torch.is_tensor(zopt.loss_scale)
        and zopt.loss_scale == 1.0  # the clip factor is the kernel's only scale
        and not zopt.check_grad_overflow
        and not zopt.cpu_offload
        and not zopt.has_moe_layers
        and not getattr(zopt, "zenflow", False)
        and getattr(zopt, "torch_autocast_gradscaler", None) is None
        and not any(lacks(i) for i in range(n))
        and all(f.dtype == torch.float32 and adamw_bf16.available(f.device) for f in fp32)
    )


def _grad_pieces(zopt, group_idx) -> list:
    """The group's gradient partition as DeepSpeed holds it: its pre-flattened buffer, else the
    list of pieces that lie end to end over the partition."""
    flat = type(zopt)._get_preflattened_grad_partition(zopt, group_idx)  # DeepSpeed's, unwidened
    grads = [flat] if flat is not None else zopt.averaged_gradients.get(group_idx)
    size = int(zopt.partition_size[group_idx])
    if not isinstance(grads, list) or not all(map(torch.is_tensor, grads)):
        raise RuntimeError(f"ZeRO group {group_idx}: no gradient partition at the step")
    got = sum(g.numel() for g in grads)
    if got != size:  # DeepSpeed's own step asserts the same
        raise RuntimeError(
            f"ZeRO group {group_idx}: gradients of {got} elements for a partition of {size}"
        )
    return grads


def step(zopt, fallback, closure=None):
    """DeepSpeed's ZeRO 1/2 ``step`` for ``bf16_step_ok`` (module docstring); otherwise its own."""
    if not bf16_step_ok(zopt):
        return fallback(closure)
    from deepspeed import comm as dist
    from deepspeed.runtime.zero import stage_1_and_2 as S

    zopt.micro_step_id = S.INITIAL_MICRO_STEP_ID
    zopt._wait_for_offload_copies()
    zopt.overflow = False  # bf16 without the scan: a bad norm is StepGuard's found_inf
    norm = zopt.scaled_global_norm() if zopt.compute_grad_norm else None
    prev_scale = zopt.loss_scale
    zopt._update_scale(False)
    zopt._global_grad_norm = None if norm is None else norm / prev_scale
    if torch.is_tensor(zopt._global_grad_norm):  # to the host before the update is queued
        zopt.early_grad_norm = (zopt._global_grad_norm, HostScalar(zopt._global_grad_norm))
    guard = _fused_guard(zopt)
    for i in range(len(zopt.bit16_groups)):
        partition_id = dist.get_rank(group=zopt.real_dp_process_group[i])
        zopt.free_grad_in_param_list(zopt.params_not_in_partition[i])
        grads = _grad_pieces(zopt, i)
        if norm is not None:  # the clip factor goes to the kernel as its grad_scale
            zopt.unscale_and_clip_grads([], norm)
        guard.bf16_update = (grads, zopt.parallel_partitioned_bit16_groups[i][partition_id])
        try:
            zopt._optimizer_step(i)
        finally:
            guard.bf16_update = None
        del grads
        zopt.free_grad_in_param_list(zopt.params_in_partition[i])
        zopt._release_preflattened_grad_buffers(i)
        zopt.averaged_gradients[i] = None
        zopt.all_grad_tensors[i] = None
    S.all_gather_dp_groups(
        groups_flat=zopt.bit16_groups_flat,
        partitioned_param_groups=zopt.parallel_partitioned_bit16_groups,
        dp_process_group=zopt.real_dp_process_group,
        start_alignment_factor=zopt.nccl_start_alignment_factor,
        allgather_bucket_size=zopt.allgather_bucket_size,
    )
    for i in range(len(zopt.bit16_groups)):
        zopt._update_model_bit16_weights(i)
    return None


def widened_partition(zopt, fallback, group_idx):
    """This rank's flat gradient partition of one group, as DeepSpeed's step builds it (its
    pre-flattened buffer, else the group's gradients concatenated and zero-padded to the
    partition size), but made at once in the dtype of the group's master weights: one multi-
    tensor copy instead of a concatenation and a dtype-changing ``Tensor.to``. The same values.
    Whatever does not fit that pattern goes back to DeepSpeed unchanged."""
    flat = fallback(group_idx)
    dtype = zopt.single_partition_of_fp32_groups[group_idx].dtype
    if flat is not None:
        grads = [flat]
    else:
        grads = zopt.averaged_gradients.get(group_idx)
        if not isinstance(grads, list) or not grads or not all(map(torch.is_tensor, grads)):
            return None
    if all(g.dtype == dtype for g in grads):
        return flat
    size = int(zopt.partition_size[group_idx])
    sizes = [g.numel() for g in grads]
    short = flat is None and sum(sizes) < size and not _last_rank(zopt, group_idx)
    if sum(sizes) > size or short:
        return flat  # DeepSpeed's own checks speak
    wide = torch.empty(size, dtype=dtype, device=grads[0].device)
    parts = list(wide.split([*sizes, size - sum(sizes)]))
    torch._foreach_copy_(parts[: len(grads)], [g.reshape(-1) for g in grads])
    parts[-1].zero_()  # DeepSpeed's alignment padding
    return wide


def _last_rank(zopt, group_idx) -> bool:
    from deepspeed import comm as dist

    group = zopt.real_dp_process_group[group_idx]
    return dist.get_rank(group=group) == dist.get_world_size(group=group) - 1


def _counted(zopt, gradients, params) -> list[torch.Tensor]:
    """The gradients DeepSpeed's L2 norm counts on this rank (its selection, unchanged)."""
    from deepspeed.runtime.constants import PIPE_REPLICATED
    from deepspeed.runtime.utils import is_model_parallel_parameter

    out = []
    grads = (g for g in gradients if not getattr(g, "_zero_padding", False))
    for g, p in zip(grads, params, strict=False):  # DeepSpeed's pairing
        if hasattr(p, PIPE_REPLICATED) and p.ds_pipe_replicated:
            continue
        if is_model_parallel_parameter(p) or zopt.model_parallel_rank == 0:
            out.append(g.detach())
    return out


def grad_norm(zopt, fallback, gradients, params, norm_type=2):
    """L2 norm of this rank's share of one group's gradients, summed over the data- and model-
    parallel groups; -1 where it is not finite (DeepSpeed's sentinel)."""
    if float(norm_type) != 2.0:
        return fallback(gradients, params, norm_type)
    return _reduced_norm(zopt, _counted(zopt, gradients, params), invalid=-1.0)


def global_norm(zopt, fallback, norm_type=2):
    """The step's global L2 norm over every group at once: one multi-tensor kernel and one
    all-reduce per parallel group, where DeepSpeed's ``scaled_global_norm`` takes each group's
    norm (kernels and all-reduces per group) and combines them. Non-finite: inf (DeepSpeed's
    combination turns any invalid group into inf). DeepSpeed's own for MoE (expert norms are
    averaged per group) and for groups holding Muon updates."""
    n = len(zopt.bit16_groups)
    lacks = getattr(zopt, "_muon_update_lacks_loss_scale", lambda i: False)
    if norm_type != 2 or zopt.has_moe_layers or any(lacks(i) for i in range(n)):
        return fallback(norm_type)
    grads = []
    for i in range(n):
        grads += _counted(zopt, zopt.averaged_gradients[i], zopt.params_in_partition[i])
    return _reduced_norm(zopt, grads, invalid=math.inf)


def _reduced_norm(zopt, grads: list, invalid: float) -> torch.Tensor:
    """L2 norm of ``grads`` (fp32 accumulation) summed over the data- and model-parallel groups;
    ``invalid`` where it is not finite."""
    from deepspeed import comm as dist

    if grads:
        norms = torch._foreach_norm(grads, 2.0, dtype=torch.float32)
        total = torch.stack(norms).square().sum()
    else:
        total = torch.zeros((), dtype=torch.float32, device=zopt.device)
    dist.all_reduce(total, op=dist.ReduceOp.SUM, group=zopt.dp_process_group)
    zopt._model_parallel_all_reduce(tensor=total, op=dist.ReduceOp.SUM)
    total = total.sqrt()
    return total.masked_fill_(~torch.isfinite(total), invalid)


def unscale_and_clip(zopt, fallback, grad_groups_flat, total_norm):
    """DeepSpeed's unscale and clip of the flat fp32 gradients, decided on the device."""
    if zopt.clip_grad == 0.0 and zopt.loss_scale == 1.0:
        return None
    if not torch.is_tensor(total_norm) or torch.is_tensor(zopt.loss_scale):
        return fallback(grad_groups_flat, total_norm)
    memo = getattr(zopt, "_lean_clip", None)  # every group of a step gets the same norm
    if memo is not None and memo[0] is total_norm:
        combined = memo[1]
    else:
        combined = zopt.loss_scale
        if zopt.clip_grad > 0.0:
            bad = ~torch.isfinite(total_norm) | (total_norm < 0)
            norm = total_norm.float().masked_fill(bad, math.inf)
            clip = ((norm / zopt.loss_scale) + 1e-6) / zopt.clip_grad
            combined = torch.clamp(clip, min=1.0) * zopt.loss_scale
        zopt._lean_clip = (total_norm, combined)
    guard = _fused_guard(zopt)
    if guard is not None and torch.is_tensor(combined):
        guard.grad_scale = combined.reshape(())  # divided out by the fused AdamW kernel
        return None
    for grad in grad_groups_flat:
        for g in grad if isinstance(grad, list) else [grad]:
            g.data.mul_(1.0 / combined)
    return None


def _fused_guard(zopt):
    """The StepGuard of a fused AdamW under ``zopt`` (it passes ``grad_scale`` on), or None."""
    inner = getattr(zopt, "optimizer", None)
    guard = getattr(inner, "step_guard", None)
    if guard is None or not inner.defaults.get("fused"):
        return None
    return guard
