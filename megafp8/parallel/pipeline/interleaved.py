"""The interleaved 1F1B schedule (Megatron's, Narayanan et al. 2021 sec. 2.2): each pipeline rank
holds v model chunks (virtual stages ``c x pp + rank``, ``stages.chunk_stages``), so a
micro-batch goes around the ring of ranks v times and the pipeline fills and drains v times
faster: the bubble is ``(pp - 1) / (v x m + pp - 1)`` of the iteration instead of
``(pp - 1) / (m + pp - 1)`` (README, Pipeline parallelism).

Order (``interleaved_order``, pure): the m x v (chunk, micro-batch) forwards of a rank run in
groups of pp micro-batches per chunk: virtual micro-batch k is chunk ``(k mod pp v) // pp``,
micro-batch ``(k // pp v) x pp + k mod pp``; backwards take the chunks in reverse
(``v - 1 - (k mod pp v) // pp``). Rank r runs ``min((pp - r - 1) x 2 + (v - 1) x pp, m v)``
warm-up forwards, then one forward / one backward, then the remaining backwards. Every rank
runs the forwards (and the backwards) in the same sequence, so what a rank sends its
neighbour (around the ring: rank pp - 1 chunk c -> rank 0 chunk c + 1) arrives in the order the
neighbour receives it. Needs m to be a multiple of pp (``validate``).

Execution is ``schedules.run_schedule``'s, per chunk: the last virtual stage backward-s its loss
through the engine (DeepSpeed's 1/m), the others the surrogate ``(output * grad_output).sum()``;
DeepSpeed's accumulation boundary is set by hand (True for the rank's last of its m x v
backwards only), so ZeRO reduces and steps once per iteration, that step after the loss is
known on every rank (``schedules.finish_iteration``); the tied embedding lives on
rank 0 chunk 0 and rank pp - 1 chunk v - 1 and is handled as under 1F1B. FP8: the scales of
a chunk's layers are updated per role after each of its forwards / backwards (only the metas
that recorded an amax are updated), so each micro-batch uses one process's scales; TE's weight
cache casts on micro-batch 0, which is each chunk's first forward of the iteration.
"""

from __future__ import annotations

import torch

from megafp8.parallel.pipeline.schedules import (
    FORWARD_ROLES,
    _token_weights,
    backward_step,
    finish_iteration,
    make_pipe,
    pipeline_loss,
    to_device,
)


def interleaved_order(pp: int, rank: int, v: int, m: int) -> list[tuple[str, int, int]]:
    """The interleaved 1F1B order of pipeline rank ``rank``: [("F", chunk, micro-batch), ...,
    ("B", chunk, micro-batch), ...]. ``m`` must be a multiple of ``pp``."""
    if m % pp:
        raise ValueError(
            f"the interleaved schedule needs the micro-batches per iteration ({m}) to be a "
            f"multiple of pipeline_model_parallel_size={pp}"
        )
    total, group = m * v, pp * v

    def event(kind: str, k: int) -> tuple[str, int, int]:
        c = (k % group) // pp
        return (kind, c if kind == "F" else v - 1 - c, (k // group) * pp + k % pp)

    warmup = min((pp - rank - 1) * 2 + (v - 1) * pp, total)
    order = [event("F", k) for k in range(warmup)]
    for i in range(total - warmup):
        order += [event("F", warmup + i), event("B", i)]
    return order + [event("B", k) for k in range(total - warmup, total)]


def interleaved_one_f_one_b(run, train_iter, hooks=None, record: dict | None = None):
    """One iteration in interleaved order; returns (loss, grad norm), the same on every rank.
    ``record`` (a dict) receives this rank's ``events`` and ``max_in_flight``."""
    g, m = run.groups, run.engine.gradient_accumulation_steps()
    order = interleaved_order(g.pp, g.coords.pp, len(run.model.chunks), m)
    return run_interleaved(run, order, [next(train_iter) for _ in range(m)], hooks, record)


def run_interleaved(run, order, batches, hooks=None, record=None):
    """Execute ``order`` ((F|B, chunk, micro-batch) events) on this rank's chunks."""
    eng, g, m, chunks = run.engine, run.groups, len(batches), run.model.chunks
    last = chunks[-1].stage.last  # this rank holds the last virtual stage (and the loss)
    batches = [to_device(b, run.device) for b in batches]
    per_token = run.cfg.train.calculate_per_token_loss
    weights = counts = n_total = None
    if per_token and last:
        weights, counts, n_total = _token_weights(batches, g, m)
    pipe, pending = make_pipe(run, ring=True), {}
    total, events, in_flight, peak = torch.zeros((), device=run.device), [], 0, 0
    n_backward, done = sum(kind == "B" for kind, _, _ in order), 0
    for kind, c, j in order:
        events.append((kind, c, j))
        st = chunks[c].stage
        if kind == "F":
            b, x = batches[j], None if st.first else pipe.recv_forward()
            run.backend.microbatch(j)  # j = 0 is this chunk's first forward of the iteration
            with run.backend.autocast():
                y = eng(b["tokens"], b["labels"], b["loss_mask"], hidden=x, chunk=c)
            run.backend.update(FORWARD_ROLES)
            if st.last:
                total += y.detach().float() * (counts[j] if per_token else 1.0)
                y = y * weights[j] if per_token else y
            else:
                pipe.send_forward(y)
            pending[(c, j)] = (x, y)
            in_flight += 1
            peak = max(peak, in_flight)
            continue
        x, y = pending.pop((c, j))
        done += 1
        eng.set_gradient_accumulation_boundary(done == n_backward)
        backward_step(run, pipe, x, y, j == m - 1, chunks[c], hooks, step=done < n_backward)
        in_flight -= 1
    pipe.drain()
    if record is not None:
        record.update(events=events, max_in_flight=peak)
    # the tied embedding: rank 0 chunk 0 holds it, rank pp - 1 chunk v - 1 the copy
    tied = chunks[0] if g.coords.pp == 0 else chunks[-1]
    return finish_iteration(run, last, total, n_total, m, hooks, tied_model=tied)


@torch.no_grad()
def forward_only_chunks(run, batches) -> float:
    """Evaluation: each batch through chunk 0, ..., v - 1 of every rank in turn (around the
    ring); the DP-mean loss, known on every rank."""
    chunks = run.model.chunks
    pipe = make_pipe(run, ring=True)
    total = torch.zeros((), device=run.device)
    for b in batches:
        b = to_device(b, run.device)
        for c, chunk in enumerate(chunks):
            st = chunk.stage
            x = None if st.first else pipe.recv_forward()
            with run.backend.autocast():
                y = run.engine(b["tokens"], b["labels"], b["loss_mask"], hidden=x, chunk=c)
            if st.last:
                total += y.float()
            else:
                pipe.send_forward(y)
    pipe.drain()
    return pipeline_loss(run, chunks[-1].stage.last, total, None, max(len(batches), 1))
