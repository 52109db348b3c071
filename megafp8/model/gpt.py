"""GPT decoder: embedding -> blocks -> final norm -> (tied) output layer -> vocab-parallel loss.

Inputs are batch-first ``[b, s]`` token ids (as the data loader gives them); activations are
sequence-first ``[s, b, h]``, and ``[s/tp, b, h]`` between TP regions under sequence parallelism.

Under pipeline parallelism each rank builds the part of the model its ``Stage`` holds
(``parallel/pipeline/stages.py``): the embedding on the first stage, its layers (named and seeded
by their global index), the final norm, output layer and loss on the last stage. A stage after the
first takes the previous stage's output as ``hidden``; a stage before the last returns its output.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from megafp8.config import Config
from megafp8.config_values import padded_vocab_size
from megafp8.model.block import TransformerBlock, make_norm
from megafp8.model.documents import document_mask, document_positions, gather_tables
from megafp8.model.recompute import Recompute
from megafp8.parallel import mappings as M
from megafp8.parallel.grad_in_place import linear
from megafp8.parallel.layers import (
    VocabParallelEmbedding,
    full_normal,
    mark_tp,
    param_seed,
    vocab_parallel_cross_entropy,
)
from megafp8.parallel.pipeline.stages import Stage, chunk_stages, virtual_size
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

    ``output_grad_in_place`` (set by the run under gradient accumulation fusion where ``.grad``
    accumulates untouched by hooks): the output layer's weight gradient GEMM adds into ``.grad``
    after the first micro-batch (``parallel/grad_in_place.py``).
    """

    output_grad_in_place = False

    def __init__(
        self,
        cfg: Config,
        *,
        backend,
        groups,
        vocab_size: int,
        device=None,
        rng=None,
        stage: Stage | None = None,
        eod: int | None = None,
    ):
        super().__init__()
        m = cfg.model
        # documents inside a sample (model/documents.py): found from the EOD id in the tokens
        self.eod, d = eod, cfg.data
        self.reset_positions, self.reset_mask = d.reset_position_ids, d.reset_attention_mask
        self.stage = stage = stage or Stage.whole(m.num_layers)
        self.cfg, self.groups, self.rng, self.backend = cfg, groups, rng, backend
        self.sp = cfg.parallel.sequence_parallel
        dtype = torch.bfloat16 if cfg.train.bf16 else torch.float32
        seed = cfg.train.seed
        tp_group = groups.tp_group
        self.vocab_size = vocab_size
        self.padded_vocab = padded_vocab_size(vocab_size, m.make_vocab_size_divisible_by, groups.tp)
        std = m.init_method_std
        self.embedding = self.pos = None
        if stage.first:
            self.embedding = self._word_embedding(device, dtype)
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
        self.recompute = Recompute(cfg, backend, rng)
        # keyed by the global layer index: the names ("layers.5.attn...") are one process's
        self.layers = nn.ModuleDict(
            (
                str(i),
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
                    recompute=self.recompute,
                ),
            )
            for i in stage.layers
        )
        self.final_norm = make_norm(cfg, backend, groups, dtype, device) if stage.last else None
        self.output = None
        if stage.last and not stage.first and not m.untie_embeddings_and_output_weights:
            # the tied output layer of a pipeline's last stage: a copy of the first stage's word
            # embedding, kept out of the optimizer; the schedule adds its gradient to the first
            # stage's and copies the updated weight back after each step
            copy = self._word_embedding(device, dtype).weight.detach().requires_grad_()
            self.register_buffer("tied_output_weight", copy)
        if stage.last and m.untie_embeddings_and_output_weights:
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
            self._rope_scaling = m.rope_scaling_factor if m.use_rope_scaling else None

    def _word_embedding(self, device, dtype) -> VocabParallelEmbedding:
        m = self.cfg.model
        return VocabParallelEmbedding(
            self.padded_vocab,
            m.hidden_size,
            name="embedding",
            tp_group=self.groups.tp_group,
            std=m.init_method_std,
            seed=self.cfg.train.seed,
            dtype=dtype,
            device=device,
        )

    def output_weight(self) -> torch.Tensor:
        """The output layer: the untied one, the word embedding, or the last stage's copy."""
        if self.output is not None:
            return self.output
        return self.embedding.weight if self.stage.first else self.tied_output_weight

    def _rope(self, s, device, positions=None):
        if self.rope is None or self.rope[0].shape[0] < s or self.rope[0].device != device:
            n = max(s, self.cfg.model.seq_length)
            self.rope = self.backend.rope_tables(n, *self._rope_cfg, device, self._rope_scaling)
        if positions is not None:  # each sample its own positions: [s, b, 1, d]
            return gather_tables(self.rope, positions)
        return tuple(t[:s] for t in self.rope)

    def _documents(self, tokens):
        """(positions [b, s] or None, attention mask [b, 1, s, s] or None) of the documents in
        the samples, where ``--reset-position-ids`` / ``--reset-attention-mask`` ask for them."""
        if not (self.reset_positions or self.reset_mask):
            return None, None
        if self.eod is None:
            raise ValueError(
                "reset_position_ids / reset_attention_mask find documents by the EOD id: build "
                "the model with eod=<the tokenizer's EOD id>"
            )
        pos = document_positions(tokens, self.eod) if self.reset_positions else None
        return pos, document_mask(tokens, self.eod) if self.reset_mask else None

    def forward(self, tokens, labels=None, loss_mask=None, hidden=None):
        """tokens, labels, loss_mask: [b, s]. Returns the mean masked loss (or the vocab-split
        logits when no labels are given); a stage before the last returns its output
        [s(/tp), b, h], and a stage after the first takes its input as ``hidden``."""
        tg = self.groups.tp_group
        s = tokens.shape[1]
        pos, mask = self._documents(tokens)
        x = self._embed(tokens, pos) if self.stage.first else hidden  # [s(/tp), b, h]
        rope = None
        if self.cfg.model.position_embedding_type == "rope":
            rope = self._rope(s, x.device, pos)
        layers = list(self.layers.values())
        for idx, checkpointed in self.recompute.layer_groups(len(layers)):
            run = _run_layers([layers[i] for i in idx], mask)
            x = self.recompute(run, x, *(rope or ())) if checkpointed else run(x, *(rope or ()))
        if not self.stage.last:
            return x
        x = self.final_norm(x)
        if self.sp:
            x = M.gather_from_sequence_parallel_region(x, tg, True)  # [s, b, h]
        else:
            x = M.copy_to_tensor_parallel_region(x, tg)
        logits = linear(x, self.output_weight(), self.output_grad_in_place)  # [s, b, V/tp]
        if labels is None:
            return logits
        fused = self.cfg.model.cross_entropy_loss_fusion  # the logits serve only the loss
        # labels [b, s] -> [s, b], as the logits; losses [s, b]
        losses = vocab_parallel_cross_entropy(logits, labels.t(), tg, fused, inplace=True)
        mask = loss_mask.t().float() if loss_mask is not None else torch.ones_like(losses)  # [s, b]
        return (losses * mask).sum() / mask.sum().clamp(min=1.0)

    def _embed(self, tokens, positions=None):
        """[b, s] token ids -> [s(/tp under SP), b, h] (word + position embedding, dropout);
        ``positions`` [b, s]: each token's position (None: 0 .. s-1 in every sample)."""
        tg = self.groups.tp_group
        x = self.embedding(tokens.t())  # [s, b, h]
        s = x.shape[0]
        if self.pos is not None and positions is not None:
            x = x + self.pos[positions.t()]  # [s, b, h]
        elif self.pos is not None:
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
        return x


def _run_layers(layers, mask=None):
    """The blocks ``layers`` in turn, as one function of (x, *rope tables); ``mask`` (the
    documents' attention mask, or None) is held by the function, not passed through it."""

    def run(x, *rope):
        for layer in layers:
            x = layer(x, rope or None, mask)
        return x

    return run


class GPTModelChunks(nn.Module):
    """The interleaved schedule's model on one pipeline rank: its v chunks (``GPTModel`` over the
    virtual stages of ``parallel/pipeline/stages.py: chunk_stages``) in one ``nn.ModuleList``, so
    one DeepSpeed engine (and ZeRO) holds every parameter of the rank. ``forward(..., chunk=c)``
    runs chunk c; parameter names are ``chunks.<c>.`` + the one-process name."""

    def __init__(self, chunks: list[GPTModel]):
        super().__init__()
        self.chunks = nn.ModuleList(chunks)
        self.padded_vocab = chunks[0].padded_vocab

    def forward(self, tokens, labels=None, loss_mask=None, hidden=None, chunk: int = 0):
        return self.chunks[chunk](tokens, labels, loss_mask, hidden=hidden)


def build_model(cfg: Config, *, backend, groups, vocab_size: int, device=None, rng=None, eod=None):
    """This pipeline rank's model: the ``GPTModel`` of its stage, or under the interleaved
    schedule the ``GPTModelChunks`` of its v chunks. ``eod``: the tokenizer's EOD id (needed by
    ``--reset-position-ids`` / ``--reset-attention-mask``)."""
    models = [
        GPTModel(
            cfg,
            backend=backend,
            groups=groups,
            vocab_size=vocab_size,
            device=device,
            rng=rng,
            stage=st,
            eod=eod,
        )
        for st in chunk_stages(cfg, groups.coords.pp)
    ]
    return models[0] if virtual_size(cfg) == 1 else GPTModelChunks(models)
