"""Durable file primitives: every write another process may read goes through here.

A write is atomic and durable when it is written to a temporary name in the same directory,
fsynced, renamed over the target with ``os.replace``, and the directory is fsynced so the rename
itself survives a power loss. Given the run directory's ``root``, the write cannot leave it: its
directories are reached from the root without following a link (supervisor/format/confined.py).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from supervisor.format import confined


def fsync_dir(path: str | os.PathLike[str]) -> None:
    """Persist a directory entry (a create, rename or unlink inside ``path``)."""
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: str | os.PathLike[str]) -> None:
    """Persist one file's data and size."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(path: str | os.PathLike[str], *, files: bool = True) -> None:
    """Persist every file under ``path`` and every directory entry, deepest first; ``files=False``:
    the directory entries only (each file's writer persisted it)."""
    folders = list(confined.walk(path, onerror=_raise))
    for dirpath, _dirnames, filenames in reversed(folders):
        for name in filenames if files else ():
            fsync_file(os.path.join(dirpath, name))
        fsync_dir(dirpath)


def _raise(e: OSError) -> None:
    raise e


def atomic_write_bytes(
    path: str | os.PathLike[str],
    data: bytes,
    root: str | os.PathLike[str] | None = None,
    make_dirs: bool = True,
) -> None:
    """Write ``data`` to ``path`` so a reader sees the old content or the new, never a mix. With
    ``root`` (the run directory ``path`` is in), through no link below it (``confined.Escape``),
    its directories made when missing (unless not ``make_dirs``); without, in ``path``'s
    directory as it is."""
    confined.write_atomic(Path(path).parent if root is None else root, path, data, make_dirs)


def atomic_write_text(
    path: str | os.PathLike[str], text: str, root: str | os.PathLike[str] | None = None
) -> None:
    atomic_write_bytes(path, text.encode(), root)


def atomic_write_json(
    path: str | os.PathLike[str], obj: Any, root: str | os.PathLike[str] | None = None
) -> None:
    atomic_write_bytes(path, (json.dumps(obj, indent=1, sort_keys=True) + "\n").encode(), root)


PID_MAX = 1 << 22  # Linux's largest pid (/proc/sys/kernel/pid_max can be at most this)


def restrict_umask() -> int:
    """Add "others may not write" to this process's umask (its children inherit it) and return the
    umask now in force. Everything the toolkit creates is made with the umask's modes (files
    0o666 & ~umask, directories 0o777 & ~umask; the event logs 0o644 & ~umask), so with this no
    file or directory of a run is world-writable, whatever the umask allowed; the rest of the
    umask (group-writable with 002, private with 077) is honoured as it is. Docs: docs/security.md."""
    mask = os.umask(0o022)  # reading the umask means setting it: restored at once below
    os.umask(mask | 0o002)
    return mask | 0o002


def hostname() -> str:
    """This host's short name. ``os.uname().nodename`` is what ``socket.gethostname()`` returns
    (both are the kernel's nodename) without importing socket: 8 ms of every `status`."""
    return os.uname().nodename.split(".")[0] or "localhost"


def pid_alive(pid: int) -> bool:
    """True when a process with this pid exists on this host (zombies count as dead). A pid
    outside what Linux gives (a state file may say ``2**70``) is no process."""
    if not 0 < pid <= PID_MAX:
        return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return True
