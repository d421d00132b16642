"""DCP load that runs nothing a checkpoint holds (docs/security.md).

torch 2.13's DCP unpickles two things from a checkpoint without restriction: the ``.metadata``
index (``FileSystemReader.read_metadata``: a plain ``pickle.load``) and every non-tensor state item
(``DefaultLoadPlanner.load_bytes``: ``torch.load(weights_only=False)``; here the step, the
scheduler, the sampler, the optimizer's param groups). Whoever can write a checkpoint could make
every rank run any code at the next resume through either. So a load goes through:

- ``SafeFileSystemReader``: ``read_metadata`` unpickles with supervisor.safepickle's allowlist
  (the real classes, nothing else), inside DCP's own read: no window between a check and the read;
- ``SafeLoadPlanner``: ``load_bytes`` with ``torch.load(weights_only=True)``, as DCP already loads
  tensors and the per-rank state files are loaded.

A refusal is one line naming the file (``UnsafePickle``), raised by ``load_dcp`` on every rank
(each reads the index itself), before anything from the file has run.
"""

from __future__ import annotations

import io
import os
import pickle
import re
from dataclasses import replace
from pathlib import Path
from typing import IO, Any, cast

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint._traverse import set_element
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.filesystem import FileSystem
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.futures import Future

from supervisor.format.layout import parse_committed
from supervisor.safepickle import WHY, UnsafePickle, load_restricted

# torch's weights_only refusal names the global: "Unsupported global: GLOBAL posix.system was not ..."
_GLOBAL = re.compile(r"GLOBAL ([\w.]+)")


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
    file, which the kernel's readahead streams when the cache is cold) and each item's bytes come
    in one read into memory, where ``torch.load`` parses them: 20-35% less CPU per load measured
    here (bench/checkpoint.py has the load against a raw read)."""

    def __init__(self, path: str | os.PathLike[str]):
        super().__init__(path)
        # The first refusal: DCP catches a read_metadata error and tries the per-rank index, then
        # wraps what it got; the load site re-raises this one line instead.
        self.refused: UnsafePickle | None = None

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        """torch 2.13's ``FileSystemReader.read_metadata`` with ``pickle.load`` restricted."""
        if self.refused is not None:
            raise self.refused
        path = self._get_metadata_path(kwargs.get("rank"))
        with self.fs.create_stream(path, "rb") as f:
            try:
                # torch types the stream as IOBase; it is the binary file opened "rb" above
                metadata = load_restricted(cast(IO[bytes], f), str(path))
            except UnsafePickle as e:
                self.refused = e
                raise
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner) -> Future[None]:
        def where(item: ReadItem) -> tuple[str, int]:
            info = self.storage_data[item.storage_index]
            return info.relative_path, info.offset

        return super().read_data(replace(plan, items=sorted(plan.items, key=where)), planner)

    def _slice_file(self, file: Any, sinfo: Any) -> IO[bytes]:
        """The item's bytes, read at once (counted, when ``fs`` counts), as an in-memory file."""
        file.seek(sinfo.offset)
        return io.BytesIO(file.read(sinfo.length))  # short (a truncated file): torch.load refuses it


class SafeLoadPlanner(DefaultLoadPlanner):
    """DefaultLoadPlanner whose non-tensor items are loaded with ``weights_only=True``."""

    def __init__(self, reader: SafeFileSystemReader):
        super().__init__()
        self.reader = reader

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        """torch 2.13's ``DefaultLoadPlanner.load_bytes`` with ``weights_only=True``."""
        fqn = read_item.dest_index.fqn
        try:
            obj = torch.load(value, weights_only=True)
        except pickle.UnpicklingError as e:
            info = self.reader.storage_data.get(read_item.storage_index)
            where = (
                Path(self.reader.path) / info.relative_path if info is not None else Path(self.reader.path)
            )
            self.reader.refused = self.reader.refused or weights_only_refusal(f"{where} (item {fqn})", e)
            raise self.reader.refused from None
        if self.flatten_state_dict:
            set_element(self.original_state_dict, self.mappings[fqn], obj)
        else:
            self.state_dict[fqn] = obj


def load_dcp(
    ckpt: Path,
    state_dict: dict[str, Any],
    process_group: dist.ProcessGroup | None,
    fs: FileSystem | None = None,
) -> None:
    """``dcp.load`` through the safe reader and planner; UnsafePickle (one line) on a refusal.
    ``fs``: the file system the reader opens files with (the trainer's counts the bytes it reads,
    train_ref/progress_io.py)."""
    reader = SafeFileSystemReader(ckpt)
    if fs is not None:
        reader.fs = fs
    try:
        dcp.load(
            state_dict, storage_reader=reader, planner=SafeLoadPlanner(reader), process_group=process_group
        )
    except (Exception, CheckpointException):  # DCP's CheckpointException is a BaseException
        if reader.refused is not None:
            raise reader.refused from None
        raise


def refusal_line(e: UnsafePickle, root: Path, ckpt: Path | None) -> str:
    """The trainer's one line for a refused load: what, and what a person does about it."""
    step = parse_committed(ckpt.name) if ckpt is not None else None
    aside = f" --ckpt-root {root} {step}" if step is not None else ""
    return (
        f"refused: {e}; inspect it, restore the checkpoint from a trusted copy, or move it aside with "
        f"`python -m supervisor ckpt quarantine{aside}` (the next launch resumes from the one before)"
    )
