"""grad_in_place's Triton kernel on the GPU: bf16 and fp32 rows added into ``.grad`` equal, bit
for bit, the same arithmetic in torch ops on the CPU (the tokens sorted stably, each token's rows
summed in fp32 in position order, rounded once, added and rounded once), with a token repeated
thousands of times and a hidden size that is not a multiple of the kernel's block; and a bf16
ZeRO-1 run on the GPU (the embedding's rows and the output layer's GEMM into ``.grad``) starts as
it does with autograd's gradients."""

import os

import pytest
import torch

from tests.helpers.dist import run_distributed

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("h", [4096, 1000])
def test_kernel_equals_the_torch_ops_on_the_cpu(dtype, h):
    from megafp8.parallel.grad_in_place import add_rows

    gen = torch.Generator().manual_seed(h)
    vocab = 5000
    ids = torch.randint(0, vocab, (2, 4096), generator=gen)
    ids.view(-1)[:3000] = 11  # one long run
    g = torch.randn(2, 4096, h, generator=gen).to(dtype)
    grad = torch.randn(vocab, h, generator=gen).to(dtype)
    ref = grad.clone()
    add_rows(ref, ids, g)  # CPU: torch ops
    mine = grad.cuda()
    add_rows(mine, ids.cuda(), g.cuda())
    assert torch.equal(mine.cpu(), ref)


def _train(cfg, in_place: bool):
    os.environ["DS_ACCELERATOR"] = "cuda"
    import megafp8.build as B
    import megafp8.train as T

    B.grads_accumulate_in_param = lambda cfg: in_place  # build_run reads it
    return [(r["lm loss"], r["grad norm"]) for r in T.train(cfg)]


def test_bf16_training_with_rows_added_in_place():
    """Untied embedding, bf16, four micro-batches: the two runs differ only in the order of the
    fp32 sum of a token's rows (autograd's CUDA kernel sums in partial sums) and in the output
    layer's accumulation (inside the GEMM, one rounding, against a rounded gradient and a
    rounded add), so an element may differ by one bf16 ulp. The first loss is the same forward,
    bit for bit; the first gradient norm is within one bf16 ulp relative (2^-8: every element
    within one ulp bounds the norm so), and every later iteration trains (finite losses)."""
    from tests.helpers.tiny import tiny_config

    cfg = tiny_config(
        train=dict(bf16=True, micro_batch_size=2, global_batch_size=8),
        model=dict(untie_embeddings_and_output_weights=True),
        optim=dict(embedding_grad_in_place=True),
    )
    mine = run_distributed(_train, 1, cfg, True)[0]
    ref = run_distributed(_train, 1, cfg, False)[0]
    assert len(mine) == len(ref) == 5
    assert mine[0][0] == ref[0][0]
    assert mine[0][1] == pytest.approx(ref[0][1], rel=2.0**-8)
    assert all(torch.isfinite(torch.tensor(loss)) for loss, _ in mine)
