"""HuggingFace export and import (``megafp8-hf``, ``python -m megafp8.hf``).

    megafp8-hf export --load CKPT --out DIR [--family llama|qwen2|qwen3|gpt2] [--iteration N]
                      [--dtype bf16]
    megafp8-hf import --hf DIR --save CKPT [--tensor-model-parallel-size T]
                      [--pipeline-model-parallel-size P] [--seq-length S]
    megafp8-hf from-megatron --load MEGATRON_SAVE_DIR --save CKPT [--iteration N]
                      [--tensor-model-parallel-size T] [--pipeline-model-parallel-size P]

``safetensors`` (and ``transformers`` to use the result) come with ``pip install -e .[hf]``;
the rest of megafp8 imports without them.
"""

from __future__ import annotations

import argparse
import logging
import sys

DTYPES = {"fp32": "float32", "bf16": "bfloat16", "fp16": "float16"}


def _parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="megafp8-hf", description=__doc__.split("\n")[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    ex = sub.add_parser("export", help="megafp8 checkpoint -> HuggingFace directory")
    ex.add_argument("--load", required=True, help="checkpoint directory (training's --save)")
    ex.add_argument("--out", required=True, help="HuggingFace model directory to write")
    ex.add_argument(
        "--family",
        choices=("llama", "qwen2", "qwen3", "gpt2"),
        default=None,
        help="default: llama for RoPE models (qwen2 with biases on q, k, v alone, qwen3 with "
        "--qk-layernorm), gpt2 for learned positions",
    )
    ex.add_argument("--iteration", type=int, default=None, help="default: the one 'latest' names")
    ex.add_argument(
        "--dtype", choices=tuple(DTYPES), default=None, help="cast the tensors (default: as saved)"
    )
    ex.add_argument(
        "--max-shard-size-gb",
        type=float,
        default=5.0,
        help="split model.safetensors into shards (with an index) above this",
    )
    im = sub.add_parser("import", help="HuggingFace directory -> megafp8 checkpoint")
    im.add_argument("--hf", required=True, help="directory with config.json + safetensors")
    im.add_argument("--save", required=True, help="checkpoint directory to write (iteration 0)")
    im.add_argument("--tensor-model-parallel-size", type=int, default=1)
    im.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    im.add_argument(
        "--seq-length",
        type=int,
        default=None,
        help="default: llama min(max_position_embeddings, 4096), gpt2 n_positions",
    )
    im.add_argument("--make-vocab-size-divisible-by", type=int, default=None)
    mg = sub.add_parser(
        "from-megatron", help="Megatron-LM checkpoint (torch_dist or torch) -> megafp8 checkpoint"
    )
    mg.add_argument("--load", required=True, help="Megatron-LM's --save directory (or iter_N)")
    mg.add_argument("--save", required=True, help="checkpoint directory to write (iteration 0)")
    mg.add_argument("--iteration", type=int, default=None, help="default: the latest one")
    mg.add_argument("--tensor-model-parallel-size", type=int, default=1)
    mg.add_argument("--pipeline-model-parallel-size", type=int, default=1)
    return ap  # fmt: skip


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    from megafp8.hf import convert

    try:
        if args.cmd == "export":
            import torch

            dtype = getattr(torch, DTYPES[args.dtype]) if args.dtype else None
            convert.export_checkpoint(
                args.load, args.out, args.family, args.iteration, dtype, args.max_shard_size_gb
            )
        elif args.cmd == "from-megatron":
            from megafp8.hf import megatron

            cfg, src = megatron.import_checkpoint(
                args.load,
                args.save,
                args.iteration,
                args.tensor_model_parallel_size,
                args.pipeline_model_parallel_size,
            )
            print(f"imported {src.path} ({src.format}, iteration {src.iteration})")
            print("model flags for pretrain_gpt.py --load " + args.save + ":")
            print(" ".join(convert.model_flags(cfg)))
        else:
            cfg = convert.import_checkpoint(
                args.hf,
                args.save,
                args.tensor_model_parallel_size,
                args.pipeline_model_parallel_size,
                seq_length=args.seq_length,
                make_vocab_size_divisible_by=args.make_vocab_size_divisible_by,
            )
            print("model flags for pretrain_gpt.py --load " + args.save + ":")
            print(" ".join(convert.model_flags(cfg)))
    except (ValueError, ImportError) as e:
        print(f"error: {e}", file=sys.stderr)
        return 2
    return 0
