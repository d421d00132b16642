"""What an attacker with write access to a run directory (or bad luck) plants there, and a sentinel
folder beside it that nothing of the toolkit may touch: shared by the drill's ``hostile`` scenario
(storage.py) and the hostile-run-dir tests (tests/test_hostile*.py). Torch-free.

- ``Outside``: the sentinel: a ``.bashrc``, a signing key file, another user's run with its own
  checkpoints and quarantine; ``changes()`` lists what differs from when it was made (nothing may
  be written, moved or deleted there).
- ``plant_*``: the shapes that made readers and writers misbehave (issue 39): symbolic links out
  of the run directory and to ``/dev/zero``, FIFOs, sparse files of GiBs, 1,200 nested
  directories; ``remove_deep`` removes what was planted, at any depth, without recursion.
"""

from __future__ import annotations

import hashlib
import os
import stat
from pathlib import Path
from typing import Any

GIB = 1 << 30
NEST = 1200  # directories deep: past Python's recursion limit, for os.walk, os.fwalk and rmtree


class Outside:
    """A folder that stands for what is outside the run directory (``path``); ``changes()`` lists
    every entry added, removed or changed in it (type, mode, size, content, mtime), no link
    followed."""

    def __init__(self, path: Path):
        self.path = path
        self.path.mkdir(parents=True, exist_ok=True)
        (self.path / ".bashrc").write_text("export PATH=$PATH\n")
        key = self.path / "run.key"
        key.write_bytes(b"k" * 48)
        key.chmod(0o600)
        for step in (10, 20):
            d = self.victim / f"step_{step:08d}"
            d.mkdir(parents=True, exist_ok=True)
            (d / "__0_0.distcp").write_bytes(os.urandom(64))
        q = self.victim / "quarantine" / "step_00000005-20260101T000000Z"
        q.mkdir(parents=True, exist_ok=True)
        (q / "reason.txt").write_text("the victim's own\n")
        self.before = self.snapshot()

    @property
    def bashrc(self) -> Path:
        return self.path / ".bashrc"

    @property
    def key(self) -> Path:
        return self.path / "run.key"

    @property
    def victim(self) -> Path:
        """Another user's run directory."""
        return self.path / "victim"

    def snapshot(self) -> dict[str, tuple[Any, ...]]:
        out: dict[str, tuple[Any, ...]] = {}
        for dirpath, dirs, files in os.walk(self.path):
            for name in dirs + files:
                p = os.path.join(dirpath, name)
                s = os.lstat(p)
                digest = ""
                if stat.S_ISREG(s.st_mode):
                    with open(p, "rb") as f:
                        digest = hashlib.sha256(f.read()).hexdigest()
                out[os.path.relpath(p, self.path)] = (s.st_mode, s.st_size, digest, s.st_mtime_ns)
        return out

    def changes(self) -> list[str]:
        now = self.snapshot()
        return sorted(
            f"{name}: {'added' if name not in self.before else 'removed' if name not in now else 'changed'}"
            for name in set(self.before) | set(now)
            if self.before.get(name) != now.get(name)
        )


def clear(path: Path) -> None:
    """Remove whatever is at ``path`` (a file, a link, a FIFO, a tree of any depth), so something
    else can be planted; its folder made when missing."""
    if path.is_symlink() or (path.exists() and not path.is_dir()):
        path.unlink()
    elif path.is_dir():
        remove_deep(path)
    path.parent.mkdir(parents=True, exist_ok=True)


def plant_link(path: Path, target: Path | str) -> None:
    clear(path)
    path.symlink_to(target)


def plant_fifo(path: Path) -> None:
    clear(path)
    os.mkfifo(path)


def plant_sparse(path: Path, size: int = 2 * GIB) -> None:
    """A file of ``size`` bytes that takes no disk (``truncate -s``): read whole, all of it is memory."""
    clear(path)
    with open(path, "wb") as f:
        f.truncate(size)


def plant_nest(path: Path, depth: int = NEST) -> None:
    """``depth`` directories, one inside the other, under ``path`` (made), a file at the bottom."""
    path.mkdir(parents=True, exist_ok=True)
    fd = os.open(path, os.O_RDONLY | os.O_DIRECTORY)
    try:
        for _ in range(depth):
            os.mkdir("d", dir_fd=fd)
            sub = os.open("d", os.O_RDONLY | os.O_DIRECTORY, dir_fd=fd)
            os.close(fd)
            fd = sub
        with open(os.open("f", os.O_WRONLY | os.O_CREAT, 0o644, dir_fd=fd), "wb") as f:
            f.write(b"deep")
    finally:
        os.close(fd)


def remove_deep(top: Path) -> None:
    """``shutil.rmtree`` without recursion (it raises RecursionError on a nest): links removed,
    never followed. For what a test or the drill planted itself, in a tree no one else writes."""
    stack: list[tuple[str, bool]] = [(str(top), False)]
    while stack:
        path, emptied = stack.pop()
        if emptied:
            os.rmdir(path)
            continue
        stack.append((path, True))
        with os.scandir(path) as entries:
            for e in entries:
                if e.is_dir(follow_symlinks=False):
                    stack.append((e.path, False))
                else:
                    os.unlink(e.path)
