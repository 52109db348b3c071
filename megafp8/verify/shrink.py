"""The configs ``megafp8-verify`` runs: the user's, made comparable, shrunk, and its reference.

``comparable(cfg, steps, on_cpu)``: what any comparison with one process needs, shrunk or not:
N steps, no checkpoints/eval/TensorBoard, no dropout (its masks are drawn per TP rank and per DP
rank's samples, so no layout draws one process's masks), fp32 parameters (bf16 rounds every
cross-rank sum to its own ~4e-3 noise), the learning rate at its peak from step 1 (a long warmup
would leave 5 steps with almost no update to compare), mock data when none is given, and on the
CPU the torch FP8 backend (Transformer Engine needs a GPU).

``shrink(cfg, tp, pp, dp)``: a CPU-sized model keeping what matters for parallel correctness:
TP splits (heads, kv groups split or replicated as the user's are, ffn, vocab padding, SP),
pipeline stages (at least one layer each, or each virtual stage, the user's uneven first/last stage
kept uneven), more than one micro-batch per step (>= pp, so 1F1B has a steady state), FP8 dims
divisible by 16.

``reference(cfg)``: the same run on one process (the same global batch, hence micro-batches).
"""

from __future__ import annotations

import math

from megafp8.config import Config
from megafp8.config_values import global_batch_size
from megafp8.validate import FP8_GEMM_MULTIPLE

SEQ = 64  # tokens per sample after shrinking (at least)
MICRO = 2  # samples per micro-batch after shrinking (at most)
MOCK_VOCAB = 256


def _changes(before: Config, after: Config) -> list[str]:
    """``["field old -> new", ...]`` for every field that differs."""
    out = []
    a, b = before.to_dict(), after.to_dict()
    for sec in a:
        for k, v in a[sec].items():
            if b[sec][k] != v:
                out.append(f"{k} {v} -> {b[sec][k]}")
    return out


def comparable(cfg: Config, steps: int, on_cpu: bool) -> tuple[Config, list[str]]:
    """``cfg`` for an N-step comparison; returns it and one note per change that matters."""
    if steps < 1:
        raise ValueError(f"--steps={steps} must be >= 1")
    f, m, d, t = cfg.fp8, cfg.model, cfg.data, cfg.train
    if on_cpu and f.enabled and f.fp8_recipe == "mxfp8":
        raise ValueError(
            "fp8_recipe='mxfp8' needs Transformer Engine on a GPU; on the CPU verify with "
            "--fp8-recipe delayed or tensorwise"
        )
    notes = []
    if m.hidden_dropout or m.attention_dropout:
        notes.append(
            f"dropout off (hidden_dropout {m.hidden_dropout}, attention_dropout "
            f"{m.attention_dropout} -> 0): each TP rank and each DP rank's samples draw their "
            "own masks, so no layout reproduces one process's masks"
        )
    if t.bf16:
        notes.append(
            "bf16 off (fp32 parameters): bf16 rounds each cross-rank sum with ~4e-3 relative "
            "error, as large as the differences a layout bug makes"
        )
    backend = f.fp8_backend
    if on_cpu and f.enabled and backend in ("auto", "te"):
        backend = "torch"
        notes.append(f"fp8_backend {f.fp8_backend} -> torch (CPU: our recipe, emulated GEMMs)")
    mock = d.mock_data or not (d.data_path or d.train_data_path)
    if mock and not d.mock_data:
        notes.append("mock data (no --data-path given)")
    o = cfg.optim
    if o.lr_warmup_iters or o.lr_decay_iters:
        notes.append(
            f"lr schedule over the {steps} steps, no warmup (lr_warmup_iters "
            f"{o.lr_warmup_iters} -> 0): updates large enough to compare"
        )
    out = cfg.replace(
        model=dict(hidden_dropout=0.0, attention_dropout=0.0),
        parallel=dict(distributed_backend=None),
        fp8=dict(fp8_backend=backend),
        optim=dict(
            lr_warmup_iters=0, lr_decay_iters=None, lr_wsd_decay_iters=None,
            grad_reduce_in_bf16=False,
        ),
        data=dict(mock_data=mock, num_workers=0),
        train=dict(
            train_iters=steps, bf16=False, save=None, load=None, save_interval=None,
            eval_interval=None, exit_duration_in_mins=None, profile=False, manual_gc=False,
            deterministic=t.deterministic or not on_cpu,
        ),
        logging=dict(tensorboard_dir=None, log_interval=1, log_memory=False),
    )  # fmt: skip
    return out, notes


def _heads(m, tp: int) -> tuple[int, int | None]:
    """(query heads, kv groups): TP still splits the heads; kv groups are split across TP when
    the user's are (>= tp), replicated when they are (< tp), and grouped when they are."""
    kv = m.num_query_groups
    if kv is None or kv == m.num_attention_heads:
        heads = tp * min(m.num_attention_heads // tp, 2)
        return heads, None if kv is None else heads
    if kv >= tp:  # split whole groups, two query heads per group
        return 2 * tp, tp
    return tp, kv  # replicated (kv divides tp): one query head per rank, fewer kv heads


def _head_dim(heads: int, kv: int, tp: int, fp8: bool) -> int:
    """The smallest multiple of 16 whose FP8 GEMM dims (qkv width / tp) are multiples of 16."""
    hd = 16
    while fp8 and (heads + 2 * kv) * hd // tp % FP8_GEMM_MULTIPLE:
        hd += 16
    return hd


def _layers(cfg: Config, pp: int) -> tuple[int, int | None, int | None]:
    """(num_layers, first stage's, last stage's): one layer per stage (per virtual stage under
    the interleaved schedule; more if the FP8 first/last bf16 blocks would leave no FP8 block),
    at least 2; an uneven split stays uneven."""
    p, f = cfg.parallel, cfg.fp8
    v = p.virtual_pipeline_model_parallel_size or 1
    need = 2
    if f.enabled and f.first_last_layers_bf16:
        need = max(need, f.num_layers_at_start_in_bf16 + f.num_layers_at_end_in_bf16 + 1)
    first, last = p.decoder_first_pipeline_num_layers, p.decoder_last_pipeline_num_layers
    first = None if first is None else min(first, 1)
    last = None if last is None else min(last, 1)
    fixed = (first or 0) + (last or 0)
    free = pp - (first is not None) - (last is not None)
    per = v
    while free and fixed + free * per < need:
        per += v
    return fixed + free * per, first, last


def _microbatches(p) -> int:
    """Per DP rank and step: >= 2 (accumulation), >= pp (1F1B reaches its steady state); under
    the interleaved schedule 2 x pp (a multiple of pp, past the warm-up of the virtual stages)."""
    pp = p.pipeline_model_parallel_size
    if (p.virtual_pipeline_model_parallel_size or 1) > 1:
        return 2 * pp
    return max(pp, 2)


def shrink(cfg: Config, tp: int, pp: int, dp: int) -> tuple[Config, list[str]]:
    """The CPU-sized model of ``cfg`` for layout tp x pp x dp; returns it and its changes."""
    m, p, d = cfg.model, cfg.parallel, cfg.data
    heads, kv = _heads(m, tp)
    kv_n = kv or heads
    hidden = heads * _head_dim(heads, kv_n, tp, cfg.fp8.enabled)
    ffn_unit = FP8_GEMM_MULTIPLE * tp
    ffn = math.ceil(m.ffn / m.hidden_size * hidden / ffn_unit) * ffn_unit
    unit = FP8_GEMM_MULTIPLE * (tp if p.sequence_parallel else 1)
    seq = min(m.seq_length, math.ceil(SEQ / unit) * unit)
    layers, first, last = _layers(cfg, pp)
    micro = min(cfg.train.micro_batch_size, MICRO)
    mock_vocab = d.mock_data and d.tokenizer_type is None and not d.tokenizer_model
    out = cfg.replace(
        model=dict(
            num_layers=layers, hidden_size=hidden, num_attention_heads=heads,
            num_query_groups=kv, ffn_hidden_size=ffn, seq_length=seq,
            max_position_embeddings=None,
            vocab_size=MOCK_VOCAB if mock_vocab else m.vocab_size,
        ),
        parallel=dict(
            decoder_first_pipeline_num_layers=first, decoder_last_pipeline_num_layers=last
        ),
        train=dict(micro_batch_size=micro, global_batch_size=micro * dp * _microbatches(p)),
    )  # fmt: skip
    return out, _changes(cfg, out)


def reference(cfg: Config, dp: int, seed: int | None = None) -> Config:
    """The same run as one process: no TP/SP/PP (nor virtual stages), the layout's global
    batch (hence its micro-batches, accumulated); ``seed`` overrides the seed."""
    gbs = global_batch_size(cfg, dp)
    return cfg.replace(
        parallel=dict(
            tensor_model_parallel_size=1,
            pipeline_model_parallel_size=1,
            virtual_pipeline_model_parallel_size=None,
            sequence_parallel=False,
            decoder_first_pipeline_num_layers=None,
            decoder_last_pipeline_num_layers=None,
        ),
        train=dict(global_batch_size=gbs, seed=cfg.train.seed if seed is None else seed),
    )


def fp32(cfg: Config) -> Config:
    """The same run without FP8: the yardstick of FP8's own noise."""
    return cfg.replace(fp8=dict(fp8_format=None))
