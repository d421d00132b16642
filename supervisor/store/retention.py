"""Retention: which checkpoints, leftovers and quarantined checkpoints may go, and ``prune``, which
removes them. Re-exported by supervisor/store/ (callers use ``store.prune``).

Space comes back from what nobody can use first: tmp dirs of dead writers (on this host a dead pid
is proof at once; on another host only an hour of silence is), then the oldest quarantined
checkpoints beyond the quarantine's own retention, then valid checkpoints the ``RetentionPolicy``
does not keep (supervisor/store/retention_policy.py, re-exported here). Nothing that could not be read is
ever deleted or quarantined; nothing is hashed under the lock.
"""

from __future__ import annotations

import json
import os
import time
from collections.abc import Callable, Mapping, Sequence
from contextlib import suppress
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.format import confined
from supervisor.format.atomic import atomic_write_json, fsync_dir, hostname, pid_alive
from supervisor.format.capped import RECORD_MAX, TooLarge, read_capped
from supervisor.format.heartbeat import Tracker
from supervisor.format.layout import (
    QUARANTINE_DELETING_PREFIX,
    RunDir,
    TmpName,
    deleting_dirname,
    parse_deleting,
    parse_quarantined,
    parse_tmp,
    safe_host,
)
from supervisor.store.checkpoints import (
    StoreError,
    list_checkpoints,
    quarantine_locked,
    require_root,
    root_lock,
    validate,
)
from supervisor.store.ioerrors import Evidence
from supervisor.store.retention_policy import (
    DEFAULT_KEEP,
    MIN_KEEP,
    Candidate,
    KeepReason,
    KeptSteps,
    RetentionPolicy,
    plan_retention,
)

__all__ = [  # the policy's names are re-exported: callers use store.<name> or retention.<name>
    "DEFAULT_KEEP",
    "MIN_KEEP",
    "QUARANTINE_KEEP",
    "STALE_TMP_AFTER_S",
    "Candidate",
    "KeepReason",
    "KeptSteps",
    "PruneResult",
    "QuarantineEntry",
    "RetentionPolicy",
    "TmpRef",
    "disk_usage",
    "list_deleting",
    "list_tmp",
    "plan_quarantine",
    "plan_retention",
    "prune",
    "read_policy",
    "record_policy",
    "tmp_is_stale",
]

STALE_TMP_AFTER_S = 3600.0
# Quarantined checkpoints kept by default (newest first); the newest copy of a step newer than
# every valid checkpoint is kept whatever the limits (it may be the run's only trace of it).
QUARANTINE_KEEP = 5


@dataclass(frozen=True)
class PruneResult:
    """What a prune deleted, kept and moved aside, or would with ``dry_run``."""

    deleted: tuple[str, ...] = ()
    kept: tuple[str, ...] = ()
    stale_tmp_removed: tuple[str, ...] = ()
    dry_run: bool = False
    # Invalid checkpoints older than the newest valid one: moved to quarantine, never deleted.
    quarantined: tuple[tuple[str, str], ...] = ()
    # Quarantined checkpoints removed by the quarantine's retention, oldest first.
    quarantine_removed: tuple[str, ...] = ()
    # Checkpoints that could not be read (name, reason): kept, neither counted as valid nor moved.
    unknown: tuple[tuple[str, str], ...] = ()
    # The policy applied, and why it keeps each valid checkpoint it keeps (name -> reasons).
    policy: RetentionPolicy = field(default_factory=RetentionPolicy)
    why_kept: Mapping[str, tuple[KeepReason, ...]] = field(default_factory=dict)


# ---------------------------------------------------------------- tmp and deleting dirs


@dataclass(frozen=True)
class TmpRef:
    """A checkpoint being written (or abandoned): its writer and how long since anything in it changed."""

    path: Path
    step: int
    pid: int
    host: str
    age_s: float


def list_tmp(root: str | Path, now: float | None = None) -> list[TmpRef]:
    """Checkpoints being written; ``age_s`` counts from the newest change anywhere inside."""
    return _list_marked(root, parse_tmp, now)


def list_deleting(root: str | Path, now: float | None = None) -> list[TmpRef]:
    """Checkpoints a prune renamed for removal and has not finished removing."""
    return _list_marked(root, parse_deleting, now)


def _list_marked(root: str | Path, parse: Callable[[str], TmpName | None], now: float | None) -> list[TmpRef]:
    """Unreadable entries are left out: a leftover that is not listed is only not removed yet."""
    root = Path(root)
    now = time.time() if now is None else now
    try:
        names = os.listdir(root)
    except OSError:
        return []
    out = []
    for name in sorted(names):
        t = parse(name)
        mtime = _newest_mtime(root / name) if t is not None else None
        if t is not None and mtime is not None:
            out.append(TmpRef(root / name, t.step, t.pid, t.host, now - mtime))
    return out


def _newest_mtime(path: Path) -> float | None:
    """Newest mtime of a directory and everything in it: a writer appending to one big shard does
    not touch the directory's own mtime."""
    try:
        newest = path.stat().st_mtime
    except OSError:
        return None
    for dirpath, dirs, names in confined.walk(path, onerror=lambda _e: None):  # no deeper than a layout's
        for n in dirs + names:
            with suppress(OSError):
                newest = max(newest, os.lstat(os.path.join(dirpath, n)).st_mtime)
    return newest


def tmp_is_stale(t: TmpRef, this_host: str, alive: Callable[[int], bool], stale_after_s: float) -> bool:
    """Nobody writes it any more. On this host the pid says so at once (a dead writer never comes
    back; a live one is never stale, however quiet). On another host only silence can be seen:
    nothing inside changed for ``stale_after_s``."""
    if t.host == safe_host(this_host):
        return not alive(t.pid)
    return t.age_s > stale_after_s


# ---------------------------------------------------------------- pure plans


@dataclass(frozen=True)
class QuarantineEntry:
    """A quarantined checkpoint as the quarantine's retention weighs it."""

    name: str
    step: int
    order: tuple[str, int]  # when it was quarantined (layout.QuarantinedName.order)
    bytes: int


def plan_quarantine(
    entries: Sequence[QuarantineEntry], keep: int | None, max_bytes: int | None, newest_valid: int | None
) -> set[str]:
    """Quarantined checkpoints to delete, oldest first, until at most ``keep`` entries and
    ``max_bytes`` bytes remain (None: no limit). Never the newest copy of a step newer than every
    valid checkpoint (every step when none is valid): it may be the only copy of the run's
    progress, which a person can still rescue by hand."""
    protected: dict[int, QuarantineEntry] = {}
    for e in entries:
        if newest_valid is None or e.step > newest_valid:
            cur = protected.get(e.step)
            if cur is None or e.order > cur.order:
                protected[e.step] = e
    spared = {e.name for e in protected.values()}
    count, total = len(entries), sum(e.bytes for e in entries)
    doomed: set[str] = set()
    for e in sorted(entries, key=lambda e: (e.order, e.name)):
        over = (keep is not None and count > keep) or (max_bytes is not None and total > max_bytes)
        if not over:
            break
        if e.name not in spared:
            doomed.add(e.name)
            count, total = count - 1, total - e.bytes
    return doomed


# ---------------------------------------------------------------- prune


def prune(
    root: str | Path,
    *,
    policy: RetentionPolicy | None = None,
    keep: int | None = None,
    dry_run: bool = False,
    stale_tmp_after_s: float = STALE_TMP_AFTER_S,
    quarantine_keep: int | None = QUARANTINE_KEEP,
    quarantine_max_bytes: int | None = None,
    progress: Tracker | None = None,
) -> PruneResult:
    """Delete valid committed checkpoints ``policy`` does not keep, stale tmp dirs and the oldest
    quarantined checkpoints beyond the quarantine's retention. ``keep`` alone (the older form)
    means ``RetentionPolicy(keep=...)``. ``progress`` hears of each checkpoint judged and each
    file removed, one unit each, and of the directory being removed: on a slow file system a
    prune is long work, whoever waits for it can beat as it moves, and a stuck one is named.

    Retention counts valid (quick check) checkpoints only, so K fallbacks really exist. Invalid
    ones older than the newest valid are quarantined with their reason, never deleted; invalid
    ones newer than it are left for ``pick``; unreadable ones are left alone. Under the lock a
    doomed directory is only renamed (``step_N.deleting.*``, ``quarantine/.deleting.*``: no reader
    sees it half deleted); its files go after the lock is released, dead writers' tmp dirs first.
    A crash mid-removal leaves a renamed dir that a later prune finishes.
    """
    policy = _policy(policy, keep)
    root = require_root(root)
    for flag, value in (
        ("--quarantine-keep", quarantine_keep),
        ("--quarantine-max-bytes", quarantine_max_bytes),
    ):
        if value is not None and value < 0:
            raise StoreError(f"{flag} {value} refused: give a number >= 0, or leave it out for no limit")
    me = hostname()
    qdir = RunDir.of(root).quarantine
    # Sizes walk every file of every quarantined checkpoint: before the lock, not under it.
    sizes = _quarantine_sizes(root) if quarantine_max_bytes is not None else {}
    tick = progress or confined.Unheard()
    with root_lock(root):
        verdicts = []
        for ref in list_checkpoints(root):
            verdicts.append(validate(ref))
            tick(1)
        valid = [v.ref.step for v in verdicts if v.ok]
        newest_valid = valid[0] if valid else None
        kept = plan_retention([Candidate.of(v.manifest) for v in verdicts if v.ok and v.manifest], policy)
        doomed = [v.ref for v in verdicts if v.ok and v.ref.step not in kept]
        bad_old = [
            v
            for v in verdicts
            if v.evidence is Evidence.CORRUPT and newest_valid is not None and v.ref.step < newest_valid
        ]
        stale = [
            t
            for t in list_tmp(root) + list_deleting(root)
            if tmp_is_stale(t, me, pid_alive, stale_tmp_after_s)
        ]
        q_doomed = sorted(
            plan_quarantine(
                _quarantine_entries(root, sizes, quarantine_max_bytes is not None),
                quarantine_keep,
                quarantine_max_bytes,
                newest_valid,
            )
        )
        trash = [t.path for t in stale]
        if not dry_run:
            for v in bad_old:
                quarantine_locked(root, v.ref, v.reason)
            for name in q_doomed:  # renames through no link: never out of the run directory
                dest = qdir / f"{QUARANTINE_DELETING_PREFIX}{name}.{os.urandom(4).hex()}"
                confined.rename(root, qdir / name, dest)
                trash.append(dest)
            if q_doomed:
                fsync_dir(qdir)
            for r in doomed:
                dest = root / deleting_dirname(r.step, os.getpid(), me)
                confined.rename(root, r.path, dest)
                trash.append(dest)
            if doomed:
                fsync_dir(root)
    if not dry_run:
        trash += [p for p in _quarantine_leftovers(root) if p not in trash]  # a crashed prune's
        _remove(root, trash, tick)
    gone = {r.step for r in doomed} | {v.ref.step for v in bad_old}
    return PruneResult(
        deleted=tuple(r.name for r in doomed),
        kept=tuple(v.ref.name for v in verdicts if v.ref.step not in gone and not v.gone),
        stale_tmp_removed=tuple(t.path.name for t in stale),
        dry_run=dry_run,
        quarantined=tuple((v.ref.name, v.reason) for v in bad_old),
        quarantine_removed=tuple(q_doomed),
        unknown=tuple((v.ref.name, v.reason) for v in verdicts if v.unknown),
        policy=policy,
        why_kept={v.ref.name: kept[v.ref.step] for v in verdicts if v.ref.step in kept},
    )


def _remove(root: Path, trash: list[Path], progress: confined.Tick) -> None:
    """The doomed directories, renamed under the lock, removed after it (through no link)."""
    for path in trash:
        confined.remove_tree(root, path, progress)
    if trash:
        fsync_dir(root)


def _policy(policy: RetentionPolicy | None, keep: int | None) -> RetentionPolicy:
    if policy is None:
        return RetentionPolicy(keep=DEFAULT_KEEP if keep is None else keep)
    if keep is not None:
        raise TypeError("prune: pass policy= or keep=, not both")
    return policy


# ---------------------------------------------------------------- the policy in force


def record_policy(root: str | Path, policy: RetentionPolicy) -> None:
    """Write ``supervisor/retention.json``, the policy a trainer prunes this run with: `status`
    shows it, and `ckpt list` / `ckpt prune` without policy flags follow it. Written only when it
    changed, so a trainer can call this at every start."""
    path = RunDir.of(root).retention
    doc = {"schema": 1, "policy": policy.to_dict()}
    with suppress(OSError, ValueError, RecursionError):  # garbage ("[[[..."): written anew
        if json.loads(read_capped(path, RECORD_MAX)) == doc:
            return
    atomic_write_json(path, doc, root)


def read_policy(root: str | Path) -> RetentionPolicy | None:
    """The recorded policy, or None when none was recorded. A record that cannot be used raises
    StoreError naming the file (an unreadable one its OSError)."""
    path = RunDir.of(root).retention
    try:
        text = read_capped(path, RECORD_MAX)
    except FileNotFoundError:
        return None
    except TooLarge as e:
        raise StoreError(f"{path}: {e}; remove it (the trainer writes it again at its next start)") from None
    try:
        doc = json.loads(text)
        if not isinstance(doc, dict) or not isinstance(doc.get("policy"), dict):
            raise ValueError("not a retention record")
        return RetentionPolicy.from_dict(doc["policy"])
    except RecursionError:
        raise StoreError(f"{path}: nested too deep to be a retention record; remove it") from None
    except (ValueError, TypeError, StoreError) as e:
        raise StoreError(f"{path}: {e}; remove it (the trainer writes it again at its next start)") from None


def _quarantine_sizes(root: Path) -> dict[str, int]:
    qdir = RunDir.of(root).quarantine
    try:
        names = confined.listdir(root, qdir)
    except FileNotFoundError:
        return {}
    return {n: disk_usage(qdir / n) for n in names if parse_quarantined(n) is not None}


def _quarantine_entries(root: Path, sizes: dict[str, int], need_sizes: bool) -> list[QuarantineEntry]:
    """Entries this layout named (a directory someone put there by hand is never touched)."""
    qdir = RunDir.of(root).quarantine
    try:
        names = confined.listdir(root, qdir)
    except FileNotFoundError:
        return []
    out = []
    for n in names:
        q = parse_quarantined(n)
        if q is not None:
            size = sizes[n] if n in sizes else (disk_usage(qdir / n) if need_sizes else 0)
            out.append(QuarantineEntry(n, q.step, q.order, size))
    return out


def _quarantine_leftovers(root: Path) -> list[Path]:
    qdir = RunDir.of(root).quarantine
    try:
        return [qdir / n for n in confined.listdir(root, qdir) if n.startswith(QUARANTINE_DELETING_PREFIX)]
    except OSError:
        return []


def disk_usage(path: str | Path, known: Mapping[str, int] | None = None) -> int:
    """Bytes of every file under ``path`` (links not followed, at most confined.MAX_DEPTH folders
    down: a deeper nest is not ours, and on a mount without an entry cache, FUSE, each level of it
    looks up every level above it again: the drill's 1,200-level plant made `status` take
    minutes) that can be read: best effort, for a report or a retention limit. scandir: `status`
    walks 10^4 files. ``known``: bytes under some folders (by their path as found under
    ``path``) already counted, not walked again."""
    total, todo, known = 0, [(os.fspath(path), 0)], known or {}
    while todo:
        folder, depth = todo.pop()
        with suppress(OSError), os.scandir(folder) as entries:
            for e in entries:  # reading the directory can fail here too, not only in scandir()
                with suppress(OSError):
                    if e.path in known:
                        total += known[e.path]
                    elif e.is_dir(follow_symlinks=False):
                        if depth < confined.MAX_DEPTH:
                            todo.append((e.path, depth + 1))
                    else:
                        total += e.stat(follow_symlinks=False).st_size
    return total
