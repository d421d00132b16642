"""Corpus, tokenizer, data fingerprint and the dataset with its in-worker augmentation.

The built-in corpus is generated deterministically (no downloads); ``--corpus FILE`` trains on any
UTF-8 text instead. Augmentation (random crop offset, token masking) runs inside DataLoader workers
but draws from a generator seeded by (seed, epoch, global batch index, sample id), so a batch is the
same with 0 or N workers and after any resume: worker RNG is derived, never state to save.
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass
from pathlib import Path

import torch
from torch.utils.data import Dataset

from supervisor.resumable import SampleKey, mix_seed

DATA_VERSION = "chars-v1"
_SUBJECTS = ["the cat", "a dog", "my friend", "the old man", "a small bird", "the river", "our ship"]
_VERBS = ["sees", "follows", "finds", "carries", "remembers", "greets", "crosses"]
_OBJECTS = ["the hill", "a red box", "the quiet town", "an open door", "the long road", "a warm fire"]
_TAILS = ["at dawn", "in the rain", "without a word", "before night", "with great care", "again"]
BUILTIN_SENTENCES = 240


def build_corpus(n_sentences: int = BUILTIN_SENTENCES) -> str:
    """Deterministic pseudo-English text from a fixed linear congruential generator."""
    state, out = 12345, []
    for _ in range(n_sentences):
        words = []
        for table in (_SUBJECTS, _VERBS, _OBJECTS, _TAILS):
            state = (state * 6364136223846793005 + 1442695040888963407) % 2**64
            words.append(table[(state >> 33) % len(table)])
        out.append(" ".join(words).capitalize() + ".")
    return "\n".join(out) + "\n"


@dataclass(frozen=True)
class Tokenizer:
    """Characters of the corpus, sorted, plus one mask token at the end."""

    chars: str

    @property
    def vocab_size(self) -> int:
        return len(self.chars) + 1

    @property
    def mask_id(self) -> int:
        return len(self.chars)

    def encode(self, text: str) -> torch.Tensor:
        table = {c: i for i, c in enumerate(self.chars)}
        return torch.tensor([table[c] for c in text], dtype=torch.long)


@dataclass(frozen=True)
class Corpus:
    text: str
    source: str

    @classmethod
    def load(cls, path: str | None) -> Corpus:
        if path is None:
            return cls(build_corpus(), "builtin")
        return cls(Path(path).read_text(encoding="utf-8"), str(path))

    @property
    def tokenizer(self) -> Tokenizer:
        return Tokenizer("".join(sorted(set(self.text))))

    @property
    def fingerprint(self) -> str:
        """The manifest's ``data_fingerprint``: data version + corpus bytes + tokenizer."""
        h = hashlib.sha256()
        h.update(DATA_VERSION.encode() + b"\0")
        h.update(self.text.encode("utf-8") + b"\0")
        h.update(json.dumps(self.tokenizer.chars).encode())
        return "sha256:" + h.hexdigest()[:32]


class WindowDataset(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Sample i is the window starting at i * block_size, randomly cropped and masked."""

    def __init__(
        self, tokens: torch.Tensor, block: int, crop_max: int, mask_prob: float, mask_id: int, seed: int
    ):
        self.tokens, self.block, self.crop_max = tokens, block, crop_max
        self.mask_prob, self.mask_id, self.seed = mask_prob, mask_id, seed
        span = block + 1 + crop_max
        if len(tokens) < span:
            raise ValueError(f"corpus has {len(tokens)} tokens, needs at least {span} for one sample")
        self.n = (len(tokens) - span) // block + 1

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, key: SampleKey) -> tuple[torch.Tensor, torch.Tensor, int]:
        g = torch.Generator().manual_seed(mix_seed(self.seed, key.epoch, key.batch, key.sample))
        offset = int(torch.randint(0, self.crop_max + 1, (1,), generator=g))
        start = key.sample * self.block + offset
        w = self.tokens[start : start + self.block + 1]
        x, y = w[:-1].clone(), w[1:].clone()
        x[torch.rand(self.block, generator=g) < self.mask_prob] = self.mask_id
        return x, y, key.sample


def collate(
    items: list[tuple[torch.Tensor, torch.Tensor, int]],
) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    xs, ys, ids = zip(*items, strict=True)
    return torch.stack(xs), torch.stack(ys), list(ids)
