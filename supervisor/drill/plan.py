"""Which faults a scenario injects, and when: pure, reproducible from a seed."""

from __future__ import annotations

import random
from dataclasses import dataclass
from enum import Enum


class Kind(str, Enum):
    KILL9 = "kill9"
    HANG = "hang"
    DURING_SAVE = "during-save"
    CORRUPT_LATEST = "corrupt-latest"
    PREEMPT = "preempt"


CHAOS = "chaos"
SCENARIOS = (*(k.value for k in Kind), CHAOS)
CORRUPTIONS = ("truncate", "bitflip", "delete-metadata")


@dataclass(frozen=True)
class Fault:
    kind: Kind
    at_step: int  # inject once the run has logged this step (in the current launch)
    rank: int  # the worker to hit (kill9, hang, during-save)
    corruption: str = ""  # corrupt-latest only

    def describe(self) -> str:
        what = {
            Kind.KILL9: f"kill -9 rank {self.rank}",
            Kind.HANG: f"SIGSTOP rank {self.rank}",
            Kind.DURING_SAVE: f"kill -9 rank {self.rank} while an async save is in flight",
            Kind.CORRUPT_LATEST: f"stop the job, {self.corruption} the newest checkpoint, start again",
            Kind.PREEMPT: "SIGUSR1 (preemption notice) to the watchdog",
        }[self.kind]
        return f"{what} after step {self.at_step}"


def steps_redone_bound(kind: Kind, save_every: int, save_in_flight: bool = False) -> int:
    """Most steps a resume may redo after this fault.

    A kill or hang loses at most the steps since the last committed save; when it lands while an
    async save is in flight, that save is lost too (by design it is never used): two intervals.
    A preemption checkpoints at the step boundary, so none. Stopping the job for a corruption
    checkpoints first, and the damaged newest one is skipped, so up to one interval.
    """
    if kind == Kind.PREEMPT:
        return 0
    if kind == Kind.DURING_SAVE or (save_in_flight and kind != Kind.CORRUPT_LATEST):
        return 2 * save_every
    return save_every


def plan(scenario: str, *, seed: int, steps: int, save_every: int, ranks: int) -> list[Fault]:
    """Faults for one scenario, spread over the run so each resume is judged before the next fault.

    Single scenarios inject one fault (corrupt-latest: one per kind of damage); chaos draws a random
    sequence of 3 to 4 faults of mixed kinds. The same seed always gives the same plan.
    """
    rng = random.Random(f"{seed}:{scenario}")
    # Faults land after the second save (so a resume has a checkpoint to come back to, and one to
    # fall back to) and before the last interval (so the resumed run still has steps to prove).
    lo, hi = 2 * save_every + 1, max(2 * save_every + 2, steps - save_every - 2)
    if scenario == CHAOS:
        kinds = [Kind(rng.choice([k.value for k in Kind])) for _ in range(rng.randint(3, 4))]
    elif scenario == Kind.CORRUPT_LATEST.value:
        kinds = [Kind.CORRUPT_LATEST] * len(CORRUPTIONS)
    elif scenario in SCENARIOS:
        kinds = [Kind(scenario)]
    else:
        raise ValueError(f"unknown scenario '{scenario}' (choose from {', '.join(SCENARIOS)})")
    # One slot per fault, in order, each at least a save interval after the previous one.
    span = (hi - lo) // len(kinds)
    if span < save_every + 1:
        raise ValueError(
            f"{steps} steps are too few for {len(kinds)} faults {save_every} steps apart; raise --steps"
        )
    faults = []
    corruptions = iter(CORRUPTIONS if scenario != CHAOS else rng.sample(CORRUPTIONS * 2, len(kinds)))
    for i, kind in enumerate(kinds):
        start = lo + i * span
        at = rng.randint(start, start + span - save_every - 1) if span > save_every + 1 else start
        if kind == Kind.DURING_SAVE:
            # Kill while the save of this step is in flight; a previous checkpoint exists to fall back to.
            at = max(2 * save_every, (at // save_every) * save_every)
        faults.append(
            Fault(
                kind=kind,
                at_step=at,
                rank=rng.randrange(ranks),
                corruption=next(corruptions) if kind == Kind.CORRUPT_LATEST else "",
            )
        )
    return faults
