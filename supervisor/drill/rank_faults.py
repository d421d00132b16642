"""Drill-only, at a rank's step boundary: a rank that hangs for real, at the step and place
``supervisor drill`` chose; and in the golden run, rank 0 keeping every checkpoint it commits.

Injected, not imported: the drill sets ``$SUPERVISOR_BOUNDARY_HOOK`` to ``switch.HOOK`` (this
module's ``boundary_hook``) beside ``TRAIN_REF_DRILL_HANG`` (format and marker names:
supervisor/drill/switch.py), and the library's step boundary calls what it returns.
The rank blocks in a read that never returns, the way a read from a dead file server or a peer that
never sends does, so no signal cures it: read(2) is interrupted, Python runs the handlers and
retries it (PEP 475), and the SIGTERM handler only sets the preemption flag, which is looked at on a
step boundary this rank never reaches again. The other ranks wait for it in the next collective.
faulthandler's SIGUSR2 dump runs at C level, so the rank's stack still shows where it is stuck.

Two more ways (``switch.How``): a collective the other ranks enter and the culprit skips, entering
another one under the same sequence number (every rank then waits forever); and a DataLoader worker
that deadlocks: the rank signals its workers (``switch.LOADER_SIGNAL``), and worker 0, whose
``worker_hook`` (supervisor/format/hooks.py, from the library's worker init) handles it, blocks
forever on a lock; the rank trains on the batches already fetched, then waits for that worker's.

Keeping (``switch.ENV_KEEP``): at every step boundary rank 0 hard-links each checkpoint committed
since the last one into the keep folder, so the trainer's own retention, which goes on pruning
the run dir, cannot take the golden checkpoints a faulted run is compared with. A checkpoint is
pruned only once newer ones are committed (at least two are kept), each at a later boundary: the
boundary after its commit always sees it.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import signal
import threading
import time
from typing import NoReturn

from supervisor.drill.switch import (
    ENV,
    ENV_KEEP,
    LOADER_SIGNAL,
    LOADER_WORKER,
    How,
    Keep,
    Switch,
    read_marker,
)
from supervisor.format.atomic import atomic_write_json
from supervisor.format.hooks import RankOps, When
from supervisor.store import list_checkpoints


class DrillFaults:
    def __init__(
        self,
        switch: Switch | None,
        rank: int,
        launch: str,
        keep: Keep | None = None,
        ops: RankOps | None = None,
    ) -> None:
        self.rank, self.launch, self.ops = rank, launch, ops
        # This rank's own hangs, and every collective hang: the other ranks enter what the culprit skips.
        self.mine = (
            [(h, switch.marker(h)) for h in switch.hangs if h.rank == rank or h.how == How.COLLECTIVE]
            if switch
            else []
        )
        self.keep = keep if rank == 0 else None
        self.kept: set[str] = set()

    @classmethod
    def from_env(cls, rank: int, launch: str, ops: RankOps | None = None) -> DrillFaults:
        try:
            switch = Switch.decode(text) if (text := os.environ.get(ENV)) else None
            keep = Keep.decode(text) if (text := os.environ.get(ENV_KEEP)) else None
        except ValueError as e:
            raise SystemExit(f"resumable: {e}") from None
        return cls(switch, rank, launch, keep, ops)

    @property
    def active(self) -> bool:
        return bool(self.mine) or self.keep is not None

    def __call__(self, step: int, when: When) -> None:
        if self.keep is not None and when == When.STEP:
            self.kept |= keep_committed(self.keep, self.kept)
        self.maybe_hang(step, when)

    def _ops(self) -> RankOps:
        assert self.ops is not None, "a collective hang runs through boundary_hook, given the rank's ops"
        return self.ops

    def maybe_hang(self, step: int, when: When) -> None:
        """Hang here if this rank is to and has not in an earlier launch (its marker says so
        first: what the drill waits for): block in a read, skip the collective the others enter,
        or deadlock a DataLoader worker. Another rank's collective hang: enter the collective it
        skips, unless an earlier launch hung there already."""
        for h, marker in self.mine:
            if h.step != step or h.when != when:
                continue
            if h.rank != self.rank:
                m = read_marker(marker)
                if m is None or m.get("launch") == self.launch:  # not yet, or in this very launch
                    self._ops().all_reduce()  # the collective the culprit skips (switch.SKIPPED_OP)
                continue
            if marker.exists():
                continue
            pids = worker_pids() if h.how == How.LOADER else []
            marker.parent.mkdir(parents=True, exist_ok=True)
            atomic_write_json(
                marker,
                {
                    "rank": h.rank,
                    "step": h.step,
                    "when": h.when.value,
                    "how": h.how.value,
                    "pid": os.getpid(),
                    "launch": self.launch,
                    "t": time.time(),
                    "workers": pids,
                },
            )
            if h.how == How.COLLECTIVE:
                skip_collective(self._ops())
            elif h.how == How.LOADER:
                for pid in pids:
                    with contextlib.suppress(ProcessLookupError):
                        os.kill(pid, LOADER_SIGNAL)
            else:
                stuck_read()


def boundary_hook(rank: int, launch: str, ops: RankOps) -> DrillFaults | None:
    """The hook of supervisor/format/hooks.py: this rank's hangs and keeping, or None when it has
    neither."""
    faults = DrillFaults.from_env(rank, launch, ops)
    return faults if faults.active else None


def keep_committed(keep: Keep, kept: set[str]) -> set[str]:
    """Link each committed checkpoint of ``keep.root`` not yet in ``kept`` into ``keep.into``
    (a copy where the file system cannot link); the names kept now. One that goes while it is
    linked (pruned: it was kept at an earlier boundary) is skipped."""
    done = set()
    keep.into.mkdir(parents=True, exist_ok=True)
    for ref in list_checkpoints(keep.root):
        dst = keep.into / ref.name
        if ref.name in kept or dst.exists():
            done.add(ref.name)
            continue
        part = keep.into / f".{ref.name}.linking"
        shutil.rmtree(part, ignore_errors=True)
        try:
            shutil.copytree(ref.path, part, copy_function=_link)
            os.rename(part, dst)
        except (OSError, shutil.Error):
            shutil.rmtree(part, ignore_errors=True)
            continue
        done.add(ref.name)
    return done


def _link(src: str, dst: str) -> str:
    try:
        os.link(src, dst)
    except OSError:
        shutil.copy2(src, dst)
    return dst


def skip_collective(ops: RankOps) -> None:
    """The culprit's branch: the all-reduce skipped, a barrier entered instead
    (``switch.INSTEAD_OP``): the same sequence number, another op, a hang on every rank."""
    ops.barrier()


def worker_pids() -> list[int]:
    """This process's children (its DataLoader workers, and whatever else it started)."""
    pids: list[int] = []
    for task in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{task}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except (OSError, ValueError):
            continue
    return sorted(set(pids))


def worker_hook(worker_id: int) -> None:
    """The worker hook of supervisor/format/hooks.py, in each DataLoader worker: worker 0 of a
    rank that is to deadlock its loader handles ``LOADER_SIGNAL`` by blocking forever."""
    try:
        switch = Switch.decode(text) if (text := os.environ.get(ENV)) else None
    except ValueError:
        return  # the rank itself refuses to start on it (from_env)
    rank = int(os.environ.get("RANK", "0"))
    if (
        switch
        and worker_id == LOADER_WORKER
        and any(h.rank == rank and h.how == How.LOADER for h in switch.hangs)
    ):
        signal.signal(LOADER_SIGNAL, deadlock)


def deadlock(_signum: int, _frame: object) -> NoReturn:  # named by switch.LOADER_BLOCKING_FUNCTION
    """A lock taken twice by the thread that holds it: the worker blocks forever, as one does on
    a lock some thread held when the process forked. No signal cures it (the worker ignores
    SIGINT and the notice; SIGTERM only from its rank ends it)."""
    lock = threading.Lock()
    lock.acquire()
    lock.acquire()
    raise AssertionError("unreachable")


def stuck_read() -> NoReturn:  # named by switch.BLOCKING_FUNCTION (tests/test_hang_culprit.py)
    """Read from a pipe whose write end this process holds and never writes: no data, no EOF."""
    r, _w = os.pipe()
    while True:
        os.read(r, 1)
