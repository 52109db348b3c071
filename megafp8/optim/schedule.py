"""Learning-rate schedule (Megatron's): linear warmup, then constant / linear / cosine / WSD /
inverse-square-root decay.

``it`` is the 0-based count of steps taken before this one, Megatron's scheduler count: with
warmup the first step runs at ``init`` and the lr reaches its peak at ``it = warmup``.

warmup:  init + (lr - init) * it / warmup   for it <= warmup (init: --lr-warmup-init, 0)
decay:   r = (it - warmup) / (decay_iters - warmup), clipped to [0, 1]
         linear  min + (lr - min) * (1 - r)
         cosine  min + (lr - min) * 0.5 * (1 + cos(pi r))
         WSD     lr until decay_iters - wsd_iters, then the chosen anneal to min over wsd_iters
         inverse-square-root  max(min, lr * sqrt(warmup / it))   (needs warmup > 0)
after decay_iters: min (constant: lr throughout)
"""

from __future__ import annotations

import math


def _anneal(style: str, r: float) -> float:
    """Fraction of (lr - min_lr) left after a fraction r of the decay."""
    if style == "linear":
        return 1.0 - r
    if style == "cosine":
        return 0.5 * (1.0 + math.cos(math.pi * r))
    if style == "exponential":
        return 2.0 * (0.5**r) - 1.0
    if style == "minus_sqrt":
        return 1.0 - math.sqrt(r)
    raise ValueError(f"unknown decay style {style!r}")


def learning_rate(o, it: int, train_iters: int) -> float:
    """The lr for iteration ``it`` (0-based) from an ``OptimConfig``."""
    decay_iters = o.lr_decay_iters or train_iters
    if o.lr_warmup_iters and it <= o.lr_warmup_iters:
        init = o.lr_warmup_init
        return init + (o.lr - init) * it / o.lr_warmup_iters
    if o.lr_decay_style == "constant":
        return o.lr
    if it > decay_iters:
        return o.min_lr
    if o.lr_decay_style == "inverse-square-root":
        return max(o.min_lr, o.lr * math.sqrt(o.lr_warmup_iters / it))
    if o.lr_decay_style == "WSD":
        wsd = o.lr_wsd_decay_iters or max(1, (decay_iters - o.lr_warmup_iters) // 10)
        start = decay_iters - wsd
        if it < start:
            return o.lr
        r = (it - start) / wsd
        return o.min_lr + (o.lr - o.min_lr) * _anneal(o.lr_wsd_decay_style, r)
    span = max(1, decay_iters - o.lr_warmup_iters)
    r = min(1.0, max(0.0, (it - o.lr_warmup_iters) / span))
    return o.min_lr + (o.lr - o.min_lr) * _anneal(o.lr_decay_style, r)
