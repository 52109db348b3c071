"""GPT decoder: embedding -> blocks -> final norm -> (tied) output layer -> vocab-parallel loss.

Inputs are batch-first ``[b, s]`` token ids (as the data loader gives them); activations are
sequence-first ``[s, b, h]``, and ``[s/tp, b, h]`` between TP regions under sequence parallelism.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megafp8.config import Config, padded_vocab_size
from megafp8.model.attention import rope_tables
from megafp8.model.block import TransformerBlock, make_norm
from megafp8.parallel import mappings as M
from megafp8.parallel.layers import (
    VocabParallelEmbedding,
    full_normal,
    mark_tp,
    param_seed,
    vocab_parallel_cross_entropy,
)
from megafp8.parallel.random import TP_STREAM


def layer_uses_fp8(cfg: Config, i: int) -> bool:
    f = cfg.fp8
    if not f.enabled:
        return False
    if f.first_last_layers_bf16:
        return (
            f.num_layers_at_start_in_bf16 <= i < cfg.model.num_layers - f.num_layers_at_end_in_bf16
        )
    return True


class GPTModel(nn.Module):
    """embedding (+ learned positions) -> num_layers TransformerBlocks -> final norm -> logits
    x E^T (tied) or x W_out^T (untied) -> vocab-parallel cross-entropy.

    Shards: this TP rank holds padded_vocab / tp rows of the embedding (and of the output layer
    when untied) and its shards of every block; positions, norms and the mean loss are the same on
    every rank. Logits stay split along the vocab ([s, b, V/tp]); the loss reduces over TP without
    gathering them.
    """

    def __init__(self, cfg: Config, *, backend, groups, vocab_size: int, device=None, rng=None):
        super().__init__()
        m = cfg.model
        self.cfg, self.groups, self.rng = cfg, groups, rng
        self.sp = cfg.parallel.sequence_parallel
        dtype = torch.bfloat16 if cfg.train.bf16 else torch.float32
        seed = cfg.train.seed
        tp_group = groups.tp_group
        self.vocab_size = vocab_size
        self.padded_vocab = padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, groups.tp)
        std = m.init_method_std
        self.embedding = VocabParallelEmbedding(
            self.padded_vocab,
            m.hidden_size,
            name="embedding",
            tp_group=tp_group,
            std=std,
            seed=seed,
            dtype=dtype,
            device=device,
        )
        self.pos = None
        if m.position_embedding_type == "learned_absolute":
            self.pos = nn.Parameter(
                full_normal(
                    (m.max_positions, m.hidden_size),
                    std,
                    param_seed(seed, "position"),
                    device or "cpu",
                    dtype,
                )
            )
        kv_group = groups.kv_replica_group(m.kv_heads)
        self.layers = nn.ModuleList(
            TransformerBlock(
                cfg,
                backend=backend,
                groups=groups,
                layer=i,
                seed=seed,
                fp8=layer_uses_fp8(cfg, i),
                dtype=dtype,
                device=device,
                rng=rng,
                kv_group=kv_group,
            )
            for i in range(m.num_layers)
        )
        self.final_norm = make_norm(cfg, backend, groups, dtype, device)
        self.output = None
        if m.untie_embeddings_and_output_weights:
            r, n = M.rank_in(tp_group), self.padded_vocab // groups.tp
            full = full_normal(
                (self.padded_vocab, m.hidden_size),
                std,
                param_seed(seed, "output"),
                device or "cpu",
                dtype,
            )
            self.output = nn.Parameter(full[r * n : (r + 1) * n].clone())
            if groups.tp > 1:
                mark_tp(self.output, 0, "output", torch.arange(r * n, (r + 1) * n))
        self.rope = None
        if m.position_embedding_type == "rope":
            self._rope_cfg = (m.head_dim, m.rotary_base)

    def _rope(self, s, device):
        if self.rope is None or self.rope[0].shape[0] < s or self.rope[0].device != device:
            self.rope = rope_tables(max(s, self.cfg.model.seq_length), *self._rope_cfg, device)
        return self.rope[0][:s], self.rope[1][:s]

    def forward(self, tokens, labels=None, loss_mask=None):
        """tokens, labels, loss_mask: [b, s]. Returns the mean masked loss
        (or the vocab-split logits when no labels are given)."""
        tg = self.groups.tp_group
        x = self.embedding(tokens.t())  # [s, b, h]
        s = x.shape[0]
        if self.pos is not None:
            x = x + self.pos[:s].unsqueeze(1)  # [s, 1, h] broadcast over b
        if self.sp:
            x = M.scatter_to_sequence_parallel_region(x, tg)  # [s/tp, b, h]
        p = self.cfg.model.hidden_dropout
        if p > 0 and self.training:
            if self.sp and self.rng is not None:
                with self.rng.fork(TP_STREAM):
                    x = F.dropout(x, p, True)
            else:
                x = F.dropout(x, p, True)
        rope = self._rope(s, x.device) if self.pos is None else None
        for layer in self.layers:
            x = layer(x, rope)
        x = self.final_norm(x)
        if self.sp:
            x = M.gather_from_sequence_parallel_region(x, tg, True)  # [s, b, h]
        else:
            x = M.copy_to_tensor_parallel_region(x, tg)
        w = self.output if self.output is not None else self.embedding.weight
        logits = F.linear(x, w)  # [s, b, V/tp]
        if labels is None:
            return logits
        fused = self.cfg.model.cross_entropy_loss_fusion  # the logits serve only the loss
        # labels [b, s] -> [s, b], as the logits; losses [s, b]
        losses = vocab_parallel_cross_entropy(logits, labels.t(), tg, fused, inplace=True)
        mask = loss_mask.t().float() if loss_mask is not None else torch.ones_like(losses)  # [s, b]
        return (losses * mask).sum() / mask.sum().clamp(min=1.0)
