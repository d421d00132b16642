"""Learning-rate schedule: linear warmup, then cosine decay to ``min_lr``."""

from __future__ import annotations

import math
from dataclasses import dataclass

from train_ref.config import TrainConfig


@dataclass(frozen=True)
class WarmupCosine:
    """LR multiplier for ``LambdaLR`` at a step count; a plain object so its state pickles as data."""

    warmup: int
    decay: int
    floor: float  # min_lr / lr

    @classmethod
    def of(cls, cfg: TrainConfig) -> WarmupCosine:
        return cls(cfg.warmup_steps, cfg.decay_steps, cfg.min_lr / cfg.lr)

    def __call__(self, step: int) -> float:
        if step < self.warmup:
            return (step + 1) / self.warmup
        t = min(1.0, (step - self.warmup) / max(1, self.decay - self.warmup))
        return self.floor + (1 - self.floor) * 0.5 * (1 + math.cos(math.pi * t))
