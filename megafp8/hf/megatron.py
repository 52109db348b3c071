"""Read a Megatron-LM checkpoint (Megatron Core's ``GPTModel``) as megafp8's one-process tensors.

Two of Megatron-LM's formats are read, without Megatron-LM installed:

* ``--ckpt-format torch_dist`` (its default): an ``iter_NNNNNNN`` directory of PyTorch
  distributed-checkpoint files. Every tensor is stored whole (its global shape, whatever the
  tensor/pipeline layout that wrote it), the layers stacked on a first axis:
  ``decoder.layers.self_attention.linear_qkv.weight`` is ``[num_layers, qkv rows, hidden]``.
  The run's arguments are the ``args`` of the common state (a ``common_state`` entry, or a
  ``common.pt`` file in older checkpoints).
* ``--ckpt-format torch``: ``iter_NNNNNNN/mp_rank_00/model_optim_rng.pt`` with ``model`` (the
  module's state dict) and ``args``; one tensor- and pipeline-parallel rank only (a checkpoint of
  several ranks is refused: Megatron-LM's ``--ckpt-convert-format torch_dist`` rewrites it).

The model's shape comes from the saved ``args``: they are Megatron-LM's flags, whose names are
megafp8's config fields. The tensor layouts are the same as megafp8's: the QKV rows grouped per
kv head (its query heads, then k, then v), the SwiGLU fc1 as [gate; up], the vocab padded to
``padded_vocab_size`` rows. What megafp8's model cannot build (experts, MLA, an L2 QK norm, partial
or interleaved RoPE, a head size other than hidden / heads, quick GeGLU) is refused with
one line naming the argument. The pickled ``args`` come from the user's own checkpoint and are
read with ``pickle`` (classes of Megatron-LM become plain placeholders): as with any ``.pt``
file, load only checkpoints you trust.
"""

from __future__ import annotations

import io
import os
import pickle
import re
import warnings
from types import SimpleNamespace

import torch

from megafp8.hf.convert import pad_vocab, write_checkpoint

ITER_DIR = re.compile(r"^iter_(\d{7})$")
TRACKER = "latest_checkpointed_iteration.txt"


class _Placeholder:
    """Stands in for a class the unpickler cannot import (Megatron-LM's enums and configs)."""

    def __init__(self, *args, **kwargs):
        self.args = args

    def __setstate__(self, state):
        if isinstance(state, dict):
            self.__dict__.update(state)

    def __repr__(self):
        return f"<{type(self).__name__} {self.args!r}>"


class _Unpickler(pickle.Unpickler):
    def find_class(self, module, name):
        try:
            return super().find_class(module, name)
        except (ImportError, AttributeError):
            return type(name, (_Placeholder,), {"__module__": module})


class _LenientPickle:
    """A ``pickle_module`` for ``torch.load``: Megatron-LM's classes need not be importable."""

    Unpickler = _Unpickler
    load = pickle.load
    __name__ = "megafp8_lenient_pickle"


def _torch_load(f):
    return torch.load(f, map_location="cpu", weights_only=False, pickle_module=_LenientPickle)


def find_iteration(load_dir: str, iteration: int | None = None) -> tuple[str, int]:
    """(the ``iter_NNNNNNN`` directory, its iteration) of a Megatron-LM ``--save`` directory:
    ``iteration``, else the one ``latest_checkpointed_iteration.txt`` names. ``load_dir`` may be
    an ``iter_`` directory itself."""
    m = ITER_DIR.match(os.path.basename(os.path.normpath(load_dir)))
    if m and iteration is None:
        return load_dir, int(m.group(1))
    if iteration is None:
        tracker = os.path.join(load_dir, TRACKER)
        if not os.path.isfile(tracker):
            raise ValueError(f"{load_dir}: no {TRACKER} and no iter_NNNNNNN directory given")
        with open(tracker) as f:
            text = f.read().strip()
        if text == "release":
            path = os.path.join(load_dir, "release")
            if os.path.isdir(path):
                return path, 0
        if not text.isdigit():
            raise ValueError(f"{tracker}: {text!r} is not an iteration")
        iteration = int(text)
    path = os.path.join(load_dir, f"iter_{iteration:07d}")
    if not os.path.isdir(path):
        raise ValueError(f"{path}: no such checkpoint directory")
    return path, iteration


def checkpoint_format(path: str) -> str:
    """``torch_dist`` or ``torch`` (one rank): what the ``iter_`` directory holds."""
    if os.path.isfile(os.path.join(path, ".metadata")):
        return "torch_dist"
    ranks = sorted(d for d in os.listdir(path) if d.startswith("mp_rank_"))
    if ranks == ["mp_rank_00"]:
        return "torch"
    if ranks:
        raise ValueError(
            f"{path}: a --ckpt-format torch checkpoint of {len(ranks)} model-parallel ranks "
            f"({', '.join(ranks[:4])}{', ...' if len(ranks) > 4 else ''}); only one rank is read "
            "here: rewrite it with Megatron-LM's --ckpt-convert-format torch_dist"
        )
    raise ValueError(f"{path}: neither a torch_dist checkpoint (.metadata) nor mp_rank_00/")


def _read_dist(path: str) -> tuple[object, dict[str, torch.Tensor]]:
    from torch.distributed.checkpoint import DefaultLoadPlanner, FileSystemReader
    from torch.distributed.checkpoint import load as dcp_load
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    raw = {}

    class RawBytes(DefaultLoadPlanner):
        """Keeps a pickled entry's bytes (the default planner unpickles it strictly)."""

        def load_bytes(self, read_item, value):
            raw[read_item.dest_index.fqn] = value.read()

    reader = FileSystemReader(path)
    meta = reader.read_metadata().state_dict_metadata
    keep = lambda k: not k.startswith(("optimizer.", "rng_state", "rerun_state"))  # noqa: E731
    tensors = {
        k: torch.empty(v.size, dtype=v.properties.dtype)
        for k, v in meta.items()
        if isinstance(v, TensorStorageMetadata) and keep(k)
    }
    common = [k for k in meta if k.split("/")[0] == "common_state"]
    state = dict(tensors, **{k: io.BytesIO() for k in common})
    with warnings.catch_warnings():  # "assuming ... load in a single process": it is
        warnings.simplefilter("ignore", UserWarning)
        dcp_load(state, storage_reader=reader, planner=RawBytes(), no_dist=True)
    if common:
        common_state = _torch_load(io.BytesIO(raw[common[0]]))
        common_state = common_state[0] if isinstance(common_state, list) else common_state
    elif os.path.isfile(os.path.join(path, "common.pt")):
        common_state = _torch_load(os.path.join(path, "common.pt"))
    else:
        raise ValueError(f"{path}: no common state (args) in this torch_dist checkpoint")
    return common_state.get("args"), tensors


def _read_torch(path: str) -> tuple[object, dict[str, torch.Tensor]]:
    f = os.path.join(path, "mp_rank_00", "model_optim_rng.pt")
    if not os.path.isfile(f):
        raise ValueError(f"{f}: no such file")
    sd = _torch_load(f)
    if "model" not in sd:
        extra = sorted(k for k in sd if re.fullmatch(r"model\d+", k))
        what = f"{extra} (virtual pipeline chunks)" if extra else sorted(sd)
        raise ValueError(f"{f}: no 'model' state dict; found {what}")
    model = {k: v for k, v in sd["model"].items() if isinstance(v, torch.Tensor)}
    return sd.get("args"), model


def read(load_dir: str, iteration: int | None = None):
    """(path, iteration, format, args, tensors by Megatron-LM's names) of a checkpoint."""
    path, it = find_iteration(load_dir, iteration)
    fmt = checkpoint_format(path)
    args, tensors = (_read_dist if fmt == "torch_dist" else _read_torch)(path)
    if args is None:
        raise ValueError(f"{path}: the checkpoint holds no args (saved by Megatron-LM's training?)")
    return path, it, fmt, args, tensors


def _arg(args, name, default=None):
    return getattr(args, name, default)


def model_fields(args, path: str = "the checkpoint") -> dict:
    """megafp8 ModelConfig fields from Megatron-LM's saved args; what cannot be built is refused
    with one line naming the argument and its value."""

    def refuse(name, ok):
        v = _arg(args, name)
        if not ok(v):
            raise ValueError(f"{path}: args.{name}={v!r} is not supported by megafp8's model")

    refuse("num_experts", lambda v: not v)
    refuse("multi_latent_attention", lambda v: not v)
    refuse("qk_l2_norm", lambda v: not v)
    refuse("rotary_interleaved", lambda v: not v)
    refuse("rotary_percent", lambda v: v in (None, 1.0))
    refuse("rotary_seq_len_interpolation_factor", lambda v: v in (None, 1, 1.0))
    refuse("mtp_num_layers", lambda v: not v)
    refuse("quick_geglu", lambda v: not v)
    refuse("decoder_first_pipeline_num_layers", lambda v: v is None)
    refuse("position_embedding_type", lambda v: v in (None, "learned_absolute", "rope"))
    refuse("normalization", lambda v: v in (None, "LayerNorm", "RMSNorm"))
    h, heads = args.hidden_size, args.num_attention_heads
    refuse("kv_channels", lambda v: v in (None, h // heads))
    gqa = bool(_arg(args, "group_query_attention"))
    fields = dict(
        num_layers=args.num_layers,
        hidden_size=h,
        num_attention_heads=heads,
        num_query_groups=_arg(args, "num_query_groups") if gqa else None,
        ffn_hidden_size=_arg(args, "ffn_hidden_size"),
        seq_length=_arg(args, "seq_length"),
        max_position_embeddings=_arg(args, "max_position_embeddings"),
        position_embedding_type=_arg(args, "position_embedding_type") or "learned_absolute",
        rotary_base=float(_arg(args, "rotary_base", 10000)),
        use_rope_scaling=bool(_arg(args, "use_rope_scaling", False)),
        rope_scaling_factor=float(_arg(args, "rope_scaling_factor", 8.0)),
        normalization=_arg(args, "normalization") or "LayerNorm",
        norm_epsilon=float(_arg(args, "norm_epsilon", 1e-5)),
        swiglu=bool(_arg(args, "swiglu", False)),
        squared_relu=bool(_arg(args, "squared_relu", False)),
        untie_embeddings_and_output_weights=bool(
            _arg(args, "untie_embeddings_and_output_weights", False)
        ),
        add_bias_linear=bool(_arg(args, "add_bias_linear", True)),
        # megafp8's --add-qkv-bias is the biases on q, k, v alone; Megatron-LM's args may hold it
        # True beside --add-bias-linear as well
        add_qkv_bias=bool(_arg(args, "add_qkv_bias", False))
        and not _arg(args, "add_bias_linear", True),
        init_method_std=float(_arg(args, "init_method_std", 0.02)),
        apply_layernorm_1p=bool(_arg(args, "apply_layernorm_1p", False)),
        qk_layernorm=bool(_arg(args, "qk_layernorm", False)),
        make_vocab_size_divisible_by=int(_arg(args, "make_vocab_size_divisible_by", 128)),
    )
    if fields["num_query_groups"] == heads:
        fields["num_query_groups"] = None
    return {k: v for k, v in fields.items() if v is not None}


# Megatron-LM's names (one layer, ``{i}`` the layer) -> megafp8's canonical names. A layer's
# norms are named by the GEMM they are fused into (TE modules, and every torch_dist checkpoint)
# or as modules of their own (``--transformer-impl local`` in the torch format).
_LAYER = {
    "self_attention.linear_qkv.layer_norm_weight": "norm1.weight",
    "self_attention.linear_qkv.layer_norm_bias": "norm1.bias",
    "input_layernorm.weight": "norm1.weight",
    "input_layernorm.bias": "norm1.bias",
    "self_attention.linear_qkv.weight": "attn.qkv.linear.weight",
    "self_attention.linear_qkv.bias": "attn.qkv.linear.bias",
    "self_attention.q_layernorm.weight": "attn.q_norm.weight",
    "self_attention.q_layernorm.bias": "attn.q_norm.bias",
    "self_attention.k_layernorm.weight": "attn.k_norm.weight",
    "self_attention.k_layernorm.bias": "attn.k_norm.bias",
    "self_attention.linear_proj.weight": "attn.proj.linear.weight",
    "self_attention.linear_proj.bias": "attn.proj.bias",
    "mlp.linear_fc1.layer_norm_weight": "norm2.weight",
    "mlp.linear_fc1.layer_norm_bias": "norm2.bias",
    "pre_mlp_layernorm.weight": "norm2.weight",
    "pre_mlp_layernorm.bias": "norm2.bias",
    "mlp.linear_fc1.weight": "mlp.fc1.linear.weight",
    "mlp.linear_fc1.bias": "mlp.fc1.linear.bias",
    "mlp.linear_fc2.weight": "mlp.fc2.linear.weight",
    "mlp.linear_fc2.bias": "mlp.fc2.bias",
}
_TOP = {
    "embedding.word_embeddings.weight": "embedding.weight",
    "embedding.position_embeddings.weight": "pos",
    "decoder.final_layernorm.weight": "final_norm.weight",
    "decoder.final_layernorm.bias": "final_norm.bias",
    "output_layer.weight": "output",
}
_STACKED = re.compile(r"^decoder\.layers\.(?P<rest>.+)$")
_PER_LAYER = re.compile(r"^decoder\.layers\.(?P<i>\d+)\.(?P<rest>.+)$")


def canonical_tensors(tensors: dict[str, torch.Tensor], num_layers: int, tied: bool, path: str):
    """Megatron-LM's tensors -> megafp8's canonical names (layers unstacked). TE's
    ``_extra_state`` (FP8 metadata) is skipped; a weight megafp8 has no place for is refused."""
    out = {}
    for k, t in tensors.items():
        if k.endswith("_extra_state") or "._extra_state/" in k:
            continue
        if k in _TOP:
            if k == "output_layer.weight" and tied:
                continue  # the last stage's copy of the word embedding
            out[_TOP[k]] = t
            continue
        m = _PER_LAYER.match(k)
        if m and m.group("rest") in _LAYER:
            out[f"layers.{m.group('i')}.{_LAYER[m.group('rest')]}"] = t
            continue
        m = _STACKED.match(k)
        if m and m.group("rest") in _LAYER:
            if t.shape[0] != num_layers:
                raise ValueError(f"{path}: {k} stacks {t.shape[0]} layers, args say {num_layers}")
            for i in range(num_layers):
                out[f"layers.{i}.{_LAYER[m.group('rest')]}"] = t[i]
            continue
        raise ValueError(f"{path}: tensor {k} {tuple(t.shape)} has no place in megafp8's model")
    return out


def import_config(load_dir: str, iteration: int | None = None, tp: int = 1, pp: int = 1):
    """(Config at layout tp x pp, one-process tensors by canonical name, unpadded vocab rows as
    the checkpoint has them, and a description of the source) of a Megatron-LM checkpoint."""
    from megafp8.config import Config

    path, it, fmt, args, tensors = read(load_dir, iteration)
    fields = model_fields(args, path)
    rows = tensors.get("embedding.word_embeddings.weight")
    if rows is None:
        raise ValueError(f"{path}: no embedding.word_embeddings.weight")
    fields["vocab_size"] = _arg(args, "vocab_size") or int(rows.shape[0])
    cfg = Config().replace(
        model=fields,
        parallel={"tensor_model_parallel_size": tp, "pipeline_model_parallel_size": pp},
    )
    tied = not cfg.model.untie_embeddings_and_output_weights
    full = canonical_tensors(tensors, cfg.model.num_layers, tied, path)
    source = SimpleNamespace(path=path, iteration=it, format=fmt, rows=int(rows.shape[0]))
    return cfg, full, source


def import_checkpoint(
    load_dir: str, save_dir: str, iteration: int | None = None, tp: int = 1, pp: int = 1
):
    """Write a Megatron-LM checkpoint's model as a megafp8 checkpoint (iteration 0) of layout
    tp x pp; returns (config, source). The optimizer state is not carried over."""
    from megafp8.config_values import padded_vocab_size
    from megafp8.validate import validate

    cfg, full, source = import_config(load_dir, iteration, tp, pp)
    validate(cfg.replace(data={"mock_data": True}), tp * pp)  # the layout and model only
    m = cfg.model
    if m.vocab_size > source.rows:
        raise ValueError(
            f"{source.path}: args.vocab_size={m.vocab_size}, the embedding has {source.rows} rows"
        )
    pad_vocab(full, padded_vocab_size(m.vocab_size, m.make_vocab_size_divisible_by, tp))
    write_checkpoint(cfg, full, save_dir, f"megatron-lm:{source.format}:{source.iteration}")
    return cfg, source
