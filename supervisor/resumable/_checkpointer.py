"""DCP save and load through the checkpoint store, with at most one async save in flight, and saves
that may fail without taking the run down.

Protocol of one save (every rank calls ``save`` at the same step boundary):
1. finish the previous save if one is still in flight (wait for it, then commit it);
2. rank 0 opens the store's tmp dir (``supervisor.store.begin``) and tells the others its path
   (or that it could not: the save failed);
3. each rank writes its per-rank state file, then DCP writes the shards (async: staged in the
   background and uploaded by a thread; sync: before returning), every write counted into the
   heartbeat, directly (sync) or through the save's relay (async), with a beat between files
   while the rank waits inside DCP for the others (``progress_io``);
4. once every rank's writes have finished, ranks send rank 0 (a gather, linear in the ranks) the
   checksums of the files they wrote, or the error that stopped them; rank 0 commits (manifest,
   rename, ``latest``) when nobody failed, then hands the commit to ``on_commit`` (the remote
   tier's uploader, which also does retention between uploads) or else prunes itself, in the
   background; then it tells every rank the outcome. A sync save does this on the loop (phase
   COMMIT). An async save starts it at the step boundary where every rank's writes are done and
   runs it in the background; the loop takes the outcome at a later boundary (``_InFlight``).

A failed save (ENOSPC, EDQUOT, EIO... on any rank, at any point: before, during or after DCP's
writes, in the commit, in the manifest; a rank's file missing from rank 0's view) is decided at
those exchanges, never by one rank alone (a rank that went its own way around a collective would
hang the others): every rank takes part in each of them whatever failed where, DCP runs to its end
on every rank (the shard writer holds a failure back until then: issue 44), and a bug is agreed
too, then raised on every rank (SaveCrashed). On a storage failure rank 0 removes the tmp dir,
nothing is committed, ``latest`` stays, every rank records the failure in its heartbeat
(``save_failures``, ``last_error``) and training goes on. The next save first makes room (dead writers' tmp dirs,
quarantine retention). ``save_policy.give_up`` decides, on rank 0, when to stop: then every rank
raises StorageGaveUp (exit 74).

Async: training continues while staging runs, but ``before_optimizer_step`` waits for staging to
complete, because an optimizer step during staging would tear the checkpoint. Whether the
writes, then the commit, are over is agreed by all ranks at each step boundary
(``step_boundary``), never decided from a local ``future.done()``, so every rank starts the commit
at the same step and takes its outcome (and a StorageGaveUp) at the same step. That agreement, and
the preemption notice's, rides on a reduction the step does anyway (``reduce_with_control``: two
numbers appended to the loss all-reduce), so a step where nothing is pending costs no extra
collective.

DCP and the step-boundary agreement each run on their own gloo group: the upload thread's
collectives on the default group deadlocked against training collectives (torch-cpu.md). The
save's opening and the commit's exchanges run on DCP's group, the opening before DCP's writes, the
commit after them, on the loop (sync) or the background thread (async): the loop uses that group
again only for the next save, after ``finish``. Every collective on it gives up after ``wait_s``
(half the shorter of the save and commit timeouts): a rank that waited that long exits 76
(PeersTimedOut), which the watchdog takes as a hang. Each of its waits beats as a wait, no
progress, with that deadline (``waiting``, ``wait_until`` in the heartbeat).
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import pickle
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import IO, Any, Protocol, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.state_dict_saver import AsyncSaveResponse
from torch.distributed.checkpoint.stateful import Stateful

from supervisor import store
from supervisor.errors import StorageError
from supervisor.format.commitstep import CommitStep
from supervisor.format.exitcodes import Exit
from supervisor.format.heartbeat import HeartbeatWriter, Phase, Progress, Tracker
from supervisor.format.layout import (
    dcp_index_filename,
    dcp_shard_filename,
    dcp_shard_prefix,
    rank_state_filename,
    step_dirname,
)
from supervisor.format.manifest import CHECKSUM_ALGO, META_SAVE_S, CheckpointInfo, FileEntry, hash_file
from supervisor.format.statediff import SHARED
from supervisor.resumable import _agree
from supervisor.resumable._bounds import as_timedelta, wait_bound_s
from supervisor.resumable._dcp_index import per_rank_index, tensor_bytes
from supervisor.resumable._devices import DeviceError
from supervisor.resumable._optim_state import prime_for_load
from supervisor.resumable._progress_io import (
    PROGRESS_CHUNK,
    Hashed,
    Keepalive,
    ProgressFileSystem,
    Relay,
    kept_alive,
    wait_forwarding,
    written_key,
)
from supervisor.resumable._readahead import readahead
from supervisor.resumable._safe_load import corrupt, load_dcp, one_line, read_listed, weights_only_refusal
from supervisor.resumable._save_policy import (
    SaveError,
    SavePolicy,
    dcp_save_error,
    failure_line,
    give_up,
    save_error,
)
from supervisor.resumable._shard_writer import ShardWriter, shard_writer
from supervisor.resumable._staging import CPU_STAGING, GPU_STAGING, OrderedStager
from supervisor.resumable._train_state import RankState
from supervisor.signing import DIGEST_ALGO
from supervisor.store.ioerrors import describe

log = logging.getLogger(__name__)

# What a rank waits for in each of a save's exchanges (its heartbeat's ``waiting``).
OPENING = "rank 0 to open the save"
REPORTS = "every rank's report of the save"
OUTCOME = "rank 0's outcome of the save"


class Saveable(Protocol):
    """What a save takes: a DCP Stateful at a step (``TrainState``, or ``resumable.Objects``).
    Not a subclass of Stateful: DCP's isinstance checks against that runtime protocol would then
    visit this one, which has a data member and cannot be checked at runtime."""

    step: int

    def saving(self, rank: int, world_size: int) -> Stateful:
        """What this rank hands DCP (its share, when the state is replicated)."""
        ...

    def state_dict(self) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    def keep(self, name: str, obj: Stateful) -> None:
        """Save ``obj`` under ``name`` too, from the next save and load on (a loader's position)."""
        ...

    def saves(self, obj: object) -> bool:
        """Whether ``obj`` is saved already (a sampler the trainer keeps among its objects)."""
        ...


_STEP_FLAGS = 3  # preempt, a save's stage busy, a time-based save due; then the memory tier's


@dataclass(frozen=True)
class MemoryAgreed:
    """The memory tier's flags as the ranks last agreed them: some rank not free to snapshot (its
    copy running, or its next slot pinned by a push to the buddy), rank 0's interval, some rank's
    tier off, some rank's copy running. Until the first agreement: none busy, interval 1."""

    busy: bool = False
    interval: int = 1
    off: bool = False
    copying: bool = False


@dataclass(frozen=True)
class CommitInfo:
    """What every manifest of this run records besides its files (``run``: each commit sets its
    step and meta), and the key that signs them."""

    run: CheckpointInfo
    # --signing-key's key: rank 0 signs every commit with it (docs/security.md); never recorded.
    sign_key: bytes | None = field(default=None, repr=False)


@dataclass(frozen=True)
class SaveOutcome:
    """How one save ended, decided by rank 0 and the same on every rank."""

    step: int
    committed: bool
    error: str = ""  # why not (one line: rank, file, errno)
    failures: int = 0  # failed saves in a row, this one included
    latest: str | None = None  # the newest committed checkpoint now
    stop: str = ""  # the save policy's reason to stop the launch ('' : go on)
    tmp_left: bool = False  # rank 0 could not remove the tmp dir (a file it cannot see)
    fatal: bool = False  # a rank met a bug, not a storage failure: every rank raises SaveCrashed


# With an uploader, retention is the uploader's (between uploads): a local prune keeps every valid one.
KEEP_ALL = store.RetentionPolicy(keep_all=True)


@dataclass(frozen=True)
class RankFiles:
    """One rank's part of a commit: the size and checksum of each file it wrote and, with a
    signing key, each one's SHA-256 (``digests``), so that rank 0 reads none of them back."""

    entries: Mapping[str, FileEntry]
    digests: Mapping[str, str] = field(default_factory=dict)


def commit_reports(
    root: Path,
    tmp: Path,
    info: CheckpointInfo,
    reports: Sequence[RankFiles],
    on_phase: Callable[[CommitStep], None] | None = None,
    sign_key: bytes | None = None,
) -> store.CheckpointRef:
    """Rank 0: commit ``tmp`` with every rank's report (by rank) as ``store.commit``'s ``known``,
    ``writers`` and ``digests``: every rank's files must be in rank 0's view, else nothing is
    committed. Each rank synced its own files (DCP, ``RankState.save``), so the commit syncs
    directory entries only. Linear in the number of files."""
    return store.commit(
        root,
        tmp,
        info,
        known={name: entry for report in reports for name, entry in report.entries.items()},
        writers={rank: sorted(report.entries) for rank, report in enumerate(reports)},
        files_synced=True,
        on_phase=on_phase,
        sign_key=sign_key,
        digests={name: d for report in reports for name, d in report.digests.items()},
    )


class StorageGaveUp(StorageError):
    """The save policy stopped the launch (exit 74); ``str(e)`` is one line for the job log."""


class SaveCrashed(RuntimeError):
    """A save met an error that is no storage failure (a bug) on some rank: raised on every rank
    at once, after they agreed on it, so the launch fails as one and is relaunched."""


class PeersTimedOut(Exception):
    """One of a save's collectives gave up (``Checkpointer.wait_s``): a peer is stuck, or the ranks
    are in different collectives. The rank exits 76 (Exit.WAIT_GAVE_UP), which the watchdog takes
    as a hang of the launch; ``str(e)`` is one line for the job log, ``what`` what it waited for."""

    def __init__(self, msg: str, what: str) -> None:
        super().__init__(msg)
        self.what = what


@dataclass
class _InFlight:
    """An async save, in stages off the loop: staging; DCP's upload, this rank's state file and
    checksums (``written``); the commit with the other ranks (``committed``: started at the step
    boundary where every rank's ``written`` is done, so commits start only at step boundaries).
    ``work`` counts the upload's writes, the checksums' and the commit's progress, so that a loop
    that must wait on them beats while they move (``Checkpointer._wait``)."""

    step: int
    tmp: Path
    meta: dict[str, Any]
    staging: Future[None] | None
    written: Future[RankFiles]
    work: Relay
    started: float = field(default_factory=time.monotonic)
    committed: Future[SaveOutcome] | None = None

    def stage(self) -> Future[Any]:
        """The stage running now: the writes, or once started, the commit."""
        return self.written if self.committed is None else self.committed


@dataclass(frozen=True)
class _Pruning:
    """Rank 0's prune after the commit of ``step``, in the background; ``work`` counts its
    progress (a checkpoint judged, a directory removed) for whoever waits on it."""

    step: int
    done: Future[None]
    work: Relay


class Checkpointer:
    def __init__(
        self,
        root: Path,
        *,
        async_save: bool,
        retention: store.RetentionPolicy,
        info: CommitInfo,
        hb: HeartbeatWriter,
        policy: SavePolicy | None = None,
        on_commit: Callable[[store.CheckpointRef], None] | None = None,
        rank_extra: Stateful | None = None,
    ):
        """``on_commit`` (rank 0) takes over retention: pruning here could delete a checkpoint
        while a background upload reads it. ``rank_extra``: the trainer's own per-rank items,
        saved in the per-rank file beside the RNG streams."""
        self.root, self.async_save, self.retention, self.info, self.hb = root, async_save, retention, info, hb
        self.policy = policy or SavePolicy()
        self.on_commit = on_commit
        self.rank_extra = rank_extra
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        # Every collective of a save, its commit and their agreements (all on DCP's group) gives
        # up after wait_s, well under the save and commit timeouts (supervisor/resumable/_bounds.py):
        # ranks in different collectives exit 76 and are relaunched, a wait is never hidden for
        # long. The step boundary's agreement (the training loop's) keeps gloo's own timeout:
        # rank-0-only work between steps may well take longer.
        self.wait_s = wait_bound_s(Phase.SAVE, Phase.COMMIT)
        self.dcp_group = dist.new_group(backend="gloo", timeout=as_timedelta(self.wait_s))
        self.ctl_group = dist.new_group(backend="gloo")
        self.stager: OrderedStager | None = None
        if async_save:
            self.stager = OrderedStager(GPU_STAGING if torch.cuda.is_available() else CPU_STAGING)
        self.in_flight: _InFlight | None = None
        # Work off the loop's clock, in order: an async save's state file and checksums, and
        # rank 0's prune after a commit (the last one, which _make_room waits for).
        self._worker: ThreadPoolExecutor | None = None
        self._pruning: _Pruning | None = None
        self._agreed: list[bool] | None = None  # flags agreed by reduce_with_control this step
        # The memory tier's part of the same all-reduce (supervisor/resumable/_memory.py): this
        # rank's (busy, rank 0's interval, off), and their newest agreement, summed.
        self.memory_flags: Callable[[], tuple[int, int, int, int]] = lambda: (0, 0, 0, 0)
        self.memory_agreed = MemoryAgreed()
        # The control exchanges done so far (one per step, in ``reduce_with_control`` or
        # ``boundary``), and the last one at which no rank's memory copy was running: every
        # snapshot begun before it is whole on every rank (_steplog.py).
        self.exchanges = self.settled = 0
        self._per_rank: bool | None = None  # saves write an index per rank (decided at the first)
        self.last_blocking_s = 0.0  # time the training loop was blocked by the last save call
        self.last_staging_wait_s = 0.0  # ... and then waiting for its staging before a step
        self.last_finish_s = 0.0  # ... and then its commit (after a wait, if its writes were not done)
        # Rank 0's account of failed saves: how many in a row, since when nothing is durable
        # (the launch started from a durable checkpoint, or from nothing), tmp dirs to remove.
        self.failures = 0
        self.last_durable = time.monotonic()
        self.leftovers: list[Path] = []

    # ------------------------------------------------------------ saving

    def save(self, state: Saveable, meta: dict[str, Any], *, blocking: bool = False) -> SaveOutcome | None:
        """Checkpoint ``state`` at its current step. ``blocking`` forces a synchronous save, and
        returns its outcome; an async save returns None (its outcome comes with its commit).
        ``meta["metrics"]``, when given, becomes the manifest's ``metrics`` (the rest its ``meta``).
        Raises StorageGaveUp, on every rank, when the save policy says to stop."""
        t0 = time.monotonic()
        self.finish()
        tmp = self._begin(state.step)
        if isinstance(tmp, SaveOutcome):
            return tmp
        rank_file = tmp / rank_state_filename(self.rank)
        app = {SHARED: state.saving(self.rank, self.world_size).state_dict()}
        alone = self._index_per_rank(app)
        if self.async_save and not blocking:
            rank_state = RankState.serialize(
                self.rank_extra
            )  # the streams as of this step; written off the loop
            # counts the upload's writes (beating between files), then the checksums and the commit
            uploading = Keepalive(Relay(), self.wait_s)
            writer = shard_writer(tmp, self.root, uploading, self._signing)
            try:
                resp = dcp.async_save(
                    app,
                    storage_writer=writer,
                    process_group=self.dcp_group,
                    async_stager=self.stager,
                    use_collectives=not alone,
                )
                staging, upload = (
                    (resp.staging_completion, resp.upload_completion)
                    if isinstance(resp, AsyncSaveResponse)
                    else (None, resp)
                )
                written = self._background().submit(
                    self._write_and_hash, tmp, upload, rank_file, rank_state, uploading, writer
                )
                self.in_flight = _InFlight(
                    state.step, tmp, meta, staging, written, uploading.inner, started=t0
                )
            finally:
                if self.stager is not None:
                    self.stager.release()  # the staging copies start now that the call is done
            self.last_blocking_s = time.monotonic() - t0
            return None
        # Whatever fails here, this rank goes through DCP and the agreement as its peers do
        # (a rank that leaves them early leaves its peers in a collective): its error is its part.
        error = None
        try:
            RankState.save(rank_file, self.rank_extra)
        except Exception as e:
            error = self._storage_error(e)
        hashed: dict[str, Hashed] = {}  # DCP's files, hashed as they were written
        try:
            with kept_alive(self.hb.tracker(Phase.SAVE, state.step), self.wait_s) as saving:
                writer = shard_writer(tmp, self.root, saving, self._signing)
                hashed = writer.written
                dcp.save(app, storage_writer=writer, process_group=self.dcp_group, use_collectives=not alone)
                writer.raise_held()
        except Exception as e:
            error = error or self._storage_error(e)
        progress = self.hb.tracker(Phase.COMMIT, state.step)  # the commit, on the loop
        try:  # this rank's part: its error, or its files' checksums
            mine = error or self._local_entries(tmp, progress, hashed)
        except Exception as e:
            mine = self._storage_error(e)
        outcome = self._agree(state.step, tmp, meta, mine, t0, progress)
        self._apply(outcome, progress)
        self.last_blocking_s = time.monotonic() - t0
        return outcome

    def _index_per_rank(self, app: dict[str, Any]) -> bool:
        """Whether saves write an index per rank, each rank saving alone, or DCP's one index
        after its plan exchange (supervisor/resumable/_dcp_index.py): decided at the first save from what is
        sharded, agreed by every rank (one all-reduce), the same for every save after."""
        if self._per_rank is None:
            mine = torch.tensor([int(per_rank_index(*tensor_bytes(app), self.world_size))])
            with self._exchange("every rank's layout of the state"):
                dist.all_reduce(mine, op=dist.ReduceOp.MIN, group=self.dcp_group)
            self._per_rank = bool(mine.item())
        return self._per_rank

    def before_optimizer_step(self) -> None:
        """Wait until the in-flight save has staged its copy; parameters may change after this."""
        if self.in_flight is not None and self.in_flight.staging is not None:
            t0 = time.monotonic()
            self.in_flight.staging.result()
            self.in_flight.staging = None
            self.last_staging_wait_s = time.monotonic() - t0

    def reduce_with_control(
        self, t: torch.Tensor, preempt_requested: bool, save_due: bool = False
    ) -> torch.Tensor:
        """``t`` summed over all ranks (default group), carrying this rank's control flags along
        for the next ``boundary``: the step's agreement then costs no collective of its own.
        ``t``: a floating tensor the step reduces anyway (the reference loop: its loss). Every rank
        calls it at the same point of every step (it is a collective)."""
        flags = self._flags(preempt_requested, save_due).to(t.device, t.dtype)
        packed = torch.cat([t.reshape(-1), flags])
        dist.all_reduce(packed)
        # SUM of 0/1 flags: > 0 when any rank set it, exact in any float dtype.
        self._agreed = self._agree_flags(packed[t.numel() :].tolist())
        return packed[: t.numel()].reshape(t.shape)

    def _agree_flags(self, summed: list[float]) -> list[bool]:
        """The step's flags from their sums; the memory tier's part kept in ``memory_agreed``."""
        busy, interval, off, copying = summed[_STEP_FLAGS:]
        self.memory_agreed = MemoryAgreed(busy > 0, round(interval), off > 0, copying > 0)
        self.exchanges += 1
        if not copying:
            self.settled = self.exchanges
        return [v > 0 for v in summed[:_STEP_FLAGS]]

    def step_boundary(self, preempt_requested: bool) -> bool:
        """Do all ranks agree the upload is done (then commit), and has any rank been asked to
        stop? Returns the latter, identical on every rank."""
        return self.boundary(preempt_requested)[0]

    def boundary(self, preempt_requested: bool, save_due: bool = False) -> tuple[bool, bool]:
        """``step_boundary``, also carrying rank 0's ``save_due`` (a time-based save: one clock
        decides, never each rank's own). Returns (preempt, save), identical on every rank. Agreed
        from the flags this step's ``reduce_with_control`` carried (their values as of that call;
        a notice that came later is agreed at the next step); a loop that did not call it pays one
        small all-reduce here. Either way every rank takes the same path: whether the flags came
        along is a property of the loop's code, the same on every rank."""
        agreed, self._agreed = self._agreed, None
        if agreed is None:
            flags = self._flags(preempt_requested, save_due)
            dist.all_reduce(flags, group=self.ctl_group)
            agreed = self._agree_flags(flags.tolist())
        preempt, busy, due = agreed
        if self.in_flight is not None and not busy:
            if self.in_flight.committed is None:
                self._start_commit(self.in_flight)
            else:
                self.finish()
        return preempt, due

    def _flags(self, preempt_requested: bool, save_due: bool) -> torch.Tensor:
        """This rank's [asked to stop, the in-flight save's stage still running, a time-based save
        due (rank 0's clock only)], to be SUM-reduced."""
        busy = self.in_flight is not None and not self.in_flight.stage().done()
        due = save_due and self.rank == 0
        memory = self.memory_flags()
        return torch.tensor([int(preempt_requested), int(busy), int(due), *memory], dtype=torch.int64)

    def finish(self) -> SaveOutcome | None:
        """Take the in-flight save's outcome (committed, or failed on some rank) into the heartbeat
        and the log, starting its commit and waiting for it if need be (every rank calls it at
        the same point); raises StorageGaveUp as ``save``."""
        if self.in_flight is None:
            return None
        t0 = time.monotonic()
        f, self.in_flight = self.in_flight, None
        if f.staging is not None:
            f.staging.result()
        if f.committed is None:
            self._start_commit(f)
        outcome = self._wait(f)
        self._apply(outcome)
        self.last_finish_s = time.monotonic() - t0
        return outcome

    def _start_commit(self, f: _InFlight) -> None:
        f.committed = self._background().submit(self._commit_written, f)  # after ``written``

    def _wait(self, f: _InFlight) -> SaveOutcome:
        """``f``'s outcome. While its background work goes on the loop waits, in phase SAVE for the
        writes and checksums, then COMMIT, and beats each time that work moved (bytes written or
        hashed, a commit step, a beat while waiting for peers), so a slow save is no hang and a
        stuck one leaves its file in the heartbeat."""
        assert f.committed is not None
        for stage, phase in ((f.written, Phase.SAVE), (f.committed, Phase.COMMIT)):
            if not stage.done():
                wait_forwarding(stage, f.work, self.hb.tracker(phase, f.step), _agree.KEEPALIVE_S)
        return f.committed.result()

    def close(self) -> None:
        self.finish()
        self.wait_pruned()
        if self.stager is not None:
            self.stager.close()
        if self._worker is not None:
            self._worker.shutdown()  # after the last prune

    def _background(self) -> ThreadPoolExecutor:
        if self._worker is None:
            self._worker = ThreadPoolExecutor(1, thread_name_prefix="checkpoint-background")
        return self._worker

    def _write_and_hash(
        self,
        tmp: Path,
        upload: Future[None],
        rank_file: Path,
        rank_state: bytes,
        uploading: Keepalive[Relay],
        writer: ShardWriter,
    ) -> RankFiles:
        """Background, while training goes on: write (and fsync) this rank's state file, wait for
        DCP's upload (beating for it between its files), then this rank's files' checksums (those
        hashed as DCP wrote them, ``writer.written``; the others read back), so the commit only
        exchanges them. Raises the OSError of the state file, a read, or what the upload met
        (held back by the writer until DCP was done, or raised by DCP), never before the upload is
        over: a failed commit removes the tmp dir."""
        try:
            RankState.write(rank_file, rank_state)
        finally:
            with _agree.beating(uploading.beat):
                upload.result()
        writer.raise_held()
        return self._local_entries(tmp, uploading.inner, writer.written)

    def _commit_written(self, f: _InFlight) -> SaveOutcome:
        """Background: ``_agree`` on what ``f``'s writes left, on DCP's group (every rank starts
        it at the same step boundary). It never touches the heartbeat, which the loop owns: its
        progress goes to ``f.work``. An error that is not a storage failure (a bug) is agreed on
        like any failure, then raised on every rank at ``finish`` (SaveCrashed)."""
        try:
            mine: RankFiles | SaveError = f.written.result()
        except Exception as e:
            mine = self._storage_error(e)
        return self._agree(f.step, f.tmp, f.meta, mine, f.started, f.work)

    def _storage_error(self, e: Exception) -> SaveError:
        """This rank's part of a failed save: its storage failure, or, for anything else (a bug, a
        collective that timed out), a fatal one, logged here with its traceback. Either way the
        rank takes it to the agreement, where its peers wait: one agreed outcome per save."""
        if isinstance(e, OSError):
            return save_error(e, self.rank, self.root)
        err = dcp_save_error(e, self.root) if isinstance(e, CheckpointException) else None
        if err is None:
            log.error(
                "rank %d: the save failed on an error that is no storage failure", self.rank, exc_info=e
            )
            return SaveError(self.rank, f"{type(e).__name__}: {one_line(e)}", fatal=True)
        return err

    def _begin(self, step: int) -> Path | SaveOutcome:
        """Rank 0 makes room if saves failed before, opens the tmp dir and tells everyone its
        path, or the outcome of a save that failed right there."""
        mine: Path | SaveOutcome | None = None
        if self.rank == 0:
            try:
                self._make_room(step)
                mine = store.begin(self.root, step)
            except OSError as e:
                mine = self._failed(step, [save_error(e, 0, self.root)])
            except Exception as e:  # a bug: agreed, then raised on every rank (``_apply``)
                mine = self._failed(step, [self._storage_error(e)])
        until = time.time() + self.wait_s
        beat = lambda: self.hb.beat(step, Phase.SAVE, waiting=OPENING, wait_until=until)  # noqa: E731
        # on DCP's group, idle here (the last save is over: ``finish``), so bounded as a save's
        with self._exchange(OPENING):  # cast: mypy solves broadcast's T for a union as their join (object)
            got = cast("Path | SaveOutcome", _agree.broadcast(mine, self.dcp_group, beat))
        if isinstance(got, SaveOutcome):
            self._apply(got)
        return got

    def wait_pruned(self, step: int | None = None) -> None:
        """Wait for rank 0's prune after the last commit, if one is running (the next save
        waits for it first: the room it frees is that save's), in phase SAVE at ``step``
        (default: the commit's), forwarding its progress. A prune on a slow file system is then
        judged by the save's timeout, per checkpoint it removes, not by a step's."""
        p, self._pruning = self._pruning, None
        if p is None:
            return
        if not p.done.done():
            progress = self.hb.tracker(Phase.SAVE, p.step if step is None else step)
            wait_forwarding(p.done, p.work, progress, _agree.KEEPALIVE_S)
        p.done.result()

    def _make_room(self, step: int) -> None:
        """Rank 0, before the save of ``step``: tmp dirs of failed saves it could not remove yet;
        after a failed save also a prune (dead writers' tmp dirs, quarantine retention;
        checkpoints beyond the retention policy unless an uploader owns retention); each file
        removed counted into the heartbeat, phase SAVE. Best effort: a failure here is the next
        save's to report."""
        self.wait_pruned(step)  # one prune at a time
        if not (self.leftovers or self.failures):
            return
        progress = self.hb.tracker(Phase.SAVE, step)
        for tmp in list(self.leftovers):
            store.remove_tree(self.root, tmp, progress)
            if not os.path.lexists(tmp):
                self.leftovers.remove(tmp)
        if self.failures:
            try:
                policy = self.retention if self.on_commit is None else KEEP_ALL
                store.prune(self.root, policy=policy, progress=progress)
            except (OSError, store.StoreError) as e:
                log.warning("prune before retrying a save failed: %s", e)

    def _agree(
        self,
        step: int,
        tmp: Path,
        meta: dict[str, Any],
        mine: RankFiles | SaveError,
        started: float,
        progress: Progress | Relay,
    ) -> SaveOutcome:
        """Every rank's writes are done: rank 0 commits with the checksums of each rank's files
        (``mine``: ``_local_entries``), unless a rank failed (``mine``: its error); every rank learns
        the outcome. The manifest records how long the save took since ``started``
        (META_SAVE_S: what a preemption notice must leave time for). Every rank takes part,
        whatever failed where: one agreed outcome per save; a bug in rank 0's decision is agreed
        as a fatal outcome too (``_apply`` raises it everywhere)."""
        # added to what it counts already (bytes written and hashed)
        progress.total += len(CommitStep) if self.rank == 0 else 0
        progress.set_path("")  # waiting for the peers, not in a read
        with self._exchange(REPORTS):
            gathered = _agree.gather_to_root(mine, self.dcp_group, self._waiting(progress, REPORTS))
        outcome = None
        if gathered is not None:  # rank 0
            meta = {**meta, META_SAVE_S: round(time.monotonic() - started, 3)}
            try:
                outcome = self._decide(step, tmp, meta, gathered, progress)
            except Exception as e:
                outcome = self._failed(step, [self._storage_error(e)])
        with self._exchange(OUTCOME):
            outcome = _agree.broadcast(outcome, self.dcp_group, self._waiting(progress, OUTCOME))
        if outcome.tmp_left:
            self._remove_own_files(tmp, progress)
        return outcome

    @contextlib.contextmanager
    def _exchange(self, what: str) -> Iterator[None]:
        """One of the save's collectives, waiting for ``what``: one that fails (gloo gave up after
        ``wait_s``, a peer's connection closed, the group an earlier one left broken) is
        PeersTimedOut."""
        try:
            yield
        except RuntimeError as e:  # torch's DistError is one
            raise PeersTimedOut(
                f"rank {self.rank}: its wait for {what} failed ({one_line(e)}): a peer died, is stuck (a "
                f"save's exchanges give up after {self.wait_s:g}s, half the save/commit timeout) or is in "
                f"another collective; exit {Exit.WAIT_GAVE_UP}, retryable",
                what,
            ) from e

    def _waiting(self, progress: Tracker, what: str) -> Callable[[], None]:
        """The beat of a wait for the peers in one of the save's collectives: no progress, said
        so, with when the collective gives up (``wait_s`` from now)."""
        until = time.time() + self.wait_s
        return lambda: progress.wait(what, until)

    def _remove_own_files(self, tmp: Path, progress: Tracker) -> None:
        """Rank 0 could not remove the tmp dir of a failed save: a file it cannot see is in it
        (a rank's view that differs: the case IncompleteCommit refuses). Every rank removes the
        files it wrote, in its own view; then rank 0 tries again (and again before the next
        save)."""
        with contextlib.suppress(OSError):
            for name in os.listdir(tmp):
                if self._is_own(name):
                    with contextlib.suppress(OSError):
                        os.unlink(tmp / name)
        with self._exchange("every rank's removal of its files"):
            dist.barrier(group=self.dcp_group)
        if self.rank == 0:
            store.remove_tree(self.root, tmp, progress)
            if not os.path.lexists(tmp):
                self.leftovers.remove(tmp)

    def _is_own(self, name: str) -> bool:
        """A file this rank writes into a checkpoint: its shards, its state file, and its own
        index where each rank writes one (else DCP's one index is rank 0's, its coordinator's)."""
        if name.startswith(dcp_shard_prefix(self.rank)) or name == rank_state_filename(self.rank):
            return True
        if self._per_rank:
            return name == dcp_index_filename(self.rank)
        return self.rank == 0 and name == dcp_index_filename()

    def _decide(
        self,
        step: int,
        tmp: Path,
        meta: dict[str, Any],
        gathered: list[RankFiles | SaveError],
        progress: Progress | Relay,
    ) -> SaveOutcome:
        """Rank 0: commit when every rank's part is there; else remove the tmp dir."""
        errors = [g for g in gathered if isinstance(g, SaveError)]
        if errors:
            return self._failed(step, errors, self._discard(tmp, progress))
        entries = [g for g in gathered if not isinstance(g, SaveError)]
        rel = os.path.relpath(tmp, self.root)

        def phase(_name: str) -> None:
            progress.set_path(rel)
            progress(1)

        try:
            ref = commit_reports(
                self.root,
                tmp,
                replace(
                    self.info.run,
                    step=step,
                    world_size=self.world_size,
                    meta={k: v for k, v in meta.items() if k != "metrics"},
                    metrics=meta.get("metrics", {}),
                ),
                entries,
                phase,
                self.info.sign_key,
            )
        except (OSError, store.IncompleteCommit) as e:
            final = self.root / step_dirname(step)
            if os.path.lexists(tmp) or not os.path.isdir(final):
                return self._failed(step, [save_error(e, 0, self.root)], self._discard(tmp, progress))
            # Renamed: committed. What failed after the rename (``latest``, an fsync) is repaired
            # by the next pick, which never trusts ``latest`` alone.
            log.warning("committed %s, but after the rename: %s", final.name, e)
            ref = store.CheckpointRef(step, final)
        return self._succeeded(ref)

    def _succeeded(self, ref: store.CheckpointRef) -> SaveOutcome:
        if self.failures:
            log.warning("save recovered: %s committed after %d failed save(s)", ref.name, self.failures)
        self.failures, self.last_durable = 0, time.monotonic()
        log.info("committed %s", ref.name)
        if self.on_commit is not None:
            self.on_commit(ref)
        else:  # off the loop: deleting a 0.6 GB checkpoint's files took 0.2 s here
            work = Relay()
            self._pruning = _Pruning(ref.step, self._background().submit(self._prune, ref, work), work)
        return SaveOutcome(ref.step, True, latest=ref.name)

    def _prune(self, ref: store.CheckpointRef, work: Relay) -> None:
        """Rank 0, in the background: retention after committing ``ref``, counted into ``work``."""
        try:
            pruned = store.prune(self.root, policy=self.retention, progress=work).deleted
        except (OSError, store.StoreError) as e:  # the checkpoint is committed all the same
            log.warning("committed %s; prune failed: %s", ref.name, e)
            return
        if pruned:
            log.info("pruned %s (after committing %s)", ", ".join(pruned), ref.name)

    def _discard(self, tmp: Path, progress: Tracker) -> bool:
        """Rank 0: a failed save's tmp dir goes (a full disk gets that space back), a beat per
        file removed (a large one on a slow file system is a long phase). True when some of it
        is left; it is kept in ``leftovers`` and tried again before the next save."""
        store.remove_tree(self.root, tmp, progress)
        if os.path.lexists(tmp):
            self.leftovers.append(tmp)
            return True
        return False

    def _failed(self, step: int, errors: list[SaveError], left: bool = False) -> SaveOutcome:
        """Rank 0: nothing is committed; ``left``: the tmp dir could not all be removed. A fatal
        error (a bug on some rank) comes first: every rank raises it."""
        self.failures += 1
        unsaved = time.monotonic() - self.last_durable
        first = min(errors, key=lambda e: (not e.fatal, e.rank))
        try:
            latest = store.read_latest(self.root)
        except OSError as e:  # said in the warning; the pick never trusts ``latest`` alone
            latest = f"unreadable ({describe(e)})"
        return SaveOutcome(
            step,
            False,
            error=str(first),
            failures=self.failures,
            latest=latest,
            stop=give_up(self.policy, self.failures, unsaved),
            tmp_left=left,
            fatal=first.fatal,
        )

    def _apply(self, outcome: SaveOutcome, progress: Progress | None = None) -> None:
        """Every rank: the outcome into the heartbeat (written now), the warning into the log, and
        StorageGaveUp when the policy says to stop."""
        self.hb.save_failures = outcome.failures
        self.hb.last_error = outcome.error
        done, total = (progress.done, progress.total) if progress else (0, 0)
        self.hb.beat(outcome.step, Phase.COMMIT, force=True, progress=done, total=total)
        if outcome.committed:
            return
        if outcome.fatal:
            raise SaveCrashed(
                f"the save of step {outcome.step} failed on an error that is no storage failure: "
                f"{outcome.error}; every rank stops here (the traceback is in that rank's log)"
            )
        if self.rank == 0 and not outcome.stop:
            log.warning(
                failure_line(
                    outcome.step,
                    outcome.error,
                    outcome.failures,
                    outcome.latest,
                    self.policy,
                    not self.leftovers,
                )
            )
        if outcome.stop:
            raise StorageGaveUp(
                f"storage: giving up at step {outcome.step}: {outcome.stop}; last error: {outcome.error}; "
                f"committed checkpoints are intact (newest: {outcome.latest or 'none'}); exit 74, retryable"
            )

    @property
    def _signing(self) -> bool:
        """Commits are signed: each rank takes its files' SHA-256 too, as it writes them."""
        return self.info.sign_key is not None

    def _local_entries(self, tmp: Path, progress: Progress | Relay, written: dict[str, Hashed]) -> RankFiles:
        """The hashes of the files this rank wrote (``_is_own``), so rank 0 does not re-read every
        shard: those hashed as they were written (``written``) when the file still has the size
        they were written to, the others read back. ``progress`` counts the bytes read."""
        mine = [n for n in sorted(os.listdir(tmp)) if self._is_own(n)]
        sizes = {n: (tmp / n).stat().st_size for n in mine}
        kept = {n: written.get(written_key(tmp / n)) for n in mine}
        hashed = {
            n: h
            for n, h in kept.items()
            if h is not None and h.entry.size == sizes[n] and (h.digest is not None or not self._signing)
        }
        todo = [n for n in mine if n not in hashed]
        # bytes counted with no total (an async save's relay: the upload's writes) are done out
        # of themselves, so done never passes total
        progress.total = max(progress.total, progress.done) + sum(sizes[n] for n in todo)
        algos = (CHECKSUM_ALGO, DIGEST_ALGO) if self._signing else (CHECKSUM_ALGO,)
        for name in todo:
            progress.set_path(os.path.relpath(tmp / name, self.root))
            sums = hash_file(tmp / name, algos, progress, PROGRESS_CHUNK)
            hashed[name] = Hashed(FileEntry(sizes[name], sums[0]), sums[1] if self._signing else None)
        return RankFiles(
            {n: hashed[n].entry for n in sorted(hashed)},
            {n: d for n in sorted(hashed) if (d := hashed[n].digest) is not None},
        )

    # ------------------------------------------------------------ loading

    def load(
        self,
        ckpt: Path,
        state: Stateful,
        *,
        saved_world_size: int,
        skip: frozenset[str],
        progress: Progress,
        listed: Mapping[str, int] | None = None,
    ) -> bool:
        """Load shards (DCP reshards to this world size), then this rank's RNG file, every read
        counted into ``progress``, which also beats while this rank waits for its peers inside
        DCP's load (a rank done with its shard is no hang while a slower one reads). Returns
        whether the per-rank state was restored; on another world size it cannot map onto the
        new ranks, and the caller derives fresh streams instead. Nothing in the checkpoint is
        run: a pickle that names anything else than plain data is UnsafePickle, one line
        (supervisor/resumable/_safe_load.py). An Adam(W) without state gets it allocated to be read into, not
        computed (supervisor/resumable/_optim_state.py). From the first line, the files this rank reads first
        (DCP's index; on the saved world size, its own shard and RNG file) are read into the page
        cache behind it (supervisor/resumable/_readahead.py)."""
        same_world = saved_world_size == self.world_size
        path = ckpt / rank_state_filename(self.rank)
        # DCP's one index, or this rank's own where each rank wrote one (the read-ahead skips the
        # one that is not there)
        first = [ckpt / dcp_index_filename(), ckpt / dcp_index_filename(self.rank)]
        first += [ckpt / dcp_shard_filename(self.rank), path] if same_world else []
        with readahead(first), kept_alive(progress, self.wait_s) as loading:
            prime_for_load(getattr(state, "optimizer", None))
            fs = ProgressFileSystem(self.root, loading)
            load_dcp(ckpt, {SHARED: state}, self.dcp_group, fs=fs, listed=listed)
            if not same_world:
                return False
            with fs.create_stream(path, "rb") as f:
                # torch types the stream as IOBase; it is the binary file opened "rb" here
                data = read_listed(cast(IO[bytes], f), path, listed)
            try:
                RankState.load(io.BytesIO(data), skip, str(path), self.rank_extra)
            except pickle.UnpicklingError as e:
                raise weights_only_refusal(str(path), e) from None
            except DeviceError:
                raise
            except Exception as e:  # a broken zip, a dict of other keys, a wrong-typed state
                raise corrupt(
                    f"{path}: not a per-rank state file this toolkit wrote ({one_line(e)})"
                ) from None
        return True
