"""``Resumable``: one object that owns a training job's checkpoint lifecycle.

A plain loop becomes resumable, bit-exactly, with a handful of lines::

    r = Resumable(root, {"model": model, "optimizer": opt}, steps=1000, identity=Identity({"lr": lr}, seed=0))
    for step in range(r.resume() + 1, 1001):
        loss = train_step(...)                 # forward, backward, optimizer.step()
        if r.step_end(step, {"loss": loss}):   # on every rank, every step
            break
    r.finish()

It composes the building blocks (``resume`` picks and verifies, ``checkpointer`` saves through the
store, ``agree`` and the step boundary keep the ranks in step, ``signals`` records notices, the
``state`` module saves per-rank RNG streams) and takes the two call-site rules off the user:

- the wait for an async save's staging is an optimizer pre-step hook (``register_step_pre_hook``):
  an optimizer step while the state is being copied would tear the checkpoint;
- ``step_end`` is the one per-step collective every rank must reach (commit of the in-flight save,
  the preemption notice, a time-based save decided by rank 0's clock alone).

Every deliberate stop (a refusal, a failed storage, a preemption) writes the exit code into the
heartbeat, says one line on rank 0 and raises ``SystemExit`` with the code of
``supervisor.format.exitcodes.Exit`` that the watchdog classifies.
"""

from __future__ import annotations

import itertools
import logging
import math
import os
import random
import sys
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import contextmanager
from pathlib import Path
from typing import Any, NoReturn, cast

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.stateful import Stateful
from torch.utils.data import DataLoader, Dataset

from supervisor import store
from supervisor.display import human_bytes
from supervisor.format import memsnap
from supervisor.format.appender import LineAppender
from supervisor.format.atomic import atomic_write_json
from supervisor.format.exitcodes import Exit
from supervisor.format.heartbeat import ENV_LAUNCH_ID, HeartbeatWriter, Phase, Progress, stack_dump_path
from supervisor.format.hooks import When
from supervisor.format.layout import FINAL, RunDir, parse_committed
from supervisor.format.manifest import META_RECENT_LOSSES, CheckpointInfo
from supervisor.format.metrics import MetricsRecord, logged_since
from supervisor.format.statediff import SHARED
from supervisor.resumable import _agree, _launch_marks, _tiering
from supervisor.resumable._checkpointer import (
    Checkpointer,
    CommitInfo,
    PeersTimedOut,
    Saveable,
    SaveOutcome,
    StorageGaveUp,
)
from supervisor.resumable._collectives import CollectiveReporter
from supervisor.resumable._devices import DeviceError
from supervisor.resumable._digest import params_digest, tensors_digest
from supervisor.resumable._exits import deliberate_exit, run_dir, tell, trainer_code
from supervisor.resumable._hooks import BoundaryHook, boundary_hook, no_hook
from supervisor.resumable._loader import Rank, ResumableLoader, SamplerPosition, build, prepare, saved_as
from supervisor.resumable._loader_check import LoaderCheck
from supervisor.resumable._memory import NO_PICK, MemoryTier, Planned, combined, common_step, loaded_line
from supervisor.resumable._objects import Objects, RankItems, Weights
from supervisor.resumable._optim_state import prime_for_load
from supervisor.resumable._options import Identity, ResumeOptions, Saves, remote_problem, resume_args
from supervisor.resumable._progress_io import ProgressFileSystem, kept_alive
from supervisor.resumable._resume import (
    RETRY_LATER,
    Choice,
    Interrupted,
    Request,
    choose_checkpoint,
    describe_diff,
    identity_diff,
)
from supervisor.resumable._safe_load import CorruptRecord, PeerLoadFailed, load_dcp, one_line, refusal_line
from supervisor.resumable._sanity import LOSS_WINDOW, ResumeSanity
from supervisor.resumable._signals import PreemptionFlag, on_uncaught, record_uncaught, register_stack_dump
from supervisor.resumable._step_clock import StepClock
from supervisor.resumable._steplog import StepLog
from supervisor.resumable._train_state import RANK_ITEMS, seed_rank_rng
from supervisor.safepickle import UnsafePickle
from supervisor.store.ioerrors import STORAGE_BACKOFF, retry_transient
from supervisor.tiers.uploader import Uploader

log = logging.getLogger("resumable")

# One per process, installed as early as the trainer can (``install_signals``), so a preemption
# notice during startup is not lost.
PREEMPTION = PreemptionFlag()
_installed: list[str] = []  # install()'s problem, once installed
UPLOADS = "the remote tier's uploads"  # what rank 0 waits for at the end (its heartbeat's ``waiting``)


def install_signals() -> str:
    """Record SIGTERM/SIGUSR1 (and $REQUEUE_SIGNAL's) as a preemption notice, and an uncaught
    exception in torchelastic's error file; once per process. Returns why $REQUEUE_SIGNAL is
    unusable, or ''."""
    if not _installed:
        _installed.append(PREEMPTION.install())
        record_uncaught()
    return _installed[0]


def init_source(spec: str) -> Path | str:
    """Rank 0, ``--init-from DIR[:STEP]``: the checkpoint to start from (checked deep, read only:
    nothing in the other run is moved), or why not (one line)."""
    where, _, step = spec.rpartition(":") if spec.rpartition(":")[2].isdigit() else (spec, "", "")
    root = Path(where)
    try:
        refs = store.list_checkpoints(root)
    except OSError as e:
        return f"{root}: cannot list it ({e.strerror})"
    if step:
        refs = [r for r in refs if r.step == int(step)]
    for ref in refs:
        v = store.validate(ref, deep=True)
        if v.ok:
            return ref.path
        if step:
            return f"{v.reason}"
    have = "no committed checkpoint" if not step else f"no committed step {step}"
    return f"{root}: {have} that passes its checks (ckpt list --ckpt-root {root})"


def resume_line(
    choice: Choice, options: ResumeOptions, world_size: int, config_changed: bool, root: Path, step: int
) -> str:
    """'resumed from step_00000020, next step 21: runs/r1/step_00000020, 6 files, 1.2 MiB; every
    checksum verified (deep, over 2 ranks); identity, data and global batch match'."""
    m = choice.manifest
    assert m is not None and choice.ckpt is not None
    if choice.verified:
        checked = "downloaded from the remote tier, every checksum verified"
    elif options.verify == "deep":
        checked = f"every checksum verified (deep, over {world_size} rank{'s' if world_size > 1 else ''})"
    else:
        checked = "file sizes checked (--verify quick: no checksum)"
    signed = "; signature verified" if options.sign_key is not None else ""
    same = "identity, data and global batch match"
    if config_changed:
        same = "--allow-config-change applied; data and global batch match"
    ranks = "" if m.world_size == world_size else f"; world size {m.world_size} -> {world_size} (resharded)"
    size = f"{len(m.files)} files, {human_bytes(m.total_bytes)}"
    return (
        f"resumed from {choice.ckpt.name}, next step {step + 1}: {choice.ckpt}, {size}; {checked}{signed}; "
        f"{same}{ranks}"
    )


class LoadFailed(RuntimeError):
    """A resume's load failed and the process went on: its state is part of a checkpoint and part
    of what was there before, and it may not be trained on or saved (``Resumable._load_failed``)."""


class Resumable:
    """The checkpoint lifecycle of one launch on this rank (every rank builds one, after
    ``init_process_group``): ``resume()``, then ``step_end()`` once per step, then ``finish()``.
    Between them: ``reduce()`` (a reduction that carries the step's control flags), ``beat()``
    and ``phase()`` (long stretches of the trainer's own), ``preemption_noticed``, ``memory_every``, and
    ``compute_done()`` (where the step's own work ends, for the straggler verdict).

    The data, before ``resume()`` (docs/adopting.md#data):

    - ``loader(dataset, batch_size, *, shuffle=False, name="data", **dataloader_kwargs)``: a torch
      DataLoader whose position is saved with every checkpoint and restored mid-epoch (map-style
      and ``IterableDataset``), with a private seeded generator (``iter()`` draws nothing from the
      global RNG), per-sample (map-style) or per-worker (stream) random streams a resume repeats,
      and workers that leave SIGTERM, SIGINT and the notice to their rank. ``batch_size`` is per
      rank; each ``iter()`` runs to the end of the epoch.
    - ``prepare(loader, *, name="data")``: the same for a DataLoader you built (a torch sampler,
      a ``ResumableBatchSampler``, an ``IterableDataset``, or torchdata's ``StatefulDataLoader``,
      whose own ``state_dict`` is saved); use what it returns.

    A DataLoader iterated without either, between ``resume()`` and the first ``step_end``, gets
    one warning (rank 0) naming what a resume loses through it and this fix.

    Extension hooks, for a subclass (the reference trainer's ``Reference`` overrides all three):

    - ``save_meta()``: what each manifest records besides the files; extend ``super()``'s dict;
    - ``final_fields()``: entries added to ``final.json`` (called on every rank: it may gather;
      ``digest_tracker`` gives a digest its heartbeat progress);
    - ``apply_config_change(diff)``: after a load under ``allow_config_change``, put the run's new
      values of the ``Identity.changeable`` fields into the loaded objects.

    Everything else is private and may change."""

    def __init__(
        self,
        root: str | Path,
        state: Saveable | Mapping[str, Any],
        *,
        steps: int,
        identity: Identity | None = None,
        saves: Saves | None = None,
        options: ResumeOptions | None = None,
        rank_items: Stateful | None = None,
        loss_window: int = LOSS_WINDOW,
    ):
        """``state``: a mapping name -> object (``model`` and ``optimizer`` required; anything
        else with ``state_dict``/``load_state_dict``), or a ready Saveable (``TrainState``).
        ``steps``: where the run ends, in total. ``rank_items``: the trainer's own per-rank state
        (tensors, numbers, strings), saved beside the RNG streams in the per-rank file.
        ``loss_window``: how many of the last losses reported to ``step_end`` each manifest
        records, for the resume's sanity step (supervisor/resumable/_sanity.py)."""
        self._root = Path(root)
        self.state: Saveable = Objects(state) if isinstance(state, Mapping) else state
        self.steps = steps
        self.identity = identity or Identity()
        self._saves = saves or Saves()
        self._options = options or ResumeOptions()
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        run_dir(self._root)
        self._hb = HeartbeatWriter(
            self._root,
            rank=self.rank,
            local_rank=int(os.environ.get("LOCAL_RANK", "0")),
            world_size=self.world_size,
        )
        _launch_marks.started(self._hb)  # process start, torch imported, process group up: recovery breakdown
        self._hb.beat(0, Phase.STARTUP)
        self._stacks = register_stack_dump(
            stack_dump_path(self._root, self.rank), self._hb.within
        )  # open until exit
        # On a hang the watchdog asks each rank what torch's flight recorder saw of its collectives.
        self._collectives = CollectiveReporter.start(
            self._hb.folder, self._hb.within, self.rank, lambda: self.state.step
        )
        on_uncaught(self._hb.died)  # the exception that ends this rank, in its last heartbeat
        self._problem = install_signals() or self._saves.problem() or self._remote_problem()
        self._uploader: Uploader | None = None  # rank 0 with a remote, from resume() on
        remote = bool(self._options.remote.url) and self.rank == 0
        run = CheckpointInfo(
            step=0,  # each commit sets its step, meta and metrics
            world_size=self.world_size,
            model_config_hash=self.identity.config_hash,
            data_fingerprint=self.identity.data,
            parallelism={
                "mode": self.identity.mode,
                "world_size": self.world_size,
                "global_batch": self.identity.global_batch,
            },
            torch_version=torch.__version__,
        )
        self._rank_items = RankItems(rank_items)  # the per-rank file's, once a loader keeps one there
        self._ckpt = Checkpointer(
            self._root,
            async_save=self._saves.async_save,
            retention=self._saves.retention_policy(),
            info=CommitInfo(run, sign_key=self._options.sign_key),
            hb=self._hb,
            policy=self._saves.policy(),
            on_commit=self._submit if remote else None,
            rank_extra=rank_items,
        )
        self.launch = ""
        self._init_source = ""
        self.start = 0  # the step this launch resumed at
        self._from_memory = False  # resumed from a memory snapshot of a step the disk does not hold
        self._metrics: dict[str, float] = {}  # the last step's, saved into the manifest
        self._recent_losses: deque[float] = deque(maxlen=loss_window)  # saved into the manifest too
        self._sanity: ResumeSanity | None = None  # rank 0, the first steps after a resume
        self._metrics_file: StepLog | None = None  # rank 0's metrics.jsonl (_steplog.py)
        self._at_boundary: BoundaryHook = no_hook  # until resume() knows the launch
        self._own_beats = 0  # the trainer's own beat() calls: its progress between steps
        self._loaders_closed = False  # resume() restored their positions
        self._loaders: list[ResumableLoader] = []  # made by loader() and prepare()
        self._loader_check = LoaderCheck(self._warn)
        self._last_save = time.monotonic()
        self._t_end = time.perf_counter()
        # The memory tier (supervisor/resumable/_memory.py): only under a watchdog that made its folder.
        self._memory = MemoryTier.from_env(self.rank, self.world_size, self._saves.memory_every)
        if self._memory is not None:
            self._ckpt.memory_flags = self._memory.flags
        self._clock = StepClock(self._t_end)  # each step's compute and wait, for the straggler verdict
        # The staging wait, before every optimizer step, so no caller can forget it.
        self._state_optimizer().register_step_pre_hook(lambda *_: self._before_optimizer_step())
        # Why the load failed, once it did: the state holds part of a checkpoint from then on, and
        # nothing may train on it or save it (``_refuse_if_failed``).
        self._load_failure = ""

    # ------------------------------------------------------------ resume

    def resume(self) -> int:
        """Every rank: choose the checkpoint (rank 0's pick, a deep verify spread over the ranks),
        check it is this run's (identity, data, global batch), load it (shards resharded, then
        this rank's RNG streams); returns the steps already done (0 on a fresh start): continue
        with the next one. Stops the process with the right exit code when it may not go on."""
        if self._problem:
            self._stop(Exit.BAD_CONFIG, Phase.STARTUP, f"refused: bad config: {self._problem}")
        planned = self._memory_plan()
        choice = Choice(os.environ.get(ENV_LAUNCH_ID, "")) if planned is not None else self._choose()
        self.launch = choice.launch
        if self._memory is not None:
            self._memory.launch = self.launch
        self._at_boundary = boundary_hook(self.rank, self.launch)  # injected: supervisor/format/hooks.py
        self._start_remote()
        diff = self._identity_change(choice)
        if self.identity.seed is not None:
            seed_rank_rng(self.identity.seed, self.rank, 0)
        resumed = self._restore(planned, choice, diff)
        if diff:
            self.apply_config_change(diff)
        self.start = self.state.step
        if resumed is not None:
            meta, lr, line = resumed
            self._resumed(meta, lr, line() if callable(line) else line)
        _launch_marks.loaded(self._hb)
        if self.rank == 0:
            self._metrics_file = StepLog(LineAppender(RunDir.of(self._root).metrics, self._root))
            if resumed is not None:
                self._relog(self._metrics_file, resumed[0])
        self._hb.beat(self.start, Phase.TRAIN, force=True)
        self._last_save, self._t_end = time.monotonic(), time.perf_counter()
        self._clock.restart(self._t_end)
        self._open_loaders()
        return self.start

    def _start_remote(self) -> None:
        """Rank 0: the remote tier's uploader, or else the retention policy recorded."""
        if self._options.remote.url and self.rank == 0:
            self._uploader = _tiering.start_uploader(self._root, self._options.remote, self._saves.keep)
        if self.rank == 0 and self._uploader is None:  # for `status` and `ckpt list`/`prune` by hand
            try:
                store.record_policy(self._root, self._saves.retention_policy())
            except OSError as e:
                log.warning("could not record the retention policy: %s", e)

    def _restore(
        self, planned: Planned | None, choice: Choice, diff: Mapping[str, tuple[Any, Any]]
    ) -> tuple[Mapping[str, Any], float | None, str | Callable[[], str]] | None:
        """Load what was chosen (a memory snapshot, a checkpoint, --init-from's weights) or start
        fresh; for a resume, what ``_resumed`` takes (the resume line once the start is known)."""
        self._init_source = ""  # --init-from's checkpoint, recorded in every manifest of this run
        if planned is not None:
            on_disk = parse_committed(choice.ckpt.name) if choice.ckpt is not None else None
            self._from_memory = on_disk != planned.pick.step
            return self._load_memory(planned)
        if choice.ckpt is not None and choice.manifest is not None:
            self._load_checked(choice)
            m = choice.manifest
            self._init_source = str(m.meta.get("init_from", ""))
            line = lambda: resume_line(  # noqa: E731
                choice, self._options, self.world_size, bool(diff), self._root, self.state.step
            )
            return m.meta, None if diff else m.metrics.get("lr"), line
        if self._options.init_from:
            self._init_from(self._options.init_from)
        else:
            self._fresh()
        return None

    def _choose(self) -> Choice:
        """The checkpoint to load (``choose_checkpoint``), or the exit that says why none. The
        signal handlers only record a notice; the verify asks at every chunk it hashes, so a
        notice there stops it (exit 75: nothing trained yet) instead of a verify hashing on."""
        try:
            choice = choose_checkpoint(
                self._args(), self._expectation(), self.identity, self._hb, stop=lambda: PREEMPTION.set
            )
        except Interrupted:
            PREEMPTION.ignore_further()
            self._stop(
                Exit.REQUEUE,
                Phase.VERIFY,
                "preemption notice during the resume's verify: nothing trained yet",
            )
        if choice.error:
            why = "cannot resume" if choice.code in (RETRY_LATER, Exit.STORAGE) else "refused"
            self._stop(choice.code, Phase.STARTUP, f"{why}: {choice.error}")
        return choice

    # ------------------------------------------------------------ data

    def loader(
        self,
        dataset: Dataset[Any],
        batch_size: int | None = 1,
        *,
        shuffle: bool = False,
        name: str = "data",
        **kwargs: Any,
    ) -> ResumableLoader:
        """A torch DataLoader over ``dataset`` whose position, random streams and workers survive
        a preemption and a resume (``_loader.build``): ``batch_size`` per rank, ``shuffle`` a seeded
        order per epoch, ``kwargs`` to the DataLoader (``num_workers``, ``collate_fn``,
        ``pin_memory``...; not ``sampler``, ``batch_sampler`` or ``generator``: its own). Saved as
        ``name`` with every checkpoint; call it before ``resume()``."""
        made = build(dataset, batch_size, self._where(), shuffle=shuffle, **kwargs)
        self._keep_loader(name, made)
        self._track(made)
        return made

    def prepare(self, loader: DataLoader[Any], *, name: str = "data") -> DataLoader[Any]:
        """The resumable equivalent of ``loader`` (``_loader.prepare``), saved as ``name`` with
        every checkpoint (a ``ResumableBatchSampler`` already among the saved objects is not saved
        twice); call it before ``resume()`` and iterate what it returns."""
        made = prepare(loader, self._where())
        position = made.position if isinstance(made, ResumableLoader) else None
        if not (isinstance(position, SamplerPosition) and self.state.saves(position.sampler)):
            self._keep_loader(name, saved_as(made))
        if isinstance(made, ResumableLoader):
            self._track(made)
        return made

    def _track(self, made: ResumableLoader) -> None:
        """Its iteration waits for resume(), which restores its position (or has already)."""
        made.resumed = self._loaders_closed
        self._loaders.append(made)

    def _warn(self, msg: str) -> None:
        if self.rank == 0:
            log.warning("%s", msg)

    def _open_loaders(self) -> None:
        """Their positions are restored: they may be iterated, and no new one may be made. Until
        the first step_end, the loop makes its iterators: each DataLoader's is looked at."""
        self._loaders_closed = True
        for made in self._loaders:
            made.resumed = True
        self._loader_check.start()

    def _where(self) -> Rank:
        return Rank(self.rank, self.world_size, self.identity.seed or 0)

    def _keep_loader(self, name: str, obj: Stateful) -> None:
        if self._loaders_closed:
            raise RuntimeError("Resumable: make loaders before resume(), which restores their position")
        if not getattr(obj, "per_rank", False):
            self.state.keep(name, obj)
            return
        if name in self._rank_items.loaders:
            raise ValueError(
                f"Resumable: a loader named '{name}' is saved already; give this one another name="
            )
        self._rank_items.loaders[name] = obj
        self._ckpt.rank_extra = self._rank_items

    def _resumed(self, meta: Mapping[str, Any], lr: float | None, line: str) -> None:
        """The losses reported before the checkpoint (its ``meta``) continue the window; rank 0
        says where the run resumed and what was verified (``line``), and judges the first steps
        after it (the sanity step; with ``lr`` None not their LR against the saved one: an
        ``allow_config_change`` may have changed it)."""
        saved = meta.get(META_RECENT_LOSSES)
        window = [float(x) for x in saved if isinstance(x, int | float)] if isinstance(saved, list) else []
        self._recent_losses.extend(window)
        if self.rank != 0:
            return
        tell(line)
        self._sanity = ResumeSanity(window, lr, self.steps - self.start)

    def _relog(self, out: StepLog, meta: Mapping[str, Any]) -> None:
        """The resumed step's metrics line, from the state's meta, when the launch that trained
        the step stopped before it wrote it (its line held: _steplog.py)."""
        metrics, launch, restarts = meta.get("metrics"), meta.get("launch"), meta.get("restart_count")
        if not isinstance(metrics, dict) or not isinstance(launch, str) or not launch:
            return
        if logged_since(RunDir.of(self._root).metrics, self.state.step, launch):
            return
        count = restarts if isinstance(restarts, int) else 0
        out.write(MetricsRecord.of(self.state.step, metrics, count, launch).to_line())

    # ------------------------------------------------------------ the memory tier

    def _memory_identity(self) -> dict[str, Any]:
        """What a memory snapshot must share with this run to be resumed from (as a manifest's)."""
        return {
            "config_hash": self.identity.config_hash,
            "data": self.identity.data,
            "global_batch": self.identity.global_batch,
        }

    def _memory_plan(self) -> Planned | None:
        """Every rank: the watchdog's pick of a memory snapshot for this launch, checked by every
        rank (its own part: identity, structure, checksum) and agreed; None when there is none,
        or when some rank refused it: then the disk tier's pick, and each node's local rank 0
        forgets the node's snapshots (a future the run abandons) and says why for the watchdog's
        event log. The step is the newest every node holds (``common_step``): a node's pick can
        be one step ahead of another's (a stand-in's replica one push behind)."""
        m = self._memory
        if m is None or getattr(self.state, "ablate", None):
            return None
        pick = m.planned()
        beat = lambda: self._hb.beat(0, Phase.VERIFY, waiting="every rank's check of its memory snapshot")  # noqa: E731
        steps: tuple[int, ...] = () if pick is None else pick.steps()
        offers = _agree.gather_to_root(steps, None, beat)
        newest: int | str | None = None if offers is None else common_step(offers)
        step = cast("int | str", _agree.broadcast(newest, None, beat))  # mypy joins the union to object
        if isinstance(step, str):
            self._memory_refused(pick, step)
            return None
        assert pick is not None
        if step != pick.step and self.rank == 0:
            log.warning(
                "memory snapshot of step %d: not held by every node; resuming from step %d, the newest "
                "every node holds",
                pick.step,
                step,
            )
        chosen = pick.at(step)
        mine = m.check(chosen, self._memory_identity(), self.state)
        verdict = (chosen.step, "" if isinstance(mine, Planned) else mine)
        gathered = _agree.gather_to_root(verdict, None, beat)
        agreed = _agree.broadcast(None if gathered is None else combined(gathered), None, beat)
        if not agreed:
            assert isinstance(mine, Planned)
            return mine
        self._memory_refused(pick, agreed)
        return None

    def _memory_refused(self, pick: memsnap.Pick | None, why: str) -> None:
        """No memory snapshot for this launch (``why``): the disk tier's pick; a pick this node
        made is forgotten, and why goes to the watchdog (``MemoryTier.reject``)."""
        if why != NO_PICK and pick is not None:
            assert self._memory is not None
            self._memory.reject(pick, why)
            if self.rank == 0:
                log.warning(
                    "memory snapshot of step %d not used: %s; resuming from the disk tier", pick.step, why
                )

    def _load_memory(self, planned: Planned) -> tuple[Mapping[str, Any], float | None, str]:
        """Load the agreed snapshot; returns its meta, LR and the resume line. A failure after the
        copies began stops the launch (the state is half loaded), the node's snapshots forgotten
        so the relaunch resumes from the disk tier."""
        assert self._memory is not None
        t0 = time.perf_counter()
        try:
            meta = self._memory.load(planned, self.state, self._ckpt.rank_extra)
        except Exception as e:
            line = self._load_failure = one_line(e)
            self._memory.reject(planned.pick, f"rank {self.rank}: the load failed: {line}")
            self._stop(
                RETRY_LATER,
                Phase.LOAD,
                f"cannot resume: the memory snapshot of step {planned.pick.step} failed to load ({line}); "
                "the relaunch resumes from the disk tier",
            )
        self._init_source = str(meta.get("init_from", ""))
        metrics = meta.get("metrics")
        lr = metrics.get("lr") if isinstance(metrics, dict) else None
        line = loaded_line(self.state.step, planned, self.world_size, time.perf_counter() - t0)
        return meta, lr if isinstance(lr, float) else None, line

    def _snapshot(self, step: int, step_s: float) -> bool:
        """``step_end``: the memory snapshot of ``step`` when it is due (the same on every rank);
        whether it was taken."""
        m = self._memory
        if m is None:
            return False
        agreed = self._ckpt.memory_agreed
        taken = False
        if m.due(step, agreed.busy, agreed.interval, agreed.off):
            meta, identity = self.save_meta(), self._memory_identity()
            taken = m.snapshot(step, self.state, self._ckpt.rank_extra, meta, identity)
        m.observe(step_s)
        return taken

    def _fresh(self) -> None:
        if self.rank == 0:
            tell(f"no checkpoint in {self._root}: starting at step 0")

    def _state_optimizer(self) -> torch.optim.Optimizer:
        opt = getattr(self.state, "optimizer", None)
        if not isinstance(opt, torch.optim.Optimizer):
            raise TypeError("Resumable: the saved state has no 'optimizer' to hook the staging wait into")
        return opt

    def _load_checked(self, choice: Choice) -> None:
        """Load; a load that fails stops the process (``_load_failed``)."""
        try:
            restored = self._load(choice)
        except Exception as e:
            self._load_failed(choice, e)
        if not restored and self.identity.seed is not None:
            seed_rank_rng(self.identity.seed, self.rank, self.state.step)
            if self.rank == 0:
                log.warning(
                    "world size %d -> %d: per-rank RNG derived from (seed, rank, step %d)",
                    choice.world_size,
                    self.world_size,
                    self.state.step,
                )

    def _load_failed(self, choice: Choice, e: Exception) -> NoReturn:
        """A load that failed on any rank stops every rank: its reads went straight into the
        model's and optimizer's own memory (no second copy of the state: a resume costs no memory
        and no time over the state itself), so what they hold now is part of the checkpoint and
        part of what was there before. Nothing may train on that or save it: from here on every
        optimizer step, ``step_end``, save and ``finish`` of this Resumable raises ``LoadFailed``,
        and ``resume()`` raises SystemExit with the exit code the watchdog acts on (not an
        Exception, which an ``except Exception`` around ``resume()`` would swallow):

        - a refused pickle: 77, not retried (nothing of it ran);
        - a foreign per-rank file (another device): 78;
        - a record or index that cannot be read (CorruptRecord, on every rank alike): the
          checkpoint is moved to quarantine/ with that line as its reason, and the relaunch
          resumes from the one before (exit 1, retried);
        - storage that did not answer (an OSError; a peer's failure): 74, retried;
        - anything else is raised as it is (a traceback names it), the state refused all the same."""
        line = one_line(e)
        self._load_failure = line
        if isinstance(e, UnsafePickle):  # nothing of it ran; every rank read the same file and refused it
            self._stop(trainer_code(e), Phase.LOAD, refusal_line(e, self._root, choice.ckpt))
        if isinstance(e, DeviceError):  # every rank's file has the same format: all refuse alike
            self._stop(trainer_code(e), Phase.LOAD, f"cannot resume: {e}")
        if isinstance(e, CorruptRecord) and choice.ckpt is not None:
            self._stop(
                RETRY_LATER, Phase.LOAD, f"cannot resume: {self._quarantine_failed(choice.ckpt, line)}"
            )
        if isinstance(e, OSError | PeerLoadFailed):
            self._stop(Exit.STORAGE, Phase.LOAD, f"cannot resume: the load failed: {line}; retryable")
        raise e

    def _quarantine_failed(self, ckpt: Path, line: str) -> str:
        """Move a checkpoint that failed at load aside (every rank raised the same line; the first
        to get the root's lock moves it) and say so."""
        step = parse_committed(ckpt.name)
        if step is None:
            return f"{line}; move {ckpt} aside"
        try:
            store.quarantine(self._root, store.CheckpointRef(step, ckpt), line)
        except FileNotFoundError:
            pass  # another rank moved it first
        except OSError as e:
            return f"{line}; not moved to quarantine ({e}): move it aside by hand"
        return f"{line}; moved to quarantine/, the relaunch resumes from the checkpoint before it"

    def _before_optimizer_step(self) -> None:
        self._refuse_if_failed()
        self._ckpt.before_optimizer_step()
        if self._memory is not None:
            self._memory.wait()

    def _refuse_if_failed(self) -> None:
        """LoadFailed when a load left the state half read (``_load_failed``)."""
        if self._load_failure:
            raise LoadFailed(
                f"resume failed ({self._load_failure}): the model and optimizer hold part of a checkpoint; "
                "nothing may train on them or save them: exit, and let the next launch resume"
            )

    def _init_from(self, spec: str) -> None:
        """A new run starts from another run's weights (and optimizer): its own identity, step 0."""
        mine = init_source(spec) if self.rank == 0 else None
        # cast: mypy solves broadcast's T for a union as their join (object)
        beat = lambda: self._hb.beat(0, Phase.VERIFY, waiting="rank 0's check of --init-from")  # noqa: E731
        src = cast("Path | str", _agree.broadcast(mine, None, beat))
        if isinstance(src, str):
            self._stop(Exit.BAD_CONFIG, Phase.STARTUP, f"refused: --init-from {spec}: {src}")
        what = "weights and optimizer" if self._options.init_optimizer else "weights"
        if self._options.init_optimizer:
            prime_for_load(getattr(self.state, "optimizer", None))
        try:
            with kept_alive(self._hb.tracker(Phase.LOAD, 0), self._ckpt.wait_s) as loading:
                load_dcp(
                    src,
                    {SHARED: Weights(self.state, self._options.init_optimizer)},
                    self._ckpt.dcp_group,
                    fs=ProgressFileSystem(src.parent, loading),
                )
        except UnsafePickle as e:
            self._load_failure = one_line(e)
            self._stop(trainer_code(e), Phase.LOAD, refusal_line(e, src.parent, src))
        except Exception as e:  # another model's: one line, not a traceback
            first = self._load_failure = one_line(e)
            self._stop(
                Exit.BAD_CONFIG,
                Phase.LOAD,
                f"refused: --init-from {spec}: the {what} of {src} do not fit this model ({first[:300]})",
            )
        self._init_source = str(src)
        if self.rank == 0:
            tell(f"new run: {what} from {src} (--init-from), starting at step 0")

    def _load(self, choice: Choice) -> bool:
        """Load the chosen checkpoint; returns whether the per-rank state was restored (not on
        another world size)."""
        assert choice.ckpt is not None
        return self._ckpt.load(
            choice.ckpt,
            self.state,
            saved_world_size=choice.world_size,
            skip=frozenset(getattr(self.state, "ablate", ())) & frozenset(RANK_ITEMS),
            progress=self._hb.tracker(Phase.LOAD, choice.manifest.step if choice.manifest else 0),
            listed={n: e.size for n, e in choice.manifest.files.items()} if choice.manifest else None,
        )

    def _identity_change(self, choice: Choice) -> dict[str, tuple[Any, Any]]:
        """The fields that differ from the checkpoint's (only when allowed, else the pick refused);
        a field that cannot be applied is refused here, one line, before anything is loaded."""
        m = choice.manifest
        if m is None or m.model_config_hash == self.identity.config_hash:
            return {}
        saved = m.meta.get("identity")
        if not isinstance(saved, dict):
            self._stop(
                Exit.MISMATCH,
                Phase.STARTUP,
                f"refused: {choice.ckpt and choice.ckpt.name}: model config hash {m.model_config_hash} differs from "
                f"this run's {self.identity.config_hash} and it records no identity to tell which fields changed; "
                "restore the config or start a new run dir",
            )
        diff = identity_diff(saved, self.identity.all_fields)
        fixed = {k: v for k, v in diff.items() if k not in self.identity.changeable}
        if fixed:
            self._stop(
                Exit.MISMATCH,
                Phase.STARTUP,
                f"refused: {choice.ckpt and choice.ckpt.name}: {describe_diff(fixed)}: "
                "--allow-config-change cannot apply that; restore it or start a new run dir",
            )
        if self.rank == 0:
            log.warning("--allow-config-change: applying %s on resume", describe_diff(diff))
        return diff

    def apply_config_change(self, diff: Mapping[str, tuple[Any, Any]]) -> None:
        """After the load: put the run's new values of the ``changeable`` fields in ``diff`` into
        the loaded objects (the load restored the saved ones). A trainer with changeable fields
        overrides this; the base class has none."""

    def _expectation(self) -> store.Expectation:
        return store.Expectation(
            model_config_hash=self.identity.config_hash,
            data_fingerprint=self.identity.data,
            allow_config_change=self._options.allow_config_change,
            allow_data_change=self._options.allow_data_change,
        )

    def _args(self) -> Request:
        return resume_args(self._root, self._options, self.identity)

    def _remote_problem(self) -> str:
        return remote_problem(self._options.remote, self._saves.keep)

    def _submit(self, ref: store.CheckpointRef) -> None:
        if self._uploader is not None:
            self._uploader.submit(ref)

    # ------------------------------------------------------------ every step

    def step_end(self, step: int, metrics: Mapping[str, float] | None = None) -> bool:
        """Call on every rank after each optimizer step, with the number of steps done. Logs
        ``metrics`` (rank 0, ``metrics.jsonl``; a ``step_time`` of the caller's replaces the
        measured one), beats the heartbeat, commits a finished async save, acts on a preemption
        notice agreed by all ranks (a synchronous save, then exit 75), starts a save when one is
        due (every N steps, or every T seconds by rank 0's clock). Returns whether the run is done."""
        self._refuse_if_failed()
        dt = float((metrics or {}).get("step_time", time.perf_counter() - self._t_end))
        self._loader_check.stop()
        self.state.step = step
        self._metrics = {**dict(metrics or {}), "step_time": round(dt, 6)}
        loss = self._metrics.get("loss")
        if loss is not None and math.isfinite(loss):
            self._recent_losses.append(float(loss))
        if self._sanity is not None:
            self._sanity.observe(step, self._metrics)
            self._sanity = None if self._sanity.done else self._sanity
        exchanges = self._ckpt.exchanges
        # Before the metrics line: a step logged is a step in memory. Its ``due`` commits the last
        # snapshot once no rank copies, and then the lines held for it go (_steplog.py).
        taken = self._snapshot(step, dt)
        if self._metrics_file is not None:
            self._metrics_file.release(self._ckpt.settled)
            rec = MetricsRecord.of(step, self._metrics, self._hb.restart_count, self.launch)
            self._metrics_file.write(rec.to_line(), exchanges if taken else None)
        self._hb.step_times = self._clock.step_done(step)
        self._hb.beat(step, Phase.TRAIN, last_step_s=dt)
        self._at_boundary(step, When.STEP)
        try:
            preempt, save_now = self._ckpt.boundary(PREEMPTION.set, self._save_due_by_time())
            done = step >= self.steps
            if preempt:
                PREEMPTION.ignore_further()
                if not done:
                    self._preempted()
                if self.rank == 0:
                    log.warning("preemption signal at the last step %d: finishing normally", step)
            every = self._saves.every_steps
            if not done and (save_now or (every and step % every == 0)):
                self._save(blocking=False)
                self._at_boundary(step, When.SAVE)
        except StorageGaveUp as e:  # raised on every rank at the same save
            self._close_uploader(0.0)
            self._stop(trainer_code(e), Phase.SAVE, str(e))
        except PeersTimedOut as e:
            self._gave_up(e)
        if self._metrics_file is not None:
            self._metrics_file.release(self._ckpt.settled)  # a loop without ``reduce``: exchanged here
        self._t_end = time.perf_counter()
        self._clock.restart(self._t_end)
        return done

    def compute_done(self) -> None:
        """Optional, once per step on every rank: this rank's own work of the step is done and it
        is about to enter the step's collective (a data-parallel trainer: just before its
        gradient all-reduce). The watchdog names a rank a straggler when this comes late against
        its peers (docs/watchdog.md#stragglers); without the call a step's compute ends at
        ``reduce``, so a rank that waited in the trainer's own collectives counts that wait as
        compute, and a slow rank shows as one that arrives late, not as one that computes slowly."""
        self._clock.compute_done()

    def reduce(self, t: torch.Tensor) -> torch.Tensor:
        """``t`` summed over all ranks, carrying this step's control flags along (a preemption
        notice, the upload's state, a time-based save due): use it for a reduction your step makes
        anyway (the loss, for logging) and ``step_end`` costs no collective of its own. Call it on
        every rank at the same point of a step (it is a collective), on every step or on none."""
        started = self._clock.reduce_started()
        try:
            return self._ckpt.reduce_with_control(t, PREEMPTION.set, self._save_due_by_time())
        finally:
            self._clock.reduce_ended(started)

    def _save_due_by_time(self) -> bool:
        """--save-every-s: due by this rank's clock; only rank 0's counts (``boundary``)."""
        return self._saves.every_s > 0 and time.monotonic() - self._last_save >= self._saves.every_s

    @property
    def memory_every(self) -> int:
        """The memory tier's snapshot interval in steps as the ranks last agreed it (rank 0's, by
        the 3% rule or ``--memory-every``; the same on every rank); 0 when the tier is off. A kill
        costs at most this many steps (docs/tiers.md): a loop may log it beside its metrics."""
        agreed = self._ckpt.memory_agreed
        return 0 if self._memory is None or agreed.off else max(1, agreed.interval)

    @property
    def preemption_noticed(self) -> bool:
        """A preemption notice (SIGTERM, SIGUSR1, $REQUEUE_SIGNAL) reached this rank; the next
        ``step_end`` acts on it (every rank agrees there), so a loop never needs to ask."""
        return PREEMPTION.set

    def beat(self) -> None:
        """A heartbeat now (throttled): for a long stretch of the trainer's own between steps.
        Each call is progress (the watchdog measures silence from the last one): call it as the
        stretch advances, not from a thread that only waits."""
        self._own_beats += 1
        self._hb.beat(self.state.step, Phase.TRAIN, progress=self._own_beats)

    @contextmanager
    def phase(self, name: str, timeout: float = 0.0) -> Iterator[Callable[[], object]]:
        """A long phase of the trainer's own (eval, a data refresh) that the watchdog holds to
        ``timeout`` seconds without progress instead of the train timeout (0: the train
        timeout). Yields a ``progress()`` to call as it advances (each call progress, and a
        throttled beat). Every rank that runs the phase must use it; status shows the phase by
        its name."""
        if not name or timeout < 0:
            raise ValueError(f"phase {name!r}, timeout {timeout}: give a name and a timeout >= 0")
        step = self.state.step
        self._hb.custom = (name, float(timeout))
        self._hb.beat(step, Phase.CUSTOM, force=True)
        calls = itertools.count(1)
        try:
            yield lambda: self._hb.beat(step, Phase.CUSTOM, progress=next(calls))
        finally:
            self._hb.custom = ("", 0.0)
            self._hb.beat(step, Phase.TRAIN, force=True)

    # ------------------------------------------------------------ saves

    def save_meta(self) -> dict[str, Any]:
        """What each manifest records besides the files (``metrics`` goes to its own field)."""
        return {
            "config": self.identity.name,
            "launch": self.launch,
            "restart_count": self._hb.restart_count,
            "loss": self._metrics.get("loss"),
            "identity": self.identity.all_fields,
            META_RECENT_LOSSES: list(self._recent_losses),
            **({"init_from": self._init_source} if self._init_source else {}),
            "metrics": {k: float(v) for k, v in self._metrics.items()},
        }

    def _save(self, blocking: bool) -> SaveOutcome | None:
        self._refuse_if_failed()
        self._hb.beat(self.state.step, Phase.SAVE)
        self._last_save = time.monotonic()
        outcome = self._ckpt.save(self.state, self.save_meta(), blocking=blocking)
        self._hb.beat(self.state.step, Phase.TRAIN)
        return outcome

    def _save_now(self) -> SaveOutcome:
        """A synchronous save, whose outcome always comes back."""
        outcome = self._save(blocking=True)
        assert outcome is not None, "a blocking save returns its outcome"
        return outcome

    def _preempted(self) -> NoReturn:
        """Asked to stop: finish any in-flight save, save this step synchronously, exit 75."""
        step = self.state.step
        if self.rank == 0:
            log.warning("preemption signal: checkpointing step %d, then exit %d", step, Exit.REQUEUE)
        outcome = self._save_now()
        self._ckpt.close()
        flush = self._options.remote.flush_timeout_s
        self._close_uploader(min(flush, _tiering.PREEMPT_FLUSH_TIMEOUT_S))
        if not outcome.committed:  # requeued, it would resume from an older checkpoint anyway
            self._stop(
                Exit.STORAGE,
                Phase.SAVE,
                f"storage: the preemption checkpoint of step {step} failed ({outcome.error}); "
                f"nothing committed: the relaunch resumes from {outcome.latest or 'step 0'}; exit 74, retryable",
            )
        self._close_metrics(finished=True)  # every step logged is in that checkpoint
        self._stop(Exit.REQUEUE, Phase.SAVE)

    # ------------------------------------------------------------ the end

    def finish(self) -> str:
        """The end of training on every rank: the final save (retried with backoff while the save
        policy allows), the final parameter digest and ``final.json``, the remote flushed, the
        heartbeat says done. Returns the digest (sha256 of the full parameters, any sharding)."""
        self._refuse_if_failed()
        try:
            if self._memory is not None:
                self._memory.close()
            # A state resumed from memory is on no disk (the last step's snapshot, say: nothing
            # left to train), and the memory goes with the watchdog: saved all the same.
            if self.state.step > self.start or self._from_memory:
                self._final_save()
            self._ckpt.close()
        except StorageGaveUp as e:
            self._close_uploader(0.0)
            self._stop(trainer_code(e), Phase.SAVE, str(e))
        except PeersTimedOut as e:
            self._gave_up(e)
        self._close_metrics(finished=True)
        digest = self._final_record()
        self._close_uploader(self._options.remote.flush_timeout_s)
        deliberate_exit(self._hb, self.rank, self.state.step, Phase.DONE, Exit.OK)
        self._stacks.close()
        if self._collectives is not None:
            self._collectives.close()
        return digest

    def _final_save(self) -> None:
        """The last checkpoint, tried again until it commits or the save policy gives up
        (StorageGaveUp). Between tries every rank waits the same backoff, beating as a wait (no
        progress): it is bounded, like every wait of a save, by ``wait_s``, well under the save
        timeout, so a backoff is never a hang verdict. The jitter is seeded by the launch and the
        agreed failure count: alike on every rank, different across jobs, and not the global RNG,
        which belongs to the training loop."""
        while not (outcome := self._save_now()).committed:
            rng = random.Random(f"{self._hb.launch_id}:{outcome.failures}")
            wait = min(STORAGE_BACKOFF.wait_s(outcome.failures, rng), self._ckpt.wait_s)
            self._wait_beating(wait, Phase.SAVE, "the backoff before the final save's next try")

    def _wait_beating(self, seconds: float, phase: Phase, what: str) -> None:
        end, until = time.monotonic() + seconds, time.time() + seconds
        while (left := end - time.monotonic()) > 0:
            self._hb.beat(self.state.step, phase, waiting=what, wait_until=until)
            time.sleep(min(left, self._hb.interval_s / 2))

    def final_fields(self) -> dict[str, Any]:
        """Entries a trainer adds to ``final.json`` (the reference trainer: its EMA's digest,
        hashed with a ``digest_tracker``). Called on every rank: it may gather. By default, each
        module saved beside the model (an ``AveragedModel`` as ``"ema"``) as ``<name>_sha256``,
        its whole ``state_dict`` hashed: the drill compares an ``ema_sha256`` with golden's too."""
        others = getattr(self.state, "others", {})
        return {
            f"{k}_sha256": tensors_digest(
                v.state_dict().items(), self.digest_tracker(v.state_dict().values())
            )
            for k, v in others.items()
            if isinstance(v, torch.nn.Module)
        }

    def digest_tracker(self, tensors: Iterable[torch.Tensor]) -> Progress:
        """Phase DIGEST's progress, in bytes of ``tensors`` hashed: a large model's digest is a
        long phase of its own, and a silent one would be judged hung."""
        total = sum(t.numel() * t.element_size() for t in tensors)
        return self._hb.tracker(Phase.DIGEST, self.state.step, total)

    def _final_record(self) -> str:
        """The digest (phase DIGEST, progress in bytes hashed) and ``final.json``, retried on a
        storage error for io_retry_s: the checkpoint is committed by now, so a report that cannot
        be written is a warning, not a failed run."""
        model: torch.nn.Module = getattr(self.state, "model")  # noqa: B009 - both Saveables have one
        digest = params_digest(model, self.digest_tracker(model.parameters()))
        extra = self.final_fields()
        if self.rank != 0:
            return digest
        final = {
            "step": self.state.step,
            "world_size": self.world_size,
            "params_sha256": digest,
            "parallel": self.identity.mode,
            "config": self.identity.name,
            "loss": self._metrics.get("loss"),
            **extra,
        }
        try:
            retry_transient(
                lambda: atomic_write_json(RunDir.of(self._root).final, final, self._root),
                deadline_s=self._options.io_retry_s,
                what=f"writing {FINAL}",
                fix=lambda _e: "the checkpoint is committed; the digest is in this log",
                on_retry=lambda msg: log.warning("%s", msg),
            )
        except store.StorageUnavailable as e:
            log.warning("%s", e)
        log.info("done at step %d, params_sha256 %s", self.state.step, digest)
        return digest

    def _close_uploader(self, timeout_s: float) -> None:
        if self._uploader is not None:
            step = self.state.step
            until = time.time() + timeout_s
            beat = lambda: self._hb.beat(step, Phase.SAVE, waiting=UPLOADS, wait_until=until)  # noqa: E731
            _tiering.close_uploader(self._uploader, timeout_s, beat)
            self._uploader = None

    def _gave_up(self, e: PeersTimedOut) -> NoReturn:
        """A save's exchange gave up waiting for the peers (exit 76): said on stderr by this rank,
        whichever it is, and in its heartbeat, what it waited for with it, for the watchdog's
        verdict (a hang of the launch: the others' stacks say who is stuck)."""
        print(f"resumable: {e}", file=sys.stderr, flush=True)
        self._close_uploader(0.0)
        self._close_metrics()
        code = Exit.WAIT_GAVE_UP
        self._hb.beat(
            self.state.step, Phase.COMMIT, exit_code=int(code), waiting=e.what, wait_until=time.time()
        )
        raise SystemExit(int(code))

    def _close_metrics(self, finished: bool = False) -> None:
        """The metrics file closed: its held lines written when every step they log is on the disk
        (``finished``: the final or the preemption checkpoint committed), else dropped
        (_steplog.py); the lines a full disk held back get their last chance."""
        if self._metrics_file is not None:
            self._metrics_file.close(finished)
            self._metrics_file = None

    def _stop(self, code: Exit, phase: Phase, msg: str = "") -> NoReturn:
        """A deliberate exit: the code into the heartbeat, ``msg`` on stderr (rank 0), SystemExit."""
        self._close_metrics()
        raise SystemExit(deliberate_exit(self._hb, self.rank, self.state.step, phase, code, msg))
