"""Llama 3.1's RoPE frequency scaling (``--use-rope-scaling --rope-scaling-factor F``): each band
against the definition worked in float64 here, the whole against transformers' Llama rotary
embedding, and the HF config.json entries it is read from."""

import math

import pytest
import torch

from megafp8.fp8.plain_ops import rope_angles
from megafp8.hf.families import model_config_from_hf

BANDS = {"low_freq_factor": 1.0, "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}


def _freqs(dim, base, factor=None):
    """The frequencies: the angles of position 1."""
    return rope_angles(2, dim, base, "cpu", factor)[1, 0, 0, : dim // 2].double()


def test_each_band_by_hand():
    """head dim 16, base 500000: f_i = base^(-i/8), wavelength 2 pi / f_i. Below 8192 / 4 = 2048
    (i = 0..3: 6.3, 32, 167, 862) a frequency stays; above 8192 (i = 5..7) it is divided by the
    factor; i = 4 (wavelength 4443) is in between: t = (8192 / 4443 - 1) / 3 = 0.281, and
    f (1 - t) / 8 + f t."""
    plain, scaled = _freqs(16, 500000.0), _freqs(16, 500000.0, 8.0)
    f = [500000.0 ** (-i / 8) for i in range(8)]
    wl = [2 * math.pi / x for x in f]
    assert [round(w) for w in wl[:5]] == [6, 32, 167, 862, 4443]
    assert wl[5] > 8192
    t = (8192 / wl[4] - 1) / 3
    want = f[:4] + [f[4] * (1 - t) / 8 + f[4] * t] + [x / 8 for x in f[5:]]
    # fp32 frequencies against float64 arithmetic: a few fp32 ulps
    assert scaled.tolist() == pytest.approx(want, rel=1e-6)
    assert torch.equal(scaled[:4], plain[:4])
    assert scaled[4] / plain[4] == pytest.approx((1 - t) / 8 + t, rel=1e-6)


@pytest.mark.parametrize("factor", [8.0, 32.0])
def test_equals_transformers_llama3_rope(factor):
    """The frequencies transformers' Llama builds from rope_scaling llama3, bit for bit."""
    transformers = pytest.importorskip("transformers")
    from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding

    cfg = transformers.LlamaConfig(
        hidden_size=2048, num_attention_heads=16, rope_theta=500000.0,
        max_position_embeddings=131072, rope_scaling=dict(rope_type="llama3", factor=factor,
                                                          **BANDS),
    )  # fmt: skip
    theirs = LlamaRotaryEmbedding(config=cfg).inv_freq.float()
    assert torch.equal(_freqs(128, 500000.0, factor).float(), theirs)


def _llama(**extra):
    return dict(model_type="llama", hidden_size=64, num_attention_heads=4, num_hidden_layers=2,
                intermediate_size=96, vocab_size=250, rope_theta=500000.0, **extra)  # fmt: skip


def test_hf_config_entries():
    """rope_scaling (transformers 4) or rope_parameters (5) of type llama3 with Llama 3.1's
    bands -> the two fields; none or "default" -> no scaling; other bands or types refused."""
    rs = dict(rope_type="llama3", factor=32.0, **BANDS)
    for hf in (_llama(rope_scaling=rs), _llama(rope_parameters=dict(rs, rope_theta=500000.0))):
        _, f = model_config_from_hf(hf, None)
        assert f["use_rope_scaling"] and f["rope_scaling_factor"] == 32.0
    for hf in (
        _llama(),
        _llama(rope_scaling=None),
        _llama(rope_parameters={"rope_type": "default"}),
    ):
        assert "use_rope_scaling" not in model_config_from_hf(hf, None)[1]
    for bad in (dict(rs, high_freq_factor=2.0), dict(rs, rope_type="yarn"), {"type": "linear"}):
        with pytest.raises(ValueError, match="rope scaling .* is not supported"):
            model_config_from_hf(_llama(rope_scaling=bad), None)
