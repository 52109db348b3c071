"""HuggingFace directories: safetensors (one file, or shards with an index), config.json and
tokenizer files."""

from __future__ import annotations

import json
import logging
import os
import shutil

import torch

log = logging.getLogger(__name__)

INSTALL = "pip install -e .[hf]"

# what a HF tokenizer directory may hold (copied when present)
TOKENIZER_FILES = (
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
)


def _safetensors():
    try:
        import safetensors.torch as st
    except ImportError:
        raise ImportError(f"safetensors is not installed: {INSTALL}") from None
    return st


def write_model(out_dir: str, tensors: dict[str, torch.Tensor], config: dict, shard_gb: float):
    """``model.safetensors`` (or ``model-0000k-of-0000n.safetensors`` + index when the tensors
    exceed ``shard_gb``) and ``config.json`` into ``out_dir``."""
    st = _safetensors()
    os.makedirs(out_dir, exist_ok=True)
    limit = int(shard_gb * 2**30)
    shards: list[dict[str, torch.Tensor]] = [{}]
    size = 0
    for name in sorted(tensors):
        t = tensors[name]
        n = t.numel() * t.element_size()
        if shards[-1] and size + n > limit:
            shards.append({})
            size = 0
        shards[-1][name] = t
        size += n
    meta = {"format": "pt"}
    if len(shards) == 1:
        st.save_file(shards[0], os.path.join(out_dir, "model.safetensors"), metadata=meta)
    else:
        index = {"metadata": {"total_size": 0}, "weight_map": {}}
        for k, part in enumerate(shards, 1):
            fname = f"model-{k:05d}-of-{len(shards):05d}.safetensors"
            st.save_file(part, os.path.join(out_dir, fname), metadata=meta)
            for name, t in part.items():
                index["weight_map"][name] = fname
                index["metadata"]["total_size"] += t.numel() * t.element_size()
        with open(os.path.join(out_dir, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)


def read_model(hf_dir: str) -> tuple[dict, dict[str, torch.Tensor]]:
    """(config.json dict, every tensor) of a HF model directory."""
    st = _safetensors()
    cfg_path = os.path.join(hf_dir, "config.json")
    if not os.path.isfile(cfg_path):
        raise ValueError(f"{cfg_path} does not exist")
    with open(cfg_path) as f:
        config = json.load(f)
    index = os.path.join(hf_dir, "model.safetensors.index.json")
    if os.path.isfile(index):
        with open(index) as f:
            files = sorted(set(json.load(f)["weight_map"].values()))
    elif os.path.isfile(os.path.join(hf_dir, "model.safetensors")):
        files = ["model.safetensors"]
    else:
        raise ValueError(f"{hf_dir}: no model.safetensors or model.safetensors.index.json")
    tensors = {}
    for fname in files:
        tensors.update(st.load_file(os.path.join(hf_dir, fname)))
    return config, tensors


def copy_tokenizer(data_cfg, out_dir: str) -> list[str]:
    """Copy the run's tokenizer files that exist into ``out_dir``; returns notes on what was not
    copied (logged as warnings)."""
    d, notes, copied = data_cfg, [], []

    def put(src, name):
        if src and os.path.isfile(src):
            shutil.copyfile(src, os.path.join(out_dir, name))
            copied.append(name)
        elif src:
            notes.append(f"{src} does not exist here: {name} not copied")

    kind = d.tokenizer_type or ("SentencePieceTokenizer" if d.tokenizer_model else "NullTokenizer")
    model = d.tokenizer_model
    if kind == "TikTokenizer":  # a tiktoken vocab is not a Hugging Face tokenizer file
        notes.append(f"{model}: a TikTokenizer vocab has no Hugging Face form: not copied")
        model = None
    if d.vocab_file or d.merge_file:
        put(d.vocab_file, "vocab.json")
        put(d.merge_file, "merges.txt")
    if model and os.path.isdir(model):
        for name in TOKENIZER_FILES:
            if os.path.isfile(os.path.join(model, name)):
                put(os.path.join(model, name), name)
    elif model:
        put(model, "tokenizer.json" if model.endswith(".json") else "tokenizer.model")
        for name in ("tokenizer_config.json", "special_tokens_map.json"):
            sib = os.path.join(os.path.dirname(model), name)
            if os.path.isfile(sib):
                put(sib, name)
        if not model.endswith(".json") and "tokenizer_config.json" not in copied:
            notes.append("no tokenizer_config.json beside the SentencePiece model: not written")
    if not (d.tokenizer_model or d.vocab_file or d.merge_file):
        notes.append(f"the run's tokenizer is {kind}: no tokenizer files to copy")
    for n in notes:
        log.warning("tokenizer: %s", n)
    if copied:
        log.info("tokenizer: copied %s", ", ".join(copied))
    return notes
