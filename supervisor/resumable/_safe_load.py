"""DCP load that runs nothing a checkpoint holds (docs/security.md).

torch 2.13's DCP unpickles two things from a checkpoint without restriction: the ``.metadata``
index (``FileSystemReader.read_metadata``: a plain ``pickle.load``) and every non-tensor state item
(``DefaultLoadPlanner.load_bytes``: ``torch.load(weights_only=False)``; here the step, the
scheduler, the sampler, the optimizer's param groups). Whoever can write a checkpoint could make
every rank run any code at the next resume through either. So a load goes through:

- ``SafeFileSystemReader``: ``read_metadata`` unpickles with supervisor.safepickle's allowlist
  (the real classes, nothing else), inside DCP's own read: no window between a check and the read;
- ``SafeLoadPlanner``: ``load_bytes`` with ``torch.load(weights_only=True)``, as the per-rank
  state files are loaded;
- tensors: on the layout of the save, read straight into their tensors before DCP plans
  anything (supervisor/resumable/_direct_read.py: each record's frame compared byte for byte); else, through
  DCP, read off their bytes when the record is the plain layout DCP writes (nothing unpickled,
  supervisor/resumable/_tensor_record.py), else ``torch.load(weights_only=True)`` as DCP does.

A refusal is one line naming the file (``UnsafePickle``), raised by ``load_dcp`` on every rank
(a record only one rank reads reaches the others through the load's agreement), before anything
from the file has run. A record that cannot be read (a truncated file, a broken zip) is
``CorruptRecord``, one line naming the file and item, on every rank alike.
"""

from __future__ import annotations

import gc
import io
import itertools
import math
import os
import pickle
import re
import warnings
from collections.abc import Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path
from typing import IO, Any, NamedTuple, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed._shard._utils import narrow_tensor_by_index
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    StorageMeta,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.stateful import Stateful
from torch.futures import Future

from supervisor.format.capped import MANIFEST_MAX, read_capped
from supervisor.format.layout import MANIFEST, dcp_index_filename, parse_committed
from supervisor.format.manifest import parse_manifest
from supervisor.resumable import _agree, _direct_read
from supervisor.resumable._dcp_index import index_problem, merged, uncovered
from supervisor.resumable._direct_read import OBJECT_RECORD_MAX
from supervisor.resumable._tensor_record import plain_tensor, read_in_place
from supervisor.safepickle import WHY, UnsafePickle, load_restricted

# torch's weights_only refusal names the global: "Unsupported global: GLOBAL posix.system was not ..."
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")
# Records from this size up are read in place, into the tensor they load into (three reads: head,
# tail, data); smaller ones in one read into a buffer, whose copy costs less than two more reads.
IN_PLACE_MIN = 64 << 10
# A record's bytes around a tensor chunk's (torch.save's zip: ~1 KB): a record may be this much
# longer than its chunk, no more (its length is read off the index before anything is allocated).
RECORD_SLACK = 1 << 20
_SHORT = "short"  # the failure kind of a rank whose own index does not hold all it loads
_Failed = tuple[int, tuple[str, str]]  # a failed rank and what failed there (``_failure``)


class CorruptRecord(ValueError):
    """A shard record that cannot be read: one line naming the file, the item and what to do."""


def weights_only_refusal(label: str, e: pickle.UnpicklingError) -> UnsafePickle:
    """torch.load(weights_only=True)'s many-line refusal as one line naming ``label``."""
    m = _GLOBAL.search(str(e))
    what = f"refers to {m.group(1)}" if m else "holds a pickle that torch.load(weights_only=True) refuses"
    return UnsafePickle(f"{label}: {what}, which a checkpoint's plain data is not made of ({WHY})")


class SafeFileSystemReader(FileSystemReader):
    """A FileSystemReader that never unpickles anything outside DCP's metadata allowlist, and
    reads each file front to back, an item at a time.

    torch 2.13 reads a file's items in plan order through a Python view of the file (a seek, a
    tell and a chunked read per access of ``torch.load``'s zip reader: ~25 Python calls per item)
    and leaves "sort by offset" as a TODO. Here the items go in offset order (one forward pass per
    file, which the kernel's readahead streams when the cache is cold), each item's bytes come in
    one read into memory, and a tensor record in DCP's plain layout is decoded there without
    ``torch.load`` (``plain_tensor``), which was most of a load's CPU (bench/checkpoint.py has
    the load against a raw read; docs/measured.md the numbers)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        rank: int | None = None,
        index: Metadata | None = None,
        listed: Mapping[str, int] | None = None,
    ):
        """``rank``: this rank, whose own index it reads when the checkpoint has one per rank
        (supervisor/resumable/_dcp_index.py); ``index``: every rank's, merged (``every_index``), instead.
        ``listed``: the size of each file, as the checkpoint's manifest lists them (``listed_sizes``):
        what an index may say of its records, and how much of an index is read."""
        super().__init__(path)
        self.own_rank, self.merged_index, self.listed = rank, index, listed
        self.index = Path(path) / dcp_index_filename()  # the index read, for a line naming it
        self.own_index = False  # ... is this rank's own, which holds only what it wrote
        # The first refusal: DCP catches a read_metadata error and tries the per-rank index, then
        # wraps what it got; the load site re-raises this one line instead.
        self.refused: UnsafePickle | None = None
        self.corrupt: CorruptRecord | None = None  # the same for a record that cannot be read
        self.tensors: dict[str, Any] = {}
        self.index_read: Metadata | None = None

    def choose_index(self) -> bool:
        """Which index ``read_metadata`` reads: every rank's merged (``index``), else DCP's one
        ``.metadata``, else this rank's own (``rank``). False when none of these is there: the
        checkpoint has an index per rank and this rank wrote none (the world grew) or has no
        ``rank``; every rank's must be merged."""
        path = Path(self.path)
        if self.merged_index is not None:
            self.index = path  # every rank's own index, merged
        elif not self.fs.exists(path / dcp_index_filename()):
            if self.own_rank is None or not self.fs.exists(path / dcp_index_filename(self.own_rank)):
                return False
            self.index, self.own_index = path / dcp_index_filename(self.own_rank), True
        return True

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """torch 2.13's ``FileSystemReader.read_metadata`` with ``pickle.load`` restricted: the
        index ``choose_index`` chose."""
        if self.refused is not None:
            raise self.refused
        if self.index_read is None:  # read once: the direct read's plan, then DCP's when it falls back
            self.index_read = self.merged_index or self._read_index(self.index)
        metadata = self.index_read
        if metadata.storage_meta is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def _read_index(self, path: Path) -> Metadata:
        try:
            return read_index(self.fs, path, self.listed)
        except UnsafePickle as e:
            self.refused = e
            raise
        except CorruptRecord as e:
            self.corrupt = self.corrupt or e
            raise

    def set_up_storage_reader(
        self, metadata: Metadata, is_coordinator: bool, *args: Any, **kwargs: Any
    ) -> None:
        super().set_up_storage_reader(metadata, is_coordinator, *args, **kwargs)
        self.tensors = metadata.state_dict_metadata  # each chunk's dtype and sizes, for plain_tensor

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        """torch 2.13's ``FileSystemReader.read_data``, in offset order, each record in one read,
        and a tensor record decoded by ``plain_tensor`` when it can (``torch.load`` otherwise)."""

        def where(item: ReadItem) -> tuple[str, int]:
            info = self.storage_data[item.storage_index]
            return info.relative_path, info.offset

        items = sorted(plan.items, key=where)
        if any(self.storage_data[i.storage_index].transform_descriptors for i in items):
            return super().read_data(replace(plan, items=items), planner)  # records an extension wrote
        per_file: dict[str, list[ReadItem]] = {}
        for item in items:
            per_file.setdefault(where(item)[0], []).append(item)
        for relative_path, reqs in per_file.items():
            path = self.fs.concat_path(self.path, relative_path)
            with self.fs.create_stream(path, "rb") as stream:
                for req in reqs:
                    self._read_item(cast(io.BufferedIOBase, stream), Path(path), req, planner)
        fut: Future[None] = Future()
        fut.set_result(None)
        return fut

    def _read_item(self, stream: io.BufferedIOBase, path: Path, req: ReadItem, planner: LoadPlanner) -> None:
        info = self.storage_data[req.storage_index]
        label = f"{path} (item {req.storage_index.fqn})"
        if (
            req.type == LoadItemType.TENSOR
            and info.length >= IN_PLACE_MIN
            and self._in_place(stream, req, planner, label)
        ):
            return
        cap = self._record_cap(req)
        if info.length > cap:  # before anything is allocated: the index says the length
            raise self._corrupt(
                f"{label}: a record of {info.length} bytes, where the item takes at most {cap}"
            )
        stream.seek(info.offset)
        rec = bytearray(info.length)
        got = stream.readinto(rec)  # counted, when ``fs`` counts
        if got != info.length:
            raise self._corrupt(
                f"{label}: the file ends {got} of {info.length} bytes into the record at offset {info.offset}"
            )
        if req.type == LoadItemType.BYTE_IO:
            planner.load_bytes(req, io.BytesIO(rec))
            return
        chunk = self._tensor(rec, req, label)
        target = planner.resolve_tensor(req).detach()
        try:
            tensor = narrow_tensor_by_index(chunk, req.storage_offsets, req.lengths)
        except (RuntimeError, IndexError, ValueError) as e:
            raise self._corrupt(
                f"{label}: holds a chunk of {tuple(chunk.size())}, not one the index says ({e})"
            ) from None
        if target.size() != tensor.size():  # another dtype is converted by the copy, as DCP does
            raise self._corrupt(
                f"{label}: holds a chunk of {tuple(tensor.size())}, the index says {tuple(target.size())}"
            )
        target.copy_(tensor)
        planner.commit_tensor(req, target)

    def _record_cap(self, req: ReadItem) -> int:
        """The most bytes ``req``'s record may take: its chunk's bytes and a zip's frame around
        them (a tensor), or ``OBJECT_RECORD_MAX`` (a non-tensor item)."""
        if req.type == LoadItemType.BYTE_IO:
            return OBJECT_RECORD_MAX
        md = self.tensors.get(req.storage_index.fqn)
        chunk = _chunk(md, req.storage_index) if isinstance(md, TensorStorageMetadata) else None
        if md is None or chunk is None:
            return 0
        return math.prod(chunk.sizes) * md.properties.dtype.itemsize + RECORD_SLACK

    def _in_place(self, stream: io.BufferedIOBase, req: ReadItem, planner: LoadPlanner, label: str) -> bool:
        """A whole chunk in the plain layout, read straight into the tensor it loads into
        (``tensor_record.read_in_place``); False when this item is not one (read it whole)."""
        md = self.tensors.get(req.storage_index.fqn)
        chunk = _chunk(md, req.storage_index) if isinstance(md, TensorStorageMetadata) else None
        if (
            md is None
            or chunk is None
            or any(req.storage_offsets)
            or tuple(req.lengths) != tuple(chunk.sizes)
        ):
            return False
        target = planner.resolve_tensor(req).detach()
        if target.dtype != md.properties.dtype or tuple(target.size()) != tuple(chunk.sizes):
            return False
        info = self.storage_data[req.storage_index]
        done = read_in_place(stream, info.offset, info.length, target)
        if isinstance(done, str):
            raise self._corrupt(f"{label}: {done}")
        if done:
            planner.commit_tensor(req, target)
        return done

    def _tensor(self, rec: bytearray, req: ReadItem, label: str) -> torch.Tensor:
        """The record's chunk: read off its bytes when it is the plain layout, else torch.load."""
        md = self.tensors.get(req.storage_index.fqn)
        chunk = _chunk(md, req.storage_index) if isinstance(md, TensorStorageMetadata) else None
        if md is not None and chunk is not None:
            plain = plain_tensor(rec, md.properties.dtype, tuple(chunk.sizes))
            if plain is not None:
                return plain
        try:
            got = torch.load(io.BytesIO(rec), map_location="cpu", weights_only=True)
        except pickle.UnpicklingError as e:
            self.refused = self.refused or weights_only_refusal(label, e)
            raise self.refused from None
        except Exception as e:  # torch's zip reader: "PytorchStreamReader failed reading ..."; and more
            raise self._corrupt(f"{label}: not a readable tensor record ({one_line(e)})") from None
        if not isinstance(got, torch.Tensor):  # a data.pkl of a dict, a number...
            raise self._corrupt(f"{label}: holds a {type(got).__name__}, not a tensor")
        return got

    def _corrupt(self, what: str) -> CorruptRecord:
        self.corrupt = self.corrupt or corrupt(what)
        return self.corrupt

    def load_object(self, value: IO[bytes], label: str) -> Any:
        """A non-tensor item, unpickled with ``weights_only=True``; a refusal is one line naming
        ``label`` (the file and item)."""
        try:
            return torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            self.refused = self.refused or weights_only_refusal(label, e)
            raise self.refused from None
        except Exception as e:  # a broken zip, a truncated pickle: one line, not torch's traceback
            raise self._corrupt(f"{label}: not a readable record ({one_line(e)})") from None


def corrupt(what: str) -> CorruptRecord:
    """``what`` is wrong with a checkpoint, as one line that says what to do about it."""
    return CorruptRecord(
        f"{what}: the checkpoint is corrupt or was changed after its checks; verify it with "
        f"`python -m supervisor ckpt verify --deep` and quarantine it (the next launch resumes from the one before)"
    )


def read_index(fs: FileSystem, path: Path, listed: Mapping[str, int] | None = None) -> Metadata:
    """One DCP index, unpickled through the allowlist (``UnsafePickle`` names ``path``), and
    checked to be one (``dcp_index.index_problem``: its records in files of this checkpoint, at
    offsets and lengths that are places in them): CorruptRecord, one line, otherwise. At most its
    size in ``listed`` is read (the manifest's), else its own size."""
    with fs.create_stream(path, "rb") as f:
        # torch types the stream as IOBase; it is the binary file opened "rb" above
        data = read_listed(cast(IO[bytes], f), path, listed)
    try:
        md = load_restricted(data, str(path))
    except UnsafePickle:
        raise
    except Exception as e:  # a pickle that fails to parse, before naming anything
        raise corrupt(f"{path}: not a readable DCP index ({one_line(e)})") from None
    problem = index_problem(md, listed, path.parent)
    if problem:
        raise corrupt(f"{path}: {problem}")
    return cast(Metadata, md)


def read_listed(stream: IO[bytes], path: Path, listed: Mapping[str, int] | None) -> bytes:
    """The whole file ``stream`` reads (``path``, in a checkpoint), read only when it is the size
    the manifest lists (``listed``; without one, its own size): a file grown, or one the manifest
    does not list, is CorruptRecord before a byte of it is read, never read past that size."""
    size = os.fstat(stream.fileno()).st_size
    cap = size if listed is None else listed.get(path.name, -1)
    if cap < 0:
        raise corrupt(f"{path}: a file its manifest does not list")
    if size > cap:
        raise corrupt(f"{path}: {size} bytes, but its manifest lists {cap}")
    data = stream.read(cap + 1)
    if len(data) > cap:
        raise corrupt(f"{path}: grew past its {cap} bytes while it was read")
    return data


def listed_sizes(ckpt: Path) -> dict[str, int]:
    """The size of each file of ``ckpt`` as its manifest lists it; without a readable one (a bare
    DCP directory), each regular file's own size: what an index's records must lie within."""
    try:
        m = parse_manifest(read_capped(ckpt / MANIFEST, MANIFEST_MAX))
    except (OSError, ValueError):  # ManifestError, TooLarge; no manifest
        try:
            with os.scandir(ckpt) as entries:
                return {e.name: e.stat().st_size for e in entries if e.is_file(follow_symlinks=False)}
        except OSError:
            return {}
    return {n: e.size for n, e in m.files.items()}


def _chunk(md: TensorStorageMetadata, index: MetadataIndex) -> ChunkStorageMetadata | None:
    """The chunk ``index`` names (``index.index`` is DCP's hint into the list)."""
    i = index.index
    if i is not None and i < len(md.chunks) and md.chunks[i].offsets == index.offset:
        return md.chunks[i]
    return next((c for c in md.chunks if c.offsets == index.offset), None)


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor items are loaded with ``weights_only=True``."""

    def __init__(self, reader: SafeFileSystemReader):
        super().__init__()
        self.reader = reader

    def create_local_plan(self) -> LoadPlan:
        """DCP's local plan, checked to read every element this rank holds (``uncovered``): a
        part no chunk covers would keep what it held before. Short of it, a rank's own index
        means another layout than the save's (``OwnIndexShort``: read them all); any other
        index is corrupt."""
        md = cast(Metadata, self.metadata)
        if self.reader.own_index and any(k not in md.state_dict_metadata for k in self.state_dict):
            raise OwnIndexShort()
        plan = super().create_local_plan()
        short = uncovered(plan, self.state_dict)
        if short is not None:
            if self.reader.own_index:
                raise OwnIndexShort()
            raise self.reader._corrupt(f"{self.reader.index}: reads only {short} this rank holds")
        return plan

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """torch 2.13's ``DefaultLoadPlanner.load_bytes`` with ``weights_only=True``."""
        fqn = read_item.dest_index.fqn
        info = self.reader.storage_data.get(read_item.storage_index)
        where = Path(self.reader.path) / info.relative_path if info is not None else Path(self.reader.path)
        obj = self.reader.load_object(value, f"{where} (item {fqn})")
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def load_dcp(
    ckpt: Path,
    state_dict: dict[str, Any],
    process_group: dist.ProcessGroup | None,
    fs: FileSystem | None = None,
    listed: Mapping[str, int] | None = None,
) -> None:
    """``dcp.load`` through the safe reader and planner; UnsafePickle (one line) on a refusal.
    ``fs``: the file system the reader opens files with (the trainer's counts the bytes it reads,
    supervisor/resumable/_progress_io.py). ``listed``: each file's size as the manifest lists it
    (``listed_sizes`` of ``ckpt`` when not given): an index's records must lie in them.

    Each rank plans and reads alone (DCP's ``no_dist``): DCP's global load plan is the identity
    (``create_default_global_load_plan``), yet with a process group it gathers every rank's local
    plan to rank 0, unpickled there, and scatters them back, pickled again: 23 ms of rank 0's CPU
    per rank for the bench model's 801 items, 93 s at 4,096 ranks, while every rank waits
    (bench/load_plan_scale.py). Then one agreement: when no rank failed, a single all-reduce of
    a number; when one did, every rank raises its error (the same UnsafePickle or CorruptRecord
    line; another error as ``PeerLoadFailed`` on the others, the rank's own exception on that
    rank), and nothing is applied on any rank, as DCP's own exchange of read errors guaranteed.
    Only then does each Stateful take its state. The caller keeps the heartbeat alive meanwhile
    (``kept_alive``): a rank done first waits there for the slowest.

    Where each rank saved its own index (sharded state, supervisor/resumable/_dcp_index.py), a rank reads its
    own; when that does not hold all some rank loads (another world size or layout), the
    agreement says so and every rank's index is merged (``every_index``: each file read once
    over the job), and the ranks short of their own read again from it. Every plan is checked to
    read each element a rank holds."""
    together = process_group is not None or dist.is_initialized()
    rank = dist.get_rank(process_group) if dist.is_initialized() else None
    listed = listed_sizes(ckpt) if listed is None else listed
    with no_gc():
        # read in place into each Stateful's state dict (DCP's own first step, done here so that
        # the state is applied only once every rank read its part)
        loaded = {k: v.state_dict() if isinstance(v, Stateful) else v for k, v in state_dict.items()}
        reader, error = _read(ckpt, loaded, rank, None, fs, listed)
        first = _agreed(reader, error, process_group) if together else None
        short = first[1][0] == _SHORT if first is not None else isinstance(error, OwnIndexShort)
        if short:  # saved in another layout: every rank's index, merged
            index = every_index(ckpt, fs or FileSystem(), process_group if together else None, listed)
            if error is not None:  # a rank whose own index held all it loads keeps what it read
                reader, error = _read(ckpt, loaded, rank, index, fs, listed)
            first = _agreed(reader, error, process_group) if together else None
        ours = reader.refused or reader.corrupt  # one line of ours, for what DCP raised
        if error is None and first is not None:
            raise _peer_error(*first)
        if ours is not None:
            raise ours from None
        if error is not None:
            raise error
        for key, value in state_dict.items():
            if isinstance(value, Stateful):
                value.load_state_dict(loaded[key])
            else:  # as dcp.load: a non-tensor value at the top is replaced, not filled in
                state_dict[key] = loaded[key]


def _read(
    ckpt: Path,
    loaded: dict[str, Any],
    rank: int | None,
    index: Metadata | None,
    fs: FileSystem | None,
    listed: Mapping[str, int] | None,
) -> tuple[SafeFileSystemReader, BaseException | None]:
    """``dcp.load`` of this rank's part into ``loaded``, alone; the reader and what it raised
    (OwnIndexShort, before anything is read, when every rank's index is needed merged)."""
    reader = SafeFileSystemReader(ckpt, rank, index, listed)
    if fs is not None:
        reader.fs = fs
    try:
        if not reader.choose_index():
            return reader, OwnIndexShort()
        if _read_direct(reader, loaded):
            return reader, None
        with warnings.catch_warnings():  # no_dist's "assuming the intent is to load in a single process"
            warnings.filterwarnings("ignore", message="torch.distributed is disabled")
            dcp.load(loaded, storage_reader=reader, planner=SafeLoadPlanner(reader), no_dist=True)
    except (Exception, CheckpointException) as e:  # DCP's CheckpointException is a BaseException
        return reader, _unwrapped(e)
    return reader, None


def _read_direct(reader: SafeFileSystemReader, loaded: dict[str, Any]) -> bool:
    """Read ``loaded`` in place without DCP's plan when every item is one whole record on this
    rank's layout (supervisor/resumable/_direct_read.py); False, to load through DCP, when one is not."""
    flat, mappings = flatten_state_dict(loaded)
    records = _direct_read.plan(flat, reader.read_metadata())
    if records is None:
        return False
    items = _direct_read.read(records, reader.fs, Path(reader.path), reader._corrupt)
    if items is None:
        return False
    files = {r.fqn: r.file for r in records}
    for fqn, raw in items.items():
        label = f"{Path(reader.path) / files[fqn]} (item {fqn})"
        set_element(loaded, mappings[fqn], reader.load_object(io.BytesIO(raw), label))
    return True


def _agreed(
    reader: SafeFileSystemReader, error: BaseException | None, group: dist.ProcessGroup | None
) -> _Failed | None:
    """The lowest rank whose read failed and its failure, on every rank (``_agree.first_failure``)."""
    return _agree.first_failure(_failure(reader.refused or reader.corrupt or error), group, lambda: None)


def every_index(
    ckpt: Path, fs: FileSystem, group: dist.ProcessGroup | None, listed: Mapping[str, int] | None = None
) -> Metadata:
    """Every rank's own index in ``ckpt``, merged (``dcp_index.merged``), on every rank of
    ``group`` (None: this process alone), each index file read once over the job.

    Were every rank to read every index, a world-size change would open N files on each of the
    new ranks: N x N over the job, and as many index reads served by the shared filesystem
    (bench/index_scale.py). Here rank r of W reads indexes r, r+W, r+2W, ... up to the first one
    missing (no directory listing, itself a read of N names per rank) and merges them, and the
    parts are all-gathered (from the job's own ranks, unpickled as ``all_gather_object`` does):
    each rank merges them and checks them (ranks 0 to N-1, none missing; none disagreeing), alike
    on every rank. So every rank raises the same error: a refusal or a corrupt index as one line;
    another error (EIO) as the rank's own exception there and ``PeerLoadFailed`` on the others."""
    together = group is not None or dist.is_initialized()
    world, me = (dist.get_world_size(group), dist.get_rank(group)) if together else (1, 0)
    mine: BaseException | None = None
    try:
        part = _index_part(ckpt, fs, me, world, listed)
    except (OSError, UnsafePickle, CorruptRecord) as e:
        mine, part = e, _Part([], None, _failure(e))
    outcome = _assembled(ckpt, [part] if world == 1 else _agree.all_gather(part, group, lambda: None))
    if isinstance(outcome, Metadata):
        return outcome
    rank, failure = outcome
    raise mine if rank == me and mine is not None else _peer_error(rank, failure)


class _Part(NamedTuple):
    """A rank's share of ``every_index``: the ranks whose index it read, merged; or its failure."""

    ranks: list[int]
    metadata: Metadata | None
    failure: tuple[str, str] | None


def _index_part(
    ckpt: Path, fs: FileSystem, me: int, world: int, listed: Mapping[str, int] | None = None
) -> _Part:
    """Rank ``me`` of ``world``'s share: indexes me, me + world, ... up to the first missing."""
    ranks, indexes = [], []
    for r in itertools.count(me, world):
        path = ckpt / dcp_index_filename(r)
        if not fs.exists(path):
            break
        ranks.append(r)
        indexes.append(read_index(fs, path, listed))
    try:
        return _Part(ranks, merged(indexes) if indexes else None, None)
    except ValueError as e:
        raise corrupt(f"{ckpt}: its ranks' indexes disagree ({e})") from None


def _assembled(ckpt: Path, parts: list[_Part]) -> Metadata | _Failed:
    """The parts merged, or the lowest failing rank and its failure: a part's, or one every rank
    finds alike in the parts (an index missing, two that disagree), named as rank 0's."""
    failed = next(((r, p.failure) for r, p in enumerate(parts) if p.failure is not None), None)
    if failed is not None:
        return failed
    found = sorted(r for p in parts for r in p.ranks)
    missing = next((want for r, want in zip(found, range(len(found)), strict=True) if r != want), None)
    if not found:
        return 0, _corrupt_line(f"{ckpt}: no {dcp_index_filename()} and no {dcp_index_filename(0)}")
    if missing is not None:
        return 0, _corrupt_line(f"{ckpt}: no {dcp_index_filename(missing)}, yet rank {found[-1]}'s is there")
    try:
        return merged([p.metadata for p in parts if p.metadata is not None])
    except ValueError as e:
        return 0, _corrupt_line(f"{ckpt}: its ranks' indexes disagree ({e})")


def _corrupt_line(what: str) -> tuple[str, str]:
    """``_failure`` of ``corrupt(what)``."""
    return "corrupt", one_line(corrupt(what))


class OwnIndexShort(Exception):
    """This rank's own index does not hold all it loads, or it has none: the checkpoint was saved
    in another layout. Raised before anything is read (while planning)."""


class PeerLoadFailed(RuntimeError):
    """This rank's part of a load was read, another rank's failed: nothing is applied."""


def one_line(e: BaseException) -> str:
    """The first line of what ``e`` says, or its type's name."""
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def _unwrapped(e: BaseException) -> BaseException:
    """The exception itself: DCP without a process group wraps it in a CheckpointException that
    says "RANK 0" whatever this rank is."""
    if isinstance(e, CheckpointException) and e.failures:
        return min(e.failures.items())[1][0]
    return e


def _failure(error: BaseException | None) -> tuple[str, str] | None:
    """What a peer needs of this rank's failed load: its kind and one line."""
    if error is None:
        return None
    if isinstance(error, OwnIndexShort):
        return _SHORT, ""
    if isinstance(error, UnsafePickle):
        return "untrusted", one_line(error)
    return "corrupt" if isinstance(error, CorruptRecord) else "", one_line(error)


def _peer_error(rank: int, failure: tuple[str, str]) -> Exception:
    """A failed rank's error as its peers raise it: a refusal or a corrupt record alike on every
    rank (one line, one exit), anything else as PeerLoadFailed naming that rank."""
    kind, line = failure
    if kind == "untrusted":
        return UnsafePickle(line)
    if kind == "corrupt":
        return CorruptRecord(line)
    return PeerLoadFailed(f"rank {rank} could not load its part: {line}")


@contextmanager
def no_gc() -> Iterator[None]:
    """The cycle collector off for the duration. A load allocates tens of thousands of objects
    (plans, read items, their unpickled copies on the coordinator), enough to set off a full
    collection over everything the trainer holds: 0.2-0.5 s measured in the bench config, on one
    rank at a time while the other waits for it in DCP's next collective. What the load frees is
    freed by reference counting; a cycle it leaves waits for the next collection after it."""
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def refusal_line(e: UnsafePickle, root: Path, ckpt: Path | None) -> str:
    """The trainer's one line for a refused load: what, and what a person does about it."""
    step = parse_committed(ckpt.name) if ckpt is not None else None
    aside = f" --ckpt-root {root} {step}" if step is not None else ""
    return (
        f"refused: {e}; inspect it, restore the checkpoint from a trusted copy, or move it aside with "
        f"`python -m supervisor ckpt quarantine{aside}` (the next launch resumes from the one before)"
    )
