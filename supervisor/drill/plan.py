"""Which faults a scenario injects, and when: pure, reproducible from a seed."""

from __future__ import annotations

import random
from collections.abc import Iterator
from dataclasses import dataclass, replace
from enum import Enum

from supervisor.drill.corruption import DRILL, Corruption


class Kind(str, Enum):
    KILL9 = "kill9"
    SIGSTOP = "sigstop"
    HANG = "hang"
    HANG_DURING_SAVE = "hang-during-save"
    HANG_COLLECTIVE = "hang-collective"
    HANG_LOADER = "hang-loader"
    DURING_SAVE = "during-save"
    CORRUPT_LATEST = "corrupt-latest"
    PREEMPT = "preempt"
    IO_ERROR = "io-error"
    DISK_FULL = "disk-full"
    SLOW_STORAGE = "slow-storage"
    HOSTILE = "hostile"
    MEMORY = "memory"


# Hangs the trainer inflicts on itself through the drill switch (switch.py): no signal cures them.
SELF_INFLICTED = frozenset({Kind.HANG, Kind.HANG_DURING_SAVE, Kind.HANG_COLLECTIVE, Kind.HANG_LOADER})
# hang-collective names the culprit as the rank whose collective differs from the others': it needs
# a majority (with two ranks, each is the odd one out for the other).
COLLECTIVE_LEAST_RANKS = 3
# Faults the watchdog must find as a hang, naming the culprit.
HANGS = frozenset({Kind.SIGSTOP, *SELF_INFLICTED})
# Faults that land while an async save is in flight, by construction.
IN_SAVE = frozenset({Kind.DURING_SAVE, Kind.HANG_DURING_SAVE})
# Faults of the storage under the run dir (the fault filesystem, storage.py): they need /dev/fuse,
# run only when asked for (--storage, --scenario storage) and chaos does not draw them.
STORAGE = (Kind.IO_ERROR, Kind.DISK_FULL, Kind.SLOW_STORAGE, Kind.HOSTILE)
# Faults the job survives without a relaunch: nothing to resume from, nothing redone.
NO_RESUME = frozenset({Kind.DISK_FULL})
# A full disk lasts until this many saves in a row have failed; it needs an interval for each, and
# one more for a save that works again.
DISK_FULL_FAILURES = 2
DISK_FULL_INTERVALS = DISK_FULL_FAILURES + 2  # the disk may fill in the save after the next, then recovers
# disk-full: the disk fills after a random number of writing operations into checkpoint tmp dirs,
# below this: a save of the drill's model makes about 150 (each rank's state file, shard and index,
# rank 0's manifest and renames), so it fills at a random moment of the next save or the one after,
# not between two saves (issue 44: where in a save the disk fills decided whether the ranks agreed).
DISK_FULL_FILL_WITHIN = 200
CHAOS = "chaos"
# Chaos does not draw these: each needs what a run may lack (3 ranks, DataLoader workers, a
# snapshot every step), and leaving them out keeps the plans every seed gave before they existed.
NOT_DRAWN = frozenset({Kind.HANG_COLLECTIVE, Kind.HANG_LOADER, Kind.MEMORY})
# Chaos draws this many faults (fewer, down to CHAOS_LEAST, where --steps has no room: ``adapt``).
CHAOS_FAULTS = (3, 4)
CHAOS_LEAST = 2
STORAGE_GROUP = "storage"
# How the preempt scenario preempts (DrillConfig.preempt_as): as SLURM does on a preemption, a
# time limit or scancel (SIGTERM to every process of the job: watchdog, torchrun's agent, ranks,
# DataLoader workers; then a requeue starts the job again), or the notice of ``--signal`` without
# ``B:`` (SIGUSR1 to every process; the watchdog relaunches).
PREEMPT_SLURM = "slurm"
PREEMPT_NOTICE = "notice"
PREEMPT_AS = (PREEMPT_SLURM, PREEMPT_NOTICE)
SCENARIOS = (*(k.value for k in Kind), CHAOS)


@dataclass(frozen=True)
class Fault:
    kind: Kind
    at_step: int  # inject once the run has logged this step; a self-inflicted hang blocks at it
    rank: int  # the worker to hit (kill9, sigstop, hang, hang-during-save, during-save)
    corruption: Corruption | None = None  # corrupt-latest only
    preempt_as: str = PREEMPT_SLURM  # preempt only
    fill_after: int = 0  # disk-full only: writing operations into tmp dirs let through first

    def describe(self) -> str:
        what = {
            Kind.KILL9: f"kill -9 rank {self.rank}",
            Kind.SIGSTOP: f"SIGSTOP rank {self.rank}",
            Kind.HANG: f"rank {self.rank} blocks forever in a read (no signal cures it)",
            Kind.HANG_DURING_SAVE: f"rank {self.rank} blocks forever in a read while its async save is in flight",
            Kind.HANG_COLLECTIVE: (
                f"rank {self.rank} skips the all_reduce the other ranks enter and enters a barrier instead"
            ),
            Kind.HANG_LOADER: f"a DataLoader worker of rank {self.rank} blocks forever on a lock",
            Kind.DURING_SAVE: f"kill -9 rank {self.rank} while an async save is in flight",
            Kind.CORRUPT_LATEST: f"stop the job, {self.corruption and self.corruption.value} the newest checkpoint, start again",
            Kind.PREEMPT: (
                "SIGTERM to every process of the job (SLURM's preemption), then the job started again"
                if self.preempt_as == PREEMPT_SLURM
                else "SIGUSR1 (the preemption notice) to every process of the job"
            ),
            Kind.IO_ERROR: f"EIO on the next reads of shard files, then kill -9 rank {self.rank}",
            Kind.DISK_FULL: (
                f"ENOSPC on every checkpoint write from the {self.fill_after + 1}th into a tmp dir on (a random "
                f"moment of a save) until {DISK_FULL_FAILURES} saves have failed"
            ),
            Kind.SLOW_STORAGE: f"throttle checkpoint reads and writes, then kill -9 rank {self.rank}",
            Kind.HOSTILE: f"plant links out of the run dir, a deep tmp dir, sparse files; kill -9 rank {self.rank}",
            Kind.MEMORY: f"kill -9 rank {self.rank} right after a step no disk checkpoint holds (the memory tier on)",
        }[self.kind]
        return f"{what} after step {self.at_step}"


def steps_redone_bound(
    kind: Kind, save_every: int, save_in_flight: bool = False, memory_every: int = 1
) -> int:
    """Most steps a resume may redo after this fault.

    A kill or hang loses at most the steps since the last committed save; when it lands while an
    async save is in flight, that save is lost too (by design it is never used): two intervals.
    A preemption checkpoints at the step boundary, so none. Under the memory tier with a snapshot
    every step (``memory_every`` 1), none: a step's line is written only once every rank's copy of it
    is whole (supervisor/resumable/_steplog.py), so the run resumes from the last step logged; with
    the trainer's own interval (0: a user's script), up to an interval of the disk's, which the
    memory pick is never older than. Stopping the job for a corruption
    checkpoints first, and the damaged newest one is skipped, so up to one interval. (A SIGSTOP is
    cured by the watchdog's SIGCONT and SIGTERM, so it usually checkpoints too; it is held to the
    bound of a kill, which it meets when SIGTERM's grace runs out.)
    """
    if kind == Kind.PREEMPT:
        return 0
    if kind == Kind.MEMORY:
        return 0 if memory_every == 1 else save_every
    if kind in IN_SAVE or (save_in_flight and kind != Kind.CORRUPT_LATEST):
        return 2 * save_every
    if kind == Kind.HANG_LOADER:  # the rank hangs a few steps later, when the prefetched batches run out
        return 2 * save_every  # and a save may be in flight then
    return save_every


def plan(
    scenario: str,
    *,
    seed: int,
    steps: int,
    save_every: int,
    ranks: int,
    adapt: bool = False,
    preempt_as: str = PREEMPT_SLURM,
    num_workers: int = 2,
) -> list[Fault]:
    """Faults for one scenario, in order, each more than a save interval after the previous one, so
    each resume is judged before the next fault (and a hang the trainer inflicts on itself at its
    step cannot fire before the fault ahead of it was injected).

    Single scenarios inject one fault (corrupt-latest: one per kind of damage); chaos draws a random
    sequence of 3 to 4 faults of mixed kinds (drawn again when they do not fit). The same seed
    always gives the same plan. ``adapt`` (the default scenario set): where ``steps`` has no room
    for them all, corrupt-latest does fewer kinds of damage and chaos draws fewer faults (at least
    2); a ValueError says what does not fit even so.
    """
    rng = random.Random(f"{seed}:{scenario}")
    # Faults land after the second save (so a resume has a checkpoint to come back to, and one to
    # fall back to) and before the last interval (so the resumed run still has steps to prove).
    lo, hi = 2 * save_every + 1, max(2 * save_every + 2, steps - save_every - 2)
    if scenario == Kind.DISK_FULL.value:
        hi = steps - DISK_FULL_INTERVALS * save_every - 1
    if scenario not in SCENARIOS:
        raise ValueError(f"unknown scenario '{scenario}' (choose from {', '.join(SCENARIOS)})")
    if scenario == Kind.HANG_COLLECTIVE.value and ranks < COLLECTIVE_LEAST_RANKS:
        raise ValueError(
            f"{scenario} needs --ranks {COLLECTIVE_LEAST_RANKS} or more: the culprit is the rank whose "
            "collective differs from the majority's"
        )
    if scenario == Kind.HANG_LOADER.value and num_workers < 1:
        raise ValueError(f"{scenario} needs DataLoader workers (--num-workers 1 or more)")
    kinds: list[Kind] = []
    at_steps: list[int] | None = None
    for draws in _draws(scenario, rng, adapt):
        laid = ((kinds, _lay_out(kinds, rng, lo, hi, save_every)) for kinds in draws)
        kinds, at_steps = next(((k, at) for k, at in laid if at is not None), ([], None))
        if at_steps is not None:
            break
    if at_steps is None:
        fewest = (
            (CHAOS_LEAST if adapt else CHAOS_FAULTS[0]) if scenario == CHAOS else len(_first_draw(scenario))
        )
        raise ValueError(
            f"{steps} steps are too few for {fewest} {scenario} fault(s) {save_every} steps apart "
            f"(after the second save, before the last interval); raise --steps or lower --save-every"
        )
    corruptions = iter(DRILL if scenario != CHAOS else rng.sample(DRILL * 2, len(kinds)))
    faults = [
        Fault(
            kind=kind,
            at_step=at,
            rank=rng.randrange(ranks),
            corruption=next(corruptions) if kind == Kind.CORRUPT_LATEST else None,
            preempt_as=preempt_as,
        )
        for kind, at in zip(kinds, at_steps, strict=True)
    ]
    # memory: a step no disk checkpoint holds (a save's step moves one on)
    faults = [
        replace(f, at_step=f.at_step + 1) if f.kind == Kind.MEMORY and f.at_step % save_every == 0 else f
        for f in faults
    ]
    # drawn last: the other scenarios' plans stay what their seeds always gave
    return [
        replace(f, fill_after=rng.randrange(DISK_FULL_FILL_WITHIN)) if f.kind == Kind.DISK_FULL else f
        for f in faults
    ]


def _first_draw(scenario: str) -> list[Kind]:
    return [Kind.CORRUPT_LATEST] * len(DRILL) if scenario == Kind.CORRUPT_LATEST.value else [Kind(scenario)]


def _draws(scenario: str, rng: random.Random, adapt: bool) -> Iterator[Iterator[list[Kind]]]:
    """Groups of candidate fault sequences, the fullest first; the first sequence that fits wins.
    Without ``adapt`` there is one group: the scenario as it is meant."""
    if scenario == CHAOS:
        drawable = [k.value for k in Kind if k not in STORAGE and k not in NOT_DRAWN]
        fewer = range(CHAOS_FAULTS[0] - 1, CHAOS_LEAST - 1, -1) if adapt else range(0)
        for count in (None, *fewer):  # None: drawn each time, as chaos is meant
            yield (
                [Kind(rng.choice(drawable)) for _ in range(count or rng.randint(*CHAOS_FAULTS))]
                for _ in range(100)
            )
        return
    full = _first_draw(scenario)
    for n in range(len(full), 0 if adapt else len(full) - 1, -1):
        yield iter([full[:n]])


def _lay_out(kinds: list[Kind], rng: random.Random, lo: int, hi: int, save_every: int) -> list[int] | None:
    """A random step in [lo, hi] for each fault, in order, more than ``save_every`` apart; a fault
    that strikes inside a save gets a save step (its save is in flight then). None: they do not fit."""
    gap = save_every + 1

    def up(kind: Kind, step: int) -> int:
        return -(-step // save_every) * save_every if kind in IN_SAVE else step

    def down(kind: Kind, step: int) -> int:
        return step // save_every * save_every if kind in IN_SAVE else step

    latest: list[int] = []
    bound = hi  # the latest step for each fault that still leaves room for the rest
    for kind in reversed(kinds):
        latest.insert(0, down(kind, bound))
        bound = latest[0] - gap
    out, earliest = [], lo - 1  # a save of step 2 x save_every may be hit: the first save is committed
    for kind, last in zip(kinds, latest, strict=True):
        first = up(kind, earliest) if kind in IN_SAVE else max(lo, earliest)
        if first > last:
            return None
        stride = save_every if kind in IN_SAVE else 1
        out.append(first + stride * rng.randint(0, (last - first) // stride))
        earliest = out[-1] + gap
    return out
