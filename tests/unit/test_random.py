"""megafp8.parallel.random: the default and tensor-parallel RNG streams.

Seeds (the module's docstring): default stream = seed + 100 * pp_rank (torch, python, numpy),
TP stream = seed + 100 * pp_rank + 2718 + tp_rank. The expected draws below come from seeding
torch/random/numpy directly with those numbers.
"""

import random

import numpy as np
import pytest
import torch

from megafp8.parallel.random import TP_STREAM, RngTracker, model_parallel_seed


@pytest.fixture(autouse=True)
def _keep_global_rng():
    """These tests reseed the process's generators: put them back for the tests that follow."""
    states = torch.get_rng_state(), random.getstate(), np.random.get_state()
    yield
    torch.set_rng_state(states[0])
    random.setstate(states[1])
    np.random.set_state(states[2])


def torch_draw(seed: int, n: int = 8) -> torch.Tensor:
    g = torch.Generator()
    g.manual_seed(seed)
    return torch.rand(n, generator=g)


def test_default_and_tp_streams_use_the_documented_seeds():
    """Seed 5, tp rank 1, pp rank 2: default stream seeded 205 (torch, python and numpy),
    TP stream 205 + 2718 + 1 = 2924."""
    tracker = model_parallel_seed(5, tp_rank=1, pp_rank=2)
    assert torch.equal(torch.rand(8), torch_draw(205))
    assert random.random() == random.Random(205).random()
    assert np.random.rand() == np.random.RandomState(205).rand()
    with tracker.fork(TP_STREAM):
        assert torch.equal(torch.rand(8), torch_draw(2924))


def test_seeding_is_reproducible():
    """The same (seed, tp, pp) gives the same draws on both streams, every time."""
    draws = []
    for _ in range(2):
        tracker = model_parallel_seed(11, tp_rank=3, pp_rank=0)
        d = torch.rand(16)
        with tracker.fork():
            t = torch.randn(16)
        draws.append((d, t))
    assert torch.equal(draws[0][0], draws[1][0]) and torch.equal(draws[0][1], draws[1][1])


def _streams(seed, tp_rank, pp_rank):
    tracker = model_parallel_seed(seed, tp_rank, pp_rank)
    default = torch.rand(64)
    with tracker.fork():
        tp = torch.rand(64)
    return default, tp


def test_tp_stream_differs_across_tp_ranks_default_agrees():
    """Dropout outside TP regions must agree across TP ranks (same default stream); inside TP
    regions each rank's heads must get their own mask (different TP streams). Across pipeline
    stages the default stream differs too."""
    (d0, t0), (d1, t1), (d2, t2) = (_streams(7, r, 0) for r in range(3))
    assert torch.equal(d0, d1) and torch.equal(d1, d2)
    assert not torch.equal(t0, t1) and not torch.equal(t1, t2) and not torch.equal(t0, t2)
    assert not torch.equal(t0, d0)  # the TP stream is not the default one
    dpp, _ = _streams(7, 0, 1)
    assert not torch.equal(dpp, d0)


def test_fork_restores_the_outer_state_and_continues_its_own():
    """Draws inside ``fork`` neither consume nor change the default stream; the TP stream resumes
    where its previous fork left it (two forks of 4 draws = one run of 8 draws)."""
    tracker = model_parallel_seed(3, tp_rank=0, pp_rank=0)
    with tracker.fork():
        a = torch.rand(4)
    outer = torch.rand(8)
    with tracker.fork():
        b = torch.rand(4)
    assert torch.equal(outer, torch_draw(3))  # as if no fork had happened
    assert torch.equal(torch.cat([a, b]), torch_draw(3 + 2718))


def test_fork_restores_on_exception_and_rejects_unknown_streams():
    tracker = model_parallel_seed(3, tp_rank=0, pp_rank=0)
    with pytest.raises(RuntimeError, match="boom"), tracker.fork():
        torch.rand(100)
        raise RuntimeError("boom")
    assert torch.equal(torch.rand(8), torch_draw(3))
    with pytest.raises(KeyError, match="never seeded"), tracker.fork("nope"):
        pass


def test_add_does_not_touch_the_current_stream():
    torch.manual_seed(9)
    tracker = RngTracker()
    tracker.add("extra", 1234)
    assert torch.equal(torch.rand(8), torch_draw(9))
    with tracker.fork("extra"):
        assert torch.equal(torch.rand(8), torch_draw(1234))


def _draw_all(tracker):
    with tracker.fork():
        tp = torch.rand(6)
    return torch.rand(6), tp, random.random(), np.random.rand(3)


def test_state_dict_round_trip():
    """state_dict captures every stream (default torch, TP, python, numpy) mid-sequence; loading
    it, even into a tracker seeded differently, replays the same draws."""
    tracker = model_parallel_seed(21, tp_rank=1, pp_rank=0)
    _draw_all(tracker)  # move every stream off its seed
    sd = tracker.state_dict()
    first = _draw_all(tracker)
    other = model_parallel_seed(99, tp_rank=0, pp_rank=3)
    assert not torch.equal(_draw_all(other)[1], first[1])
    other.load_state_dict(sd)
    again = _draw_all(other)
    assert torch.equal(first[0], again[0]) and torch.equal(first[1], again[1])
    assert first[2] == again[2] and np.array_equal(first[3], again[3])
    # loading twice gives the same draws: the saved dict was not consumed by the first load
    tracker.load_state_dict(sd)
    third = _draw_all(tracker)
    assert torch.equal(first[0], third[0]) and torch.equal(first[1], third[1])
