"""The Triton QKV-split RoPE's shape checks (its arithmetic is tested against the torch path on a
GPU: tests/gpu/test_gpu_backends.py::test_te_fused_qkv_rope_equals_the_torch_path)."""

import pytest
import torch

from megafp8.fp8.qkv_rope import available, split_qkv_rope


def test_bad_shapes_get_one_line_before_any_launch():
    """A width that is not (hpg + 2) whole heads of an even head dim, or angles of another head
    dim or length: one line naming the shapes, raised before Triton is touched (so here, on a
    machine without it)."""
    ang = torch.zeros(8, 1, 1, 64)
    with pytest.raises(ValueError, match=r"width 320 is not \(heads_per_group 4 \+ 2\)"):
        split_qkv_rope(torch.zeros(8, 1, 2, 5 * 64), ang, 4)
    with pytest.raises(ValueError, match="angles' 64"):
        split_qkv_rope(torch.zeros(8, 1, 2, 6 * 32), ang, 4)
    with pytest.raises(ValueError, match="angles' 63"):
        split_qkv_rope(torch.zeros(8, 1, 2, 6 * 63), torch.zeros(8, 1, 1, 63), 4)  # odd
    with pytest.raises(ValueError, match=r"angles \(8, 1, 1, 64\) for qkv \(16, 1, 2, 384\)"):
        split_qkv_rope(torch.zeros(16, 1, 2, 6 * 64), ang, 4)
    with pytest.raises(ValueError, match=r"angles \(8, 3, 1, 64\) for qkv \(8, 2, 2, 384\)"):
        split_qkv_rope(torch.zeros(8, 2, 2, 6 * 64), torch.zeros(8, 3, 1, 64), 4)


def test_cpu_tensors_take_the_torch_path():
    """The kernel is for GPU tensors only: the te backend asks ``available`` first."""
    assert not available(torch.zeros(2, 1, 1, 6 * 8))
