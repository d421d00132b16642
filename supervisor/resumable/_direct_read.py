"""A load on the layout it was saved in, read straight into the tensors: no DCP plan.

DCP's load plans an item at a time (read items, chunk lists, DTensor offsets, lookups) and the
reader parses each record's zip headers before it reads the bytes: ~0.1 s of Python per load for
the bench model's ~800 records, more than the bytes' own copy (bench/checkpoint.py). Yet a resume
on the layout of its save (the same world size and parallelism, the common case) asks each rank
for exactly what it wrote: every tensor it holds is one whole chunk of the checkpoint, in a
record whose bytes around the data are known in advance (``tensor_record.plain_frame``).

So before DCP's load, ``plan`` checks that this holds for every item a rank loads, against the
index the load reads (dtype, global size, one chunk whose offsets and sizes are this rank's
shard, a plain record of the length those give): a pure decision, nothing read. Then ``read``
reads each file's records front to back with ``preadv``: the record's head and tail into small
buffers, its data straight into the tensor's memory, in calls sized as counted writes are (each
counted, so a long load beats), and compares every head and tail with the expected bytes (a
file's first record before anything of the file goes into a tensor). A
non-tensor item (the step, the scheduler, param groups) is read into a buffer for the caller to
unpickle safely. Anything else (another layout, an index with several chunks for a tensor, a
record another writer wrote) falls back to DCP's own load, which reads every item again.
"""

from __future__ import annotations

import io
import itertools
import os
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    BytesStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorStorageMetadata,
)
from torch.distributed.tensor import DTensor
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from supervisor.resumable._progress_io import PROGRESS_CHUNK, next_write_chunk, read_at
from supervisor.resumable._tensor_record import bytes_as_shown, plain_frame

__all__ = ["OBJECT_RECORD_MAX", "Record", "plan", "read"]

IOV_MAX = 1024  # Linux's limit on buffers per preadv
# A non-tensor item's record (the step, a scheduler's or sampler's state, param groups) is no
# larger: its length comes from the index, and is allocated before the read.
OBJECT_RECORD_MAX = 256 << 20


@dataclass(frozen=True)
class Record:
    """One item's record: where it is and what receives it. ``target``: the tensor's own memory
    and ``frame`` the bytes around it; None for a non-tensor item, read into a buffer."""

    fqn: str
    file: str  # relative to the checkpoint
    offset: int
    length: int
    target: memoryview | None = None
    frame: tuple[bytes, bytes] | None = None


def plan(flat: Mapping[str, Any], index: Metadata) -> list[Record] | None:
    """Every item of ``flat`` (a flattened state dict) as one record to read in place, or None
    when one is not (the caller loads through DCP): an item the index lacks or holds as another
    type, a tensor whose dtype or size differs, or that is not one whole chunk there at this
    rank's offsets, or not in memory as it shows (a strided view; a GPU tensor: CUDA state loads
    through DCP), or a record of another length than its plain layout."""
    records, shards = [], _Shards()
    for fqn, value in flat.items():
        meta = index.state_dict_metadata.get(fqn)
        if not isinstance(value, torch.Tensor):
            info = (
                index.storage_data.get(MetadataIndex(fqn)) if isinstance(meta, BytesStorageMetadata) else None
            )
            if info is None or info.transform_descriptors or info.length > OBJECT_RECORD_MAX:
                return None
            records.append(Record(fqn, info.relative_path, info.offset, info.length))
            continue
        if (
            not isinstance(meta, TensorStorageMetadata)
            or meta.properties.dtype != value.dtype
            or meta.size != value.size()
            or len(meta.chunks) != 1
        ):
            return None
        local, offsets = shards.of(value)
        chunk = meta.chunks[0]
        frame = plain_frame(local.dtype, tuple(local.size()))
        if (
            offsets is None
            or tuple(chunk.offsets) != offsets
            or chunk.sizes != local.size()
            or frame is None
            or not bytes_as_shown(local)
        ):
            return None
        info = index.storage_data.get(MetadataIndex(fqn, chunk.offsets))
        if (
            info is None
            or info.transform_descriptors
            or info.length != len(frame[0]) + local.nbytes + len(frame[1])
        ):
            return None
        target = local.detach().view(-1).view(torch.uint8).numpy().data  # its own memory
        records.append(Record(fqn, info.relative_path, info.offset, info.length, target, frame))
    return records


class _Shards:
    """A tensor's local part and its offsets in the whole. A DTensor's offsets are worked out
    once per global size, mesh and placements (torch's function: ~25 us a call)."""

    def __init__(self) -> None:
        self.known: dict[tuple[Any, ...], tuple[tuple[int, ...], tuple[int, ...]]] = {}

    def of(self, value: torch.Tensor) -> tuple[torch.Tensor, tuple[int, ...] | None]:
        """The local tensor and its offsets (None when its shape is not the one its placements
        give: not a shard this reads)."""
        if not isinstance(value, DTensor):
            return value, (0,) * value.dim()
        local = value._local_tensor
        key = (tuple(value.size()), id(value.device_mesh), tuple(value.placements))
        if key not in self.known:
            shape, offsets = compute_local_shape_and_global_offset(
                value.size(), value.device_mesh, value.placements
            )
            self.known[key] = tuple(shape), tuple(offsets)
        shape, offsets = self.known[key]
        return local, offsets if shape == tuple(local.size()) else None


def read(
    records: Sequence[Record], fs: FileSystem, ckpt: Path, corrupt: Callable[[str], Exception]
) -> dict[str, bytearray] | None:
    """Read ``records`` (``plan``'s) from ``ckpt`` through ``fs``: each tensor's bytes into its
    target; the non-tensor items' bytes returned by name. None when a tensor record's head or
    tail is not its plain frame (another writer's: the caller loads through DCP, which reads
    every item again). A file's first tensor record is checked before the file is read
    (``_framed``); the rest after, against the bytes read with them. ``corrupt(what)``: the
    error for a file that ends inside a record."""
    by_file: dict[str, list[Record]] = {}
    for r in sorted(records, key=lambda r: (r.file, r.offset)):
        by_file.setdefault(r.file, []).append(r)
    items: dict[str, bytearray] = {}
    frames: list[tuple[bytearray, bytearray, tuple[bytes, bytes]]] = []
    for name, recs in by_file.items():
        path = ckpt / name
        with fs.create_stream(path, "rb") as stream:
            size = os.fstat(stream.fileno()).st_size
            short = next((r for r in recs if r.offset + r.length > size), None)
            if short is not None:
                raise corrupt(
                    f"{path} (item {short.fqn}): the file ends {size - short.offset} of {short.length} bytes "
                    f"into the record at offset {short.offset}"
                )
            first = next(((r, r.frame) for r in recs if r.frame is not None), None)
            if first is not None and not _framed(stream, *first):
                return None  # another writer's file (or a damaged one): nothing of it read in place
            run: list[memoryview] = []
            start = end = recs[0].offset
            for r in recs:
                if r.offset != end:  # a gap: what is read so far, then on from here
                    _read_run(stream, run, start, path, corrupt)
                    run, start = [], r.offset
                if r.target is None or r.frame is None:
                    items[r.fqn] = bytearray(r.length)
                    run.append(memoryview(items[r.fqn]))
                else:
                    head, tail = bytearray(len(r.frame[0])), bytearray(len(r.frame[1]))
                    frames.append((head, tail, r.frame))
                    run += [memoryview(head), r.target, memoryview(tail)]
                end = r.offset + r.length
            _read_run(stream, run, start, path, corrupt)
    if any(head != frame[0] or tail != frame[1] for head, tail, frame in frames):
        return None
    return items


def _framed(stream: io.IOBase, record: Record, frame: tuple[bytes, bytes]) -> bool:
    """Whether ``record``'s head and tail are ``frame`` (its plain frame): checked on a file's
    first tensor record before any of the file is read into a tensor, so that a file another
    writer wrote (stock DCP's records carry a serialization id) is left to DCP whole rather than
    read twice, and a record damaged there leaves its tensor as it was."""
    head, tail = frame
    got = [bytearray(len(head)), bytearray(len(tail))]
    read_at(stream, [memoryview(got[0])], record.offset)
    read_at(stream, [memoryview(got[1])], record.offset + record.length - len(tail))
    return got[0] == head and got[1] == tail


def _read_run(
    stream: io.IOBase, buffers: list[memoryview], offset: int, path: Path, corrupt: Callable[[str], Exception]
) -> None:
    """Fill ``buffers`` (bytes) in order from ``offset`` of ``stream``'s file: preadv calls of at
    most ``IOV_MAX`` buffers, sized as counted writes are (``next_write_chunk``: the first
    ``PROGRESS_CHUNK``, then what takes ``WRITE_CHUNK_S`` at the rate the last ran), so a load
    beats all along on a slow file system and makes few calls on a fast one."""
    chunk, i = PROGRESS_CHUNK, 0
    while i < len(buffers):
        batch: list[memoryview] = []
        nbytes = 0
        for buf in itertools.islice(buffers, i, i + IOV_MAX):
            batch.append(buf[: chunk - nbytes])
            nbytes += batch[-1].nbytes
            if nbytes >= chunk:
                break
        start = time.monotonic()
        got = read_at(stream, batch, offset)
        if got == 0 and nbytes:
            raise corrupt(f"{path}: the file ended at offset {offset}, inside a record it held when opened")
        chunk = next_write_chunk(got, time.monotonic() - start)
        offset += got
        while i < len(buffers) and got >= buffers[i].nbytes:  # what was read; a part-read one goes on
            got -= buffers[i].nbytes
            i += 1
        if got:
            buffers[i] = buffers[i][got:]
