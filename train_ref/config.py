"""Named configurations and the config hash a checkpoint is tied to.

The hash covers everything that changes what one update does (model shape, optimizer, schedule,
global batch, augmentation); it leaves out where to stop (``--steps``) and how often to save, so a
run can be extended or its save interval changed without a refusal.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import asdict, dataclass, replace


@dataclass(frozen=True)
class ModelConfig:
    block_size: int
    n_layer: int
    n_head: int
    n_embd: int
    dropout: float
    vocab_size: int = 0  # filled in from the tokenizer


@dataclass(frozen=True)
class TrainConfig:
    """One update's recipe. ``global_batch`` sequences per step whatever the world size."""

    name: str
    model: ModelConfig
    global_batch: int
    lr: float
    min_lr: float
    warmup_steps: int
    decay_steps: int  # cosine horizon; independent of --steps so a run can be extended
    weight_decay: float
    grad_clip: float
    crop_max: int  # worker augmentation: random crop offset in [0, crop_max]
    mask_prob: float  # worker augmentation: input tokens replaced by the mask token
    trunc_min: int  # main-process python `random`: per-step sequence length in [trunc_min, block]
    noise_prob: float  # main-process numpy: input tokens replaced by random tokens
    loss_window: int = 16


CONFIGS: dict[str, TrainConfig] = {
    "tiny": TrainConfig(
        name="tiny",
        model=ModelConfig(block_size=32, n_layer=2, n_head=2, n_embd=32, dropout=0.1),
        global_batch=8,
        lr=3e-3,
        min_lr=3e-4,
        warmup_steps=5,
        decay_steps=200,
        weight_decay=0.1,
        grad_clip=1.0,
        crop_max=8,
        mask_prob=0.05,
        trunc_min=16,
        noise_prob=0.02,
    ),
    # ~50M parameters: 12 * n_layer * n_embd^2 = 12 * 16 * 512^2 = 50.3M (+ embeddings).
    "bench": TrainConfig(
        name="bench",
        model=ModelConfig(block_size=128, n_layer=16, n_head=8, n_embd=512, dropout=0.1),
        global_batch=8,
        lr=3e-4,
        min_lr=3e-5,
        warmup_steps=10,
        decay_steps=2000,
        weight_decay=0.1,
        grad_clip=1.0,
        crop_max=8,
        mask_prob=0.05,
        trunc_min=128,
        noise_prob=0.02,
    ),
}
# Steps of about 0.1 s on a shared core (4 ranks on 2 cores), every sequence full length: a step's
# compute far above a scheduler's jitter and alike on every rank, as a real one is
# (tests/straggler_sweep.py judges stragglers on it).
CONFIGS["small"] = replace(
    CONFIGS["tiny"],
    name="small",
    model=replace(CONFIGS["tiny"].model, block_size=64, n_layer=4, n_embd=128),
    trunc_min=64,
)
# As many bytes as "bench" in few large tensors (12 * 2 * 1536^2 = 56.6M parameters in 2 layers), as
# a large model's layers are: bench/checkpoint.py --config wide tells a cost per tensor from one per byte.
CONFIGS["wide"] = replace(
    CONFIGS["bench"], name="wide", model=replace(CONFIGS["bench"].model, n_layer=2, n_head=12, n_embd=1536)
)


def get_config(name: str, vocab_size: int) -> TrainConfig:
    """The named config with the tokenizer's vocabulary size; KeyError names the choices."""
    if name not in CONFIGS:
        raise KeyError(f"unknown config '{name}' (choose from {', '.join(sorted(CONFIGS))})")
    cfg = CONFIGS[name]
    return replace(cfg, model=replace(cfg.model, vocab_size=vocab_size))


def config_hash(cfg: TrainConfig) -> str:
    """sha256 of the canonical JSON of the config: the manifest's ``model_config_hash``."""
    blob = json.dumps(asdict(cfg), sort_keys=True, separators=(",", ":")).encode()
    return "sha256:" + hashlib.sha256(blob).hexdigest()[:32]
