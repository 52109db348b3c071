"""One training iteration (all micro-batches of the global batch) as a schedule of forwards and
backwards, driving the DeepSpeed engine of this rank's stage.

``no_pipelining`` (pp = 1): gradient accumulation, forward and backward of each micro-batch in
turn. ``one_f_one_b`` (pp > 1), Megatron's non-interleaved schedule: stage k runs
``min(pp - k - 1, m)`` warm-up forwards, then alternates one forward and one backward, then
drains the remaining backwards, so at most ``pp - k`` micro-batches are in flight on stage k. The
order of events is a pure function (``one_f_one_b_order``) that the tests compare with the
published table; ``run_schedule`` executes any such order. With virtual stages (a model of
``GPTModelChunks``) ``train_iteration`` runs the interleaved schedule (``interleaved.py``).

DeepSpeed owns the optimizer on every stage: the last stage backward-s its loss through the
engine (scaled by 1/m as one process); a stage before it backward-s the scalar surrogate
``(output * grad_output).sum()``, whose gradient with respect to ``output`` is exactly the
received ``grad_output`` (already scaled), so with ``scale_wrt_gas=False`` DeepSpeed's hooks,
accumulation and ZeRO reduction see the gradients one process would have. ``engine.step()``
follows every backward; DeepSpeed steps at the m-th, the accumulation boundary, which every
schedule calls last (``boundary_step``): after the iteration's loss is known on every rank, so
the bad-step policy (``run.policy``, ``optim/step_guard.py``) can withhold the update.
Without pipelining the loss stays on the GPU until the step is launched: where the optimizer can
withhold its update on the device (``StepPolicy.on_device``) the host reads it only afterwards,
so the step's many small kernels queue behind the last backward instead of starting on an idle
GPU.

Tied embeddings across stages: the last stage's output layer is a copy of the first stage's word
embedding outside the optimizer. After its last backward the last stage sends the copy's
accumulated gradient to the first stage, which adds it to its final backward through the
surrogate ``(W * grad_copy).sum()`` (so ZeRO reduces and clips the sum, the word embedding
counted once), steps, and sends the updated weight back over the embedding group.

FP8 (delayed scaling): each scaling state has its own amax history, and the scales of a
micro-batch's forward (input and weight roles) depend only on earlier forwards, those of its
backward (gradient role) only on earlier backwards. So under pipelining the input/weight roles
are updated after each forward and the gradient role after each backward: every micro-batch
uses the scales one process would use although several are in flight (one process updates all
roles after each backward, the same sequence per role).
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.profiler import record_function

from megafp8.metrics import HostScalar
from megafp8.parallel.pipeline import p2p

FORWARD_ROLES, BACKWARD_ROLES = ("x", "w"), ("g",)


def to_device(batch: dict, device) -> dict:
    """To the device without waiting: from pageable memory a host-to-GPU copy blocks the CPU
    until the GPU has drained its queue, and the next micro-batch's launches start from empty."""
    if torch.device(device).type == "cuda":
        return {k: v.pin_memory().to(device, non_blocking=True) for k, v in batch.items()}
    return {k: v.to(device) for k, v in batch.items()}


def dp_mean(x: torch.Tensor, groups, on_device: bool = False) -> float | torch.Tensor:
    """The mean of ``x`` over the data-parallel group: a float, or the tensor (not waited for)."""
    if groups.dp > 1:
        dist.all_reduce(x, group=groups.dp_group)
        x = x / groups.dp
    return x if on_device else float(x)


def one_f_one_b_order(pp: int, rank: int, m: int) -> list[tuple[str, int]]:
    """The 1F1B order of stage ``rank``: [("F", 0), ..., ("B", 0), ...]."""
    warmup = min(pp - rank - 1, m)
    order = [("F", j) for j in range(warmup)]
    for j in range(m - warmup):
        order += [("F", warmup + j), ("B", j)]
    return order + [("B", j) for j in range(m - warmup, m)]


def _token_weights(batches, groups, m):
    """calculate_per_token_loss: each micro-batch's weight, and the global token count."""
    counts = [b["loss_mask"].float().sum() for b in batches]
    n_total = torch.stack(counts).sum()
    if groups.dp > 1:
        dist.all_reduce(n_total, group=groups.dp_group)
    n_total = n_total.clamp(min=1.0)
    return [c * (m * groups.dp) / n_total for c in counts], counts, n_total


def no_pipelining(run, train_iter, hooks=None) -> tuple[float, float | None]:
    """pp = 1: forward, backward, engine step for each micro-batch (DeepSpeed accumulates)."""
    eng, gas, cfg = run.engine, run.engine.gradient_accumulation_steps(), run.cfg
    total = torch.zeros((), device=run.device)
    per_token = cfg.train.calculate_per_token_loss
    if per_token:  # every micro-batch's token count first: the weights need the total
        batches = [to_device(next(train_iter), run.device) for _ in range(gas)]
        weights, counts, n_total = _token_weights(batches, run.groups, gas)
    for i in range(gas):
        with record_function("megafp8.data"):
            b = batches[i] if per_token else to_device(next(train_iter), run.device)
        run.backend.microbatch(i)
        with record_function("megafp8.forward"), run.backend.autocast():
            loss = eng(b["tokens"], b["labels"], b["loss_mask"])
        with record_function("megafp8.backward"):
            eng.set_gradient_accumulation_boundary(i == gas - 1)  # the batch may change (ramp-up)
            eng.backward(loss * weights[i] if per_token else loss)
        if per_token:
            total += loss.detach().float() * counts[i]
        else:
            total += loss.detach().float()
        with record_function("megafp8.fp8-update"):
            run.backend.update()
        if i < gas - 1:  # the boundary's step waits for the loss
            eng.step()
            if hooks is not None:
                hooks.after_microbatch()
    if per_token:  # sum over DP of the token-weighted sums, over the global token count
        loss = dp_mean(total / n_total, run.groups, True) * run.groups.dp
    else:
        loss = dp_mean(total / gas, run.groups, True)
    return boundary_step(run, loss, hooks)


def boundary_step(run, loss: float | torch.Tensor, hooks=None) -> tuple[float, float | None]:
    """The accumulation boundary's ``engine.step()`` (the optimizer update), once ``loss`` (the
    same on every rank; a float, or a 0-d tensor read only after the step is launched where the
    policy can judge it on the device) is known: ``run.policy`` (where there is one) decides
    before it whether the update happens and reads the gradient norm after it. Returns (loss,
    grad norm) as floats.

    A tensor loss goes to the host ahead of the step's kernels (``HostScalar``), and so does the
    norm where the step makes it before its update (``lean_step.step``): reading both then
    waits for the last backward and the norm, not for the update, and the host goes on to the
    next iteration's launches while the GPU runs the update (the first micro-batch's forward
    no longer starts on an idle GPU)."""
    policy = getattr(run, "policy", None)
    if torch.is_tensor(loss) and (policy is None or not policy.on_device()):
        loss = float(loss)
    if policy is not None:
        policy.before_step(loss)
    early_loss = HostScalar(loss) if torch.is_tensor(loss) else None
    run.backend.release_main_grads()  # fused wgrad accumulation: .grad is DeepSpeed's alone
    with record_function("megafp8.step"):
        run.engine.step()
    gn = _grad_norm(run.engine)
    loss = float(early_loss) if early_loss is not None else loss
    if policy is not None:
        policy.after_step(loss, gn)
    if hooks is not None:
        hooks.after_microbatch()
    return loss, gn


def _grad_norm(engine) -> float | None:
    """The step's gradient norm as a float: the copy the step sent to the host before its
    update when there is one for this very norm, else the engine's own (a wait for the GPU)."""
    gn = engine.get_global_grad_norm()
    early = getattr(getattr(engine, "optimizer", None), "early_grad_norm", None)
    if early is not None:
        engine.optimizer.early_grad_norm = None
        if early[0] is gn:
            return float(early[1])
    return float(gn) if gn is not None else None


def activation_shape(cfg, tp: int) -> tuple[int, int, int]:
    """What passes between stages: [s (/tp under SP), micro_batch, hidden]."""
    s = cfg.model.seq_length
    s = s // tp if cfg.parallel.sequence_parallel else s
    return (s, cfg.train.micro_batch_size, cfg.model.hidden_size)


def make_pipe(run, ring: bool = False) -> p2p.Pipe:
    dtype = torch.bfloat16 if run.cfg.train.bf16 else torch.float32
    shape = activation_shape(run.cfg, run.groups.tp)
    return p2p.Pipe(run.groups, shape, dtype, run.device, ring=ring)


def _tied(run) -> bool:
    return run.groups.pp > 1 and not run.cfg.model.untie_embeddings_and_output_weights


def one_f_one_b(run, train_iter, hooks=None, record: dict | None = None):
    """pp > 1: one iteration in 1F1B order; returns (loss, grad norm), the same on every rank.
    ``record`` (a dict) receives this rank's ``events`` and ``max_in_flight``."""
    g, m = run.groups, run.engine.gradient_accumulation_steps()
    order = one_f_one_b_order(g.pp, g.coords.pp, m)
    return run_schedule(run, order, [next(train_iter) for _ in range(m)], hooks, record)


def run_schedule(run, order, batches, hooks=None, record=None):
    """Execute ``order`` ((F|B, micro-batch) events) on this stage; see the module doc."""
    eng, st, g, m = run.engine, run.model.stage, run.groups, len(batches)
    batches = [to_device(b, run.device) for b in batches]
    per_token = run.cfg.train.calculate_per_token_loss
    weights = counts = n_total = None
    if per_token and st.last:
        weights, counts, n_total = _token_weights(batches, g, m)
    pipe, pending = make_pipe(run), {}
    total, events, in_flight, peak = torch.zeros((), device=run.device), [], 0, 0
    for kind, j in order:
        events.append((kind, j))
        if kind == "F":
            b, x = batches[j], None if st.first else pipe.recv_forward()
            run.backend.microbatch(j)
            with run.backend.autocast():
                y = eng(b["tokens"], b["labels"], b["loss_mask"], hidden=x)
            run.backend.update(FORWARD_ROLES)
            if st.last:
                total += y.detach().float() * (counts[j] if per_token else 1.0)
                y = y * weights[j] if per_token else y
            else:
                pipe.send_forward(y)
            pending[j] = (x, y)
            in_flight += 1
            peak = max(peak, in_flight)
            continue
        x, y = pending.pop(j)
        eng.set_gradient_accumulation_boundary(j == m - 1)  # the batch may change (ramp-up)
        backward_step(run, pipe, x, y, j == m - 1, run.model, hooks, step=j < m - 1)
        in_flight -= 1
    pipe.drain()
    if record is not None:
        record.update(events=events, max_in_flight=peak)
    return finish_iteration(run, st.last, total, n_total, m, hooks)


def pipeline_loss(run, last: bool, total, n_total, m: int) -> float:
    """On every rank: the last stage's mean loss (per token when ``n_total`` is given),
    DP-averaged, broadcast over the pipeline."""
    g = run.groups
    loss = torch.zeros((), dtype=torch.float64, device=run.device)
    if last:
        mean = total / n_total if n_total is not None else total / m
        loss += dp_mean(mean, g) * (g.dp if n_total is not None else 1)
    dist.broadcast(loss, src=g.ranks["pp"][-1], group=g.pp_group)
    return float(loss)


def finish_iteration(
    run, last: bool, total, n_total, m: int, hooks=None, tied_model=None
) -> tuple[float, float | None]:
    """After the last backward: the loss on every rank, the boundary step, then the updated tied
    embedding to the last stage's copy. (loss, grad norm), the same on every rank."""
    loss = pipeline_loss(run, last, total, n_total, m)
    loss, gn = boundary_step(run, loss, hooks)
    if _tied(run):
        _share_tied_weight(run, tied_model)
    return loss, gn


def backward_step(run, pipe, x, y, last_mb: bool, model, hooks, step: bool = True) -> None:
    """A scheduled backward: the engine backward, the gradient-role scale update, the input
    gradient to the previous stage, the engine step unless this is the accumulation boundary
    (``step=False``: ``finish_iteration`` steps once the loss is known everywhere)."""
    _backward(run, pipe, y, last_mb=last_mb, model=model)
    run.backend.update(BACKWARD_ROLES)
    if not model.stage.first:
        pipe.send_backward(x.grad)
    if step:
        run.engine.step()
        if hooks is not None:
            hooks.after_microbatch()


def _backward(run, pipe, y, last_mb: bool, model=None) -> None:
    """One micro-batch's backward through the engine (loss, or surrogate on earlier stages).
    ``model``: the stage (or, interleaved, the chunk) that ran the forward; ``last_mb``: its
    last backward of the iteration."""
    eng = run.engine
    model = run.model if model is None else model
    st = model.stage
    if st.last:
        eng.backward(y)
        if last_mb and _tied(run):  # the copy's gradient goes to the first stage's weight
            w, g = model.tied_output_weight, run.groups
            reqs = p2p.send_tied_grad(w.grad, g.ranks["emb"][0], g.embedding_group)
            pipe.pending.append((reqs, w.grad))
            w.grad = None
        return
    surrogate = (y * pipe.recv_backward()).sum()
    if last_mb and st.first and _tied(run):
        w = model.embedding.weight
        gw = p2p.recv_tied_grad(w, run.groups.ranks["emb"][-1], run.groups.embedding_group)
        surrogate = surrogate + (w * gw).sum()
    eng.backward(surrogate, scale_wrt_gas=False)


def _share_tied_weight(run, model=None) -> None:
    """After the step: the first stage's updated word embedding -> the last stage's copy."""
    model = run.model if model is None else model
    st, g = model.stage, run.groups
    if st.first:
        w = model.embedding.weight
    elif st.last:
        w = model.tied_output_weight
    else:
        return
    dist.broadcast(w.detach(), src=g.ranks["emb"][0], group=g.embedding_group)


def train_iteration(run, train_iter, hooks=None) -> tuple[float, float | None]:
    """The schedule for this layout: one iteration; (loss, grad norm) on every rank."""
    if run.groups.pp == 1:
        return no_pipelining(run, train_iter, hooks)
    if is_interleaved(run):
        from megafp8.parallel.pipeline.interleaved import interleaved_one_f_one_b

        return interleaved_one_f_one_b(run, train_iter, hooks)
    return one_f_one_b(run, train_iter, hooks)


def is_interleaved(run) -> bool:
    """The model is ``GPTModelChunks`` (virtual stages)."""
    return getattr(run.model, "chunks", None) is not None


@torch.no_grad()
def forward_only(run, batches) -> float:
    """Evaluation: the mean loss of ``batches`` (every stage passes them through in order), the
    DP mean, known on every rank."""
    if is_interleaved(run):
        from megafp8.parallel.pipeline.interleaved import forward_only_chunks

        return forward_only_chunks(run, batches)
    st, g = run.model.stage, run.groups
    pipe = make_pipe(run) if g.pp > 1 else None
    total = torch.zeros((), device=run.device)
    for b in batches:
        b = to_device(b, run.device)
        x = None if st.first else pipe.recv_forward()
        with run.backend.autocast():
            y = run.engine(b["tokens"], b["labels"], b["loss_mask"], hidden=x)
        if st.last:
            total += y.float()
        else:
            pipe.send_forward(y)
    if pipe is not None:
        pipe.drain()
    loss = torch.zeros((), dtype=torch.float64, device=run.device)
    if st.last:
        loss += dp_mean(total / max(len(batches), 1), g)
    if g.pp > 1:
        dist.broadcast(loss, src=g.ranks["pp"][-1], group=g.pp_group)
    return float(loss)
