"""DCP's index of a checkpoint: one ``.metadata`` for all ranks, or one per rank, and which a save writes.

With one index, DCP's save gathers every rank's save plan to rank 0, which builds the global plan
and the index from them, scatters the plans back, and then gathers every rank's write results
(torch 2.13 ``_save_state_dict``): rank 0's CPU grows with the ranks, in the async save's thread
beside the loop. And at every resume each rank reads and unpickles that whole index, which holds
a chunk per rank of every sharded tensor: the job's work grows with ranks x ranks
(bench/index_scale.py has both).

When the state is sharded (FSDP: the tensors are DTensors split over the ranks), each rank saves
alone (``use_collectives=False``): its shards and its own index, ``__<rank>_index.metadata``, nothing
exchanged. A resume on the same layout reads its own index: what a rank loads is what it wrote
(``uncovered`` checks that, element for element). On another layout (a world-size change, FSDP to
DDP) it needs them all, ``merged``, each read once over the job (safe_load.every_index).
Replicated state (DDP, HSDP's replicas) keeps the one index: with one per rank, every rank would
write what the others write (or, split into the trainer's replica shares, would need every
rank's index to load).
"""

from __future__ import annotations

import math
import operator
from collections.abc import Iterator, Mapping, Sequence
from pathlib import Path
from typing import Any, cast

import torch
from torch.distributed.checkpoint.filesystem import _StorageInfo
from torch.distributed.checkpoint.metadata import (
    STORAGE_TYPES,
    BytesStorageMetadata,
    ChunkStorageMetadata,
    Metadata,
    MetadataIndex,
    TensorProperties,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadItemType, LoadPlan
from torch.distributed.tensor import DTensor, Shard

__all__ = ["REPLICATED_MAX", "index_problem", "merged", "per_rank_index", "tensor_bytes", "uncovered"]

# With an index per rank, every rank writes its own copy of what is replicated: allowed while all
# the copies together stay within this share of the checkpoint (the sharded bytes).
REPLICATED_MAX = 0.01


def _tensors(value: Any) -> Iterator[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        yield value
    elif isinstance(value, Mapping):
        for v in value.values():
            yield from _tensors(v)
    elif isinstance(value, list | tuple):
        for v in value:
            yield from _tensors(v)


def tensor_bytes(state_dict: Mapping[str, Any]) -> tuple[int, int]:
    """(replicated, sharded) bytes of the tensors in a nested state dict: a DTensor split along
    every dim of its mesh counts its whole size as sharded; any other tensor (a plain one, or a
    DTensor replicated along some mesh dim) as replicated, by what this rank holds."""
    replicated = sharded = 0
    for t in _tensors(state_dict):
        if isinstance(t, DTensor) and all(isinstance(p, Shard) for p in t.placements):
            sharded += t.numel() * t.element_size()
        else:
            local = t.to_local() if isinstance(t, DTensor) else t
            replicated += local.numel() * local.element_size()
    return replicated, sharded


def per_rank_index(replicated: int, sharded: int, world_size: int) -> bool:
    """Whether a save writes an index per rank: the state is sharded, and the copies of what is
    replicated, one per rank, cost at most ``REPLICATED_MAX`` of the sharded bytes."""
    return sharded > 0 and replicated * world_size <= REPLICATED_MAX * sharded


def index_problem(md: Any, listed: Mapping[str, int] | None, ckpt: Path = Path()) -> str:
    """Why ``md``, as unpickled from a checkpoint's index, cannot be one ('' when it can). DCP's
    planner and readers take every field of it as it is: a record "in" ``../step_10/__0_0.distcp``
    was read from another checkpoint, a negative offset or length failed deep inside them (EINVAL,
    ValueError), a length past the file's end allocated that much before reading. So every
    record must lie in a file of this checkpoint by its plain name (one the manifest lists, when
    ``listed`` holds its files' sizes), at offset and length >= 0 within the file's listed size;
    every tensor's chunks within its size, of its rank. A record past its file's end is named as
    a read would name it: ``ckpt/<file> (item <fqn>): the file ends ...``."""
    if not isinstance(md, Metadata):
        return f"holds {type(md).__name__}, not DCP's Metadata"
    items: Any = md.state_dict_metadata  # as unpickled: any type at all
    records: Any = md.storage_data
    if not isinstance(items, dict) or not isinstance(records, dict):
        return "its item table or its storage table is not a table"
    for fqn, item in items.items():
        if not isinstance(fqn, str):
            return f"an item named {type(fqn).__name__}, not by a string"
        if isinstance(item, TensorStorageMetadata):
            if problem := _tensor_problem(item):
                return f"{fqn}: {problem}"
        elif not isinstance(item, BytesStorageMetadata):
            return f"{fqn}: neither a tensor nor a value ({type(item).__name__})"
    for index, info in records.items():
        if not isinstance(index, MetadataIndex) or not isinstance(index.fqn, str):
            return f"a record keyed by {type(index).__name__}, not by an item"
        if problem := _record_problem(info, listed, index.fqn, ckpt):
            return problem
    return ""


def _is_size(v: Any, rank: int | None = None) -> bool:
    """A sequence of ints >= 0 (of ``rank`` of them, when given), as DCP's sizes and offsets are
    (a torch.Size holds ints only: one ``min`` tells, in C; 800 tensors are checked per load)."""
    if type(v) is torch.Size:
        return (rank is None or len(v) == rank) and (not v or min(v) >= 0)
    return (
        isinstance(v, tuple | list)
        and (rank is None or len(v) == rank)
        and all(type(x) is int and x >= 0 for x in v)
    )


def _tensor_problem(item: TensorStorageMetadata) -> str:
    props, size, chunks = cast(Any, item.properties), cast(Any, item.size), cast(Any, item.chunks)
    if not isinstance(props, TensorProperties) or not isinstance(props.dtype, torch.dtype):
        return "no dtype"
    if not _is_size(size) or not isinstance(chunks, list):
        return "a size or chunk list that is not one"
    rank = len(size)
    for c in chunks:
        if (
            not isinstance(c, ChunkStorageMetadata)
            or not _is_size(c.offsets, rank)
            or not _is_size(c.sizes, rank)
            or any(map(operator.gt, map(operator.add, c.offsets, c.sizes), size))
        ):
            return f"a chunk outside its size {tuple(size)}"
    return ""


def _record_problem(info: Any, listed: Mapping[str, int] | None, fqn: str, ckpt: Path) -> str:
    if not isinstance(info, _StorageInfo):
        return f"{fqn}: its record is a {type(info).__name__}"
    name, offset, length = cast(Any, info.relative_path), cast(Any, info.offset), cast(Any, info.length)
    if not isinstance(name, str) or not name or name in (".", "..") or "/" in name or "\x00" in name:
        return f"{fqn}: its record is in {name!r}, not a file of this checkpoint"
    if type(offset) is not int or type(length) is not int or offset < 0 or length < 0:
        return f"{fqn}: its record in {name} is at offset {offset!r}, {length!r} bytes: not a place in a file"
    transforms: Any = info.transform_descriptors
    if not isinstance(transforms, list | tuple | None):
        return f"{fqn}: its record in {name} names no transforms but {type(transforms).__name__}"
    if listed is None:
        return ""
    size = listed.get(name)
    if size is None:
        return f"{fqn}: its record is in {name}, not one of the checkpoint's files"
    if offset + length > size:
        return (
            f"{ckpt / name} (item {fqn}): the file ends {max(0, size - offset)} of {length} bytes into the "
            f"record at offset {offset}"
        )
    return ""


def merged(indexes: Sequence[Metadata]) -> Metadata:
    """The per-rank indexes (in rank order) as one, as DCP's global plan would have built it:
    every tensor's chunks from every rank, an item every rank wrote alike (a replicated tensor, a
    non-tensor value) once, from the lowest rank. ValueError when two ranks disagree on an item.
    Linear in the chunks: a world-size change at thousands of ranks merges millions."""
    items: dict[str, STORAGE_TYPES] = {}
    tensors: dict[str, tuple[TensorStorageMetadata, _Chunks]] = {}  # each tensor, its chunks by offsets
    storage: dict[MetadataIndex, Any] = {}
    planner_data: dict[str, Any] = {}
    for md in indexes:
        for fqn, item in md.state_dict_metadata.items():
            have = items.get(fqn)
            if have is None:
                if isinstance(item, TensorStorageMetadata):
                    tensor = TensorStorageMetadata(item.properties, item.size, [])
                    items[fqn], tensors[fqn] = tensor, (tensor, {})
                    _add_chunks(fqn, tensors[fqn][1], item.chunks)
                else:
                    items[fqn] = item
            elif isinstance(have, TensorStorageMetadata) and isinstance(item, TensorStorageMetadata):
                if have.size != item.size or have.properties.dtype != item.properties.dtype:
                    raise ValueError(f"{fqn}: {tuple(item.size)} {item.properties.dtype} in one index, "
                                     f"{tuple(have.size)} {have.properties.dtype} in another")  # fmt: skip
                _add_chunks(fqn, tensors[fqn][1], item.chunks)
            elif isinstance(have, TensorStorageMetadata) or isinstance(item, TensorStorageMetadata):
                raise ValueError(f"{fqn}: a tensor in one index, a value in another")
        for index, info in md.storage_data.items():
            storage.setdefault(MetadataIndex(index.fqn, index.offset), info)
        if isinstance(md.planner_data, Mapping):
            for k, v in md.planner_data.items():
                planner_data.setdefault(k, v)
    for tensor, at in tensors.values():
        tensor.chunks = list(at.values())
    first = indexes[0]
    return Metadata(items, planner_data or first.planner_data, storage, first.storage_meta, first.version)


_Chunks = dict[tuple[int, ...], ChunkStorageMetadata]  # a tensor's chunks, by their offsets


def _add_chunks(fqn: str, at: _Chunks, more: Sequence[ChunkStorageMetadata]) -> None:
    for c in more:
        same = at.setdefault(tuple(c.offsets), c)
        if same is not c and tuple(same.sizes) != tuple(c.sizes):
            raise ValueError(f"{fqn}: a chunk at {tuple(c.offsets)} of {tuple(c.sizes)} in one index, "
                             f"of {tuple(same.sizes)} in another")  # fmt: skip


def uncovered(plan: LoadPlan, state_dict: Mapping[str, Any]) -> str | None:
    """The first tensor of the (flattened) ``state_dict`` that ``plan`` does not read in full, as
    "fqn: N of M elements"; None when every element of every tensor is read. DCP plans the reads
    from the index's chunks that overlap what a rank holds, and reads nothing for a part no chunk
    covers: that part would keep whatever the tensor held before the load."""
    read: dict[str, int] = {}
    for item in plan.items:
        if item.type == LoadItemType.TENSOR:
            read[item.dest_index.fqn] = read.get(item.dest_index.fqn, 0) + math.prod(item.lengths)
    for fqn, value in state_dict.items():
        if isinstance(value, torch.Tensor):
            need = (value.to_local() if isinstance(value, DTensor) else value).numel()
            if read.get(fqn, 0) < need:
                return f"{fqn}: {read.get(fqn, 0)} of {need} elements"
    return None
