"""Waiting for a file to appear without polling it every few milliseconds.

A standby rank waits for its release file for as long as the launch before it trains, often
hours. Polled every 5 ms, each waiting rank cost 1.4-1.8% of a core and 200 wakeups a second,
taken from the ranks that train on the same cores. Here the wait sleeps on Linux inotify on the
file's folder (0.13% of a core): a create or a rename into it, the watchdog's atomic write, wakes
it at once, and the file is checked only on an event or every ``backstop_s``, the backstop for
what raises no local event (another host's write to a shared folder). Where inotify cannot watch
the folder (another platform, the kernel's instance or watch limit reached) it polls every
``poll_s``, as before.
"""

from __future__ import annotations

import ctypes
import os
import select
import time
from pathlib import Path
from types import TracebackType

from supervisor.libc import libc_function

__all__ = ["Appearance"]

_IN_NONBLOCK, _IN_CLOEXEC = os.O_NONBLOCK, os.O_CLOEXEC  # inotify_init1's flags are these
_IN_CREATE, _IN_MOVED_TO = 0x100, 0x80
_init1 = libc_function("inotify_init1", [ctypes.c_int])
_add_watch = libc_function("inotify_add_watch", [ctypes.c_int, ctypes.c_char_p, ctypes.c_uint32])


class Appearance:
    """``wait(timeout_s)``: True once ``path`` exists (at once if it does), False when the timeout
    ran out first. ``events=False``: the poll, as where inotify cannot watch the folder."""

    def __init__(self, path: Path, backstop_s: float, poll_s: float, *, events: bool = True) -> None:
        self.path = path
        self._fd = -1
        if events and _init1 is not None and _add_watch is not None:
            fd = _init1(_IN_NONBLOCK | _IN_CLOEXEC)
            if fd >= 0 and _add_watch(fd, os.fsencode(path.parent), _IN_CREATE | _IN_MOVED_TO) < 0:
                os.close(fd)
                fd = -1
            self._fd = fd
        self.sleep_s = backstop_s if self.watching else poll_s
        self._poller = select.poll()  # not select.select: a rank may hold fds past FD_SETSIZE
        if self.watching:
            self._poller.register(self._fd, select.POLLIN)

    @property
    def watching(self) -> bool:
        """Whether the wait sleeps on events (else it polls)."""
        return self._fd >= 0

    def wait(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while not self.path.exists():  # checked after the watch began: no event can be missed
            left = deadline - time.monotonic()
            if left <= 0:
                return False
            if not self.watching:
                time.sleep(min(left, self.sleep_s))
                continue
            if self._poller.poll(1000 * min(left, self.sleep_s)):
                self._drain()
        return True

    def _drain(self) -> None:
        try:
            while os.read(self._fd, 4096):
                pass
        except BlockingIOError:
            pass

    def close(self) -> None:
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> Appearance:
        return self

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.close()
