"""The memory tier on a rank (docs/tiers.md#the-memory-tier): the whole training state of a step
copied into node-local shared memory that the node's watchdog owns (supervisor/format/memsnap.py),
and a relaunch's resume from it.

Taking a snapshot (``Resumable.step_end``, before the step's metrics line):

- the state's structure and every value that is not a tensor are encoded on the loop (they change
  with the next step); the tensors are written, raw, at their offsets of the slot's data file and
  hashed (xxh3-128), then the index is written by rename;
- a copy that costs at most the overhead budget of a step (3%) is made on the loop, every step: its
  metrics line is then written only once the step is in memory, so a kill after it redoes nothing.
  A larger one goes to a thread, every N steps so that one copy per N steps stays within the budget
  (``memsnap.plan``, measured on this rank; rank 0's interval is agreed by every rank in the step's
  control all-reduce). The tensors only the optimizer step changes (parameters, optimizer state) are
  copied there as they are: ``wait`` (the optimizer's pre-step hook) holds the next step until the
  copy is done; every other tensor (buffers a forward changes, a moving average) is cloned first;
- a rank starts a snapshot only when every rank agreed that none is still copying the previous one
  (the control all-reduce's ``busy``): the slot it overwrites is then never the newest one every
  rank finished. At that agreement each node's local rank 0 records the previous one as committed.

Writes use ``pwrite`` into a file whose pages were allocated first (``posix_fallocate``): a full
/dev/shm is ENOSPC at that call, never a SIGBUS in the middle of a copy. Any failure turns the tier
off on this rank for the launch (one warning), and the others with it at the next agreement: the
disk tier goes on as before.

Resuming (``Resumable.resume``): the watchdog's pick (``pick.json``) names the step, slot and folder
for this launch; every rank checks its own snapshot (identity, world size, the state's structure
against its own, every tensor's dtype and shape, the checksum) before anything is copied, the
ranks agree, and only then is every tensor copied into the state's own tensors (as DCP loads, in
place) and ``load_state_dict`` called, the RNG streams and per-rank items restored last.
"""

from __future__ import annotations

import contextlib
import ctypes
import logging
import mmap
import os
import time
from collections.abc import Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.distributed.checkpoint.stateful import Stateful
from torch.distributed.tensor import DTensor

from supervisor import memroom
from supervisor.format import memsnap
from supervisor.format.heartbeat import ENV_RESTART_COUNT
from supervisor.format.layout import MEMORY_DIR_ENV
from supervisor.format.statediff import RANK_USER_ITEMS
from supervisor.resumable._optim_state import prime_for_load
from supervisor.resumable._train_state import RankState
from supervisor.store.ioerrors import describe

log = logging.getLogger("resumable")

_EWMA = 0.3  # weight of the newest measure in the running copy and step times
# Steps after an off-loop snapshot that it slows: the one beside the copy (which the optimizer's
# hook ends with it) and the next (caches). Tiny, 17 steps apart, by distance from the snapshot:
# +2.8 ms on the loop at the snapshot, +1.0 and +0.3 ms the next two steps, +0.0 the third.
_AFTERMATH = 2


def _local(t: torch.Tensor) -> torch.Tensor:
    """This rank's part of ``t``: a DTensor's local tensor as it holds it (``to_local`` goes
    through an autograd Function: 0.1 ms a call, a tenth of a tiny snapshot's time per tensor)."""
    return t._local_tensor if isinstance(t, DTensor) else t


_DTYPE_NAMES = {
    getattr(torch, n): n for n in memsnap.DTYPE_SIZES if isinstance(getattr(torch, n, None), torch.dtype)
}


def _dtype_name(t: torch.Tensor) -> str:
    name = _DTYPE_NAMES.get(t.dtype)
    if name is None:
        raise memsnap.Unsupported(f"a tensor of dtype {t.dtype}")
    return name


def _cpu_contiguous(t: torch.Tensor) -> torch.Tensor:
    """``t``'s elements in CPU memory, contiguous (a copy only when they are not)."""
    t = t.detach()
    if t.device.type != "cpu":
        t = t.cpu()
    return t.resolve_conj().resolve_neg().contiguous()


def _view(t: torch.Tensor) -> memoryview:
    """The bytes of a contiguous CPU tensor, read in place (by address: a numpy view of each
    tensor cost ~10x as much, and a tiny model's snapshot is 100+ small tensors)."""
    return memoryview((ctypes.c_char * (t.numel() * t.element_size())).from_address(t.data_ptr())).cast("B")


def _write(fd: int, entries: tuple[memsnap.TensorEntry, ...], tensors: list[torch.Tensor]) -> str:
    """Every tensor's bytes at its offset, a few writes of many buffers each (the padding between
    them is written as zeros); returns their checksum, in table order."""
    import xxhash

    h = xxhash.xxh3_128()
    batch: list[memoryview | bytes] = []
    held: list[torch.Tensor] = []  # the bytes in ``batch`` are theirs: alive until written
    start = end = 0
    for entry, t in zip(entries, tensors, strict=True):
        if not entry.nbytes:
            continue
        if len(batch) >= _IOV_BATCH:
            _pwritev_all(fd, batch, start)
            batch, held = [], []
        if not batch:
            start = end = entry.offset
        held.append(_cpu_contiguous(t))
        data = _view(held[-1])
        h.update(data)
        batch += [bytes(entry.offset - end), data] if entry.offset > end else [data]
        end = entry.offset + entry.nbytes
    if batch:
        _pwritev_all(fd, batch, start)
    return h.hexdigest()


_IOV_BATCH = 512  # buffers per pwritev (Linux takes up to 1024)


def _pwritev_all(fd: int, buffers: list[memoryview | bytes], offset: int) -> None:
    views = [memoryview(b).cast("B") for b in buffers]
    while views:
        n = os.pwritev(fd, views, offset)
        offset += n
        while views and n >= len(views[0]):
            n -= len(views[0])
            views.pop(0)
        if views and n:
            views[0] = views[0][n:]


def _leaves(obj: Any, path: tuple[Any, ...] = ()) -> dict[tuple[Any, ...], torch.Tensor]:
    """Every tensor of a state dict by its path (the keys and indexes of ``memsnap.decode``)."""
    if isinstance(obj, torch.Tensor):
        return {path: obj}
    items = obj.items() if isinstance(obj, dict) else enumerate(obj) if isinstance(obj, list | tuple) else ()
    out: dict[tuple[Any, ...], torch.Tensor] = {}
    for k, v in items:
        out.update(_leaves(v, (*path, k)))
    return out


@dataclass
class _Captured:
    """One snapshot, taken on the loop: its index (checksum to come) and its tensors, in order."""

    index: memsnap.RankIndex
    tensors: list[torch.Tensor]
    slot: int


@dataclass(frozen=True)
class Planned:
    """This launch's pick, and this rank's snapshot in it, checked (``MemoryTier.check``), with
    the state's own tensors the load copies into, by path."""

    pick: memsnap.Pick
    index: memsnap.RankIndex
    folder: Path
    template: Mapping[tuple[Any, ...], torch.Tensor]


# A rank's verdict on the pick when the watchdog made none for this launch (a cold start, a resume
# from the disk tier): the same on every rank then, and not a refusal.
NO_PICK = "no memory snapshot picked for this launch"


def combined(verdicts: list[tuple[int, str]]) -> str:
    """The ranks' verdicts (the step picked for each, its refusal or '') as one: '' when every
    rank checked its snapshot of one same step (each node's watchdog picks for its own ranks),
    NO_PICK when none was picked anywhere, else the first refusal."""
    refusals = [(r, why) for r, (_, why) in enumerate(verdicts) if why]
    if not refusals:
        steps = {step for step, _ in verdicts}
        if len(steps) == 1:
            return ""
        by_step = ", ".join(
            f"step {s} on rank {next(r for r, (t, _) in enumerate(verdicts) if t == s)}"
            for s in sorted(steps)
        )
        return f"the nodes picked different steps ({by_step})"
    if all(why == NO_PICK for _, why in refusals) and len(refusals) == len(verdicts):
        return NO_PICK
    r, why = next(((r, w) for r, w in refusals if w != NO_PICK), refusals[0])
    return f"rank {r}: {why}"


def common_step(offers: Sequence[Sequence[int]]) -> int | str:
    """The newest step every rank's node holds a snapshot of (each rank offers its node's pick's
    steps: ``Pick.steps``; none: no pick), or why there is none: NO_PICK when no rank has a pick.
    A node standing in for a lost one holds that node's replica, which can be one push behind
    the other nodes' newest: they all go back to the step before, not to the disk."""
    if not any(offers):
        return NO_PICK
    without = next((r for r, steps in enumerate(offers) if not steps), None)
    if without is not None:
        return f"rank {without}: {NO_PICK}"
    common = set(offers[0]).intersection(*offers[1:])
    if common:
        return max(common)
    first: dict[tuple[int, ...], int] = {}  # each distinct offer, by the first rank that made it
    for r, steps in enumerate(offers):
        first.setdefault(tuple(steps), r)
    shown = [f"rank {r}: {', '.join(map(str, steps))}" for steps, r in first.items()]
    more = f"; and {len(shown) - 4} more" if len(shown) > 4 else ""
    return f"no step that every node holds a snapshot of ({'; '.join(shown[:4])}{more})"


class MemoryTier:
    """One rank's memory tier, for one launch (``from_env``: only under a watchdog that made the
    folder)."""

    def __init__(self, folder: Path, rank: int, world_size: int, every: int = 0) -> None:
        self.folder, self.rank, self.world_size, self.every = folder, rank, world_size, every
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        self.local_world_size = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        self.launch_number = int(os.environ.get(ENV_RESTART_COUNT, "0")) + 1
        self.launch = ""  # the launch id, set by resume()
        self.sync, self.interval = True, every or 1  # this rank's mode; rank 0's interval for all
        self.last = 0  # the step of the last snapshot taken
        self.snapshots = 0  # taken by this launch: the slot alternates
        self.first_slot = 0
        self.uncommitted: tuple[int, int] | None = None  # (step, slot) of the last one, to commit
        self._pin: tuple[tuple[int, int], int | None] | None = None  # pinned.json's (inode, mtime), slot
        self.copy_s = 0.0  # running cost of one snapshot to the loop, and step time without one
        self.step_s = 0.0
        # An off-loop snapshot's cost, gathered while it is near: its start on the loop, then how
        # much longer than a step without one each of the next _AFTERMATH steps took (``observe``).
        self._near: tuple[int, float, float] | None = None  # (steps seen since, start, slowdown)
        self.blocked_s = 0.0  # the loop's time in snapshots and their waits, this launch
        self.broken = ""  # why the tier is off on this rank ('' : on)
        self._pending: Future[str] | None = None
        self._fds: dict[int, tuple[int, int]] = {}  # slot -> (fd, size) of this rank's data file
        self._pool: ThreadPoolExecutor | None = None

    @classmethod
    def from_env(cls, rank: int, world_size: int, every: int) -> MemoryTier | None:
        folder = os.environ.get(MEMORY_DIR_ENV)
        if not folder or not os.path.isdir(folder):
            return None
        return cls(Path(folder), rank, world_size, every)

    # ------------------------------------------------------------ the control all-reduce

    def flags(self) -> tuple[int, int, int, int]:
        """This rank's part of the step's control all-reduce (SUM): not free to snapshot, rank 0's
        interval, off, still copying."""
        copying = self._pending is not None and not self._pending.done()
        busy = copying or self._pinned()
        return int(busy), self.interval if self.rank == 0 else 0, int(bool(self.broken)), int(copying)

    def _pinned(self) -> bool:
        """The slot the next snapshot goes to is being pushed to the buddy (memsnap.Pinned). One
        stat a step; the record is read only when it changed."""
        try:
            st = os.stat(self.folder / memsnap.PINNED)
        except OSError:
            self._pin = None
            return False
        if self._pin is None or self._pin[0] != (st.st_ino, st.st_mtime_ns):
            pinned = memsnap.read_pinned(self.folder)
            self._pin = ((st.st_ino, st.st_mtime_ns), pinned.slot if pinned else None)
        return self._pin[1] == (self.first_slot + self.snapshots) % memsnap.SLOTS

    def due(self, step: int, busy: bool, interval: int, off: bool) -> bool:
        """Whether this step is snapshotted: the same answer on every rank (every input agreed, or
        the same on all). On an agreement that nobody is copying, the last one is committed."""
        if off and not self.broken:
            self._off("another rank's memory tier is off")
        if self.broken:
            return False
        if not busy and self.uncommitted is not None:
            self._commit(*self.uncommitted)
        return not busy and step - self.last >= max(1, interval)

    def _commit(self, step: int, slot: int) -> None:
        self.uncommitted = None
        if self.local_rank != 0:
            return
        try:
            memsnap.write_record(
                self.folder / memsnap.COMMITTED,
                memsnap.Commit(step, slot, self.launch, time.time()).to_dict(),
            )
        except OSError as e:
            self._off(f"{self.folder / memsnap.COMMITTED}: {describe(e)}")

    # ------------------------------------------------------------ taking a snapshot

    def snapshot(
        self,
        step: int,
        state: Any,
        extra: Stateful | None,
        meta: Mapping[str, Any],
        identity: Mapping[str, Any],
    ) -> bool:
        """Snapshot ``state`` (a Saveable: its full state dict, not a save's share) at ``step``;
        whether it was taken (made on the loop, or its copy started on the thread)."""
        t0 = time.perf_counter()
        self.wait()
        self._settle()
        taken = False
        try:
            cap = self._capture(step, state, extra, meta, identity)
            if self.sync:
                self._finish(cap)
                self._cost(time.perf_counter() - t0)
            else:
                self._pending = self._executor().submit(self._finish, cap)
                self._near = (0, time.perf_counter() - t0, 0.0)
            taken = True
        except (OSError, memsnap.Unsupported, memsnap.SnapshotError) as e:
            self._off(self._os_error(e) if isinstance(e, OSError) else str(e))
        self.last, self.snapshots = step, self.snapshots + 1
        self.blocked_s += time.perf_counter() - t0
        return taken

    def _capture(
        self,
        step: int,
        state: Any,
        extra: Stateful | None,
        meta: Mapping[str, Any],
        identity: Mapping[str, Any],
    ) -> _Captured:
        sd = state.state_dict()
        own = RankState.capture()
        if extra is not None:
            own[RANK_USER_ITEMS] = extra.state_dict()
        stable = set() if self.sync else _stable(state)
        tensors: list[torch.Tensor] = []

        def ref(x: Any) -> int | None:
            if not isinstance(x, torch.Tensor):
                return None
            t = _local(x).detach()
            tensors.append(t if self.sync or t.data_ptr() in stable else t.clone())
            return len(tensors) - 1

        shared_tree, own_tree = memsnap.encode(sd, ref), memsnap.encode(own, ref)
        entries, size = memsnap.layout([(_dtype_name(t), tuple(t.shape)) for t in tensors])
        slot = (self.first_slot + self.snapshots) % memsnap.SLOTS
        index = memsnap.RankIndex(
            step=step,
            launch=self.launch,
            rank=self.rank,
            local_rank=self.local_rank,
            local_world_size=self.local_world_size,
            world_size=self.world_size,
            identity=identity,
            size=size,
            checksum="",
            tensors=tuple(entries),
            shared=shared_tree,
            own=own_tree,
            meta=meta,
        )
        self._room_for(slot, size)
        os.makedirs(memsnap.slot_dir(self.folder, slot), mode=0o700, exist_ok=True)
        with contextlib.suppress(FileNotFoundError):  # the index first: its data is overwritten now
            os.unlink(memsnap.index_path(self.folder, slot, self.rank))
        return _Captured(index, tensors, slot)

    def _room_for(self, slot: int, size: int) -> None:
        """Before a slot's pages are allocated (its first snapshot, or a state of another size):
        both slots of every local rank (ranks alike: this rank's need times the node's ranks) must
        leave a quarter of the node's memory, or of the job's cgroup limit, to training
        (``memroom``). Else the tier is off for this launch, the reason in its one warning."""
        if self._fds.get(slot, (-1, -1))[1] == size:
            return
        held = sum(sz for _, sz in self._fds.values())
        need = (memsnap.SLOTS * size - held) * self.local_world_size
        why = memroom.refusal(need, memroom.room())
        if why:
            raise memsnap.SnapshotError(
                f"{memsnap.SLOTS} slots of {size} bytes for each of this node's {self.local_world_size} ranks: {why}"
            )

    def _finish(self, cap: _Captured) -> str:
        """Write the tensors and hash them, then the index; on the loop or the thread."""
        fd = self._data_file(cap.slot, cap.index.size)
        checksum = _write(fd, cap.index.tensors, cap.tensors)
        index = replace(cap.index, checksum=checksum, written=time.time())
        memsnap.write_record(memsnap.index_path(self.folder, cap.slot, self.rank), index.to_dict())
        self.uncommitted = (index.step, cap.slot)
        return index.checksum

    def _cost(self, took: float) -> None:
        """One snapshot's cost to the loop, into the running cost the interval rule sees."""
        self.copy_s = took if not self.copy_s else (1 - _EWMA) * self.copy_s + _EWMA * took

    def _settle(self) -> None:
        """The off-loop snapshot near, if any, has cost what it has: into the running cost (never
        less than its start: a step faster than the running step time beside it is noise)."""
        if self._near is not None:
            _, start, slowdown = self._near
            self._cost(start + max(0.0, slowdown))
            self._near = None

    def _data_file(self, slot: int, size: int) -> int:
        """This rank's data file of ``slot``, open, ``size`` bytes with every page allocated."""
        fd, had = self._fds.get(slot, (-1, -1))
        if fd < 0:
            path = memsnap.data_path(self.folder, slot, self.rank)
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
        if had != size:
            os.ftruncate(fd, size)
            if size:
                os.posix_fallocate(fd, 0, size)
            self._fds[slot] = (fd, size)
        return fd

    def wait(self) -> None:
        """The optimizer's pre-step hook, and before the next snapshot: the copy in flight done."""
        pending, self._pending = self._pending, None
        if pending is None:
            return
        t0 = time.perf_counter()
        try:
            pending.result()
        except OSError as e:
            self._off(self._os_error(e))
        self.blocked_s += time.perf_counter() - t0

    def observe(self, step_s: float) -> None:
        """A step's time (without its snapshot): this rank's mode, and rank 0's interval.

        An off-loop snapshot costs the loop its start and how much longer the next _AFTERMATH
        steps took than the steps with no copy near (measured, not estimated: the copy's CPU time
        on its thread, the rule's measure before, missed its contention with the loop for the
        interpreter lock and the caches; a tiny model's steps were then 7-11% slower where the
        rule allowed 3%). Only the steps with no copy near are the step time."""
        near = self._near
        if near is None or near[0] == 0 or not self.step_s:  # 0: the step the snapshot is of
            self.step_s = step_s if not self.step_s else (1 - _EWMA) * self.step_s + _EWMA * step_s
        if near is not None:
            seen, start, slowdown = near
            if seen and self.step_s:
                slowdown += step_s - self.step_s
            self._near = (seen + 1, start, slowdown)
            if seen + 1 > _AFTERMATH:
                self._settle()
        if self.copy_s:
            self.sync, self.interval = memsnap.plan(self.copy_s, self.step_s, self.every)

    def _os_error(self, e: OSError) -> str:
        return f"{e.filename or self.folder}: {describe(e)}"

    def _off(self, why: str) -> None:
        if not self.broken:
            self.broken = why
            log.warning(
                "rank %d: memory tier off for this launch (the disk tier goes on): %s", self.rank, why
            )

    def _executor(self) -> ThreadPoolExecutor:
        if self._pool is None:
            self._pool = ThreadPoolExecutor(1, thread_name_prefix="memory-snapshot")
        return self._pool

    def close(self) -> None:
        self.wait()
        if self._pool is not None:
            self._pool.shutdown()
        for fd, _ in self._fds.values():
            os.close(fd)
        self._fds.clear()

    # ------------------------------------------------------------ resuming from one

    def planned(self) -> memsnap.Pick | None:
        """The watchdog's pick for this launch, if it made one."""
        pick = memsnap.read_pick(self.folder)
        return pick if pick is not None and pick.launch == self.launch_number else None

    def check(self, pick: memsnap.Pick, identity: Mapping[str, Any], state: Any) -> Planned | str:
        """This rank's snapshot of the pick, checked (index, identity, the state's structure, each
        tensor's dtype and shape, size, checksum), or why not: nothing is copied yet."""
        folder = self.folder / pick.folder if pick.folder else self.folder
        try:
            ix = memsnap.read_index(memsnap.index_path(folder, pick.slot, self.rank))
        except (OSError, memsnap.SnapshotError) as e:
            return f"{e.filename}: {describe(e)}" if isinstance(e, OSError) else str(e)
        if (ix.step, ix.rank, ix.world_size) != (pick.step, self.rank, self.world_size):
            return (
                f"its snapshot is of step {ix.step}, rank {ix.rank} of {ix.world_size} "
                f"(the pick: step {pick.step}, world size {self.world_size})"
            )
        differ = sorted(k for k in set(ix.identity) | set(identity) if ix.identity.get(k) != identity.get(k))
        if differ:
            return f"the snapshot's {', '.join(differ)} differ from this run's"
        try:
            template = _structure(ix, state)
        except (memsnap.SnapshotError, memsnap.Unsupported) as e:
            return str(e)
        why = memsnap.verify_rank(folder, pick.slot, ix, mapped=True)
        return why or Planned(pick, ix, folder, template)

    def load(self, planned: Planned, state: Any, extra: Stateful | None) -> Mapping[str, Any]:
        """Copy the checked snapshot into ``state`` (its own tensors, in place) and this rank's RNG
        streams and items; returns the snapshot's meta."""
        ix, template = planned.index, planned.template
        path = memsnap.data_path(planned.folder, planned.pick.slot, self.rank)
        with open(path, "rb") as f, mmap.mmap(f.fileno(), ix.size, access=mmap.ACCESS_READ) as mm:
            shared = memsnap.decode(ix.shared, lambda ref, p: _fill(template[p], ix.tensors[ref], mm))
            own = memsnap.decode(ix.own, lambda ref, p: _fresh(ix.tensors[ref], mm))
        state.load_state_dict(shared)
        RankState.restore(own, frozenset(), f"memory snapshot {path}")
        if extra is not None:
            extra.load_state_dict(own[RANK_USER_ITEMS])
        self.first_slot = (planned.pick.slot + 1) % memsnap.SLOTS if not planned.pick.folder else 0
        self.last = ix.step
        if self.local_rank == 0:  # consumed: a restart inside this launch (torchrun's) never reuses it
            with contextlib.suppress(OSError):
                os.unlink(self.folder / memsnap.PICK)
            memsnap.forget_newer(self.folder, ix.step)  # a step the other nodes did not hold
        return ix.meta

    def reject(self, pick: memsnap.Pick, reason: str) -> None:
        """The ranks refused the pick: local rank 0 forgets the node's snapshots (the run goes on
        from elsewhere: what they hold is a future it abandons, never to be picked) and says why,
        for the watchdog's event log. Before the collectives of the resume that follows, so no
        rank writes a snapshot meanwhile."""
        if self.local_rank == 0:
            memsnap.clear(self.folder)
            try:
                memsnap.write_record(
                    self.folder / memsnap.REJECTED, memsnap.Rejected(pick.launch, pick.step, reason).to_dict()
                )
            except OSError as e:
                log.warning("%s: %s", self.folder / memsnap.REJECTED, describe(e))


def _structure(ix: memsnap.RankIndex, state: Any) -> dict[tuple[Any, ...], torch.Tensor]:
    """The state's own tensors by path, once they match the snapshot's one for one (path, dtype,
    local shape); SnapshotError (one line) otherwise. An optimizer without state gets it allocated
    to be copied into (``prime_for_load``), as for a load from the disk tier."""
    prime_for_load(getattr(state, "optimizer", None))
    template = _leaves(state.state_dict())
    wanted = dict(memsnap.paths(ix.shared))
    if set(wanted) != set(template):
        only_there, only_here = set(wanted) - set(template), set(template) - set(wanted)
        raise memsnap.SnapshotError(
            "the state's tensors differ from the snapshot's "
            f"(only in the snapshot: {_few(only_there)}; only here: {_few(only_here)})"
        )
    for path, ref in wanted.items():
        e, t = ix.tensors[ref], _local(template[path])
        if (e.dtype, e.shape) != (_dtype_name(t), tuple(t.shape)):
            raise memsnap.SnapshotError(
                f"{'.'.join(map(str, path))} is {e.dtype}{list(e.shape)} in the snapshot, "
                f"{_dtype_name(t)}{list(t.shape)} here"
            )
    return template


def _few(paths: set[tuple[Any, ...]]) -> str:
    shown = sorted(".".join(map(str, p)) for p in paths)
    return ", ".join(shown[:3]) + (f" and {len(shown) - 3} more" if len(shown) > 3 else "") or "none"


def _stable(state: Any) -> set[int]:
    """The storages only the optimizer step changes: the parameters and the optimizer's state."""
    ptrs: set[int] = set()
    model, optimizer = getattr(state, "model", None), getattr(state, "optimizer", None)
    if isinstance(model, torch.nn.Module):
        ptrs |= {_local(p).data_ptr() for p in model.parameters()}
    if isinstance(optimizer, torch.optim.Optimizer):
        for per_param in optimizer.state.values():
            ptrs |= {_local(v).data_ptr() for v in per_param.values() if isinstance(v, torch.Tensor)}
    return ptrs


def _region(entry: memsnap.TensorEntry, mm: mmap.mmap) -> np.ndarray[Any, np.dtype[np.uint8]]:
    return np.frombuffer(mm, dtype=np.uint8, count=entry.nbytes, offset=entry.offset)


def _fill(into: torch.Tensor, entry: memsnap.TensorEntry, mm: mmap.mmap) -> torch.Tensor:
    """Copy ``entry``'s bytes into the state's own tensor (its local shard); returns that tensor."""
    dst = _local(into).detach()
    if entry.nbytes:
        if dst.device.type == "cpu" and dst.is_contiguous():
            dst.reshape(-1).view(torch.uint8).numpy()[:] = _region(entry, mm)
        else:
            dst.copy_(_fresh(entry, mm))
    return into


def _fresh(entry: memsnap.TensorEntry, mm: mmap.mmap) -> torch.Tensor:
    """A new CPU tensor of ``entry``'s bytes."""
    dtype: torch.dtype = getattr(torch, entry.dtype)
    if not entry.nbytes:
        return torch.empty(entry.shape, dtype=dtype)
    return torch.from_numpy(_region(entry, mm).copy()).view(dtype).reshape(entry.shape)


def loaded_line(step: int, planned: Planned, world_size: int, took_s: float) -> str:
    """'resumed from the memory snapshot of step 42, next step 43: /dev/shm/..., 2 ranks ...'."""
    where = "a buddy node's replica" if planned.pick.folder else "this node's memory"
    return (
        f"resumed from the memory snapshot of step {step}, next step {step + 1}: {where} ({planned.folder}); "
        f"every rank's checksum, identity and structure verified over {world_size} rank"
        f"{'s' if world_size > 1 else ''}; loaded in {took_s:.3f}s"
    )
