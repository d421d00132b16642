"""Memory-tier snapshots written as a rank writes them (supervisor/format/memsnap.py): an index
and its data file, for the tests of the format and of the replica."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path

import xxhash

from supervisor.format import memsnap

SMALL = (("float32", (3, 2)), ("bfloat16", (5,)), ("int64", ()))


def index(
    step: int = 5,
    rank: int = 0,
    local_rank: int = 0,
    lws: int = 1,
    tensors: Sequence[tuple[str, tuple[int, ...]]] = SMALL,
    **kw: object,
) -> memsnap.RankIndex:
    """A rank's index (no checksum yet: ``written`` gives it one)."""
    entries, size = memsnap.layout(tensors)
    fields = dict(
        step=step, launch="L", rank=rank, local_rank=local_rank, local_world_size=lws, world_size=lws,
        identity={"config_hash": "h"}, size=size, checksum="", tensors=tuple(entries), shared=None, own=None,
    )  # fmt: skip
    fields.update(kw)
    return memsnap.RankIndex(**fields)  # type: ignore[arg-type]


def written(folder: Path, ix: memsnap.RankIndex, slot: int = 0) -> memsnap.RankIndex:
    """``ix``'s data (tensor n all bytes n + 1, plus the rank, mod 256) and its index, in ``slot``
    of ``folder``; the index with its checksum."""
    data = bytearray(ix.size)
    for n, t in enumerate(ix.tensors):
        data[t.offset : t.offset + t.nbytes] = bytes([(n + 1 + ix.rank) % 256]) * t.nbytes
    h = xxhash.xxh3_128()
    for t in ix.tensors:
        h.update(bytes(data[t.offset : t.offset + t.nbytes]))
    memsnap.slot_dir(folder, slot).mkdir(parents=True, exist_ok=True)
    memsnap.data_path(folder, slot, ix.rank).write_bytes(bytes(data))
    ix = memsnap.RankIndex(**{**ix.__dict__, "checksum": h.hexdigest()})
    memsnap.write_record(memsnap.index_path(folder, slot, ix.rank), ix.to_dict())
    return ix
