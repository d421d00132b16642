"""The retention policy: which valid checkpoints ``prune`` keeps, and why each one is kept.

Pure: one frozen ``RetentionPolicy`` (the newest N, every M-th step, one per period of wall time,
the best K by a metric, or all), ``plan_retention`` (checkpoint facts + policy -> kept steps with
their reasons), and the one place that turns command-line flags into a policy
(``add_retention_args`` / ``policy_from_args``: `ckpt prune`, `ckpt list`, and any trainer).
``supervisor/store/retention.py`` applies it on disk and re-exports it.
"""

from __future__ import annotations

import argparse
import math
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, fields
from enum import Enum
from typing import Any

from supervisor.format.manifest import Manifest
from supervisor.store.checkpoints import StoreError

DEFAULT_KEEP = 3
MIN_KEEP = 2
BEST_MODES = ("min", "max")


class KeepReason(str, Enum):
    """Why a checkpoint is kept; a checkpoint can have several."""

    NEWEST = "newest"  # one of the newest ``keep``
    MILESTONE = "milestone"  # its step is a multiple of ``milestone_every``
    PERIOD = "period"  # the oldest of its period of ``keep_every_s`` seconds
    BEST = "best"  # one of the best ``best_k`` by ``best_metric``
    ALL = "all"  # ``keep_all``


@dataclass(frozen=True)
class RetentionPolicy:
    """What ``prune`` keeps of the valid checkpoints; the others are deleted. The newest one is
    always kept (``keep >= MIN_KEEP``, so a corrupt newest has a fallback), whatever else is set.

    ``keep_every_s``: periods are aligned to the epoch (3600: on the hour, UTC), by the manifest's
    commit time, and the OLDEST checkpoint of each period is kept. The oldest, because it is
    decided by the first commit of a period and never changes after: keeping the newest would
    move the keeper with every commit and only settle when the period ends.

    ``best_metric``: the best ``best_k`` by the manifest's ``metrics[best_metric]`` (smallest with
    ``best_mode="min"``), ties to the older step (the one already kept); a checkpoint without a
    finite value of that metric is never among the best."""

    keep: int = DEFAULT_KEEP
    milestone_every: int = 0
    keep_every_s: float = 0.0
    best_metric: str = ""
    best_mode: str = "min"
    best_k: int = 1
    keep_all: bool = False

    def __post_init__(self) -> None:
        problem = _problem(self)
        if problem:
            raise StoreError(problem)

    def describe(self) -> str:
        """One line for a person: ``newest 3, every 1000th step, one per 3600s, best 2 by loss (min)``."""
        if self.keep_all:
            return "all"
        parts = [f"newest {self.keep}"]
        if self.milestone_every:
            parts.append(f"every {self.milestone_every}th step")
        if self.keep_every_s:
            parts.append(f"one per {self.keep_every_s:g}s")
        if self.best_metric:
            parts.append(f"best {self.best_k} by {self.best_metric} ({self.best_mode})")
        return ", ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_dict(cls, d: Mapping[str, Any]) -> RetentionPolicy:
        """The policy of ``to_dict``; StoreError on unknown or wrong-typed fields (a record
        another version wrote is reported, never a traceback)."""
        names = {f.name: f.type for f in fields(cls)}
        unknown = sorted(set(d) - set(names))
        if unknown:
            raise StoreError(f"unknown retention field '{unknown[0]}'")
        for key, value in d.items():
            want: type | tuple[type, ...] = _FIELD_TYPES[str(names[key])]
            if not isinstance(value, want) or (isinstance(value, bool) and names[key] != "bool"):
                raise StoreError(f"retention field '{key}' has the wrong type")
        return cls(**d)


_FIELD_TYPES: dict[str, type | tuple[type, ...]] = {
    "int": int,
    "float": (int, float),
    "str": str,
    "bool": bool,
}


def _problem(p: RetentionPolicy) -> str:
    """Why ``p`` cannot be applied, named by its command-line flag; '' when it can."""
    if p.keep < MIN_KEEP:
        return f"--keep {p.keep} refused: keep at least {MIN_KEEP} so a corrupt newest has a fallback"
    if p.milestone_every < 0:
        return f"--milestone-every {p.milestone_every} refused: give a step count >= 0 (0: no milestones)"
    if not (math.isfinite(p.keep_every_s) and p.keep_every_s >= 0):
        return f"--keep-every-s {p.keep_every_s} refused: give seconds > 0 (0: off)"
    if p.best_mode not in BEST_MODES:
        return f"--keep-best mode '{p.best_mode}' refused: give min or max (e.g. --keep-best loss:min)"
    if p.best_k < 1:
        return f"--keep-best K {p.best_k} refused: keep at least 1 (e.g. --keep-best loss:min:3)"
    return ""


# ---------------------------------------------------------------- the plan, pure


@dataclass(frozen=True)
class Candidate:
    """What retention needs to know of one valid checkpoint (from its manifest)."""

    step: int
    wall_time: float = 0.0  # when it was committed
    metrics: Mapping[str, float] = field(default_factory=dict)

    @classmethod
    def of(cls, m: Manifest) -> Candidate:
        return cls(m.step, m.wall_time, m.metrics)


KeptSteps = dict[int, tuple[KeepReason, ...]]


def plan_retention(candidates: Sequence[Candidate], policy: RetentionPolicy) -> KeptSteps:
    """The steps to keep, each with every reason it is kept (in KeepReason's order); the
    candidates not in it may be deleted. Candidates are the valid checkpoints: only they count,
    so ``keep=3`` leaves three usable ones."""
    if policy.keep_all:
        return {c.step: (KeepReason.ALL,) for c in candidates}
    why: dict[int, list[KeepReason]] = {}

    def add(chosen: Sequence[Candidate], reason: KeepReason) -> None:
        for c in chosen:
            why.setdefault(c.step, []).append(reason)

    add(sorted(candidates, key=lambda c: c.step, reverse=True)[: policy.keep], KeepReason.NEWEST)
    if policy.milestone_every > 0:
        add([c for c in candidates if c.step % policy.milestone_every == 0], KeepReason.MILESTONE)
    if policy.keep_every_s > 0:
        add(_oldest_per_period(candidates, policy.keep_every_s), KeepReason.PERIOD)
    if policy.best_metric:
        add(_best(candidates, policy), KeepReason.BEST)
    return {s: tuple(r) for s, r in sorted(why.items(), reverse=True)}


def _oldest_per_period(candidates: Sequence[Candidate], period_s: float) -> list[Candidate]:
    first: dict[int, Candidate] = {}
    for c in sorted(candidates, key=lambda c: (c.wall_time, c.step)):
        first.setdefault(math.floor(c.wall_time / period_s), c)
    return list(first.values())


def _best(candidates: Sequence[Candidate], policy: RetentionPolicy) -> list[Candidate]:
    sign = 1.0 if policy.best_mode == "min" else -1.0
    scored = [
        (sign * v, c.step, c)
        for c in candidates
        if (v := c.metrics.get(policy.best_metric)) is not None and math.isfinite(v)
    ]
    return [c for _, _, c in sorted(scored, key=lambda t: (t[0], t[1]))[: policy.best_k]]


# ---------------------------------------------------------------- flags


def add_retention_args(p: argparse.ArgumentParser, milestones: bool = True) -> None:
    """The policy's flags. Their defaults are None (``policy_from_args`` tells "not given" from a
    value), so each help says its default itself. ``milestones=False`` leaves out
    --milestone-every (the trainer's means the remote tier's milestones)."""
    g = p.add_argument_group("retention (which valid checkpoints prune keeps; the newest always)")
    g.add_argument(
        "--keep", type=int, help=f"the newest K valid ones (>= {MIN_KEEP}; default {DEFAULT_KEEP})"
    )
    if milestones:
        g.add_argument(
            "--milestone-every",
            type=int,
            metavar="M",
            help="also every step divisible by M (default 0: none)",
        )
    g.add_argument(
        "--keep-every-s",
        type=float,
        metavar="SECONDS",
        help="also the oldest of each period of SECONDS of commit time, periods aligned to the epoch "
        "(3600: one an hour, on the hour; default 0: off)",
    )
    g.add_argument(
        "--keep-best",
        type=_best_flag,
        metavar="METRIC:min|max[:K]",
        help="also the best K (default 1) by the manifest's metrics[METRIC], e.g. loss:min:3",
    )
    g.add_argument("--keep-all", action="store_true", default=None, help="keep every valid checkpoint")


def _best_flag(text: str) -> tuple[str, str, int]:
    """``loss:min``, ``val/acc:max:3`` -> (metric, mode, K); the metric may hold colons."""
    parts = text.split(":")
    k = 1
    if len(parts) >= 3 and parts[-1].isascii() and parts[-1].isdigit():
        k = int(parts.pop())
    mode = parts.pop() if len(parts) >= 2 else ""
    metric = ":".join(parts)
    if not metric or mode not in BEST_MODES:
        raise argparse.ArgumentTypeError(
            f"{text!r}: give METRIC:min or METRIC:max, optionally :K (e.g. loss:min:3)"
        )
    return metric, mode, k


def policy_from_args(args: argparse.Namespace, milestones: bool = True) -> RetentionPolicy | None:
    """The policy the flags of ``add_retention_args`` (with the same ``milestones``) ask for;
    None when none was given (the caller picks its default). StoreError when one is out of range."""
    names = ("keep", "milestone_every", "keep_every_s", "keep_best", "keep_all")
    given = {k: getattr(args, k, None) for k in names if milestones or k != "milestone_every"}
    if all(v is None for v in given.values()):
        return None
    best = given.pop("keep_best")
    values = {k: v for k, v in given.items() if v is not None}
    if best is not None:
        values.update(best_metric=best[0], best_mode=best[1], best_k=best[2])
    return RetentionPolicy(**values)
