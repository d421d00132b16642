"""Two runs' checkpoints compared item by item: the record ``python -m supervisor.resumable._compare``
(torch side) prints and the drill (torch-free) reads to say where a resumed run left the golden one.

A checkpoint holds the state every rank shares (DCP: ``model``, ``optimizer`` and each other object
the trainer saves, by its own name: ``scheduler``, ``sampler``, ``step``...) and one file per rank
(``layout.rank_state_filename``) with that rank's RNG streams and the trainer's own per-rank items.
The names of that file's entries are declared here, for the training side that writes them and
for the drill that names them in a verdict.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

# The per-rank file's entries: one per RNG stream, and the trainer's own per-rank items.
TORCH_RNG = "torch_rng"  # {"cpu": the global CPU generator's state, "cuda": this rank's device's}
PYTHON_RNG = "python_rng"  # the random module's
NUMPY_RNG = "numpy_rng"  # numpy's global generator's
RNG_STREAMS = (PYTHON_RNG, NUMPY_RNG, TORCH_RNG)
RANK_USER_ITEMS = "user"  # Resumable(rank_items=...)
# ... which, once a loader keeps its position per rank, holds the trainer's own items and the
# loaders' positions by name (Resumable's RankItems).
RANK_OWN = "own"
RANK_LOADERS = "loaders"
# The key the shared state is saved under in DCP (its items below it).
SHARED = "app"
# Shared items with a fixed name (the others are named by the trainer).
MODEL = "model"
OPTIMIZER = "optimizer"
STEP = "step"


@dataclass(frozen=True)
class ItemDiff:
    """One item that differs: ``rank`` None for the shared state, else whose per-rank file; ``key``
    the first entry inside it that differs (``cpu``, ``0.weight``, ``last_epoch``); ``what`` how
    (``values differ``, ``only in golden``, ``shape (3,) vs (4,)``); ``learned`` whether that entry
    is a floating-point tensor (what training computes, not what it counts or draws)."""

    item: str
    rank: int | None
    key: str
    what: str
    learned: bool = False


@dataclass(frozen=True)
class StepDiff:
    """One step both runs saved: the items of the run's checkpoint that differ from golden's."""

    step: int
    differs: tuple[ItemDiff, ...]


@dataclass(frozen=True)
class Comparison:
    """Steps compared in order, up to the first that differs; ``problems``: why a step could not be
    compared (an unreadable checkpoint), one line each."""

    steps: tuple[StepDiff, ...] = ()
    problems: tuple[str, ...] = ()

    @property
    def first(self) -> StepDiff | None:
        """The first step compared whose checkpoints differ."""
        return next((s for s in self.steps if s.differs), None)

    def to_json(self) -> str:
        return json.dumps(asdict(self))

    @classmethod
    def from_json(cls, text: str) -> Comparison:
        """ValueError (a short reason) unless ``text`` is one of these records."""
        try:
            d = json.loads(text)
            steps = tuple(StepDiff(int(s["step"]), tuple(_item(x) for x in s["differs"])) for s in d["steps"])
            return cls(steps, tuple(str(p) for p in d["problems"]))
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"not a checkpoint comparison ({type(e).__name__}: {e})") from None


def _item(d: dict[str, Any]) -> ItemDiff:
    rank = d["rank"]
    return ItemDiff(
        str(d["item"]),
        None if rank is None else int(rank),
        str(d["key"]),
        str(d["what"]),
        bool(d.get("learned", False)),
    )
