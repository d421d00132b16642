"""Checkpoint file I/O that tells the heartbeat how far it got, and errors that name their file.

DCP reads every file through its storage reader's ``fs.create_stream`` (torch 2.13,
torch/distributed/checkpoint/filesystem.py): ``ProgressFileSystem`` opens those files through
``ProgressFile``, a raw file whose reads are at most ``PROGRESS_CHUNK`` bytes each and are counted
into a heartbeat tracker (``supervisor.format.heartbeat.Progress``) that names the file being read. A
load that moves slowly therefore beats at every chunk and is never taken for a hang, and a read
that never returns leaves the heartbeat silent with that file in ``io_path``. Short reads are
what a raw file may return; the buffered reader on top loops until it has what DCP asked for.

DCP writes through the same ``create_stream``: with a tracker, its writes are counted the same
way, a chunk per write(2), sized by the rate the writes run at (the buffered writer on top loops
over short writes). A sync save counts into the loop's heartbeat (phase SAVE); an async save's
upload thread, which must not write the heartbeat, into the save's ``Relay``, which a loop that
waits on the save forwards (``wait_forwarding``). So a slow write is no hang either, and a stuck
one names its file. An OSError of either direction gets the file's path when it has none (a
failed write(2) names no file), so a failed save's warning can name it.

A file written through it is hashed as it is written (the manifest's xxh3-128): ``written`` holds
each file written start to end in one pass, so a save's commit records its checksums without
reading its files back. At a checkpoint of hundreds of GB a rank's shard no longer fits the page
cache once written, and reading it back read every byte from the disk or shared filesystem twice.
A write anywhere but at the end (a seek, a truncate) drops the running hash, and the file is read
back as before. Asked for ``digest``, it also keeps each file's SHA-256 as written, which a
signing key signs (supervisor/signing.py): rank 0 then reads no rank's files back to sign them.

A file written starts the disk writing what it holds every ``WRITEBACK_CHUNK`` bytes
(``start_writeback``), as it goes. Left to the save's fsync, the disk sat idle while a rank
pickled and copied its ~800 records, then wrote all of it at once: fsync took ~0.3 s of a 0.6 s
sync save here; with the writeback started as the bytes come, 0.02-0.08 s (a profile of rank 0's sync saves, bench config).
"""

from __future__ import annotations

import copy
import ctypes
import errno
import hashlib
import io
import os
import threading
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import Future, wait
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from torch.distributed.checkpoint.filesystem import FileSystem

from supervisor.format import confined
from supervisor.format.capped import regular_only
from supervisor.format.heartbeat import Progress, Tracker
from supervisor.format.manifest import FileEntry, checksum_hasher
from supervisor.libc import libc_function
from supervisor.resumable import _agree
from supervisor.resumable._save_policy import storage_cause
from supervisor.signing import DIGEST_ALGO

if TYPE_CHECKING:
    from _typeshed import ReadableBuffer, WriteableBuffer

# Bytes per counted read: small enough that one chunk takes well under any phase timeout on a
# slow file system (64 KiB at 64 KB/s is one second), large enough to cost nothing measurable:
# xxh3 over a page-cached file ran at the same 6-11 GB/s with 64 KiB as with 8 MiB chunks here.
PROGRESS_CHUNK = 64 << 10
# Counted writes are sized to take about WRITE_CHUNK_S each at the rate the last one ran: each
# write(2) costs (64 KiB writes slowed a 320 MB DCP save by 20% here, 256 KiB ones by 6%, 1 MiB ones
# by 1.5%), so a fast disk gets few large writes, while on a slow file system each still ends
# within a second or so (16 KiB at 45 kB/s: 0.4 s) and a save beats all along.
WRITE_CHUNK_S = 0.05
MIN_WRITE_CHUNK = 16 << 10
MAX_WRITE_CHUNK = 8 << 20
_PAGE = 4096
# A file written starts its writeback every WRITEBACK_CHUNK bytes (``start_writeback``), so the disk
# writes while the save still pickles and copies, and the save's fsync waits only for the tail.
WRITEBACK_CHUNK = 8 << 20
PEERS_IN_DCP = "peers in DCP's exchanges"  # what a rank between files of a DCP save or load waits for
_SYNC_FILE_RANGE_WRITE = 2  # <linux/fs.h>: start writeback of the range's dirty pages, do not wait


_sync_file_range = libc_function(
    "sync_file_range", [ctypes.c_int, ctypes.c_int64, ctypes.c_int64, ctypes.c_uint]
)
# What sync_file_range(2) returns on a file that it does not apply to (a pipe, some network and
# FUSE file systems): the save's fsync does all of it instead.
_NOT_SUPPORTED = frozenset({errno.EINVAL, errno.ENOSYS, errno.EOPNOTSUPP, errno.ESPIPE})


def start_writeback(fd: int, offset: int, nbytes: int) -> None:
    """Ask the kernel to start writing ``nbytes`` at ``offset`` of ``fd`` to the disk, without
    waiting for it (``SYNC_FILE_RANGE_WRITE`` alone neither waits nor takes a write error from the
    fsync that follows). A file system without it is left to the fsync; any other error is
    raised, naming no file (``naming`` adds it), as a failed write is."""
    if _sync_file_range is None or _sync_file_range(fd, offset, nbytes, _SYNC_FILE_RANGE_WRITE) == 0:
        return
    err = ctypes.get_errno()
    if err not in _NOT_SUPPORTED:
        raise OSError(err, os.strerror(err))


def next_write_chunk(n: int, seconds: float) -> int:
    """Bytes for the next counted write (or direct read, supervisor/resumable/_direct_read.py), after one of
    ``n`` bytes took ``seconds``."""
    fit = n / seconds * WRITE_CHUNK_S if seconds > 0 else MAX_WRITE_CHUNK
    return max(MIN_WRITE_CHUNK, min(MAX_WRITE_CHUNK, int(fit) // _PAGE * _PAGE))


class Relay:
    """A tracker for work on a background thread, which must not write the heartbeat (the loop's
    thread owns it): it only counts, and ``moves`` goes up at each call. A thread that waits on
    that work forwards the counts to its own tracker when ``moves`` changed: its wait then beats
    while the work moves, and goes silent, naming the work's file, when the work is stuck, as if
    it did the work itself. The work's own waits (for its peers) are forwarded as waits, no
    progress. One thread writes it (the work's, or a helper beating while it waits for peers; the
    work is blocked meanwhile); readers may see a count one call old."""

    def __init__(self) -> None:
        self.done = self.total = self.moves = 0
        self.path = ""
        self.waiting: tuple[str, float] = ("", 0.0)  # what the work waits for, until when

    def __call__(self, n: int) -> None:
        self.done += n
        self.moves += 1
        if n:
            self.waiting = ("", 0.0)

    def set_path(self, path: str) -> None:
        self.path = path
        self.moves += 1
        if path:
            self.waiting = ("", 0.0)

    def wait(self, what: str, until: float = 0.0) -> None:
        self.waiting = (what, until)
        self.moves += 1


def wait_forwarding(done: Future[Any], work: Relay, progress: Progress, interval_s: float) -> None:
    """Wait until ``done``, looking at ``work`` every ``interval_s``: when it moved, its counts
    and file go into ``progress`` (a beat; progress when its count grew), and its own wait, if it
    waits, as a wait; when it did not move, nothing does (silence: the work is stuck)."""
    moves = -1
    while wait([done], timeout=interval_s).not_done:
        if work.moves != moves:
            moves = work.moves
            progress.total = work.total
            progress.set_path(work.path)
            progress(work.done - progress.done)
            if work.waiting[0]:
                progress.wait(*work.waiting)


@dataclass(frozen=True)
class Hashed:
    """A file as written in one pass from its start: its manifest entry, and its SHA-256 when
    the file system was asked for digests."""

    entry: FileEntry
    digest: str | None = None


class ProgressFile(io.FileIO):
    """A file opened for reading (``mode`` "rb") or writing ("wb") whose reads or writes are counted
    into ``progress``, a chunk at a time: ``chunk`` bytes per read; writes start at ``chunk`` and
    follow the rate (``next_write_chunk``). A file written is hashed as it is written
    (``hashed``; ``digest``: its SHA-256 too)."""

    def __init__(
        self,
        path: str | os.PathLike[str],
        progress: Tracker,
        chunk: int = PROGRESS_CHUNK,
        mode: str = "rb",
        digest: bool = False,
    ):
        # written: never through a link (ELOOP); read: a regular file only, opened without blocking
        super().__init__(path, mode, opener=confined.no_follow if "w" in mode else regular_only)
        self.progress, self.chunk = progress, chunk
        self.size = 0  # bytes written
        self.written_back = 0  # ... whose writeback was started
        # ... all in order, from 0: the checksum, and the digest when asked for
        self.hashes: list[Any] = [checksum_hasher()] if mode == "wb" else []
        if self.hashes and digest:
            self.hashes.append(hashlib.new(DIGEST_ALGO))

    def hashed(self) -> Hashed | None:
        """The size and hashes of all this file was written, when it was written in one pass
        from its start (no seek or truncate since)."""
        if not self.hashes:
            return None
        sums = [h.hexdigest() for h in self.hashes]
        return Hashed(FileEntry(self.size, sums[0]), sums[1] if len(sums) > 1 else None)

    def readinto(self, b: WriteableBuffer) -> int:
        n = super().readinto(memoryview(b).cast("B")[: self.chunk])
        if n:
            self.progress(n)
        return n or 0

    def write(self, b: ReadableBuffer) -> int:
        view = memoryview(b).cast("B")[: self.chunk]
        start = time.monotonic()
        n = super().write(view) or 0
        if n:
            for h in self.hashes:
                h.update(view[:n])
            self.size += n
            if self.size - self.written_back >= WRITEBACK_CHUNK:
                start_writeback(self.fileno(), self.written_back, self.size - self.written_back)
                self.written_back = self.size
            self.chunk = next_write_chunk(n, time.monotonic() - start)
            self.progress(n)
        return n

    def seek(self, pos: int, whence: int = os.SEEK_SET) -> int:
        at = super().seek(pos, whence)
        if at != self.size:
            self.hashes = []  # the next write lands elsewhere than the end: read the file back
        return at

    def truncate(self, size: int | None = None) -> int:
        self.hashes = []
        return super().truncate(size)

    def read(self, size: int | None = -1) -> bytes:
        if size is None or size < 0:
            return self.readall()
        buf = bytearray(min(size, self.chunk))
        return bytes(buf[: self.readinto(buf)])

    def readall(self) -> bytes:
        out = bytearray()
        while part := self.read(self.chunk):
            out += part
        return bytes(out)


def read_at(stream: io.IOBase, buffers: Sequence[memoryview], offset: int) -> int:
    """One ``preadv`` into ``buffers`` from ``offset`` of ``stream``'s file (its position left
    as it was), counted when the stream is a ``ProgressFile``'s (``ProgressFileSystem``)."""
    raw = getattr(stream, "raw", stream)
    n = os.preadv(raw.fileno(), buffers, offset)
    if n and isinstance(raw, ProgressFile):
        raw.progress(n)
    return n


def written_key(path: str | os.PathLike[str]) -> str:
    """How ``ProgressFileSystem.written`` names a file: its path, normalized."""
    return os.path.normpath(path)


def _named(path: str | os.PathLike[str], root: Path) -> str:
    rel = os.path.relpath(path, root)
    return os.fspath(path) if rel.startswith("..") else rel


class ProgressFileSystem(FileSystem):
    """DCP's local file system with counted reads and writes (when given a tracker) and named
    errors. With a tracker, every operation names its file while it runs and clears it after: a
    rank stuck in one is named, and one between files (waiting on its peers) is known to be
    (``Keepalive``). With a tracker, ``written`` holds each file written through it in one pass
    from its start, and not removed since: its size and checksum (``digest``: and SHA-256), by
    path (``written_key``)."""

    def __init__(self, root: Path, progress: Tracker | None = None, digest: bool = False) -> None:
        super().__init__()
        self.root, self.progress, self.digest = root, progress, digest
        self.written: dict[str, Hashed] = {}

    @contextmanager
    def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
        with self._on(path):
            if self.progress is not None and mode in ("rb", "wb"):
                first = PROGRESS_CHUNK if mode == "rb" else MIN_WRITE_CHUNK
                if mode == "wb":
                    self.written.pop(written_key(path), None)
                raw = ProgressFile(path, self.progress, first, mode, self.digest)
                buffered = io.BufferedReader(raw) if mode == "rb" else io.BufferedWriter(raw)
                with buffered as stream:
                    yield stream
                # closed (flushed) without an error: all its bytes went through ``raw``
                if (entry := raw.hashed()) is not None:
                    self.written[written_key(path)] = entry
            else:  # DCP's own, opened as above
                with open(path, mode, opener=confined.no_follow if "w" in mode else regular_only) as stream:
                    yield cast(io.IOBase, stream)

    def rename(self, path: str | os.PathLike[str], new_path: str | os.PathLike[str]) -> None:
        with self._on(path):
            super().rename(path, new_path)
        if (entry := self.written.pop(written_key(path), None)) is not None:
            self.written[written_key(new_path)] = entry

    def mkdir(self, path: str | os.PathLike[str]) -> None:
        with self._on(path):
            super().mkdir(path)

    def exists(self, path: str | os.PathLike[str]) -> bool:
        with self._on(path):
            return super().exists(path)

    def rm_file(self, path: str | os.PathLike[str]) -> None:
        self.written.pop(written_key(path), None)
        with self._on(path):
            super().rm_file(path)

    @contextmanager
    def _on(self, path: str | os.PathLike[str]) -> Iterator[None]:
        with naming(path):
            if self.progress is None:
                yield
                return
            self.progress.set_path(_named(path, self.root))
            try:
                yield
            finally:
                self.progress.set_path("")


T = TypeVar("T", bound=Tracker)


class Keepalive(Generic[T]):
    """A tracker for I/O that waits on its peers between files (DCP's exchanges inside a save or
    a load): ``beat``, called every so often by a helper thread (``_agree.beating``), beats for it
    while no file operation is under way and never during one, as a wait for its peers (no
    progress: a rank done with its shard is held to its launch's progress, not its own), giving
    up ``bound_s`` after its last file (each of DCP's exchanges is bounded so, 0: unknown). So a
    rank that did its part and waits for the slowest is no hang, and one stuck in a read or write
    still goes silent, naming the file. Both threads' calls go through one lock (neither
    ``Progress`` nor ``Relay`` is thread-safe)."""

    def __init__(self, inner: T, bound_s: float = 0.0) -> None:
        self.inner = inner
        self.bound_s = bound_s
        self._lock = threading.Lock()
        self._in_file = False
        self._since = time.time()  # the end of its last file operation

    def __call__(self, n: int) -> None:
        with self._lock:
            self.inner(n)

    def set_path(self, path: str) -> None:
        with self._lock:
            self._in_file = bool(path)
            if not path:
                self._since = time.time()
            self.inner.set_path(path)

    def wait(self, what: str, until: float = 0.0) -> None:
        with self._lock:
            self.inner.wait(what, until)

    def beat(self) -> None:
        with self._lock:
            if not self._in_file:
                self.inner.wait(PEERS_IN_DCP, self._since + self.bound_s if self.bound_s else 0.0)


@contextmanager
def kept_alive(progress: T, bound_s: float = 0.0) -> Iterator[Keepalive[T]]:
    """``progress`` as a ``Keepalive``, beaten by a helper thread while the block runs: for DCP's
    save and load, which wait on their peers between files (a rank done with its shard waits in
    DCP's exchanges for the slowest, as long as that one needs, each exchange up to ``bound_s``)."""
    alive = Keepalive(progress, bound_s)
    with _agree.beating(alive.beat):
        yield alive


@contextmanager
def naming(path: str | os.PathLike[str]) -> Iterator[None]:
    """An exception raised inside whose cause is an OSError leaves as that OSError, naming ``path``
    when it names no file (a failed write(2) does not).

    torch's serializer turns a failed write into a RuntimeError ("unexpected pos") raised while
    handling the OSError. DCP pickles each rank's exception to the others, and a pickled exception
    loses its ``__context__``: only an OSError raised as such is seen as a storage failure, alike
    on every rank, instead of a bug that crashes the launch."""
    try:
        yield
    except BaseException as e:
        cause = storage_cause(e)
        if cause is None:
            raise
        if not cause.filename:
            cause.filename = os.fspath(path)
        if cause is e:
            raise
        raise copy.copy(cause) from e
