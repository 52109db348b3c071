"""Token dispatch for expert parallelism: routed tokens go to the ranks that hold their experts,
and the experts' outputs come back.

The E experts of a layer are split over the ``ep`` ranks of the expert-parallel group (inside
data parallelism): rank r holds experts [r L, (r + 1) L), L = E / ep. Each rank routes its own
tokens; the capacity (if any) drops assignments on that rank before anything moves, so the drops
are those of one process running the same micro-batch.

``alltoall`` (Megatron's default): the kept assignments, sorted by expert, are exchanged with one
all-to-all of the rows (after one of the counts); each rank regroups what it received by local
expert, runs its experts, and a second all-to-all returns the rows to where they came from.
``allgather``: every rank all-gathers the group's tokens, routing and probabilities, runs its
experts on the assignments that are theirs, weights them, and a reduce-scatter sums the partial
outputs back onto each rank's own tokens. With ``ep`` = 1 both move nothing.

Both give every expert's rows in source-rank order, within a source in token order (then slot),
so an expert sees exactly the rows one process would give it for the same tokens.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megafp8.parallel import mappings as M


class _AllToAll(torch.autograd.Function):
    """Rows of ``x`` split by ``send`` go to the group's ranks; ``recv`` rows come from each.
    Backward: the same exchange in reverse."""

    @staticmethod
    def forward(ctx, x, group, recv: list[int], send: list[int]):
        ctx.group, ctx.recv, ctx.send = group, recv, send
        return _exchange(x, group, recv, send)

    @staticmethod
    def backward(ctx, g):
        return _exchange(g, ctx.group, ctx.send, ctx.recv), None, None, None


def _exchange(x: torch.Tensor, group, recv: list[int], send: list[int]) -> torch.Tensor:
    x = x.contiguous()
    out = x.new_empty((sum(recv), *x.shape[1:]))
    dist.all_to_all_single(out, x, recv, send, group=group)
    return out


def all_to_all(x: torch.Tensor, group, recv: list[int], send: list[int]) -> torch.Tensor:
    return x if M.world(group) == 1 else _AllToAll.apply(x, group, recv, send)


class Dispatch:
    """What ``combine`` needs to undo one ``dispatch``."""

    def __init__(self, **kw):
        self.__dict__.update(kw)


class AllToAllDispatcher:
    def __init__(self, group, num_experts: int):
        self.group, self.ep = group, M.world(group)
        self.e, self.local = num_experts, num_experts // self.ep

    def dispatch(self, xt, probs, idx, keep):
        """xt [T, h], probs/idx/keep [T, k] -> (rows [R, h] grouped by local expert, rows per
        local expert [L], the state for ``combine``)."""
        tok, slot = keep.nonzero(as_tuple=True)  # kept assignments, token-major
        exp = idx[tok, slot]
        order = torch.argsort(exp, stable=True)  # by expert, then token order
        tok, slot, exp = tok[order], slot[order], exp[order]
        counts = torch.bincount(exp, minlength=self.e)  # [E] assignments sent to each expert
        if self.ep == 1:
            return xt[tok], counts.tolist(), Dispatch(tok=tok, slot=slot, probs=probs)
        recv_counts = torch.empty_like(counts)  # [ep * L]: from source s for local expert j
        dist.all_to_all_single(recv_counts, counts, group=self.group)
        send = counts.view(self.ep, self.local).sum(1).tolist()
        per_src = recv_counts.view(self.ep, self.local)
        recv = per_src.sum(1).tolist()
        rows = all_to_all(xt[tok], self.group, recv, send)  # by source, then local expert
        local = torch.arange(self.local, device=xt.device).repeat(self.ep)
        lexp = torch.repeat_interleave(local, per_src.reshape(-1))  # local expert of each row
        perm = torch.argsort(lexp, stable=True)  # by local expert, then source
        st = Dispatch(tok=tok, slot=slot, probs=probs, perm=perm, send=send, recv=recv)
        return rows[perm], per_src.sum(0).tolist(), st

    def combine(self, y, st, out):
        """y [R, h] (local experts' rows, as dispatched) -> ``out`` [T, h] plus the
        probability-weighted outputs of every kept assignment."""
        if self.ep > 1:
            back = torch.empty_like(st.perm)
            back[st.perm] = torch.arange(len(st.perm), device=st.perm.device)
            y = all_to_all(y[back], self.group, st.send, st.recv)  # rows in sent order
        w = st.probs[st.tok, st.slot].unsqueeze(-1).to(y.dtype)
        return out.index_add(0, st.tok, y * w)


class AllGatherDispatcher:
    def __init__(self, group, num_experts: int):
        self.group, self.ep = group, M.world(group)
        self.e, self.local = num_experts, num_experts // self.ep
        self.first = M.rank_in(group) * self.local  # this rank's first global expert

    def dispatch(self, xt, probs, idx, keep):
        g = self.group
        if self.ep > 1:
            xt = M.gather_from_sequence_parallel_region(xt, g)  # [ep T, h]; grads summed back
            probs = M.gather_from_sequence_parallel_region(probs, g)
            idx = M._all_gather(idx, g, 0)
            keep = M._all_gather(keep.to(torch.uint8), g, 0).bool()
        mine = keep & (idx >= self.first) & (idx < self.first + self.local)
        tok, slot = mine.nonzero(as_tuple=True)
        exp = idx[tok, slot] - self.first
        order = torch.argsort(exp, stable=True)
        tok, slot = tok[order], slot[order]
        counts = torch.bincount(exp, minlength=self.local).tolist()
        return xt[tok], counts, Dispatch(tok=tok, slot=slot, probs=probs, rows=xt.shape[0])

    def combine(self, y, st, out):
        w = st.probs[st.tok, st.slot].unsqueeze(-1).to(y.dtype)
        if self.ep == 1:
            return out.index_add(0, st.tok, y * w)
        full = y.new_zeros(st.rows, y.shape[-1]).index_add(0, st.tok, y * w)  # [ep T, h]
        return out + M.reduce_scatter_to_sequence_parallel_region(full, self.group)


def make_dispatcher(kind: str, group, num_experts: int):
    cls = {"alltoall": AllToAllDispatcher, "allgather": AllGatherDispatcher}[kind]
    return cls(group, num_experts)
