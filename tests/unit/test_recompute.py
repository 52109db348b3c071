"""Activation recompute (``model/recompute.py``) changes memory, never results.

One process, the schedule's gradient accumulation over 3 micro-batches with a plain engine:
with every granularity and method, the loss, every weight gradient, the FP8 scaling state and
the RNG streams afterwards are bit-identical to the run without recompute (fp32 on the CPU and
the exact FP8 emulation: the recomputed forward repeats the same ops on the same values, with
dropout drawing the same numbers and FP8 casting with the same scales). The activations kept for
the backward shrink: full < selective < none.
"""

from types import SimpleNamespace

import pytest
import torch

from megafp8.cli import parse_args
from megafp8.model.recompute import Recompute
from megafp8.validate import validate
from tests.helpers.engine import PlainEngine
from tests.helpers.tiny import tiny_config


def _cfg(fp8=None, layers=3, **model):
    return tiny_config(
        model=dict(num_layers=layers, num_query_groups=2, hidden_dropout=0.1,
                   attention_dropout=0.1, swiglu=True, position_embedding_type="rope",
                   **model),
        fp8=dict(fp8_format="hybrid", fp8_amax_history_len=4, fp8_recipe=fp8) if fp8 else {},
    )  # fmt: skip


def _build(cfg):
    from megafp8.fp8.backend import build_backend
    from megafp8.model.gpt import GPTModel
    from megafp8.parallel.groups import ParallelGroups
    from megafp8.parallel.random import model_parallel_seed

    groups = ParallelGroups.single()
    rng = model_parallel_seed(cfg.train.seed, 0, 0)
    backend = build_backend(cfg.fp8, amax_group=groups.tp_dp_group, tp_group=groups.tp_group)
    model = GPTModel(cfg, backend=backend, groups=groups, vocab_size=cfg.model.vocab_size, rng=rng)
    return SimpleNamespace(cfg=cfg, groups=groups, model=model, engine=PlainEngine(model, 3),
                           backend=backend, rng=rng, device=torch.device("cpu"))  # fmt: skip


def _batches(cfg, m=3):
    g = torch.Generator().manual_seed(5)
    b, s = cfg.train.micro_batch_size, cfg.model.seq_length
    out = []
    for _ in range(m):
        t = torch.randint(0, cfg.model.vocab_size, (b, s + 1), generator=g)
        out.append({"tokens": t[:, :-1], "labels": t[:, 1:], "loss_mask": torch.ones(b, s)})
    return out


def _iterations(cfg, n=2):
    """n iterations of 3 micro-batches; returns losses, gradients, FP8 state, RNG state."""
    from megafp8.parallel.pipeline.schedules import no_pipelining

    run = _build(cfg)
    losses = []
    for _ in range(n):
        for p in run.model.parameters():
            p.grad = None
        losses.append(no_pipelining(run, iter(_batches(cfg)))[0])
    grads = {k: p.grad.clone() for k, p in run.model.named_parameters()}
    return losses, grads, run.backend.state_dict(), run.rng.state_dict()


RECOMPUTE = {
    "full-uniform-1": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=1),
    "full-uniform-2": dict(recompute_granularity="full", recompute_method="uniform",
                           recompute_num_layers=2),  # groups of 2 and 1
    "full-block-2": dict(recompute_granularity="full", recompute_method="block",
                         recompute_num_layers=2),  # layers 0, 1 recomputed, 2 kept
    "selective-core_attn": dict(recompute_granularity="selective"),
    "selective-all": dict(recompute_granularity="selective",
                          recompute_modules=("core_attn", "mlp", "layernorm")),
}  # fmt: skip


@pytest.mark.parametrize("fp8", [None, "delayed", "tensorwise"])
@pytest.mark.parametrize("case", list(RECOMPUTE))
def test_recompute_is_bit_identical(case, fp8):
    ref = _iterations(_cfg(fp8))
    got = _iterations(_cfg(fp8, **RECOMPUTE[case]))
    assert got[0] == ref[0]
    assert got[1].keys() == ref[1].keys()
    for k, g in got[1].items():
        assert torch.equal(g, ref[1][k]), k
    if fp8:  # each forward recorded once: same histories, same scales
        assert got[2].keys() == ref[2].keys() and got[2]
        for k, v in got[2].items():
            assert torch.equal(v["scale"], ref[2][k]["scale"]), k
            assert torch.equal(v["amax_history"], ref[2][k]["amax_history"]), k
        assert any(float(v["scale"]) != 1.0 for v in got[2].values())
    # the streams moved on exactly as without recompute (dropout drew once per forward)
    for name, st in got[3]["streams"].items():
        assert torch.equal(st["cpu"], ref[3]["streams"][name]["cpu"]), name
    assert torch.equal(got[3]["default"]["cpu"], ref[3]["default"]["cpu"])


def _saved_bytes(cfg) -> int:
    """Bytes of the distinct tensors autograd keeps for the backward of one forward."""
    run = _build(cfg)
    b = _batches(cfg, 1)[0]
    seen = {}

    def pack(t):
        seen[t.untyped_storage().data_ptr()] = t.untyped_storage().nbytes()
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        run.model(b["tokens"], b["labels"], b["loss_mask"])
    return sum(seen.values())


def test_recompute_keeps_fewer_activations():
    kw = dict(seq_length=128, layers=4)
    none = _saved_bytes(_cfg(**kw))
    sel = _saved_bytes(_cfg(**kw, **RECOMPUTE["selective-all"]))
    full = _saved_bytes(_cfg(**kw, recompute_granularity="full", recompute_method="uniform",
                             recompute_num_layers=4))  # fmt: skip
    assert full < sel < none, (full, sel, none)


def test_layer_groups():
    def groups(method, k, n):
        cfg = _cfg(recompute_granularity="full", recompute_method=method, recompute_num_layers=k)
        return [(list(r), c) for r, c in Recompute(cfg, None).layer_groups(n)]

    assert groups("uniform", 2, 5) == [([0, 1], True), ([2, 3], True), ([4], True)]
    assert groups("block", 2, 5) == [([0], True), ([1], True), ([2, 3, 4], False)]
    assert groups("block", 3, 3) == [([0], True), ([1], True), ([2], True)]
    none = Recompute(_cfg(), None).layer_groups(3)
    assert [(list(r), c) for r, c in none] == [([0, 1, 2], False)]


def _errors(argv, world=1):
    cfg = parse_args(["--mock-data", *argv])
    with pytest.raises(ValueError) as e:
        validate(cfg, world)
    return str(e.value)


def test_bad_recompute_flags_are_one_line_errors():
    assert "needs recompute_method" in _errors(["--recompute-granularity", "full"])
    assert "need recompute_granularity='full'" in _errors(
        ["--recompute-granularity", "selective", "--recompute-method", "uniform"]
    )
    msg = _errors(["--num-layers", "4", "--pipeline-model-parallel-size", "2",
                   "--recompute-granularity", "full", "--recompute-method", "block",
                   "--recompute-num-layers", "3"], world=2)  # fmt: skip
    assert "recompute_num_layers=3 must be in [1, 2]" in msg
    assert "not in" in _errors(["--recompute-modules", "core_attn", "moe_act"])


def test_megatron_recompute_flags():
    cfg = parse_args(["--mock-data", "--recompute-activations"])
    assert cfg.model.recompute_granularity == "selective"
    cfg = parse_args(["--mock-data", "--recompute-granularity", "full", "--recompute-method",
                      "uniform", "--recompute-num-layers", "1"])  # fmt: skip
    validate(cfg, 1)
    assert (cfg.model.recompute_method, cfg.model.recompute_num_layers) == ("uniform", 1)
