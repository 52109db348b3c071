"""Documents inside a sample (``--reset-position-ids``, ``--reset-attention-mask``): the positions
and the mask against hand-worked examples, and the model on a packed sample against the same
model run on each document alone (logits and weight gradients), on both RoPE and learned
positions, multi-head and grouped-query; the te backend's per-sample RoPE path (torch code,
runnable without Transformer Engine) against the torch backend's."""

import pytest
import torch
import torch.nn.functional as F

from megafp8.model.documents import document_ids, document_mask, document_positions
from tests.helpers.tiny import tiny_config

E = 255  # the EOD id of these tests (vocab 256)

# fp32 on the CPU: the packed and the lone runs do the same arithmetic per token, but GEMMs of
# other row counts and attention over other key counts may sum in another order (~1e-7 relative
# per sum), grown through two blocks and the backward to ~1e-5 at most. A wrong mask or position
# moves the logits by O(1e-2) and more (asserted below).
TOL = dict(rtol=1e-4, atol=1e-5)


def test_positions_ids_and_mask_by_hand():
    t = torch.tensor([[1, E, 2, 3, E, 4], [E, E, 5, 6, 7, E]])
    assert document_ids(t, E).tolist() == [[0, 0, 1, 1, 1, 2], [0, 1, 2, 2, 2, 2]]
    assert document_positions(t, E).tolist() == [[0, 1, 0, 1, 2, 0], [0, 0, 0, 1, 2, 3]]
    m = document_mask(t, E)
    assert m.shape == (2, 1, 6, 6) and m.dtype == torch.bool
    want0 = [  # row j: the keys query j sees
        [1, 0, 0, 0, 0, 0],
        [1, 1, 0, 0, 0, 0],
        [0, 0, 1, 0, 0, 0],
        [0, 0, 1, 1, 0, 0],
        [0, 0, 1, 1, 1, 0],
        [0, 0, 0, 0, 0, 1],
    ]
    assert m[0, 0].int().tolist() == want0
    assert m[1, 0, 3].int().tolist() == [0, 0, 1, 1, 0, 0]
    assert m[1, 0, 1].int().tolist() == [0, 1, 0, 0, 0, 0]  # an EOD right after an EOD


def test_no_eod_gives_the_plain_causal_layout():
    t = torch.arange(1, 9).view(1, 8)
    assert document_positions(t, E).tolist() == [list(range(8))]
    assert torch.equal(document_mask(t, E)[0, 0], torch.ones(8, 8, dtype=torch.bool).tril())


def _cfg(pos_type, groups, positions=True, mask=True):
    return tiny_config(
        model=dict(position_embedding_type=pos_type, num_query_groups=groups, seq_length=32),
        data=dict(reset_position_ids=positions, reset_attention_mask=mask),
    )


def _model(cfg):
    from megafp8.fp8.backend import Backend
    from megafp8.model.gpt import GPTModel
    from megafp8.parallel.groups import ParallelGroups

    torch.manual_seed(0)
    return GPTModel(cfg, backend=Backend(), groups=ParallelGroups.single(), vocab_size=256, eod=E)


def _packed():
    """Two samples of 32 tokens: [A (10, EOD-ended) | B (15, EOD-ended) | C (7, cut)] and one
    document D of 32 (none ended). Returns (tokens [2, 33], the documents as (sample, start,
    end) spans of the inputs)."""
    g = torch.Generator().manual_seed(5)
    t = torch.randint(0, E, (2, 33), generator=g)
    t[0, 9] = t[0, 24] = E
    return t, [(0, 0, 10), (0, 10, 25), (0, 25, 32), (1, 0, 32)]


def _loss_grads(model, tokens):
    """Logits [s, b, V] and the gradients of the summed token losses."""
    model.zero_grad(set_to_none=True)
    x, y = tokens[:, :-1], tokens[:, 1:]
    logits = model(x)  # [s, b, V]
    F.cross_entropy(logits.flatten(0, 1), y.t().flatten(), reduction="sum").backward()
    return logits.detach(), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("pos_type", ["rope", "learned_absolute"])
@pytest.mark.parametrize("groups", [None, 2])
def test_packed_sample_equals_each_document_alone(pos_type, groups):
    """Logits of every document in the packed samples equal the document's logits when it is a
    sample of its own, and the gradient of the packed loss equals the sum of the lone ones."""
    model = _model(_cfg(pos_type, groups))
    tokens, docs = _packed()
    logits, grads = _loss_grads(model, tokens)
    summed: dict = {}
    for b, i, j in docs:
        alone, g = _loss_grads(model, tokens[b : b + 1, i : j + 1])
        torch.testing.assert_close(logits[i:j, b], alone[:, 0], **TOL)
        for n, v in g.items():
            summed[n] = summed.get(n, 0) + v
    for n, v in grads.items():
        torch.testing.assert_close(v, summed[n], **TOL, msg=n)


@pytest.mark.parametrize(
    "positions,mask,pos_type", [(False, False, "rope"), (True, False, "rope"),
                                (False, True, "learned_absolute")]
)  # fmt: skip
def test_each_reset_is_needed(positions, mask, pos_type):
    """Without both resets the second document sees the first, or runs at shifted learned
    positions (RoPE alone is relative: with the mask alone it would already match)."""
    model = _model(_cfg(pos_type, None, positions, mask))
    tokens, _ = _packed()
    logits, _ = _loss_grads(model, tokens)
    alone, _ = _loss_grads(model, tokens[0:1, 10:26])
    assert (logits[10:25, 0] - alone[:, 0]).abs().max() > 1e-2


def test_rope_with_the_mask_alone_is_already_relative():
    model = _model(_cfg("rope", None, positions=False, mask=True))
    tokens, _ = _packed()
    logits, _ = _loss_grads(model, tokens)
    alone, _ = _loss_grads(model, tokens[0:1, 10:26])
    torch.testing.assert_close(logits[10:25, 0], alone[:, 0], **TOL)


def test_te_backend_rope_per_sample_is_the_torch_rope():
    """TE's fused RoPE kernels take one table row per position; per-sample positions take the
    torch path inside the te backend: equal, bit for bit, to the torch backend's. The documents'
    mask makes the te backend's core attention torch's SDPA."""
    from megafp8.fp8.backend import Backend
    from megafp8.fp8.plain_ops import SdpaAttention, rope_angles, rope_tables
    from megafp8.fp8.te_backend import TEBackend
    from megafp8.model.documents import gather_tables

    te = object.__new__(TEBackend)  # the paths below import no TE
    tokens, _ = _packed()
    pos = document_positions(tokens[:, :-1], E)  # [2, 32]
    angles = gather_tables((rope_angles(32, 16, 1e4, "cpu"),), pos)  # the te backend's table
    cos_sin = gather_tables(rope_tables(32, 16, 1e4, "cpu"), pos)  # the torch backend's
    assert angles[0].shape == (32, 2, 1, 16)
    qkv = torch.randn(32, 2, 2, 4 * 16)  # [s, b, g, (hpg 2 + 2) * hd 16]
    got, want = te.split_qkv(qkv, 2, angles), Backend().split_qkv(qkv, 2, cos_sin)
    for a, b in zip(got, want, strict=True):
        assert torch.equal(a, b)
    q = torch.randn(32, 2, 4, 16)
    assert torch.equal(te.rope(q, *angles), Backend().rope(q, *cos_sin))
    te.attention_backend = "auto"
    core = te.make_core_attention(4, 16, 2, dropout=0.0, document_mask=True)
    assert isinstance(core, SdpaAttention)


@pytest.mark.parametrize(
    "recompute",
    [
        dict(recompute_granularity="full", recompute_method="uniform", recompute_num_layers=1),
        dict(recompute_granularity="selective", recompute_modules=("core_attn",)),
    ],
    ids=["full", "selective-core_attn"],
)
def test_recompute_keeps_the_documents(recompute):
    """The recomputed regions see the same mask (held by the region's function, not passed
    through the checkpoint): logits and gradients equal the run without recompute, bit for bit
    (the same ops replayed on the CPU)."""
    cfg = _cfg("rope", 2)
    tokens, _ = _packed()
    want = _loss_grads(_model(cfg), tokens)
    model = _model(cfg.replace(model=recompute))
    model.train()
    got = _loss_grads(model, tokens)
    assert torch.equal(got[0], want[0])
    for n, v in got[1].items():
        assert torch.equal(v, want[1][n]), n
