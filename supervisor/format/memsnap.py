"""The memory tier's snapshots (docs/tiers.md#the-memory-tier): each rank's whole training state in
node-local shared memory, in a folder its node's watchdog owns, so a kill -9, a crash or a hang
verdict leaves the state of the last step behind for the relaunch.

    MEMDIR/                               layout.node_memory_dir (the watchdog makes and removes it)
      slot0/rank_00003.data               rank 3's tensors: raw bytes at the offsets of its index
      slot0/rank_00003.json               its index (RankIndex): written after the data, by rename
      slot1/...                           the other slot: the snapshot being written never
                                          overwrites the newest complete one
      committed.json                      Commit: the newest step every rank of the job finished
      pick.json                           Pick: the watchdog's choice for the next launch
      rejected.json                       Rejected: a launch's ranks refused the pick (the reason)
      pinned.json                         Pinned: the slot the watchdog is pushing to its buddy
      replica/<node>/slot0/...            a buddy node's committed snapshot, streamed here

No pickle: the index is JSON (the state's structure, each non-tensor value, each tensor's dtype,
shape, offset and size) and the data file raw bytes; the checksum (xxh3-128) runs over the tensors'
bytes in index order. A rank writes a snapshot as: remove its index in the slot, write the data,
write the index (atomic rename); so an index names data that was completely written. Which slot a
snapshot goes to alternates per snapshot; a rank starts writing the next only when every rank of
the job agreed the previous one is done (the step's control all-reduce), so the newest complete
snapshot is never the one being overwritten.

What the watchdog reads here was written by processes it does not trust to have finished: every
reader caps what it reads (an index at INDEX_MAX), checks every offset against the data file's size,
and checks the checksum before anything is used (``verify_rank``).

The state's structure is encoded by ``encode``/``decode`` (a small JSON tree codec): JSON scalars as
they are, lists as lists, tuples, dicts (any key type, in order) and bytes tagged, tensors as
references into the index's tensor table. Anything else cannot be snapshotted (``Unsupported``).
"""

from __future__ import annotations

import base64
import contextlib
import json
import math
import mmap
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any, TypeGuard

from supervisor.format.capped import RECORD_MAX, read_capped

FORMAT = 1
SLOTS = 2
DATA_SUFFIX = ".data"
INDEX_SUFFIX = ".json"
COMMITTED = "committed.json"
PICK = "pick.json"
REJECTED = "rejected.json"
PINNED = "pinned.json"
REPLICA = "replica"
# Offsets of tensors in a data file are multiples of this (aligned copies).
ALIGN = 64
# An index holds the state's structure: ~100 bytes per tensor and per small value (a model of
# 100,000 tensors with Adam: ~30 MB).
INDEX_MAX = 64 << 20
# The checksum over the tensors' bytes, as the manifests' (supervisor/format/manifest.py).
CHECKSUM = "xxh3_128"
READ_CHUNK = 8 << 20
# The overhead the memory tier may cost a step, as a fraction of the step time (``plan``).
OVERHEAD_BUDGET = 0.03
# Bytes per element of each dtype a tensor of a snapshot may have (torch's names, without "torch.").
DTYPE_SIZES = {
    "float64": 8, "float32": 4, "float16": 2, "bfloat16": 2, "complex128": 16, "complex64": 8,
    "int64": 8, "int32": 4, "int16": 2, "int8": 1, "uint64": 8, "uint32": 4, "uint16": 2, "uint8": 1,
    "bool": 1, "float8_e4m3fn": 1, "float8_e5m2": 1,
}  # fmt: skip

# The tree codec's tags (a dict of one of these keys is a tagged value, never a plain dict).
TENSOR, TUPLE, DICT, BYTES = "__tensor__", "__tuple__", "__dict__", "__bytes__"


class Unsupported(ValueError):
    """A value the snapshot cannot hold (not a tensor, a JSON scalar, a list, tuple, dict or
    bytes); ``str(e)`` names where in the state it is."""


class SnapshotError(ValueError):
    """A snapshot file that is not what it claims (a bad index, a short data file, a checksum that
    differs); ``str(e)`` is one line naming the file."""


# ---------------------------------------------------------------- the tree codec


def encode(obj: Any, tensor: Callable[[Any], int | None], path: str = "") -> Any:
    """``obj`` as JSON: ``tensor(x)`` gives a tensor's number in the table (None: not a tensor)."""
    ref = tensor(obj)
    if ref is not None:
        return {TENSOR: ref}
    if obj is None or isinstance(obj, bool | str):
        return obj
    if isinstance(obj, int):
        return int(obj)
    if isinstance(obj, float):
        return float(obj)
    if isinstance(obj, bytes):
        return {BYTES: base64.b64encode(obj).decode()}
    if isinstance(obj, list):
        return [encode(v, tensor, f"{path}[{i}]") for i, v in enumerate(obj)]
    if isinstance(obj, tuple):
        return {TUPLE: [encode(v, tensor, f"{path}[{i}]") for i, v in enumerate(obj)]}
    if isinstance(obj, dict):
        return {DICT: [[encode(k, tensor, path), encode(v, tensor, f"{path}.{k}")] for k, v in obj.items()]}
    raise Unsupported(
        f"{path or 'the state'}: a {type(obj).__name__} (not a tensor, number, string, list or dict)"
    )


def decode(tree: Any, tensor: Callable[[int, tuple[Any, ...]], Any], path: tuple[Any, ...] = ()) -> Any:
    """The value ``encode`` encoded; ``tensor(ref, path)`` gives the tensor of a reference at
    ``path`` (the keys and indexes leading to it). Raises SnapshotError on a tree ``encode`` never
    makes."""
    if tree is None or isinstance(tree, bool | int | float | str):
        return tree
    if isinstance(tree, list):
        return [decode(v, tensor, (*path, i)) for i, v in enumerate(tree)]
    if isinstance(tree, dict) and len(tree) == 1:
        ((tag, v),) = tree.items()
        if tag == TENSOR and isinstance(v, int) and not isinstance(v, bool):
            return tensor(v, path)
        if tag == TUPLE and isinstance(v, list):
            return tuple(decode(x, tensor, (*path, i)) for i, x in enumerate(v))
        if tag == BYTES and isinstance(v, str):
            return base64.b64decode(v.encode(), validate=True)
        if tag == DICT and isinstance(v, list):
            return _decode_dict(v, tensor, path)
    raise SnapshotError(f"not a value this toolkit encodes at {_shown(path)}")


def _decode_dict(
    items: list[Any], tensor: Callable[[int, tuple[Any, ...]], Any], path: tuple[Any, ...]
) -> dict[Any, Any]:
    out: dict[Any, Any] = {}
    for item in items:
        if not (isinstance(item, list) and len(item) == 2):
            raise SnapshotError(f"not a dict entry at {_shown(path)}")
        key = decode(item[0], _no_tensor, path)
        try:
            out[key] = decode(item[1], tensor, (*path, key))
        except TypeError:  # an unhashable key
            raise SnapshotError(f"a key that cannot be one at {_shown(path)}") from None
    return out


def _no_tensor(ref: int, path: tuple[Any, ...]) -> Any:
    raise SnapshotError(f"a tensor as a dict key at {_shown(path)}")


def _shown(path: Sequence[Any]) -> str:
    return ".".join(map(str, path)) or "the top"


def paths(tree: Any, path: tuple[Any, ...] = ()) -> Iterator[tuple[tuple[Any, ...], int]]:
    """(path, reference) of every tensor of an encoded tree, in order."""
    refs: list[tuple[tuple[Any, ...], int]] = []
    decode(tree, lambda ref, p: refs.append((p, ref)), path)
    return iter(refs)


# ---------------------------------------------------------------- the records


@dataclass(frozen=True)
class TensorEntry:
    """One tensor's bytes in the data file: ``nbytes`` at ``offset``; ``shape`` as this rank holds it
    (its own shard of a sharded one)."""

    dtype: str
    shape: tuple[int, ...]
    offset: int
    nbytes: int

    def to_list(self) -> list[Any]:
        return [self.dtype, list(self.shape), self.offset, self.nbytes]


@dataclass(frozen=True)
class RankIndex:
    """One rank's snapshot of one step: the state's structure (``shared``: what every rank saves
    to the disk tier, ``own``: its RNG streams and per-rank items), its tensors in the data file,
    and what a resume checks before using it (the run's identity, the world size, the launch)."""

    step: int
    launch: str
    rank: int
    local_rank: int
    local_world_size: int
    world_size: int
    identity: Mapping[str, Any]  # config_hash, data, global_batch: as the manifest's
    size: int  # bytes of the data file
    checksum: str  # xxh3-128 of the tensors' bytes, in table order
    tensors: tuple[TensorEntry, ...]
    shared: Any  # encoded trees
    own: Any
    meta: Mapping[str, Any] = field(default_factory=dict)  # the manifest's meta (recent losses...)
    written: float = 0.0  # wall time
    format: int = FORMAT

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": self.format,
            "step": self.step,
            "launch": self.launch,
            "rank": self.rank,
            "local_rank": self.local_rank,
            "local_world_size": self.local_world_size,
            "world_size": self.world_size,
            "identity": dict(self.identity),
            "size": self.size,
            "checksum_algo": CHECKSUM,
            "checksum": self.checksum,
            "tensors": [t.to_list() for t in self.tensors],
            "shared": self.shared,
            "own": self.own,
            "meta": dict(self.meta),
            "written": self.written,
        }


def layout(tensors: Sequence[tuple[str, tuple[int, ...]]]) -> tuple[list[TensorEntry], int]:
    """Each tensor's place in a data file (dtype, local shape), aligned; and the file's size."""
    out, end = [], 0
    for dtype, shape in tensors:
        nbytes = math.prod(shape) * DTYPE_SIZES[dtype]
        offset = -(-end // ALIGN) * ALIGN
        out.append(TensorEntry(dtype, tuple(shape), offset, nbytes))
        end = offset + nbytes
    return out, end


def natural(v: object) -> TypeGuard[int]:
    """An int >= 0, not a bool (JSON's true is not a step)."""
    return isinstance(v, int) and not isinstance(v, bool) and v >= 0


def parse_index(raw: bytes, where: str) -> RankIndex:
    """A rank's index, every field and every tensor's place checked; SnapshotError (one line)."""
    try:
        d = json.loads(raw)
    except (ValueError, UnicodeDecodeError) as e:
        raise SnapshotError(f"{where}: not JSON ({e})") from None
    if not isinstance(d, dict) or d.get("format") != FORMAT:
        raise SnapshotError(f"{where}: not a memory snapshot index of format {FORMAT}")
    nat = ("step", "rank", "local_rank", "local_world_size", "world_size", "size")
    bad = [k for k in nat if not natural(d.get(k))]
    bad += [k for k in ("launch", "checksum") if not isinstance(d.get(k), str)]
    bad += [k for k in ("identity", "meta") if not isinstance(d.get(k), dict)]
    if d.get("checksum_algo") != CHECKSUM:
        bad.append("checksum_algo")
    if not isinstance(d.get("tensors"), list):
        bad.append("tensors")
    if bad:
        raise SnapshotError(f"{where}: bad or missing {', '.join(bad)}")
    tensors = tuple(_entry(t, d["size"], where) for t in d["tensors"])
    written = d.get("written", 0.0)
    return RankIndex(
        step=d["step"],
        launch=d["launch"],
        rank=d["rank"],
        local_rank=d["local_rank"],
        local_world_size=d["local_world_size"],
        world_size=d["world_size"],
        identity=d["identity"],
        size=d["size"],
        checksum=d["checksum"],
        tensors=tensors,
        shared=d.get("shared"),
        own=d.get("own"),
        meta=d["meta"],
        written=float(written) if isinstance(written, int | float) else 0.0,
    )


def _entry(t: object, size: int, where: str) -> TensorEntry:
    ok = isinstance(t, list) and len(t) == 4 and t[0] in DTYPE_SIZES and isinstance(t[1], list)
    if not ok or not all(natural(n) for n in t[1]) or not (natural(t[2]) and natural(t[3])):  # type: ignore[index]
        raise SnapshotError(
            f"{where}: a tensor entry that is not [dtype, shape, offset, nbytes]: {str(t)[:80]}"
        )
    assert isinstance(t, list)
    entry = TensorEntry(t[0], tuple(t[1]), t[2], t[3])
    if (
        entry.nbytes != math.prod(entry.shape) * DTYPE_SIZES[entry.dtype]
        or entry.offset + entry.nbytes > size
    ):
        raise SnapshotError(f"{where}: a tensor entry beyond the data file or of the wrong size: {t}")
    return entry


@dataclass(frozen=True)
class Commit:
    """The newest step whose snapshot every rank of the job finished (agreed by the ranks; written
    by each node's local rank 0)."""

    step: int
    slot: int
    launch: str
    t: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "step": self.step, "slot": self.slot, "launch": self.launch, "t": self.t}


@dataclass(frozen=True)
class Pick:
    """The watchdog's choice for launch number ``launch``: resume from the snapshot of ``step`` in
    ``slot`` (under ``folder``: this node's own, or a buddy's replica), verified before the launch.
    ``older``: (step, slot) of the older complete snapshots there, newest first, not verified: the
    launch's ranks fall back to one of them when another node holds no snapshot of ``step`` (a
    replica one push behind), and check it themselves."""

    launch: int
    step: int
    slot: int
    folder: str  # relative to MEMDIR: "" for this node's own snapshots, else replica/<node>
    t: float = 0.0
    older: tuple[tuple[int, int], ...] = ()

    def steps(self) -> tuple[int, ...]:
        """The steps this node can resume from, newest first."""
        return (self.step, *(step for step, _ in self.older))

    def at(self, step: int) -> Pick:
        """This pick moved to its older snapshot of ``step`` (one of ``steps()``)."""
        if step == self.step:
            return self
        slot = next(slot for s, slot in self.older if s == step)
        return replace(self, step=step, slot=slot, older=())

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "launch": self.launch,
            "step": self.step,
            "slot": self.slot,
            "folder": self.folder,
            "t": self.t,
            "older": [list(o) for o in self.older],
        }


@dataclass(frozen=True)
class Rejected:
    """A launch's ranks refused the pick (``reason``: one line, naming the rank)."""

    launch: int
    step: int
    reason: str

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "launch": self.launch, "step": self.step, "reason": self.reason}


@dataclass(frozen=True)
class Pinned:
    """The watchdog pushes the snapshot of ``step`` in ``slot`` to its buddy: the ranks write no
    snapshot into that slot until it is gone (their busy flag; the push would fail its checksum)."""

    slot: int
    step: int

    def to_dict(self) -> dict[str, Any]:
        return {"format": FORMAT, "slot": self.slot, "step": self.step}


def read_pinned(folder: Path) -> Pinned | None:
    d = _record(folder / PINNED)
    if d is None or not (d.get("slot") in range(SLOTS) and natural(d.get("step"))):
        return None
    return Pinned(d["slot"], d["step"])


@dataclass(frozen=True)
class Endpoint:
    """Where a node's watchdog receives its buddy's pushes and answers pulls (in the run dir:
    layout.RunDir.replica_endpoint), for as long as process ``pid`` on ``host`` runs."""

    node: int
    host: str
    port: int
    pid: int
    t: float = 0.0

    def to_dict(self) -> dict[str, Any]:
        return {
            "format": FORMAT,
            "node": self.node,
            "host": self.host,
            "port": self.port,
            "pid": self.pid,
            "t": self.t,
        }


def read_endpoint(path: Path) -> Endpoint | None:
    d = _record(path)
    if d is None or not (natural(d.get("node")) and natural(d.get("pid")) and isinstance(d.get("host"), str)):
        return None
    port = d.get("port")
    if not (natural(port) and 0 < port < 65536) or not d["host"]:
        return None
    return Endpoint(d["node"], d["host"][:255], port, d["pid"], float(d.get("t", 0.0) or 0.0))


def _record(path: Path) -> dict[str, Any] | None:
    """A small JSON record of MEMDIR, or None when it is missing or not one."""
    try:
        d = json.loads(read_capped(path, RECORD_MAX))
    except (OSError, ValueError, UnicodeDecodeError):
        return None
    return d if isinstance(d, dict) and d.get("format") == FORMAT else None


def read_commit(folder: Path) -> Commit | None:
    d = _record(folder / COMMITTED)
    if d is None or not (
        natural(d.get("step")) and d.get("slot") in range(SLOTS) and isinstance(d.get("launch"), str)
    ):
        return None
    return Commit(d["step"], d["slot"], d["launch"], float(d.get("t", 0.0) or 0.0))


def read_pick(folder: Path) -> Pick | None:
    d = _record(folder / PICK)
    if d is None or not (
        natural(d.get("launch")) and natural(d.get("step")) and d.get("slot") in range(SLOTS)
    ):
        return None
    if not isinstance(d.get("folder"), str) or not _inside(d["folder"]):
        return None
    older = d.get("older", [])
    if not (
        isinstance(older, list)
        and len(older) < SLOTS
        and all(
            isinstance(o, list)
            and len(o) == 2
            and natural(o[0])
            and o[0] < d["step"]
            and o[1] in range(SLOTS)
            for o in older
        )
        and len({o[1] for o in older} | {d["slot"]}) == len(older) + 1
    ):
        return None
    t = float(d.get("t", 0.0) or 0.0)
    return Pick(d["launch"], d["step"], d["slot"], d["folder"], t, tuple((o[0], o[1]) for o in older))


def read_rejected(folder: Path) -> Rejected | None:
    d = _record(folder / REJECTED)
    if d is None or not (
        natural(d.get("launch")) and natural(d.get("step")) and isinstance(d.get("reason"), str)
    ):
        return None
    return Rejected(d["launch"], d["step"], d["reason"][:2000])


def _inside(rel: str) -> bool:
    """A pick's folder: "" or ``replica/<node>`` (never a way out of MEMDIR)."""
    if rel == "":
        return True
    head, _, node = rel.partition("/")
    return head == REPLICA and node.isdigit()


def write_record(path: Path, record: Mapping[str, Any]) -> None:
    """A record of MEMDIR, by rename (a reader sees the old one or the new one); no fsync: it is
    memory, it does not outlive the node."""
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    data = json.dumps(record).encode()  # dumps: C's encoder (dump's is Python's, ~10x slower)
    with open(tmp, "wb", opener=_private) as f:
        f.write(data)
    os.replace(tmp, path)


def _private(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW, 0o600)


# ---------------------------------------------------------------- names


def slot_dir(folder: Path, slot: int) -> Path:
    return folder / f"slot{slot}"


def data_path(folder: Path, slot: int, rank: int) -> Path:
    return slot_dir(folder, slot) / f"rank_{rank:05d}{DATA_SUFFIX}"


def index_path(folder: Path, slot: int, rank: int) -> Path:
    return slot_dir(folder, slot) / f"rank_{rank:05d}{INDEX_SUFFIX}"


def replica_dir(folder: Path, node: int) -> Path:
    return folder / REPLICA / str(node)


def _index_rank(name: str) -> int | None:
    digits = name[len("rank_") : -len(INDEX_SUFFIX)]
    ok = name.startswith("rank_") and name.endswith(INDEX_SUFFIX) and digits.isdigit()
    return int(digits) if ok else None


# ---------------------------------------------------------------- reading a node's snapshots


def read_index(path: Path) -> RankIndex:
    """Raises OSError (missing, unreadable, too large) or SnapshotError."""
    return parse_index(read_capped(path, INDEX_MAX, follow=False), str(path))


@dataclass(frozen=True)
class NodeSnapshot:
    """A step every rank of a node has in one slot of ``folder``: each rank's index."""

    folder: Path
    step: int
    launch: str
    slot: int
    ranks: Mapping[int, RankIndex]

    @property
    def size(self) -> int:
        return sum(ix.size for ix in self.ranks.values())


def read_slots(folder: Path) -> tuple[list[tuple[int, RankIndex]], list[str]]:
    """Every readable index of both slots (slot, index), and a line for each that is not."""
    found, problems = [], []
    for slot in range(SLOTS):
        try:
            names = sorted(os.listdir(slot_dir(folder, slot)))
        except OSError:
            continue
        for name in names:
            rank = _index_rank(name)
            if rank is None:
                continue
            try:
                ix = read_index(slot_dir(folder, slot) / name)
            except (OSError, SnapshotError) as e:
                problems.append(str(e) if isinstance(e, SnapshotError) else f"{e.filename}: {e.strerror}")
                continue
            if ix.rank != rank:
                problems.append(f"{slot_dir(folder, slot) / name}: says rank {ix.rank}")
                continue
            found.append((slot, ix))
    return found, problems


def complete(folder: Path, indexes: Sequence[tuple[int, RankIndex]]) -> list[NodeSnapshot]:
    """The snapshots every local rank finished (same step, launch and slot; local ranks 0..N-1 of
    one local world size), newest first. Pure."""
    groups: dict[tuple[int, str, int], dict[int, RankIndex]] = {}
    for slot, ix in indexes:
        groups.setdefault((ix.step, ix.launch, slot), {})[ix.rank] = ix
    out = []
    for (step, launch, slot), ranks in groups.items():
        sizes = {ix.local_world_size for ix in ranks.values()}
        local = sorted(ix.local_rank for ix in ranks.values())
        if len(sizes) == 1 and local == list(range(sizes.pop())):
            out.append(NodeSnapshot(folder, step, launch, slot, ranks))
    return sorted(out, key=lambda s: -s.step)


def named(folder: Path, commit: Commit | None) -> NodeSnapshot | None:
    """The complete snapshot of ``folder`` that ``commit`` names; None when there is none (no
    commit, or its slot overwritten or unfinished since)."""
    if commit is None:
        return None
    found, _ = read_slots(folder)
    return next((s for s in complete(folder, found) if (s.step, s.slot) == (commit.step, commit.slot)), None)


class _Short(Exception):
    """A data file ended before a tensor its index names (truncated meanwhile)."""


def verify_rank(
    folder: Path,
    slot: int,
    ix: RankIndex,
    progress: Callable[[int], None] | None = None,
    mapped: bool = False,
) -> str:
    """'' when the rank's data file holds what its index says (size, checksum), else why not (one
    line naming the file). Read with pread into one reused buffer: a file truncated meanwhile is a
    short read, not a SIGBUS (the watchdog reads here: it must outlive any file). ``mapped``: hashed
    where it lies in a mapping, no copy, for the rank about to copy from that mapping (it risks a
    truncation's SIGBUS anyway; the watchdog verified the file just before its pick)."""
    path = data_path(folder, slot, ix.rank)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    except OSError as e:
        return f"{path}: {e.strerror}"
    try:
        size = os.fstat(fd).st_size
        if size != ix.size:
            return f"{path}: {size} bytes, its index says {ix.size}"
        if not (mapped and size):  # an empty file cannot be mapped
            return _compare(path, ix, _read(fd, ix, progress))
        with mmap.mmap(fd, size, access=mmap.ACCESS_READ) as mm, memoryview(mm) as view:
            return _compare(path, ix, (view[t.offset : t.offset + t.nbytes] for t in ix.tensors))
    except OSError as e:
        return f"{path}: {e.strerror}"
    except _Short as e:
        return f"{path}: short read at {e}"
    finally:
        os.close(fd)


def _read(fd: int, ix: RankIndex, progress: Callable[[int], None] | None) -> Iterator[memoryview]:
    """The tensors' bytes in index order, in chunks read into one buffer (each valid until the next)."""
    buf = memoryview(bytearray(READ_CHUNK))
    for t in ix.tensors:
        done = 0
        while done < t.nbytes:
            n = os.preadv(fd, [buf[: min(READ_CHUNK, t.nbytes - done)]], t.offset + done)
            if not n:
                raise _Short(t.offset + done)
            yield buf[:n]
            done += n
            if progress is not None:
                progress(n)


def _compare(path: Path, ix: RankIndex, chunks: Iterator[memoryview]) -> str:
    import xxhash  # here: listing never hashes

    h = xxhash.xxh3_128()
    for chunk in chunks:
        h.update(chunk)
    if h.hexdigest() != ix.checksum:
        return f"{path}: checksum {h.hexdigest()[:16]}... differs from its index's {ix.checksum[:16]}... (step {ix.step})"
    return ""


def verify(snap: NodeSnapshot) -> str:
    """'' when every rank's data of ``snap`` verifies, else the first reason."""
    for ix in snap.ranks.values():
        why = verify_rank(snap.folder, snap.slot, ix)
        if why:
            return why
    return ""


def clear(folder: Path) -> None:
    """Forget every snapshot of this node (both slots, the records); best effort. The replicas of
    other nodes stay."""
    for slot in range(SLOTS):
        d = slot_dir(folder, slot)
        with contextlib.suppress(OSError):
            for name in os.listdir(d):
                with contextlib.suppress(OSError):
                    os.unlink(d / name)
    for name in (COMMITTED, PICK):
        with contextlib.suppress(OSError):
            os.unlink(folder / name)


def forget_newer(folder: Path, step: int) -> None:
    """Forget this node's snapshots newer than ``step`` (their indexes; best effort): the run
    resumed from ``step``, so they are a future it abandons, never to be picked later."""
    found, _ = read_slots(folder)
    for slot, ix in found:
        if ix.step > step:
            with contextlib.suppress(OSError):
                os.unlink(index_path(folder, slot, ix.rank))


def remove(folder: Path) -> int:
    """The whole memory folder (the run is over); best effort, never through a link. Returns the
    memory its removed files held (allocated blocks: a slot is allocated whole), counted as it goes."""
    freed = 0
    with contextlib.suppress(OSError):
        for dirpath, dirnames, filenames in os.walk(folder, topdown=False):
            for name in filenames:
                path = os.path.join(dirpath, name)
                with contextlib.suppress(OSError):
                    blocks = os.lstat(path).st_blocks
                    os.unlink(path)
                    freed += blocks * 512
            for name in dirnames:
                p = os.path.join(dirpath, name)
                with contextlib.suppress(OSError):
                    os.unlink(p) if os.path.islink(p) else os.rmdir(p)
        os.rmdir(folder)
    return freed


# ---------------------------------------------------------------- the interval (pure)


def plan(copy_s: float, step_s: float, every: int = 0, budget: float = OVERHEAD_BUDGET) -> tuple[bool, int]:
    """(synchronous, interval): how the next snapshots are taken, from the last copy's cost
    (``copy_s``: what one snapshot takes from training, measured on the loop: its time there, or
    its start and how much it slowed the steps beside its thread) and the step time. A copy within the budget of
    one step is made on the loop (no thread to hand it to, and the step's metrics line is written
    only once its snapshot is), every step; a larger one off the loop, every N steps so that one
    copy per N steps stays within the budget (CheckFreq's rule). ``every`` > 0: that interval,
    whatever the cost."""
    allowed = budget * step_s
    sync = copy_s <= allowed
    if every > 0:
        return sync, every
    if sync or allowed <= 0:
        return sync, 1
    return False, max(1, math.ceil(copy_s / allowed))
