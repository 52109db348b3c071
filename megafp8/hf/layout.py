"""Where each tensor of a megafp8 checkpoint lives, and the merge/split between rank shards and
the one-process ("full") model.

A checkpoint written by ``train.py`` holds one ``mp_rank_NN_model_states.pt`` per (tp, pp)
position, NN = tp_rank + tp * pp_rank (``ParallelGroups.as_deepspeed_mpu``), whose ``module`` is
that rank's ``state_dict``. Its ``megafp8.json`` carries the resolved config. A name of a rank's
state dict maps to a *canonical* name (the one-process model's, without the interleaved
schedule's ``chunks.<c>.`` prefix or a backend's own module names) and to the rows or columns
of the full tensor that rank holds: the same selections the model code makes
(``attention.qkv_rows``, the SwiGLU [gate; up] halves of ``mlp.py``, the vocab chunks of
``VocabParallelEmbedding``, the column chunks of ``RowParallelLinear``), which the layers also
record as ``full_name`` / ``full_index`` on each shard.
"""

from __future__ import annotations

import json
import os
import re

import torch

from megafp8.checkpoint import latest_tag, tag_for
from megafp8.config import Config, ModelConfig
from megafp8.config_values import padded_vocab_size
from megafp8.model.attention import qkv_rows

# a backend's own names (Transformer Engine's fused modules) -> the plain backend's names
_TE_NAMES = [
    (re.compile(r"\.inner\."), "."),
    (re.compile(r"\.attn\.(qkv|q)\.linear\.layer_norm_(weight|bias)$"), r".norm1.\2"),
    (re.compile(r"\.mlp\.fc1\.linear\.layer_norm_(weight|bias)$"), r".norm2.\1"),
    (re.compile(r"\.mlp\.layer_norm_(weight|bias)$"), r".norm2.\1"),
    (re.compile(r"\.mlp\.(fc1|fc2)_weight$"), r".mlp.\1.linear.weight"),
    (re.compile(r"\.mlp\.fc1_bias$"), ".mlp.fc1.linear.bias"),
    (re.compile(r"\.mlp\.fc2_bias$"), ".mlp.fc2.bias"),
]


def canonical(name: str) -> str | None:
    """A rank's state-dict name -> the one-process model's name (None: not a weight)."""
    if name.endswith("_extra_state") or name == "tied_output_weight":
        return None
    name = re.sub(r"^chunks\.\d+\.", "", name)
    for pat, rep in _TE_NAMES:
        name = pat.sub(rep, name)
    # a row-parallel bias lives in the GEMM at tp = 1 and after the reduction at tp > 1
    return re.sub(r"\.(proj|fc2)\.linear\.bias$", r".\1.bias", name)


def _chunk(full: int, tp: int, r: int) -> torch.Tensor:
    n = full // tp
    return torch.arange(r * n, (r + 1) * n)


def qkv_split_rows(m: ModelConfig, tp: int, r: int) -> tuple[torch.Tensor, torch.Tensor]:
    """tp > kv heads: rank r's query rows and its (replicated) k/v rows of the grouped QKV
    weight, as ``SelfAttention`` selects them."""
    heads, kv, hd = m.num_attention_heads, m.kv_heads, m.head_dim
    hpg = heads // kv
    q = torch.cat(
        [torch.arange(g * (hpg + 2) * hd, g * (hpg + 2) * hd + hpg * hd) for g in range(kv)]
    )
    base = (r * kv // tp) * (hpg + 2) * hd
    return q.view(tp, -1)[r], torch.arange(base + hpg * hd, base + (hpg + 2) * hd)


def swiglu_rows(ffn: int, tp: int, r: int) -> torch.Tensor:
    """Rank r's rows of the SwiGLU fc1 [gate; up]: its chunk of each half (as ``mlp.MLP``)."""
    return torch.cat([_chunk(ffn, tp, r), ffn + _chunk(ffn, tp, r)])


def locate(name: str, m: ModelConfig, tp: int, r: int):
    """(canonical name, dim, index, full length of dim) of a rank's tensor ``name``: the tensor is
    ``full[canonical].index_select(dim, index)``; dim None: the full tensor (replicated)."""
    c = name if name == "tied_output_weight" else canonical(name)
    if c is None:
        return None
    vocab = padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp)
    qkv_out = (m.num_attention_heads + 2 * m.kv_heads) * m.head_dim
    if c in ("embedding.weight", "output", "tied_output_weight"):
        c = "embedding.weight" if c == "tied_output_weight" else c
        return c, 0, _chunk(vocab, tp, r), vocab
    kind = re.sub(r"^layers\.\d+\.", "", c)
    prefix = c[: len(c) - len(kind)]
    if kind.startswith("attn.qkv.linear."):
        return c, 0, qkv_rows(m.num_attention_heads, m.kv_heads, m.head_dim, tp, r), qkv_out
    if kind.startswith(("attn.q.linear.", "attn.kv_proj.linear.")):
        q, kv = qkv_split_rows(m, tp, r)
        rows = q if kind.startswith("attn.q.") else kv
        return prefix + "attn.qkv.linear." + kind.rsplit(".", 1)[1], 0, rows, qkv_out
    if kind == "attn.proj.linear.weight":
        hq = m.num_attention_heads * m.head_dim
        return c, 1, _chunk(hq, tp, r), hq
    if kind.startswith("mlp.fc1.linear."):
        if m.swiglu:
            return c, 0, swiglu_rows(m.ffn, tp, r), 2 * m.ffn
        return c, 0, _chunk(m.ffn, tp, r), m.ffn
    if kind == "mlp.fc2.linear.weight":
        return c, 1, _chunk(m.ffn, tp, r), m.ffn
    return c, None, None, None


def find_checkpoint(load_dir: str, iteration: int | None = None) -> str:
    """The checkpoint directory ``latest`` names (or that of ``iteration``)."""
    tag = tag_for(iteration) if iteration is not None else latest_tag(load_dir)
    if tag is None:
        raise ValueError(f"{load_dir}: no 'latest' file; give --iteration")
    path = os.path.join(load_dir, tag)
    if not os.path.isfile(os.path.join(path, "megafp8.json")):
        raise ValueError(f"{path} is not a complete megafp8 checkpoint (no megafp8.json)")
    return path


def read_meta(path: str) -> tuple[Config, dict]:
    with open(os.path.join(path, "megafp8.json")) as f:
        meta = json.load(f)
    if "config" not in meta:
        raise ValueError(f"{path}/megafp8.json holds no config")
    return Config.from_dict(meta["config"]), meta


def merge_checkpoint(path: str) -> tuple[Config, dict, dict[str, torch.Tensor]]:
    """Every rank's shards of the checkpoint at ``path`` -> (config, meta, one-process tensors by
    canonical name, padded vocab rows included)."""
    cfg, meta = read_meta(path)
    m, p = cfg.model, cfg.parallel
    tp, pp = p.tensor_model_parallel_size, p.pipeline_model_parallel_size
    full: dict[str, torch.Tensor] = {}
    seen: dict[str, torch.Tensor] = {}
    for pr in range(pp):
        for r in range(tp):
            f = os.path.join(path, f"mp_rank_{r + tp * pr:02d}_model_states.pt")
            if not os.path.isfile(f):
                raise ValueError(f"{f} is missing (the config says tp={tp}, pp={pp})")
            sd = torch.load(f, map_location="cpu", weights_only=False)["module"]
            for name, t in sd.items():
                if name == "tied_output_weight":
                    continue
                where = locate(name, m, tp, r)
                if where is None:
                    continue
                c, dim, index, n = where
                if dim is None:
                    full.setdefault(c, t.clone())
                    continue
                if c not in full:
                    shape = list(t.shape)
                    shape[dim] = n
                    full[c] = torch.zeros(shape, dtype=t.dtype)
                    seen[c] = torch.zeros(n, dtype=torch.bool)
                full[c].index_copy_(dim, index, t)
                seen[c][index] = True
    for c, s in seen.items():
        if not bool(s.all()):
            raise ValueError(f"{path}: {int((~s).sum())} rows of {c} are in no rank's file")
    return cfg, meta, full


def shard(full: dict[str, torch.Tensor], name: str, m: ModelConfig, tp: int, r: int):
    """Rank r's tensor ``name`` cut from the one-process tensors (None: not a weight)."""
    where = locate(name, m, tp, r)
    if where is None:
        return None
    c, dim, index, _ = where
    if c not in full:
        raise ValueError(f"no tensor for {c} (needed by {name})")
    t = full[c]
    return t if dim is None else t.index_select(dim, index)
