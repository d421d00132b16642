"""DCP save and load through the checkpoint store, with at most one async save in flight.

Protocol of one save (every rank calls ``save`` at the same step boundary):
1. finish the previous save if one is still in flight (wait for it, then commit it);
2. rank 0 opens the store's tmp dir (``supervisor.store.begin``) and tells the others its path;
3. each rank writes its per-rank state file, then DCP writes the shards (async: staged in the
   background and uploaded by a thread; sync: before returning);
4. once every rank's writes have finished, ranks send rank 0 the checksums of the files they wrote
   and rank 0 commits (manifest, rename, ``latest``), then hands the commit to ``on_commit`` (the
   remote tier's uploader, which also does retention between uploads) or else prunes itself.

Async: training continues while staging runs, but ``before_optimizer_step`` waits for staging to
complete, because an optimizer step during staging would tear the checkpoint. Whether the upload is
done is agreed by all ranks at each step boundary (``step_boundary``), never decided from a local
``future.done()``, so every rank commits at the same step.

DCP and the step-boundary agreement each run on their own gloo group: the upload thread's
collectives on the default group deadlocked against training collectives (torch-cpu.md).
"""

from __future__ import annotations

import logging
import os
import pickle
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

from supervisor import store
from supervisor.manifest import FileEntry, checksum_file
from train_ref.safe_load import load_dcp, weights_only_refusal
from train_ref.state import RankState, TrainState, rank_state_filename

log = logging.getLogger(__name__)

DCP_METADATA = ".metadata"  # written by DCP's coordinator (rank 0)

# Test-only fault injection: seconds every checkpoint write sleeps before writing its shards, to
# widen the window between "save started" and "commit" so a test can kill a rank inside it.
ENV_SAVE_DELAY = "TRAIN_REF_SAVE_DELAY_S"
# CPU-safe async staging (the default stager's pinned memory / non-blocking copy need a GPU).
CPU_STAGING = StagingOptions(
    use_pinned_memory=False, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=False
)
GPU_STAGING = StagingOptions(
    use_pinned_memory=True, use_shared_memory=False, use_async_staging=True, use_non_blocking_copy=True
)


@dataclass(frozen=True)
class CommitInfo:
    """What every manifest of this run records besides its files."""

    model_config_hash: str
    data_fingerprint: str
    parallelism: dict[str, Any]
    torch_version: str = torch.__version__
    # --signing-key's key: rank 0 signs every commit with it (docs/security.md); never recorded.
    sign_key: bytes | None = field(default=None, repr=False)


@dataclass
class _InFlight:
    step: int
    tmp: Path
    meta: dict[str, Any]
    staging: Future | None
    upload: Future
    started: float = field(default_factory=time.monotonic)


class _DelayedWriter(FileSystemWriter):
    def __init__(self, path: Path, delay_s: float):
        super().__init__(path)
        self.delay_s = delay_s

    def write_data(self, plan, planner):  # type: ignore[no-untyped-def]
        time.sleep(self.delay_s)
        return super().write_data(plan, planner)


def _writer(path: Path) -> FileSystemWriter:
    delay = float(os.environ.get(ENV_SAVE_DELAY, "0") or 0)
    return _DelayedWriter(path, delay) if delay > 0 else FileSystemWriter(path)


class Checkpointer:
    def __init__(
        self,
        root: Path,
        *,
        async_save: bool,
        keep: int,
        info: CommitInfo,
        on_commit: Callable[[store.CheckpointRef], None] | None = None,
    ):
        """``on_commit`` (rank 0) takes over retention: pruning here could delete a checkpoint
        while a background upload reads it."""
        self.root, self.async_save, self.keep, self.info = root, async_save, keep, info
        self.on_commit = on_commit
        self.rank, self.world_size = dist.get_rank(), dist.get_world_size()
        self.dcp_group = dist.new_group(backend="gloo")
        self.ctl_group = dist.new_group(backend="gloo")
        self.stager: DefaultStager | None = None
        if async_save:
            self.stager = DefaultStager(GPU_STAGING if torch.cuda.is_available() else CPU_STAGING)
        self.in_flight: _InFlight | None = None
        self.last_blocking_s = 0.0  # time the training loop was blocked by the last save call
        self.last_staging_wait_s = 0.0  # ... and then waiting for its staging before a step

    # ------------------------------------------------------------ saving

    def save(self, state: TrainState, meta: dict[str, Any], *, blocking: bool = False) -> None:
        """Checkpoint ``state`` at its current step. ``blocking`` forces a synchronous save."""
        t0 = time.monotonic()
        self.finish()
        tmp = self._begin(state.step)
        RankState.save(tmp / rank_state_filename(self.rank))
        if self.async_save and not blocking:
            resp = dcp.async_save(
                {"app": state},
                storage_writer=_writer(tmp),
                process_group=self.dcp_group,
                async_stager=self.stager,
            )
            staging, upload = (
                (resp.staging_completion, resp.upload_completion)
                if hasattr(resp, "upload_completion")
                else (None, resp)
            )
            self.in_flight = _InFlight(state.step, tmp, meta, staging, upload)
        else:
            dcp.save({"app": state}, storage_writer=_writer(tmp), process_group=self.dcp_group)
            self._commit(state.step, tmp, meta)
        self.last_blocking_s = time.monotonic() - t0

    def before_optimizer_step(self) -> None:
        """Wait until the in-flight save has staged its copy; parameters may change after this."""
        if self.in_flight is not None and self.in_flight.staging is not None:
            t0 = time.monotonic()
            self.in_flight.staging.result()
            self.in_flight.staging = None
            self.last_staging_wait_s = time.monotonic() - t0

    def step_boundary(self, preempt_requested: bool) -> bool:
        """One small collective per step: do all ranks agree the upload is done (then commit), and
        has any rank been asked to stop? Returns the latter, identical on every rank."""
        busy = self.in_flight is not None and not self.in_flight.upload.done()
        flags = torch.tensor([int(preempt_requested), int(busy)], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=self.ctl_group)
        if self.in_flight is not None and not flags[1]:
            self.finish()
        return bool(flags[0])

    def finish(self) -> None:
        """Wait for the in-flight save, if any, and commit it."""
        if self.in_flight is None:
            return
        f, self.in_flight = self.in_flight, None
        if f.staging is not None:
            f.staging.result()
        f.upload.result()
        self._commit(f.step, f.tmp, f.meta)

    def close(self) -> None:
        self.finish()
        if self.stager is not None:
            self.stager.close()

    def _begin(self, step: int) -> Path:
        box = [str(store.begin(self.root, step)) if self.rank == 0 else None]
        dist.broadcast_object_list(box, src=0, group=self.ctl_group)
        return Path(box[0])

    def _commit(self, step: int, tmp: Path, meta: dict[str, Any]) -> None:
        """Every rank's writes are done: rank 0 commits with the checksums each rank computed."""
        mine = _local_entries(tmp, self.rank)
        gathered: list[dict[str, FileEntry] | None] = [None] * self.world_size
        dist.all_gather_object(gathered, mine, group=self.ctl_group)
        if self.rank == 0:
            known = {k: v for d in gathered if d for k, v in d.items()}
            # Every rank's files must be in rank 0's view, else nothing is committed.
            writers = {r: sorted(d or ()) for r, d in enumerate(gathered)}
            ref = store.commit(
                self.root,
                tmp,
                step=step,
                world_size=self.world_size,
                model_config_hash=self.info.model_config_hash,
                data_fingerprint=self.info.data_fingerprint,
                parallelism=self.info.parallelism,
                torch_version=self.info.torch_version,
                meta=meta,
                known=known,
                writers=writers,
                sign_key=self.info.sign_key,
            )
            if self.on_commit is not None:
                log.info("committed %s", ref.name)
                self.on_commit(ref)
            else:
                pruned = store.prune(self.root, keep=self.keep)
                log.info(
                    "committed %s%s",
                    ref.name,
                    f" (pruned {', '.join(pruned.deleted)})" if pruned.deleted else "",
                )
        dist.barrier(group=self.ctl_group)

    # ------------------------------------------------------------ loading

    def load(self, ckpt: Path, state: TrainState, *, saved_world_size: int, skip: frozenset[str]) -> bool:
        """Load shards (DCP reshards to this world size), then this rank's RNG file. Returns whether
        the per-rank state was restored; on another world size it cannot map onto the new ranks,
        and the caller derives fresh streams instead. Nothing in the checkpoint is run: a pickle
        that names anything else than plain data is UnsafePickle, one line (train_ref/safe_load.py)."""
        load_dcp(ckpt, {"app": state}, self.dcp_group)
        if saved_world_size != self.world_size:
            return False
        path = ckpt / rank_state_filename(self.rank)
        try:
            RankState.load(path, skip)
        except pickle.UnpicklingError as e:
            raise weights_only_refusal(str(path), e) from None
        return True


def _local_entries(tmp: Path, rank: int) -> dict[str, FileEntry]:
    """Checksums of the files this rank wrote, so rank 0 does not re-read every shard. DCP's
    ``.metadata`` is written by its coordinator, rank 0."""
    out = {}
    for name in sorted(os.listdir(tmp)):
        mine = name.startswith(f"__{rank}_") or name == rank_state_filename(rank)
        if mine or (rank == 0 and name == DCP_METADATA):
            p = tmp / name
            out[name] = FileEntry(p.stat().st_size, checksum_file(p))
    return out
