"""parallel/grad_in_place.py: the word embedding's gradient rows added into ``.grad`` in place
give autograd's dense gradient and its accumulation (fp32, the same order: bit for bit); the
output layer's weight gradient GEMM adding into ``.grad`` gives autograd's accumulation to fp32
rounding; the run turns them on exactly where ``.grad`` accumulates out of every hook's sight
(the embedding with ``--embedding-grad-in-place``, the output layer under gradient accumulation
fusion); training with them equals training without, at TP 1 and 2 under ZeRO-1."""

import pytest
import torch
import torch.nn.functional as F

from megafp8.parallel import grad_in_place as E
from tests.helpers.dist import run_distributed
from tests.helpers.tiny import tiny_config


def _ids(gen, shape, vocab):
    ids = torch.randint(0, vocab, shape, generator=gen)
    ids.view(-1)[: ids.numel() // 3] = 7  # a token a third of the batch repeats
    return ids


@pytest.mark.parametrize("shape", [(1,), (3, 7), (2, 40)])
def test_rows_added_equal_the_dense_gradient_and_its_add(shape):
    gen = torch.Generator().manual_seed(len(shape))
    vocab, h = 50, 24
    ids = _ids(gen, shape, vocab)
    g = torch.randn(*shape, h, generator=gen)
    grad = torch.randn(vocab, h, generator=gen)
    dense = torch.ops.aten.embedding_backward(g, ids, vocab, -1, False, False)
    mine = grad.clone()
    E.add_rows(mine, ids, g)
    assert torch.equal(mine, grad + dense)
    untouched = torch.ones(vocab, dtype=torch.bool)
    untouched[ids.view(-1)] = False
    assert torch.equal(mine[untouched], grad[untouched])


def test_runs_of_equal_ids_end_where_the_next_id_starts():
    s, perm, end, start = E._runs(torch.tensor([[4, 1, 4], [1, 9, 4]]))
    assert s.tolist() == [1, 1, 4, 4, 4, 9]
    assert perm.tolist() == [1, 3, 0, 2, 5, 4]  # stable: within an id, position order
    assert end.tolist() == [2, 2, 5, 5, 5, 6]
    assert start.tolist() == [True, False, True, False, False, True]


def test_micro_batches_accumulate_as_autograd_does(monkeypatch):
    """Three micro-batches: the first hands autograd its dense gradient (``.grad`` is made from
    it), the next two add rows in place; ``.grad`` equals F.embedding's accumulation."""
    calls = []
    plain = E.add_rows
    monkeypatch.setattr(E, "add_rows", lambda *a: calls.append(1) or plain(*a))
    gen = torch.Generator().manual_seed(3)
    w0 = torch.randn(40, 16, generator=gen)
    ref, mine = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    for mb in range(3):
        ids, t = _ids(gen, (2, 9), 40), torch.randn(2, 9, 16, generator=gen)
        (F.embedding(ids, ref) * t).sum().backward()
        (E.embedding(ids, mine, True) * t).sum().backward()
        assert len(calls) == mb
        assert torch.equal(mine.grad, ref.grad)
    with torch.no_grad():  # no autograd: the plain lookup
        assert torch.equal(E.embedding(ids, mine, True), F.embedding(ids, mine))


@pytest.mark.parametrize(
    "optim,train,on",
    [
        (dict(zero_stage=1), {}, True),
        (dict(zero_stage=2), {}, False),
        (dict(zero_stage=1, overlap_grad_reduce=True), {}, False),
        (dict(zero_stage=1, accumulate_allreduce_grads_in_fp32=True), dict(bf16=True), False),
        (dict(zero_stage=1), dict(bf16=True), True),
    ],
)
def test_in_place_only_where_no_hook_sees_each_micro_batch(optim, train, on):
    from megafp8.optim.zero import grads_accumulate_in_param

    assert grads_accumulate_in_param(tiny_config(optim=optim, train=train)) is on


def test_output_layer_accumulates_as_autograd_does():
    """Three micro-batches through the output layer and, tied, the embedding: the first hands
    autograd fresh gradients, the next two add in place; ``.grad`` and the input gradients equal
    autograd's to fp32 rounding (the GEMM adds ``.grad`` inside its sum, autograd after it)."""
    gen = torch.Generator().manual_seed(5)
    w0 = torch.randn(40, 16, generator=gen)
    ref, mine = torch.nn.Parameter(w0.clone()), torch.nn.Parameter(w0.clone())
    for _ in range(3):
        ids, t = _ids(gen, (2, 9), 40), torch.randn(2, 9, 40, generator=gen)
        x0 = torch.randn(2, 9, 16, generator=gen)
        xa, xb = x0.clone().requires_grad_(), x0.clone().requires_grad_()
        ((F.linear(xa + F.embedding(ids, ref), ref)) * t).sum().backward()
        ((E.linear(xb + E.embedding(ids, mine, True), mine, True)) * t).sum().backward()
        torch.testing.assert_close(mine.grad, ref.grad, rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(xb.grad, xa.grad, rtol=0, atol=0)  # the same GEMM
    with torch.no_grad():
        assert torch.equal(E.linear(x0, mine, True), F.linear(x0, mine))


def _train(cfg, in_place: bool):
    import megafp8.build as B
    import megafp8.parallel.grad_in_place as EG
    import megafp8.train as T

    calls = {"rows": 0, "gemm": 0}
    plain_rows, plain_bwd = EG.add_rows, EG._Linear.backward

    def rows(*a):
        calls["rows"] += 1
        return plain_rows(*a)

    def bwd(ctx, g):
        calls["gemm"] += ctx.weight.grad is not None
        return plain_bwd(ctx, g)

    EG.add_rows = rows
    EG._Linear.backward = staticmethod(bwd)
    B.grads_accumulate_in_param = lambda cfg: in_place  # build_run reads it
    hist = [(r["lm loss"], r["grad norm"]) for r in T.train(cfg)]
    return hist, calls


@pytest.mark.parametrize(
    "tp,untie,fusion,emb",
    [
        (1, True, False, True),
        (2, True, False, True),
        (1, True, True, True),
        (2, False, True, True),
        (1, False, True, False),
    ],
)
def test_training_with_gradients_added_in_place_equals_autograds(tp, untie, fusion, emb):
    """ZeRO-1, dp 2 (tp 1) or tp 2 (dp 1), two micro-batches per rank and iteration, five
    iterations. With ``embedding_grad_in_place`` and without gradient accumulation fusion only
    the embedding's rows go in place: the same sums in the same order, so the history is equal
    bit for bit. With fusion the output layer's GEMM adds into ``.grad`` too (and, tied, the
    embedding's gradient joins in another order): fp32 rounding apart. With
    ``--no-embedding-grad-in-place`` the embedding keeps autograd's gradient."""
    gbs = 8 if tp == 1 else 4  # two micro-batches of 2 on every data-parallel rank
    cfg = tiny_config(
        parallel=dict(tensor_model_parallel_size=tp),
        model=dict(untie_embeddings_and_output_weights=untie),
        train=dict(global_batch_size=gbs),
        fp8=dict(gradient_accumulation_fusion=fusion),
        optim=dict(embedding_grad_in_place=emb),
    )
    mine, calls = run_distributed(_train, 2, cfg, True)[0]
    ref, none = run_distributed(_train, 2, cfg, False)[0]
    # the second micro-batch of each iteration
    assert calls == {"rows": 5 if emb else 0, "gemm": 5 if fusion else 0}
    assert none == {"rows": 0, "gemm": 0}
    assert len(mine) == 5
    if not fusion:
        assert mine == ref
    else:
        for (la, ga), (lb, gb) in zip(mine, ref, strict=True):
            assert la == pytest.approx(lb, rel=1e-5)
            assert ga == pytest.approx(gb, rel=1e-5)
