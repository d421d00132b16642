"""Mounts for storage faults: is a path mounted, unmount it for sure, and a size-limited tmpfs that
can be filled to a real ENOSPC and freed again (a full disk without a fake).

Unmounting never leaves a stale mount behind: a plain unmount first, a lazy one (detach now,
release when the last open file closes) when something still holds the mount.
"""

from __future__ import annotations

import errno
import os
import shutil
import subprocess
from pathlib import Path
from types import TracebackType

FILLER = ".tmpfs-filler"
_CHUNK = 1 << 20


def _unescape(field: str) -> str:
    """Mount points in /proc/self/mountinfo escape space, tab, newline and backslash as \\ooo."""
    return field.encode().decode("unicode_escape").encode("latin-1").decode(errors="surrogateescape")


def mount_points() -> set[str]:
    with open("/proc/self/mountinfo") as f:
        return {_unescape(line.split()[4]) for line in f if line.strip()}


def is_mounted(path: str | os.PathLike[str]) -> bool:
    return os.path.realpath(path) in mount_points()


def unmount(path: str | os.PathLike[str], command: tuple[str, ...] = ("umount",)) -> None:
    """Unmount ``path`` (``command`` is ``umount`` or ``fusermount3 -u``), lazily when it is busy
    (detached now; files still open keep the filesystem alive until closed). Raises only when the
    mount is still there afterwards."""
    target = os.path.realpath(path)
    tried = []
    for cmd in ([*command, target], [*command, "-z" if "fusermount3" in command[0] else "-l", target]):
        if target not in mount_points():
            return
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        tried.append(f"{' '.join(cmd)}: {r.returncode} {r.stderr.strip()}")
    if target in mount_points():
        raise RuntimeError(
            f"{target}: still mounted after {'; '.join(tried)}: unmount it by hand (umount -l {target})"
        )


def mount_unavailable() -> str | None:
    """Why mount(8) cannot be used here, or None."""
    if os.geteuid() != 0:
        return "not root: mount needs root on this machine"
    if shutil.which("mount") is None or shutil.which("umount") is None:
        return "no mount/umount command on this machine"
    return None


class SmallTmpfs:
    """A tmpfs of ``size`` bytes on ``path``: a real filesystem that really runs full.

    ``fill()`` writes a filler file until the kernel says ENOSPC; every later data write in the
    tmpfs fails with ENOSPC too (an empty file or a directory may still be created: tmpfs counts
    inodes apart from bytes) until ``free()`` removes the filler.
    """

    def __init__(self, path: str | os.PathLike[str], size: int) -> None:
        self.path = Path(path)
        self.size = size

    @property
    def filler(self) -> Path:
        return self.path / FILLER

    def mount(self) -> SmallTmpfs:
        self.path.mkdir(parents=True, exist_ok=True)
        cmd = ["mount", "-t", "tmpfs", "-o", f"size={self.size},mode=0755", "tmpfs", str(self.path)]
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=False)
        if r.returncode != 0:
            raise RuntimeError(f"{self.path}: {' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}")
        return self

    def fill(self) -> int:
        """Take every free byte; returns how many the filler took (this call)."""
        fd = os.open(self.filler, os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
        written = 0
        chunk = bytes(_CHUNK)
        try:
            while True:
                written += os.write(fd, chunk)  # a short write first, then ENOSPC
        except OSError as e:
            if e.errno != errno.ENOSPC:
                raise
        finally:
            os.close(fd)
        return written

    def free(self) -> None:
        self.filler.unlink(missing_ok=True)

    def unmount(self) -> None:
        unmount(self.path)

    def __enter__(self) -> SmallTmpfs:
        return self.mount()

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.unmount()
