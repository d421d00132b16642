"""Read-ahead of the files a rank's load will read, from its first line.

A load's first part is all CPU: FSDP's ``get_state_dict``, the optimizer's state allocated, DCP's
plans built and exchanged (0.06 s of the bench's load, far more at scale). The disk idles through
it, and then DCP reads cold. ``readahead`` starts a thread that pulls the files into the page cache
meanwhile, in the order the load reads them, so DCP's reads find them there or under way.

It reads with ``sendfile`` to ``/dev/null``: the kernel reads the pages in and drops nothing, and
no byte is copied into the process (a page already cached costs almost nothing: 305 MB hot in
4 ms here), with the GIL released for a whole ``CHUNK``. ``posix_fadvise(WILLNEED)`` was tried
first: Linux reads at most the device's readahead window per call (8 MiB here), so it fetched
80 MB of a 305 MB shard however long it ran.

It runs only where it helps. A file whose first and last bytes are in the page cache is taken as
hot and skipped (sendfile over 305 MB of cached pages still cost 4 ms of a core that the load on
the same node needs: 8 ms of a 0.1 s hot load in bench/checkpoint.py). After the first
``PROBE`` bytes of each file it checks that the file system kept them (the first byte reads back
without I/O: ``preadv(RWF_NOWAIT)``). Where it did not, or cannot say (FUSE with ``direct_io``,
as the fault filesystem mounts: EOPNOTSUPP), reading ahead would read every byte twice, so it
stops.

Advisory only: any error (a file system without ``sendfile``, EIO) stops it silently, and the
load's own read meets the error and names it. A file that is not there is skipped: the caller
names both candidates for the index (DCP's one, or this rank's own) and the read-ahead, not the
load's first line, finds out which the checkpoint has. At most ``LIMIT`` bytes per rank are read
ahead, so a shard larger than the page cache can hold is not read twice.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from pathlib import Path

# Per sendfile call: the stop flag is checked between calls.
CHUNK = 32 << 20
# The first read of each file, after which the page cache is checked: all that is read twice where
# the file system keeps nothing.
PROBE = 1 << 20
# At most this much per rank: 8 ranks on a node hold 8 GiB of page cache with it at most.
LIMIT = 1 << 30


@contextmanager
def readahead(paths: Sequence[Path], limit: int = LIMIT) -> Iterator[None]:
    """Read ``paths`` into the page cache, in order, from a thread, for the ``with`` body. On
    leaving, the thread stops after its current chunk; it is not waited for (a call stalled on
    slow storage must not hold up a load that has its bytes)."""
    stop = threading.Event()
    threading.Thread(
        target=_read_ahead, args=(paths, limit, stop), name="ckpt-readahead", daemon=True
    ).start()
    try:
        yield
    finally:
        stop.set()


class _NotKept(Exception):
    """The file system did not keep what was read ahead, or cannot say."""


def _read_ahead(paths: Sequence[Path], limit: int, stop: threading.Event) -> None:
    try:
        sink = os.open(os.devnull, os.O_WRONLY)
    except OSError:
        return
    try:
        for path in paths:
            if stop.is_set() or limit <= 0:
                return
            try:
                limit -= _into_cache(path, limit, sink, stop)
            except FileNotFoundError:
                continue
    except (OSError, _NotKept):
        return  # advice only: the load's own read meets an error and names it
    finally:
        os.close(sink)


def _into_cache(path: Path, limit: int, sink: int, stop: threading.Event) -> int:
    """Bytes of ``path`` read into the page cache, at most ``limit``; _NotKept after the first
    ``PROBE`` bytes when they are not there."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        if size and kept(fd) and kept(fd, size - 1):  # hot: the load finds it all (a saved file
            return 0  # is cached whole or from its start; what a load reads is read on)
        done = 0
        while done < limit and not stop.is_set():
            n = os.sendfile(sink, fd, done, min(CHUNK if done else PROBE, limit - done))
            if n <= 0:
                break
            if not done and not kept(fd):
                raise _NotKept
            done += n
        return done
    finally:
        os.close(fd)


def kept(fd: int, offset: int = 0) -> bool:
    """Whether the byte at ``offset`` of ``fd`` is in the page cache: it reads without I/O. False
    also where the file system cannot read without I/O on demand (EOPNOTSUPP)."""
    try:
        return os.preadv(fd, [bytearray(1)], offset, os.RWF_NOWAIT) == 1
    except OSError:
        return False
