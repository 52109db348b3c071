"""Documents inside a sample: Megatron's ``--reset-position-ids`` and ``--reset-attention-mask``.

A sample is ``seq_length`` tokens cut from the stream of documents, so it may hold the end of one
document, whole ones and the start of another, each ended by the EOD id. The EOD belongs to the
document it ends; the next document starts right after it. For input tokens ``t`` [b, s]:

    doc[j] = the number of EODs in t[0 .. j-1]          (which document token j is in)
    pos[j] = j - (the index after the last EOD before j, else 0)
    mask[j, i] = i <= j and doc[i] == doc[j]            (causal, within the document)

so every document is seen as if it were a sample of its own starting at position 0.
"""

from __future__ import annotations

import torch


def document_ids(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, s] token ids -> [b, s]: the index of each token's document within its sample."""
    ends = (tokens == eod).long()
    return torch.cumsum(ends, dim=1) - ends


def document_positions(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, s] -> [b, s] int64: each token's position inside its document (0 at its start)."""
    b, s = tokens.shape
    idx = torch.arange(s, device=tokens.device).expand(b, s)
    after = torch.where(tokens == eod, idx + 1, torch.zeros_like(idx))  # next document's start
    start = torch.cummax(after, dim=1).values  # up to and including j
    start = torch.cat([start.new_zeros(b, 1), start[:, :-1]], dim=1)  # strictly before j
    return idx - start


def document_mask(tokens: torch.Tensor, eod: int) -> torch.Tensor:
    """[b, s] -> [b, 1, s, s] bool, True where query j may attend to key i (torch SDPA's
    convention): causal and inside one document. Every row holds its diagonal."""
    doc = document_ids(tokens, eod)
    s = tokens.shape[1]
    causal = torch.ones(s, s, dtype=torch.bool, device=tokens.device).tril()
    return ((doc[:, :, None] == doc[:, None, :]) & causal).unsqueeze(1)


def gather_tables(tables: tuple, positions: torch.Tensor) -> tuple:
    """RoPE tables [n, 1, 1, d] (one row per position) -> [s, b, 1, d] at ``positions`` [b, s]."""
    return tuple(t.reshape(t.shape[0], t.shape[-1])[positions.t()].unsqueeze(2) for t in tables)
