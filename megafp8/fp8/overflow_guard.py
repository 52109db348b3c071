"""FP8 overflow fallback (``--fp8-overflow-fallback-steps``): the layers whose FP8 casts keep
overflowing leave FP8, all ranks agreeing; and the layer a GEMM or module belongs to."""

from __future__ import annotations

import logging
import re

import torch
import torch.distributed as dist

log = logging.getLogger(__name__)


_LAYER = re.compile(r"(?:^|\.)(layers\.\d+)(?:\.|$)")


def layer_name(name: str) -> str | None:
    """The transformer layer of a GEMM or module name: "chunks.0.layers.3.mlp.fc1" -> "layers.3"
    (layer indices are global, one process's); None outside the layers."""
    m = _LAYER.search(name)
    return m.group(1) if m else None


class Fp8OverflowGuard:
    """``--fp8-overflow-fallback-steps K``: a layer whose FP8 casts overflow (the backend's
    ``fp8_overflows``) in K iterations in a row leaves FP8 for good: ``fall_back_to_bf16``.

    After each iteration one MAX all-reduce over every rank of a per-layer flag vector (a
    superset of the TP x DP ranks that hold shards and replicas of a layer, so those agree, and
    every pipeline stage learns of every layer, rank 0 included, which logs the fallback once).
    The fallen-back layers and the current runs are checkpointed (``state_dict``) and applied
    again on load."""

    def __init__(self, backend, model, num_layers: int, steps: int | None, rank0: bool, device):
        self.backend, self.model, self.steps, self.rank0 = backend, model, steps, rank0
        self.device = device
        self.runs = [0] * num_layers  # iterations in a row with an overflow, per layer
        self.fallen: list[str] = []

    def after_iteration(self, iteration: int) -> list[str]:
        """Returns the layers that fell back now."""
        if self.steps is None:
            return []
        flags = torch.zeros(len(self.runs), dtype=torch.float32, device=self.device)
        for lay, flag in self.backend.fp8_overflows(self.model).items():
            i = int(lay.split(".")[1])
            flags[i] = torch.maximum(flags[i], flag.to(flags))
        if dist.is_initialized() and dist.get_world_size() > 1:
            dist.all_reduce(flags, op=dist.ReduceOp.MAX)
        new = []
        for i, f in enumerate(flags.tolist()):
            name = f"layers.{i}"
            self.runs[i] = self.runs[i] + 1 if f > 0 and name not in self.fallen else 0
            if self.runs[i] >= self.steps:
                new.append(name)
                self.runs[i] = 0
        for name in new:
            self.fall_back(name)
            if self.rank0:
                log.warning(
                    "FP8 overflow in %s for %d iterations in a row (to iteration %d): its GEMMs "
                    "run without FP8 from iteration %d on",
                    name, self.steps, iteration, iteration + 1,
                )  # fmt: skip
        return new

    def fall_back(self, name: str) -> None:
        self.backend.fall_back_to_bf16(self.model, name)
        if name not in self.fallen:
            self.fallen.append(name)

    def state_dict(self) -> dict:
        return {"layers": list(self.fallen), "runs": list(self.runs)}

    def load_state_dict(self, sd: dict) -> None:
        for name in sd.get("layers", []):
            self.fall_back(name)
        if len(sd.get("runs", [])) == len(self.runs):
            self.runs = list(sd["runs"])
        if self.fallen and self.rank0:
            log.info("FP8 off (fallen back after overflows) in: %s", ", ".join(self.fallen))
