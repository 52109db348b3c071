"""Per-rank RNG streams.

The default stream is seeded with ``seed + 100 * pp_rank``: identical across TP and DP ranks, so
dropout outside TP regions (on the replicated residual stream) agrees across TP ranks. The
``tensor-parallel`` stream is seeded with ``seed + 2718 + tp_rank``: dropout inside TP regions
(on this
rank's heads) differs across TP ranks, as a single process's dropout differs across heads.
Under sequence parallelism the residual stream is itself sharded, so its dropout uses the TP stream.
"""

from __future__ import annotations

import contextlib
import random

import numpy as np
import torch

TP_STREAM = "tensor-parallel"


def _get_state() -> dict:
    """The CPU and (where there is a GPU) the current device's generator states. The CUDA state
    is read even before CUDA is initialized: ``torch.manual_seed`` seeds the GPU lazily, so a
    stream seeded then and not saved would leave the GPU on that stream's seed."""
    st = {"cpu": torch.get_rng_state()}
    if torch.cuda.is_available():
        st["cuda"] = torch.cuda.get_rng_state()
    return st


def _set_state(st: dict) -> None:
    torch.set_rng_state(st["cpu"])
    if "cuda" in st:
        torch.cuda.set_rng_state(st["cuda"])


class RngTracker:
    """Named RNG streams; ``with tracker.fork(name):`` runs code on that stream."""

    def __init__(self):
        self.states: dict[str, dict] = {}

    def add(self, name: str, seed: int) -> None:
        saved = _get_state()
        torch.manual_seed(seed)
        self.states[name] = _get_state()
        _set_state(saved)

    @contextlib.contextmanager
    def fork(self, name: str = TP_STREAM):
        if name not in self.states:
            raise KeyError(f"RNG stream {name!r} was never seeded")
        saved = _get_state()
        _set_state(self.states[name])
        try:
            yield
        finally:
            self.states[name] = _get_state()
            _set_state(saved)

    def recompute_contexts(self):
        """(forward, recompute) context managers for one checkpointed region: the first keeps
        the named streams as they are when the region's forward starts; the second runs the
        recomputation from those states and puts the current ones back after it, so dropout in
        the recomputed region draws what the first forward drew and the streams move on once."""
        kept: dict[str, dict] = {}

        @contextlib.contextmanager
        def forward():
            kept.update(self.states)  # each entry is replaced, never mutated, by fork()
            yield

        @contextlib.contextmanager
        def recompute():
            now, self.states = self.states, dict(kept)
            try:
                yield
            finally:
                self.states = now

        return forward(), recompute()

    def state_dict(self) -> dict:
        return {
            "streams": {k: dict(v) for k, v in self.states.items()},
            "default": _get_state(),
            "python": random.getstate(),
            "numpy": np.random.get_state(),
        }

    def load_state_dict(self, sd: dict) -> None:
        self.states = {k: dict(v) for k, v in sd["streams"].items()}
        _set_state(sd["default"])
        random.setstate(sd["python"])
        np.random.set_state(sd["numpy"])


def model_parallel_seed(seed: int, tp_rank: int, pp_rank: int) -> RngTracker:
    """Seed the default stream and the TP stream as described above; return the tracker."""
    default_seed = seed + 100 * pp_rank
    random.seed(default_seed)
    np.random.seed(default_seed % 2**32)
    torch.manual_seed(default_seed)
    tracker = RngTracker()
    tracker.add(TP_STREAM, default_seed + 2718 + tp_rank)
    return tracker
