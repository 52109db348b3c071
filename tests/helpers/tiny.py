"""Tiny configs and one-call training used by many tests."""

from __future__ import annotations

import os

from megafp8.config import Config


def tiny_config(**sections) -> Config:
    base = Config().replace(
        model=dict(
            num_layers=2,
            hidden_size=64,
            num_attention_heads=4,
            seq_length=32,
            vocab_size=256,
            make_vocab_size_divisible_by=64,
        ),
        data=dict(mock_data=True),
        train=dict(micro_batch_size=2, global_batch_size=8, train_iters=5, seed=7),
        optim=dict(lr=1e-3, min_lr=1e-4, lr_warmup_iters=1, clip_grad=1.0, zero_stage=1),
        logging=dict(log_interval=1, log_memory=False),
    )
    return base.replace(**sections) if sections else base


def train_losses(cfg: Config) -> list[float]:
    """Train under the current process group (or alone); the lm loss of every iteration."""
    from megafp8.train import train

    os.environ.setdefault("DS_ACCELERATOR", "cpu")
    return [r["lm loss"] for r in train(cfg)]
