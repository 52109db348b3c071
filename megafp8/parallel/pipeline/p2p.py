"""Point-to-point transfers between neighbouring pipeline stages, on the explicit pp group.

Stage k sends each micro-batch's output activation to stage k+1 and receives its gradient back.
Shapes are known ahead: ``[s/tp (under SP) or s, micro_batch, hidden]`` in the parameters'
dtype, so no shape is ever exchanged. Sends are asynchronous (``isend`` through
``batch_isend_irecv``) and waited for at the end of the iteration (``Pipe.drain``); receives
are waited for at once. With every send non-blocking, any per-rank order that respects the data
dependencies (1F1B does) cannot deadlock: a rank only ever waits for a tensor that its neighbour
sends without waiting on anything else first. Tags keep the two directions and the tied-embedding
gradient apart where two of them share a pair of ranks and a group.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

TAG_ACTIVATION, TAG_GRAD, TAG_TIED = 1, 2, 3


class Pipe:
    """This rank's links to the previous and next stage of its pipeline. With ``ring`` (the
    interleaved schedule) the last rank's next is the first rank and the first rank's previous
    the last: virtual stage ``c x pp + pp - 1`` (rank pp - 1, chunk c) feeds ``(c + 1) x pp``
    (rank 0, chunk c + 1). Each rank sends its chunks' outputs in one order (the same on every
    rank) and its neighbour receives them in that order, so one tag per direction suffices."""

    def __init__(self, groups, shape: tuple[int, ...], dtype, device, ring: bool = False):
        pp_ranks = groups.ranks["pp"]  # global ranks of this pipeline, stage order
        k, n = groups.coords.pp, len(pp_ranks)
        self.group, self.shape, self.dtype, self.device = groups.pp_group, shape, dtype, device
        self.prev = pp_ranks[(k - 1) % n] if k > 0 or ring else None
        self.next = pp_ranks[(k + 1) % n] if k + 1 < n or ring else None
        self.pending: list = []  # send requests (with their tensors, kept alive until done)

    def _recv(self, src: int, tag: int) -> torch.Tensor:
        buf = torch.empty(self.shape, dtype=self.dtype, device=self.device)
        op = dist.P2POp(dist.irecv, buf, src, self.group, tag)
        for req in dist.batch_isend_irecv([op]):
            req.wait()
        return buf

    def _send(self, x: torch.Tensor, dst: int, tag: int) -> None:
        if tuple(x.shape) != self.shape or x.dtype != self.dtype:
            raise RuntimeError(
                f"pipeline send of {tuple(x.shape)} {x.dtype}, expected {self.shape} {self.dtype}"
            )
        x = x.detach().contiguous()
        op = dist.P2POp(dist.isend, x, dst, self.group, tag)
        self.pending.append((dist.batch_isend_irecv([op]), x))

    def recv_forward(self) -> torch.Tensor:
        """The previous stage's output for the next micro-batch (requires grad)."""
        return self._recv(self.prev, TAG_ACTIVATION).requires_grad_()

    def send_forward(self, y: torch.Tensor) -> None:
        self._send(y, self.next, TAG_ACTIVATION)

    def recv_backward(self) -> torch.Tensor:
        """The gradient of this stage's output, from the next stage."""
        return self._recv(self.next, TAG_GRAD)

    def send_backward(self, g: torch.Tensor) -> None:
        self._send(g, self.prev, TAG_GRAD)

    def drain(self) -> None:
        """Wait for every send of this iteration."""
        for reqs, _ in self.pending:
            for r in reqs:
                r.wait()
        self.pending.clear()


def send_tied_grad(g: torch.Tensor, dst: int, group) -> list:
    """Last stage -> first stage: the tied output layer's gradient (asynchronous)."""
    op = dist.P2POp(dist.isend, g.contiguous(), dst, group, TAG_TIED)
    return dist.batch_isend_irecv([op])


def recv_tied_grad(like: torch.Tensor, src: int, group) -> torch.Tensor:
    buf = torch.empty_like(like)
    for req in dist.batch_isend_irecv([dist.P2POp(dist.irecv, buf, src, group, TAG_TIED)]):
        req.wait()
    return buf
