"""`status`'s quick checks of committed checkpoints, remembered between runs of `status`.

A committed checkpoint does not change, yet `status` quick-checked every one on every call (500
checkpoints: 500 manifests read and parsed, 500 directories walked, every file stat'ed: half of its
time). This module keeps, per checkpoint that passed, a key over everything the quick check reads:
every file's relative path, device, inode, size, mtime and ctime, the manifest's included. ctime
cannot be set by a process: a write, truncate, rename, chmod or replace of any file, or a file
added or removed, gives another key. A checkpoint whose key matches the one remembered is listed
as it was checked; any other is checked again in full (``store.validate``). Only verdicts that
passed are remembered: a corrupt or unreadable checkpoint is checked on every call. A checkpoint
holding a symlink or anything but files and folders is never cached (a symlink's own stat does not
change with its target). `ckpt verify` and the resume path never use this cache.

The cache is one JSON file (layout.STATUS_CACHE under supervisor/), written atomically, only when
it changes; a file that cannot be read or parsed is an empty cache, one that cannot be written
(read-only run directory) is not written: `status` is then as slow as without it, never wrong.
"""

from __future__ import annotations

import json
import marshal
import os
import stat
from _blake2 import blake2b  # hashlib's, without importing hashlib: OpenSSL's load, 2.5 ms a `status`
from contextlib import suppress
from dataclasses import dataclass
from pathlib import Path

from supervisor import store
from supervisor.format.atomic import atomic_write_bytes
from supervisor.format.capped import CACHE_MAX, read_capped
from supervisor.format.layout import RunDir
from supervisor.store.ioerrors import Evidence

# 2: the key hashes the entries' marshal bytes (their repr in 1: 5x slower, 5 ms of 500 checkpoints)
CACHE_VERSION = 2


@dataclass(frozen=True)
class Fingerprint:
    """What a checkpoint's files are now, in one key, and the bytes they take."""

    key: str
    disk_bytes: int


def fingerprint(path: str) -> Fingerprint | None:
    """The key of the checkpoint directory ``path``; None when any part of it cannot be read or
    holds something other than files and folders (then it is not cached)."""
    entries: list[tuple[str, int, int, int, int, int]] = []
    todo = [(path, "")]
    total = 0
    try:
        while todo:
            folder, prefix = todo.pop()
            with os.scandir(folder) as it:
                for e in it:
                    st = e.stat(follow_symlinks=False)
                    if stat.S_ISDIR(st.st_mode):
                        todo.append((e.path, prefix + e.name + "/"))
                    elif not stat.S_ISREG(st.st_mode):
                        return None
                    total += st.st_size
                    entries.append(
                        (prefix + e.name, st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns)
                    )
    except OSError:
        return None
    entries.sort()
    # marshal: bytes that stand for the entries, 6x faster than their repr. They may differ
    # between Python versions: a new Python checks every checkpoint once, as a cold cache does.
    return Fingerprint(blake2b(marshal.dumps(entries), digest_size=16).hexdigest(), total)


@dataclass(frozen=True)
class Checked:
    """A checkpoint's quick check, fresh or remembered: what `status` lists of it."""

    evidence: Evidence
    reason: str
    wall_time: float | None  # the manifest's, when it could be parsed
    total_bytes: int | None
    gone: bool = False  # vanished while it was checked
    disk_bytes: int | None = None  # bytes under it as stat'ed; None when it could not be walked whole


@dataclass(frozen=True)
class _Passed:
    """A remembered quick check that passed: its files' key and what the listing shows."""

    key: str
    wall_time: float
    total_bytes: int


class QuickChecks:
    """The cache of one run directory: ``check`` each checkpoint, then ``save``."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.path = RunDir.of(root).status_cache
        self.known = _load(self.path)
        self.passed: dict[str, _Passed] = {}

    def check(self, ref: store.CheckpointRef) -> Checked:
        """The quick check of ``ref``: remembered when its files are those that passed it."""
        # Keyed before it is checked: a file changed in between gives the next call another key.
        fp = fingerprint(os.fspath(ref.path))
        disk = fp.disk_bytes if fp else None
        hit = self.known.get(ref.name)
        if fp is not None and hit is not None and hit.key == fp.key:
            self.passed[ref.name] = hit
            return Checked(Evidence.OK, "", hit.wall_time, hit.total_bytes, disk_bytes=disk)
        v = store.validate(ref)
        m = v.manifest
        if v.ok and fp is not None and m is not None:
            self.passed[ref.name] = _Passed(fp.key, m.wall_time, m.total_bytes)
        wall, size = (m.wall_time, m.total_bytes) if m is not None else (None, None)
        return Checked(v.evidence, v.reason, wall, size, v.gone, disk)

    def save(self) -> None:
        """Remember the checkpoints that passed (those gone are forgotten), when that changed."""
        if self.passed == self.known:
            return
        body = {
            "version": CACHE_VERSION,
            "passed": {n: [p.key, p.wall_time, p.total_bytes] for n, p in sorted(self.passed.items())},
        }
        # A read-only run directory or a full disk: the next call checks again, as without cache.
        with suppress(OSError):
            atomic_write_bytes(
                self.path, json.dumps(body, separators=(",", ":")).encode(), self.root, make_dirs=False
            )


def _load(path: Path) -> dict[str, _Passed]:
    """The remembered checkpoints; a cache that cannot be read or is not one is empty."""
    try:
        d = json.loads(read_capped(path, CACHE_MAX))
        if d.get("version") != CACHE_VERSION:
            return {}
        return {
            n: _Passed(key, float(wall), size)
            for n, (key, wall, size) in d["passed"].items()
            if isinstance(key, str) and isinstance(size, int)
        }
    except (OSError, ValueError, TypeError, AttributeError, KeyError, RecursionError, OverflowError):
        return {}
