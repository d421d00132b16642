"""Run under torchrun by test_agree.py: the commit's gather reaches rank 0 only, in rank order, for
objects of different sizes; the step-boundary flags riding on a reduction reach every rank alike,
and so do those of a loop that does not piggyback (step_boundary's own all-reduce); an async
save's commit, started at a step boundary, runs in the background; a load whose part failed on one
rank fails on every rank alike, with nothing applied anywhere; a load of a checkpoint with an index
per rank on another layout reads each index once over the ranks; a save's commit reads back only
the files DCP did not write, and its manifest holds what is on disk."""

from __future__ import annotations

import io
import json
import os
import sys
from collections.abc import Iterable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.filesystem import FileSystem

from supervisor import signing, store
from supervisor.format.heartbeat import HeartbeatWriter
from supervisor.format.layout import (
    DCP_METADATA,
    dcp_index_filename,
    dcp_shard_filename,
    is_dcp_index,
    rank_state_filename,
    step_dirname,
)
from supervisor.format.manifest import CheckpointInfo
from supervisor.resumable import _agree, _safe_load
from supervisor.resumable import _checkpointer as checkpointer
from supervisor.resumable._checkpointer import Checkpointer, CommitInfo
from supervisor.resumable._shard_writer import shard_writer

SIGNING_KEY = bytes(range(32))  # the commit's key in the signed save


@dataclass
class _Tiny:
    """The least a save takes (``checkpointer.Saveable``)."""

    step: int
    w: torch.Tensor

    def saving(self, rank: int, world_size: int) -> _Tiny:
        return self

    def state_dict(self) -> dict[str, Any]:
        return {"w": self.w}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.w = state_dict["w"]


class _Applied:
    """A Stateful that remembers whether a load applied its state."""

    def __init__(self, sd: dict[str, Any]):
        self.sd, self.applied = sd, False

    def state_dict(self) -> dict[str, Any]:
        return self.sd

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        self.applied = True


def _loads(root: Path, rank: int, group: dist.ProcessGroup) -> list[list[Any]]:
    """Loads of a checkpoint where each rank's item is its own (in its own shard file): clean;
    rank 1's record made a foreign pickle (junk over its zip header); rank 1's record broken (junk
    over its zip's end); the last rank asking for an item the checkpoint lacks. Per load: the
    exception's type on this rank, its line, whether any state was applied, the values read."""
    ckpt = root / "load"
    dcp.save({"app": {f"r{rank}": torch.full((4,), float(rank))}}, checkpoint_id=ckpt, process_group=group)
    dist.barrier(group)
    shard = ckpt / dcp_shard_filename(1)
    saved = shard.read_bytes()
    broken = {"untrusted": 0, "corrupt": len(saved) - 22}  # the end of central directory record
    out = []
    for case in ("clean", "untrusted", "corrupt", "missing"):
        if rank == 1:
            shard.write_bytes(saved)
            if case in broken:
                with open(shard, "r+b") as f:
                    f.seek(broken[case])
                    f.write(b"JUNK")
        dist.barrier(group)
        key = "r99" if case == "missing" and rank == dist.get_world_size() - 1 else f"r{rank}"
        target = _Applied({key: torch.zeros(4)})
        try:
            _safe_load.load_dcp(ckpt, {"app": target}, group)
            got = [None, "", target.applied, target.sd[key].tolist()]
        except Exception as e:
            got = [type(e).__name__, str(e), target.applied, target.sd[key].tolist()]
        out.append(got)
    return out


class _CountingFS(FileSystem):
    """DCP's file system, remembering the names of the files it opens."""

    def __init__(self) -> None:
        super().__init__()
        self.opened: list[str] = []

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        self.opened.append(Path(path).name)
        with super().create_stream(path, mode) as stream:
            yield stream


def _per_rank_loads(root: Path, rank: int, group: dist.ProcessGroup) -> list[list[Any]]:
    """Loads of a checkpoint where each rank saved alone, with its own index: each rank's own
    item; the next rank's (another layout: every index, merged); the same with rank 1's index
    gone (a gap in the ranks), then with the last rank's made a foreign pickle. Per load: the
    exception's type, its line, whether any state was applied, the values read, and the DCP
    indexes this rank opened."""
    ckpt = root / "per_rank"
    world = dist.get_world_size(group)
    state = {f"r{rank}": torch.full((4,), float(rank)), "step": 7}
    dcp.save(
        {"app": state}, storage_writer=shard_writer(ckpt, root), process_group=group, use_collectives=False
    )
    dist.barrier(group)
    gone, last = ckpt / dcp_index_filename(1), ckpt / dcp_index_filename(world - 1)
    out = []
    for case in ("own", "another", "gap", "untrusted"):
        if rank == 0 and case == "gap":
            gone.rename(ckpt / "aside")
        if rank == 0 and case == "untrusted":
            (ckpt / "aside").rename(gone)
            last.write_bytes(b"cposix\nsystem\n(S'touch /nonexistent/x'\ntR.")
        dist.barrier(group)
        key = f"r{rank if case == 'own' else (rank + 1) % world}"
        target, fs = _Applied({key: torch.zeros(4), "step": 0}), _CountingFS()
        try:
            _safe_load.load_dcp(ckpt, {"app": target}, group, fs=fs)
            got = [None, "", target.applied, target.sd[key].tolist()]
        except Exception as e:
            got = [type(e).__name__, str(e), target.applied, target.sd[key].tolist()]
        out.append([*got, [n for n in fs.opened if is_dcp_index(n)]])
    return out


@contextmanager
def _read_back() -> Iterator[list[str]]:
    """The names of the files a commit reads back to hash them, while the block runs: a rank's
    read back of its own files, and rank 0's of every file to sign them."""
    names: list[str] = []
    hash_file, digest_files = checkpointer.hash_file, signing.digest_files

    def recorded(path: str | Path, *args: Any) -> list[str]:
        names.append(Path(path).name)
        return hash_file(path, *args)

    def digested(ckpt_dir: Path, files: Iterable[str]) -> dict[str, str]:
        files = sorted(files)
        names.extend(files)
        return digest_files(ckpt_dir, files)

    checkpointer.hash_file, signing.digest_files = recorded, digested
    try:
        yield names
    finally:
        checkpointer.hash_file, signing.digest_files = hash_file, digest_files


def _as_on_disk(ckpt: Path, step: int, key: bytes | None = None) -> bool:
    """Whether the committed checkpoint passes a deep check: every file at the manifest's size and
    checksum (with ``key``: and signed with it, every file at its signed SHA-256)."""
    return store.validate(store.CheckpointRef(step, ckpt), deep=True, key=key).ok


def _checkpointer(
    root: Path, hb: HeartbeatWriter, async_save: bool, key: bytes | None = None
) -> Checkpointer:
    return Checkpointer(
        root,
        async_save=async_save,
        retention=store.RetentionPolicy(keep=2),
        info=CommitInfo(CheckpointInfo(0, dist.get_world_size()), sign_key=key),
        hb=hb,
    )


def main() -> int:
    root = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    hb = HeartbeatWriter(root, rank=rank, local_rank=rank, world_size=world)
    ckpt = _checkpointer(root, hb, async_save=False)
    # None of the ranks has a problem; then ranks 1 and 2 have one: rank 1's reaches everyone.
    failures = [
        _agree.first_failure(None, ckpt.ctl_group, lambda: 0),
        _agree.first_failure(f"rank {rank}'s problem" if rank >= 1 else None, ckpt.ctl_group, lambda: 0),
    ]
    loads = _loads(root, rank, ckpt.dcp_group)
    per_rank = _per_rank_loads(root, rank, ckpt.dcp_group)
    # Rank r sends r+1 file names: sizes differ, so the padding and lengths are exercised.
    gathered = _agree.gather_to_root(
        {f"__{rank}_{i}.distcp": i for i in range(rank + 1)}, ckpt.ctl_group, lambda: 0
    )
    # Rank 1 alone got a notice: the sum of the payload and the agreed flag, on every rank.
    total = ckpt.reduce_with_control(torch.tensor([float(rank), 1.0]), preempt_requested=rank == 1)
    piggybacked = ckpt.step_boundary(preempt_requested=False)  # this call's argument comes too late
    own = ckpt.step_boundary(preempt_requested=rank == world - 1)  # nothing carried: its own all-reduce
    quiet = ckpt.step_boundary(preempt_requested=False)
    with _read_back() as sync_read_back:
        ckpt.save(_Tiny(3, torch.full((4,), float(rank))), {}, blocking=True)
    sync_save = {"read_back": sync_read_back, "as_on_disk": _as_on_disk(root / step_dirname(3), 3)}
    # Signed: every rank takes its files' SHA-256 as it writes them, and rank 0 signs those
    signed_root = root / "signed"
    signed_root.mkdir(exist_ok=True)
    signer = _checkpointer(signed_root, hb, async_save=False, key=SIGNING_KEY)
    with _read_back() as signed_read_back:
        signer.save(_Tiny(4, torch.full((4,), float(rank))), {}, blocking=True)
    signed = {
        "read_back": signed_read_back,
        "as_on_disk": _as_on_disk(signed_root / step_dirname(4), 4, SIGNING_KEY),
    }
    signer.close()
    # An async save's commit starts at the boundary that agrees its writes are done and runs in
    # the background; a later boundary takes the outcome.
    async_root = root / "async"
    async_root.mkdir(exist_ok=True)
    asy = _checkpointer(async_root, hb, async_save=True)
    with _read_back() as async_read_back:
        asy.save(_Tiny(5, torch.full((4,), float(rank))), {})
        f = asy.in_flight
        assert f is not None
        early = []
        while f.committed is None:  # every rank's writes done: started at the same boundary
            early.append(store.read_latest(async_root))  # nothing has started the commit yet
            asy.step_boundary(preempt_requested=False)
        f.committed.result()  # done in the background: no boundary in between
    before_taken = store.read_latest(async_root)
    asy.step_boundary(preempt_requested=False)  # takes the outcome
    committed = {
        "early": early,
        "before_taken": before_taken,
        "taken": asy.in_flight is None,
        # what a loop waiting on it would show: bytes written, then hashed, then commit steps,
        # never over 100%
        "counted": (f.work.done, f.work.total),
        "read_back": async_read_back,
        "as_on_disk": _as_on_disk(async_root / step_dirname(5), 5),
        "sizes": {
            n: os.path.getsize(async_root / step_dirname(5) / n)
            for n in (dcp_shard_filename(rank), rank_state_filename(rank), DCP_METADATA)
        },
    }
    asy.close()
    # A file per rank: lines printed by several ranks at once may interleave on torchrun's stdout.
    result = {
        "gathered": gathered,
        "total": total.tolist(),
        "flags": [piggybacked, own, quiet],
        "async": committed,
        "sync": sync_save,
        "signed": signed,
        "failures": failures,
        "loads": loads,
        "per_rank_loads": per_rank,
    }
    (root / f"result_{rank}.json").write_text(json.dumps(result))
    ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
