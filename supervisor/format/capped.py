"""Reads of run-directory files that the file cannot size: every reader of a file under a run
directory (or a checkpoint copied in) goes through ``read_capped`` with the cap of what it holds.

Whoever can write the run directory chooses what a read meets there: a sparse file of a TiB
(``truncate -s``: no disk used, and a plain ``read()`` allocates all of it), a symbolic link to
``/dev/zero`` (a read that never ends), a FIFO (an ``open`` that never returns). So a read here
opens without blocking (``O_NONBLOCK``: a FIFO opens at once), takes a regular file only
(``NotRegular`` otherwise, checked on what was opened: no window between a check and the read),
refuses one larger than its cap before reading a byte of it (``TooLarge``), and never reads more
than the cap (a file that grows meanwhile is refused, not followed).

The caps are sized by what a file of that kind holds at the largest scale the toolkit runs at,
with room to spare; a JSON record is read into Python objects at up to ~10x its size.
"""

from __future__ import annotations

import errno
import json
import os
import stat
from collections.abc import Callable
from typing import Any, TypeVar

_T = TypeVar("_T")

# One JSON record of the run's own: a heartbeat, a watchdog's state, an error file, the remote
# tier's status, the retention policy, SLURM's requeue record, reason.txt, ``latest``, final.json.
RECORD_MAX = 1 << 20
# A watchdog's node summary: one heartbeat record (~0.5 KB) per rank of its node.
SUMMARY_MAX = 16 << 20
# A checkpoint's manifest.json and manifest.sig: ~150 bytes per file (4,096 ranks: ~2 MB).
MANIFEST_MAX = 16 << 20
# `status`'s remembered quick checks: ~100 bytes per committed checkpoint.
CACHE_MAX = 16 << 20
# An append-only log read whole (events, metrics, samples): its tail is what a reader wants.
LOG_MAX = 64 << 20

_CHUNK = 1 << 16
_KINDS = (
    (stat.S_ISDIR, "a directory"),
    (stat.S_ISFIFO, "a FIFO"),
    (stat.S_ISCHR, "a character device"),
    (stat.S_ISBLK, "a block device"),
    (stat.S_ISSOCK, "a socket"),
)


class NotRegular(OSError):
    """What is there is not a regular file (a FIFO, a device, a directory): structural evidence,
    like a directory where a file must be (supervisor/ioerrors.py), never retried."""

    def __init__(self, path: str | os.PathLike[str], mode: int):
        kind = next((name for test, name in _KINDS if test(mode)), "not a regular file")
        super().__init__(errno.EINVAL, f"not a regular file ({kind})", os.fspath(path))


class TooLarge(OSError, ValueError):
    """A file larger than anything of its kind can be (or than its listed size): structural
    evidence, never retried. Both an OSError (EFBIG: a reader's handling of a file it cannot use
    applies) and a ValueError (a record reader's handling of garbage applies); ``str(e)`` says
    what is wrong, ``e.filename`` names the file."""

    def __init__(self, path: str | os.PathLike[str], why: str):
        super().__init__(errno.EFBIG, why, os.fspath(path))

    def __str__(self) -> str:
        return str(self.strerror)


def file_kind_problem(mode: int) -> str:
    """'' for a regular file, else what it is ("a FIFO", "a symbolic link"...)."""
    if stat.S_ISREG(mode):
        return ""
    if stat.S_ISLNK(mode):
        return "a symbolic link"
    return next((name for test, name in _KINDS if test(mode)), "not a regular file")


def open_regular(path: str | os.PathLike[str], *, follow: bool = True) -> tuple[int, int]:
    """``(fd, size)`` of the regular file at ``path``, opened read-only without blocking (a FIFO
    opens at once); NotRegular (closed) for anything else. ``follow=False``: a symbolic link is
    refused too (ELOOP), as for a file a checkpoint lists."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(path, st.st_mode)
    except BaseException:
        os.close(fd)
        raise
    return fd, st.st_size


def regular_only(path: str, flags: int) -> int:
    """An ``opener`` for ``open``/``io.FileIO`` reading a checkpoint's file: without blocking (a
    FIFO opens at once), and only a regular file (NotRegular, closed, for anything else)."""
    fd = os.open(path, flags | os.O_NONBLOCK | os.O_CLOEXEC, 0o666)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):
        os.close(fd)
        raise NotRegular(path, mode)
    return fd


def read_capped(path: str | os.PathLike[str], cap: int, *, follow: bool = True) -> bytes:
    """The whole regular file at ``path``, at most ``cap`` bytes: TooLarge when it is larger
    (by its size, before more than 64 KiB of it is read; or by what a read found, when it grew),
    NotRegular for anything but a regular file; any other OSError as raised. A file of less than
    64 KiB is one ``os.read`` (a short read of a regular file is its end) and nothing more:
    `status` reads thousands. Only a read that fills 64 KiB, or finds nothing, asks what the file
    is (``fstat``): a FIFO opens without blocking and reads as nothing, ``/dev/zero`` fills it."""
    flags = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | (0 if follow else os.O_NOFOLLOW)
    fd = os.open(path, flags)
    try:
        first = os.read(fd, min(_CHUNK, cap + 1))
        if 0 < len(first) < _CHUNK and len(first) <= cap:
            return first
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise NotRegular(path, st.st_mode)
        if st.st_size > cap:
            raise TooLarge(path, f"larger than {cap} bytes")
        chunks, got = [first], len(first)
        while first and got <= cap:
            want = min(max(st.st_size - got, _CHUNK), cap + 1 - got)
            part = os.read(fd, want)
            if not part:
                break
            chunks.append(part)
            got += len(part)
            if got >= st.st_size and len(part) < want:  # all its size said, and a short read: the end
                break
        if got > cap:
            raise TooLarge(path, f"grew past {cap} bytes while it was read")
        return b"".join(chunks)
    finally:
        os.close(fd)


def read_record(path: str | os.PathLike[str], parse: Callable[[Any], _T]) -> _T | None:
    """The JSON record at ``path`` parsed by ``parse`` (None when there is none); ValueError naming
    the file when it is garbage or larger than a record can be, OSError when it cannot be read."""
    try:
        text = read_capped(path, RECORD_MAX)
    except FileNotFoundError:
        return None
    except TooLarge as e:
        raise ValueError(str(e)) from None
    try:
        return parse(json.loads(text))
    except (ValueError, RecursionError, UnicodeDecodeError) as e:
        raise ValueError(f"{os.fspath(path)}: {e}") from None


def read_tail(path: str | os.PathLike[str], tail: int) -> tuple[bytes, bool]:
    """The last ``tail`` bytes of the regular file at ``path`` (all of it when shorter) and
    whether it was cut (then its first line may be partial). NotRegular for anything else."""
    fd, size = open_regular(path)
    try:
        start = max(0, size - tail)
        chunks = []
        at = start
        while at < size:
            part = os.pread(fd, min(size - at, 1 << 20), at)
            if not part:
                break
            chunks.append(part)
            at += len(part)
        return b"".join(chunks), start > 0
    finally:
        os.close(fd)


def read_from(path: str | os.PathLike[str], offset: int, cap: int) -> tuple[bytes, int]:
    """What the regular file at ``path`` holds from ``offset`` on, at most ``cap`` bytes, cut after
    its last whole line (a line being appended stays for the next read); and the file's size now.
    For a reader that follows an append-only log (the SLURM job's coordinator follows every node's
    event log). NotRegular for anything but a regular file."""
    fd, size = open_regular(path)
    try:
        want = max(0, min(size - offset, cap))
        data = os.pread(fd, want, offset) if want else b""
    finally:
        os.close(fd)
    end = data.rfind(b"\n")
    return (data[: end + 1] if end >= 0 else b""), size
