"""The writer of a save's DCP shards: DCP's file system writer, each write counted and hashed as it
goes (``ProgressFileSystem``), a rank's failure held back until DCP is done on every rank, and
tensor records written without ``torch.save``'s CPU."""

from __future__ import annotations

import io
import os
import time
from pathlib import Path
from typing import IO, cast

import torch
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint.filesystem import (
    DEFAULT_SUFFIX,
    SerializationFormat,
    _StorageInfo,
    _StoragePrefix,
)
from torch.distributed.checkpoint.metadata import Metadata
from torch.distributed.checkpoint.planner import SavePlan, SavePlanner, WriteItem, WriteItemType
from torch.distributed.checkpoint.storage import WriteResult
from torch.futures import Future as TorchFuture

from supervisor.format.heartbeat import Tracker
from supervisor.format.hooks import ENV_SAVE_DELAY
from supervisor.format.layout import dcp_index_filename
from supervisor.resumable._progress_io import ProgressFileSystem
from supervisor.resumable._tensor_record import write_plain

__all__ = ["ShardWriter", "shard_writer"]


class ShardWriter(FileSystemWriter):
    """DCP's file system writer, minus the zip CRC32 of every tensor record, and each tensor record
    written by ``tensor_record.write_plain`` (the bytes ``torch.save`` writes, at a fifth of its
    CPU) where DCP writes it with ``torch.save``.

    DCP writes each tensor with ``torch.save``, whose zip writer computes a CRC32 of every byte:
    a third of a sync save's CPU time here (bench/checkpoint.py), for a check nothing reads
    (``torch.load`` skips it; unzip would warn) and that the manifest's xxh3-128 of every file
    already makes. ``torch.serialization.set_crc32_options`` is process-wide: it is off only
    while this writer writes (at most one save writes at a time), so a ``torch.save`` elsewhere in
    the process during an async save's write also goes without it, and loads all the same."""

    def __init__(self, path: Path, fs: ProgressFileSystem, delay_s: float = 0.0):
        super().__init__(path)
        self.fs, self.delay_s = fs, delay_s
        self.written = fs.written  # each file's size and hashes, as written (no read back)
        self.error: Exception | None = None  # the first failure of this rank's part, held back

    def _get_metadata_path(self, rank: int | None = None) -> os.PathLike[str]:
        """Where DCP's ``finish`` puts the index: a rank's own under this toolkit's name for it
        (``dcp_index_filename``: not DCP's, which torch's own load reads unchecked)."""
        return cast(Path, self.fs.concat_path(self.path, dcp_index_filename(rank)))

    # A failure of this rank's part (ENOSPC on any file, a bug) is held back (``error``) until
    # DCP returns, and what follows it is skipped: DCP must run to its end on every rank alike.
    # Raised inside DCP, it left a rank that saves alone (an index per rank) out of DCP's final
    # barrier, into the commit's agreement, while its peers waited in that barrier: two ranks in
    # different collectives for good (issue 44). ``raise_held`` raises it once DCP is done.

    def prepare_local_plan(self, plan: SavePlan) -> SavePlan:
        try:
            return super().prepare_local_plan(plan)
        except Exception as e:
            self.error = self.error or e
            return plan

    def write_data(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        results: list[WriteResult] = []
        if self.error is None:
            try:
                future = self._write_now(plan, planner)
                future.wait()
                results = future.value()
            except Exception as e:
                self.error = e
        done: TorchFuture[list[WriteResult]] = TorchFuture()
        done.set_result(results)
        return done

    def finish(self, metadata: Metadata, results: list[list[WriteResult]]) -> None:
        if self.error is not None:
            return
        try:
            super().finish(metadata, results)
        except Exception as e:
            self.error = e

    def raise_held(self) -> None:
        """The failure held back while DCP ran, if there was one."""
        if self.error is not None:
            raise self.error

    def _write_now(self, plan: SavePlan, planner: SavePlanner) -> TorchFuture[list[WriteResult]]:
        if self.delay_s > 0:
            time.sleep(self.delay_s)
        crc = torch.serialization.get_crc32_options()
        torch.serialization.set_crc32_options(False)
        try:
            tensors = [
                (item, cast(torch.Tensor, planner.resolve_data(item)))
                for item in plan.items
                if item.type != WriteItemType.BYTE_IO
            ]
            if not self._one_plain_file() or any(t.device.type != "cpu" for _, t in tensors):
                return super().write_data(plan, planner)
            return self._write_shard(plan, planner, tensors)
        finally:
            torch.serialization.set_crc32_options(crc)

    def _one_plain_file(self) -> bool:
        """DCP writes this rank's items into one file, on one thread, each as ``torch.save`` does
        with no extension: the layout ``_write_shard`` writes. (A GPU's tensors, not staged to
        the CPU, go to DCP, which copies them ahead on a stream.)"""
        return (
            self.single_file_per_rank
            and self.thread_count == 1
            and not self.transforms.extensions
            and self.serialization_format == SerializationFormat.TORCH_SAVE
        )

    def _write_shard(
        self, plan: SavePlan, planner: SavePlanner, tensors: list[tuple[WriteItem, torch.Tensor]]
    ) -> TorchFuture[list[WriteResult]]:
        """torch 2.13's ``_write_files_from_queue`` for ``_one_plain_file``: the same file, items
        in the same order (the non-tensor ones first) and results, each tensor record written by
        ``write_plain`` (``torch.save`` for one it declines)."""
        name = f"{cast(_StoragePrefix, plan.storage_data).prefix}0{DEFAULT_SUFFIX}"
        results = []
        with self.fs.create_stream(self.fs.concat_path(self.path, name), "wb") as stream:
            for item in plan.items:
                if item.type != WriteItemType.BYTE_IO:
                    continue
                offset = stream.tell()
                stream.write(cast(io.BytesIO, planner.resolve_data(item)).getbuffer())
                results.append(_result(item, name, offset, stream.tell() - offset))
            for item, tensor in tensors:
                tensor = tensor.detach()
                if tensor.untyped_storage().size() != tensor.nbytes:
                    tensor = tensor.clone()  # as DCP: a record of the tensor's elements, not its base's
                offset = stream.tell()
                if write_plain(stream.write, tensor) is None:
                    torch.save(tensor, cast(IO[bytes], stream))
                results.append(_result(item, name, offset, stream.tell() - offset))
            if self.sync_files:
                stream.flush()
                os.fsync(stream.fileno())
        done: TorchFuture[list[WriteResult]] = TorchFuture()
        done.set_result(results)
        return done


def _result(item: WriteItem, name: str, offset: int, length: int) -> WriteResult:
    """DCP's record of where ``item`` went: ``length`` bytes at ``offset`` of the file ``name``."""
    return WriteResult(
        index=item.index, size_in_bytes=length, storage_data=_StorageInfo(name, offset, length)
    )


def shard_writer(
    path: Path, root: Path, progress: Tracker | None = None, digest: bool = False
) -> ShardWriter:
    """DCP's writer into ``path``: a failed write names its file; with ``progress``, bytes written
    are counted into it, a chunk at a time, naming the file, and hashed (``written``; ``digest``:
    SHA-256 too)."""
    return ShardWriter(
        path, ProgressFileSystem(root, progress, digest), float(os.environ.get(ENV_SAVE_DELAY, "0") or 0)
    )
