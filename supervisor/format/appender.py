"""Append-only logs (metrics.jsonl, samples) that never crash a rank on a full disk or an EIO.

Lines are kept in memory until the file takes them: a line that could not be written is written
later, in order, and none is lost once space comes back (the save policy stops a launch that can
write nothing for long, so memory stays bounded). Bytes go through ``os.write`` on an O_APPEND
descriptor and only what the kernel reports written is dropped from the buffer: a short write
(the disk filled in the middle of a line) resumes with the rest of that line, so no line is ever
written twice or left half-written by this process. A line left half-written by a process that
was killed is closed with a newline before the first new one, so it cannot swallow it.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path

from supervisor.format import confined
from supervisor.store.ioerrors import describe

log = logging.getLogger(__name__)


class LineAppender:
    """One writer's lines to ``path`` in the run directory ``root`` (opened through no link below
    it: supervisor/format/confined.py); ``append`` and ``flush`` never raise OSError."""

    def __init__(self, path: Path, root: Path) -> None:
        self.path, self.root = path, root
        self.fd: int | None = None
        self.pending = bytearray()  # queued bytes not yet in the file, from a line boundary on
        self.failing = False  # in a streak of failed writes (warned once)

    def append(self, line: str) -> bool:
        """Queue one line (without its newline) and write what can be written; True when every
        queued line is in the file."""
        self.pending += line.encode() + b"\n"
        return self.flush()

    def flush(self) -> bool:
        """Write queued bytes; True when none is left. A failure is warned once per streak."""
        try:
            if self.fd is None:
                self.fd = _open_for_append(self.root, self.path, self.pending)
            while self.pending:
                n = os.write(self.fd, self.pending)
                del self.pending[:n]
        except OSError as e:
            if not self.failing:
                self.failing = True
                log.warning(
                    "%s: not written (%s); %d line(s) kept in memory, written once it can be",
                    self.path,
                    describe(e),
                    self.pending.count(b"\n"),
                )
            return False
        if self.failing:
            self.failing = False
            log.warning("%s: written again; the lines held back meanwhile are in it, in order", self.path)
        return True

    def close(self) -> None:
        """Write what is left (warn about what cannot be) and close."""
        if not self.flush():
            log.warning(
                "%s: %d line(s) could not be written and are lost", self.path, self.pending.count(b"\n")
            )
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _open_for_append(root: Path, path: Path, pending: bytearray) -> int:
    """An O_APPEND descriptor; when the file ends inside a line (its writer was killed), a newline
    is queued first so that line cannot swallow the next one."""
    fd = confined.open_append(root, path)
    try:
        size = os.fstat(fd).st_size
        if size and os.pread(fd, 1, size - 1) != b"\n":
            pending[:0] = b"\n"
    except OSError:
        os.close(fd)
        raise
    return fd
