"""Checkpoints other trainers wrote, in a root this toolkit did not make: torchtitan's DCP
``step-N/`` folders (plain ``dcp.save``: a global ``.metadata``, no manifest of ours) and
Lightning's ``.ckpt`` files (``torch.save``'s zip format). `ckpt list|verify|pick|seal`, `status`
and the watchdog's progress test read them here.

They carry no manifest, so their check is structural:

- a DCP folder: its ``.metadata`` is there (DCP writes it last: a folder without one is a save
  that never finished, the partial folder that wins torchtitan's ``max()``), it parses under the
  restricted unpickler (supervisor/safepickle.py: nothing in it runs, torch is not imported), and
  every file its index names is there, at least as long as the index's last byte in it;
- a Lightning file: the zip opens (a truncated one has no central directory), it holds the
  pickle, and every tensor storage the pickle names is a record of the size its dtype and count
  give; deep, every record is read and its CRC32 checked.

Until `ckpt seal` records their checksums (supervisor/format/seal.py) they are marked
*unverified: no checksums*; sealed, a deep check proves every byte. ``pick`` walks back past a
broken one and moves it to ``quarantine/`` (never deletes); one still being written (newer than
an hour, as the store's own tmp folders) is left where it is.
"""

from __future__ import annotations

import errno
import os
import pickletools
import time
import zipfile
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

from supervisor import safepickle
from supervisor.format.atomic import atomic_write_text, fsync_dir
from supervisor.format.layout import (
    DCP_METADATA,
    REASON,
    RunDir,
    is_lightning_ckpt,
    lightning_step,
    parse_foreign_dcp,
    quarantined_dirname,
    seal_filename,
)
from supervisor.format.manifest import ManifestError, ProgressFn, hash_files, list_files
from supervisor.format.seal import Seal, SealedFile, parse_seal
from supervisor.store.checkpoints import CheckpointRef, Verdict, root_lock
from supervisor.store.ioerrors import Evidence, describe, evidence_of
from supervisor.store.retention import STALE_TMP_AFTER_S


class ForeignKind(str, Enum):
    DCP = "dcp"  # torchtitan's step-N/ folder
    LIGHTNING = "lightning"  # a .ckpt file


FOREIGN_LABEL = {ForeignKind.DCP: "DCP folder (torchtitan)", ForeignKind.LIGHTNING: "Lightning .ckpt"}
UNVERIFIED = "unverified: no checksums (`ckpt seal` records them)"


@dataclass(frozen=True)
class ForeignRef(CheckpointRef):
    """Another trainer's checkpoint: a folder or a file, and the step it holds (-1: unknown)."""

    kind: ForeignKind = ForeignKind.DCP


@dataclass(frozen=True)
class Size:
    """What a checkpoint holds on disk (none of it from a manifest: there is none)."""

    files: int = 0
    bytes: int = 0
    wall_time: float = 0.0


@dataclass(frozen=True)
class ForeignVerdict:
    """``verdict`` as the store's (OK, CORRUPT with the reason, UNKNOWN), and what was checked:
    ``mark`` says whether its bytes are proven (sealed) or only its structure."""

    verdict: Verdict
    mark: str
    sealed: bool  # a seal speaks for it (deep: its checksums matched)
    size: Size = field(default_factory=Size)

    @property
    def ref(self) -> ForeignRef:
        assert isinstance(self.verdict.ref, ForeignRef)
        return self.verdict.ref


# ---------------------------------------------------------------- discovery


def list_foreign(root: str | Path) -> list[ForeignRef]:
    """Other trainers' checkpoints directly under ``root``, newest step first (an unknown step
    last). A Lightning file without a step in its name (``last.ckpt``) has it read from its
    pickle. A root that cannot be listed raises its OSError."""
    root = Path(root)
    refs = []
    for name in os.listdir(root):
        path = root / name
        step = parse_foreign_dcp(name)
        if step is not None and path.is_dir():
            refs.append(ForeignRef(step, path, ForeignKind.DCP))
        elif is_lightning_ckpt(name) and path.is_file():
            found = lightning_step(name)
            refs.append(
                ForeignRef(found if found is not None else _pickled_step(path), path, ForeignKind.LIGHTNING)
            )
    return sorted(refs, key=lambda r: (r.step, r.name), reverse=True)


def newest_foreign_step(root: str | Path) -> int | None:
    """The newest step among the checkpoints that pass the quick structural check (the
    watchdog's progress: a partial folder is no progress); None when there is none."""
    for ref in list_foreign(root):
        if ref.step >= 0 and validate_foreign(ref).verdict.ok:
            return ref.step
    return None


# ---------------------------------------------------------------- validation


def validate_foreign(
    ref: ForeignRef, deep: bool = False, progress: ProgressFn | None = None
) -> ForeignVerdict:
    """The structural check (deep: a Lightning file's CRC32s too), then the seal's, if any (quick:
    sizes and mtimes; deep: checksums). Never raises OSError: what cannot be read is UNKNOWN."""
    try:
        files = _files(ref)
        sizes = {n: os.stat(_path(ref, n)).st_size for n in files}
        wall = os.stat(ref.path).st_mtime
        problem = _dcp_problem(ref, sizes) if ref.kind is ForeignKind.DCP else _lightning_problem(ref, deep)
    except OSError as e:
        return ForeignVerdict(_unknown(ref, e), UNVERIFIED, sealed=False)
    size = Size(len(files), sum(sizes.values()), wall)
    if problem:
        return ForeignVerdict(_corrupt(ref, problem), UNVERIFIED, sealed=False, size=size)
    if ref.step < 0:
        why = "no step in its name or its pickle"
        return ForeignVerdict(_corrupt(ref, why), UNVERIFIED, sealed=False, size=size)
    return _against_seal(ref, files, deep, progress, size)


def _files(ref: ForeignRef) -> list[str]:
    return list_files(ref.path) if ref.kind is ForeignKind.DCP else [ref.name]


def _path(ref: ForeignRef, name: str) -> str:
    return os.path.join(ref.path, name) if ref.kind is ForeignKind.DCP else str(ref.path)


def _against_seal(
    ref: ForeignRef, files: list[str], deep: bool, progress: ProgressFn | None, size: Size
) -> ForeignVerdict:
    seal_path = ref.path.parent / seal_filename(ref.name)
    try:
        seal = parse_seal(seal_path.read_bytes(), str(seal_path))
    except FileNotFoundError:
        return ForeignVerdict(_ok(ref), UNVERIFIED, sealed=False, size=size)
    except ManifestError as e:
        return ForeignVerdict(_ok(ref), f"unverified: {e}", sealed=False, size=size)
    except OSError as e:
        return ForeignVerdict(_unknown(ref, e), UNVERIFIED, sealed=False, size=size)
    try:
        changed = _rewritten(ref, files, seal)
        if changed:
            mark = f"unverified: {changed} changed after `ckpt seal` (rewritten?); seal it again"
            return ForeignVerdict(_ok(ref), mark, sealed=False, size=size)
        if not deep:
            mark = "sealed: sizes and mtimes match (--deep checks the checksums)"
            return ForeignVerdict(_ok(ref), mark, sealed=True, size=size)
        sums = hash_files([_path(ref, n) for n in files], progress=progress)
    except OSError as e:
        return ForeignVerdict(_unknown(ref, e), UNVERIFIED, sealed=False, size=size)
    for name, (actual,) in zip(files, sums, strict=True):
        if actual != seal.files[name].checksum:
            why = f"{name} checksum {actual[:12]}.. differs from its seal {seal.files[name].checksum[:12]}.."
            return ForeignVerdict(_corrupt(ref, why), "sealed: checksum differs", sealed=True, size=size)
    return ForeignVerdict(_ok(ref), "sealed: every checksum verified", sealed=True, size=size)


def _rewritten(ref: ForeignRef, files: list[str], seal: Seal) -> str:
    """The first file whose size or mtime is not the sealed one, or that the seal does not list
    (or that it lists and is gone): '' when the seal still speaks for every file."""
    if set(files) != set(seal.files):
        return sorted(set(files) ^ set(seal.files))[0]
    for name in files:
        st = os.stat(_path(ref, name))
        if (st.st_size, st.st_mtime_ns) != (seal.files[name].size, seal.files[name].mtime_ns):
            return name
    return ""


def _dcp_problem(ref: ForeignRef, sizes: dict[str, int]) -> str:
    """Why a DCP folder is not a complete checkpoint ('' when it is): its index is there, parses
    torch-free, and every byte it points at is on disk."""
    if DCP_METADATA not in sizes:
        return f"no {DCP_METADATA}: the save did not finish (DCP writes it last)"
    data = (ref.path / DCP_METADATA).read_bytes()
    try:
        index = safepickle.read_inert(data, f"{ref.name}/{DCP_METADATA}")
    except safepickle.UnsafePickle as e:
        return str(e).removeprefix(f"{ref.name}/")
    except Exception as e:  # a broken pickle raises anything
        return f"{DCP_METADATA} is not a DCP index ({e.__class__.__name__}: {e})"
    needed = _index_ends(index)
    if needed is None:
        return f"{DCP_METADATA} is not a DCP index (no storage_data)"
    for name, end in sorted(needed.items()):
        if name not in sizes:
            return f"{name} is missing ({DCP_METADATA} names it)"
        if sizes[name] < end:
            return f"{name} is {sizes[name]} bytes, {DCP_METADATA} needs {end}"
    return ""


def _index_ends(index: Any) -> dict[str, int] | None:
    """File -> the end of its last byte the index points at; None when it is not DCP's Metadata."""
    state = getattr(index, "state", None)
    storage = state.get("storage_data") if isinstance(state, dict) else None
    if not isinstance(storage, dict):
        return None
    ends: dict[str, int] = {}
    for info in storage.values():
        s = getattr(info, "state", None)
        if not isinstance(s, dict) or not isinstance(s.get("relative_path"), str):
            return None
        name, end = s["relative_path"], int(s.get("offset", 0)) + int(s.get("length", 0))
        ends[name] = max(ends.get(name, 0), end)
    return ends


# ---------------------------------------------------------------- Lightning's zip

# Bytes per element of the storage classes torch.save names (``torch.FloatStorage``...).
_STORAGE_BYTES = {
    "DoubleStorage": 8, "FloatStorage": 4, "HalfStorage": 2, "BFloat16Storage": 2, "LongStorage": 8,
    "IntStorage": 4, "ShortStorage": 2, "CharStorage": 1, "ByteStorage": 1, "BoolStorage": 1,
    "ComplexDoubleStorage": 16, "ComplexFloatStorage": 8, "UntypedStorage": 1,
}  # fmt: skip
_MEMO_PUT = frozenset({"MEMOIZE", "PUT", "BINPUT", "LONG_BINPUT"})
_MEMO_GET = frozenset({"GET", "BINGET", "LONG_BINGET"})


@dataclass(frozen=True)
class _Pickled:
    """What the checkpoint's pickle says without running it: each storage (key, class, count)
    and the first ``global_step`` value."""

    storages: tuple[tuple[str, str, int], ...]
    global_step: int | None


def _scan(data: bytes) -> _Pickled:
    """Walk the pickle's opcodes (pickletools: nothing is built or called), following its memo
    for the scalars: a storage's persistent id is MARK, 'storage', <module>, <class>, key,
    location, count, TUPLE, BINPERSID; the step is the int right after the first 'global_step'."""
    memo: dict[int, Any] = {}
    last: Any = None
    prev = ""
    pid: list[Any] | None = None  # the scalars of the persistent id being built
    storages: list[tuple[str, str, int]] = []
    step: int | None = None
    after_key = False
    for op, arg, _pos in pickletools.genops(data):
        name = op.name
        if name in _MEMO_PUT:
            memo[len(memo) if arg is None else int(arg)] = last
            continue
        value = memo.get(int(arg)) if name in _MEMO_GET and arg is not None else arg
        scalar = isinstance(value, str | int) and not isinstance(value, bool)
        if after_key:
            step = value if isinstance(value, int) and scalar else None
            after_key = False
        elif step is None and value == "global_step":
            after_key = True
        if value == "storage" and prev == "MARK":
            pid = []
        elif pid is not None and scalar:
            pid.append(value)
        if name == "BINPERSID" and pid is not None and len(pid) >= 4:
            storages.append((str(pid[-3]), str(pid[-4]).replace(" ", ".").rsplit(".", 1)[-1], int(pid[-1])))
        if name == "BINPERSID":
            pid = None
        last, prev = value, name
    return _Pickled(tuple(storages), step)


def _pickle_member(z: zipfile.ZipFile) -> str | None:
    return next((n for n in z.namelist() if n.endswith("/data.pkl") or n == "data.pkl"), None)


def _pickled_step(path: Path) -> int:
    """The ``global_step`` a Lightning checkpoint's pickle records, or -1 when it cannot be read
    (validation then says why)."""
    try:
        with zipfile.ZipFile(path) as z:
            member = _pickle_member(z)
            step = _scan(z.read(member)).global_step if member else None
    except (OSError, zipfile.BadZipFile, ValueError, EOFError):
        return -1
    return step if step is not None else -1


def _lightning_problem(ref: ForeignRef, deep: bool) -> str:
    """Why a ``.ckpt`` is not a complete torch.save file ('' when it is); OSError propagates."""
    try:
        with zipfile.ZipFile(ref.path) as z:
            member = _pickle_member(z)
            if member is None:
                return "no data.pkl in it: not a torch.save checkpoint"
            try:
                pickled = _scan(z.read(member))
            except (ValueError, EOFError) as e:
                return f"{member} is not a complete pickle ({e})"
            sizes = {i.filename: i.file_size for i in z.infolist()}
            prefix = member.removesuffix("data.pkl")
            for key, cls, count in pickled.storages:
                rec = f"{prefix}data/{key}"
                if rec not in sizes:
                    return f"{rec} is missing (the pickle names storage {key})"
                want = count * _STORAGE_BYTES.get(cls, 0)
                if want and sizes[rec] != want:
                    return f"{rec} is {sizes[rec]} bytes, its {cls} of {count} needs {want}"
            if deep:
                bad = z.testzip()  # reads every record, checking its CRC32
                if bad is not None:
                    return f"{bad}: CRC32 differs"
    except zipfile.BadZipFile as e:
        return f"not a complete zip ({e}): truncated?"
    return ""


# ---------------------------------------------------------------- verdicts


def _ok(ref: ForeignRef) -> Verdict:
    return Verdict(ref, Evidence.OK)


def _corrupt(ref: ForeignRef, why: str) -> Verdict:
    return Verdict(ref, Evidence.CORRUPT, f"{ref.name}: {why}")


def _unknown(ref: ForeignRef, e: OSError) -> Verdict:
    if e.errno == errno.ENOENT and not os.path.lexists(ref.path):
        return Verdict(ref, Evidence.UNKNOWN, f"{ref.name}: vanished while it was read", gone=True)
    if e.errno == errno.ENOENT:
        return _corrupt(ref, f"{os.path.basename(e.filename or '') or 'a file'} is missing")
    return Verdict(ref, evidence_of(e), f"{ref.name}: unreadable ({describe(e)})", error=e)


# ---------------------------------------------------------------- seal and pick


def seal_foreign(
    root: str | Path,
    refs: list[ForeignRef],
    progress: ProgressFn | None = None,
    now: Callable[[], float] = time.time,
) -> Iterator[tuple[ForeignRef, str]]:
    """Record the checksums of each checkpoint of ``refs`` that passes its structural check and
    has no seal that still speaks for it; yields (ref, what was done) for each. A broken one is
    not sealed (its seal would vouch for a broken file)."""
    for ref in refs:
        v = validate_foreign(ref, deep=True)  # a Lightning file's CRC32s too: never seal a broken one
        if not v.verdict.ok:
            yield ref, f"not sealed: {v.verdict.reason.removeprefix(ref.name + ': ')}"
            continue
        if v.sealed:
            yield ref, "already sealed"
            continue
        files = _files(ref)
        stats = [os.stat(_path(ref, n)) for n in files]
        sums = hash_files([_path(ref, n) for n in files], progress=progress)
        record = Seal(
            kind=ref.kind.value,
            step=ref.step,
            sealed_at=now(),
            files={
                n: SealedFile(st.st_size, st.st_mtime_ns, s[0])
                for n, st, s in zip(files, stats, sums, strict=True)
            },
        )
        if _rewritten(ref, files, record):  # written to while it was hashed: the checksums may be torn
            yield ref, "not sealed: it changed while it was read; run `ckpt seal` again"
            continue
        atomic_write_text(Path(root) / seal_filename(ref.name), record.to_json() + "\n")
        yield ref, f"sealed {len(files)} file{'s' if len(files) != 1 else ''}"


def foreign_may_be_writing(ref: ForeignRef, now: float) -> bool:
    """A broken folder or file changed within the hour: a save in flight, left alone."""
    try:
        return now - os.stat(ref.path).st_mtime < STALE_TMP_AFTER_S
    except OSError:
        return True


def quarantine_foreign(root: str | Path, ref: ForeignRef, reason: str) -> Path:
    """Move a broken checkpoint (and its seal) to ``quarantine/<name>-<utc>/`` with ``reason.txt``;
    a folder is moved as the entry itself, a file into an entry of its own. Never deletes."""
    root = Path(root)
    with root_lock(root):
        qdir = RunDir.of(root).quarantine
        qdir.mkdir(exist_ok=True)
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        n = 1
        while (dest := qdir / quarantined_dirname(ref.name, stamp, n)).exists():
            n += 1
        if ref.kind is ForeignKind.DCP:
            os.rename(ref.path, dest)
        else:
            dest.mkdir()
            os.rename(ref.path, dest / ref.name)
        sealed = root / seal_filename(ref.name)
        if sealed.exists():
            os.rename(sealed, dest / sealed.name)
        fsync_dir(root)
        atomic_write_text(dest / REASON, reason.rstrip("\n") + "\n")
        fsync_dir(qdir)
    return dest
