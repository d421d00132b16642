"""Who owns a memory folder on this node, and the sweep of those nobody owns any more.

A memory folder is RAM (/dev/shm): a watchdog that dies without its cleanup (SIGKILL, the node's
OOM killer, a `scancel` whose KILL came first, a node lost and back) leaves its snapshots there,
gigabytes per rank, until the node reboots, and every later job on the node has that much less
memory. So a watchdog holds an exclusive ``flock`` on its folder's lock (``memoryN.lock`` beside it,
layout.owner_lock) for as long as it lives; the kernel releases it when the process dies, however it
dies, and no pid is trusted (pids are reused, and every node of a test cluster shares one kernel).
At start a watchdog takes its own lock (a lock held by another live watchdog: the same job, run and
node twice on one machine, and the tier is off rather than both writing one folder), then removes
every other memory folder of its user whose lock it can take: its owner is gone, and a watchdog
never trusts a snapshot its predecessor left (memory.py), so nothing usable is lost. Heartbeat
folders (nodeN, kilobytes, read by tools after the run) are left alone.

A sweeper removes the folder before the lock's file, holding the lock; whoever opened that file
meanwhile finds, once it has the lock, that the path no longer names the file it locked, and opens
it again (``take``).
"""

from __future__ import annotations

import contextlib
import fcntl
import os
import stat
import time
from dataclasses import dataclass
from pathlib import Path

from supervisor.format import memsnap
from supervisor.format.layout import MEMORY_PREFIX, is_memory_dirname, owner_lock

# A sweeper holds a dead owner's lock only while it removes the folder: a starting watchdog that
# meets it waits this long before it calls the lock held by a live watchdog.
TAKE_WAIT_S = 5.0
_TAKE_POLL_S = 0.05


def take(folder: Path, wait_s: float = 0.0) -> int | None:
    """The descriptor holding ``folder``'s lock (close it, or ``release``, to let go), or None when
    another live process holds it still after ``wait_s``. Raises OSError when the lock cannot be made."""
    path = owner_lock(folder)
    deadline = time.monotonic() + wait_s
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            if time.monotonic() >= deadline:
                return None
            time.sleep(_TAKE_POLL_S)
            continue
        except OSError:
            os.close(fd)
            raise
        if _names(path, fd):
            return fd
        os.close(fd)  # a sweeper unlinked it between our open and our lock: open the new one


def release(folder: Path, fd: int) -> None:
    """Let go of a lock ``take`` gave, its file removed first (while still held, see the module)."""
    with contextlib.suppress(OSError):
        os.unlink(owner_lock(folder))
    os.close(fd)


@dataclass(frozen=True)
class Swept:
    """A dead owner's memory folder, removed."""

    path: str
    bytes: int


def sweep(user: Path, mine: Path | None = None) -> list[Swept]:
    """Remove every memory folder under ``user`` (``supervisor-UID/*/memoryN``) but ``mine`` whose
    owner is gone; best effort (one that cannot be locked or removed is left for the next sweep)."""
    swept = []
    for folder in sorted(user.glob(f"*/{MEMORY_PREFIX}*")):
        if folder == mine or not is_memory_dirname(folder.name) or not _is_dir(folder):
            continue
        try:
            fd = take(folder)
        except OSError:
            continue
        if fd is None:
            continue  # its watchdog lives
        try:
            size = memsnap.remove(folder)
        finally:
            release(folder, fd)
        if not folder.exists():
            swept.append(Swept(str(folder), size))
        with contextlib.suppress(OSError):
            folder.parent.rmdir()  # the run's folder, when its heartbeat folder is gone too
    return swept


def _names(path: Path, fd: int) -> bool:
    """Whether ``path`` still names the file open at ``fd``."""
    try:
        st = os.stat(path, follow_symlinks=False)
    except FileNotFoundError:
        return False
    mine = os.fstat(fd)
    return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino)


def _is_dir(path: Path) -> bool:
    try:
        return stat.S_ISDIR(os.lstat(path).st_mode)
    except OSError:
        return False
