"""The read-ahead of a load's first files (supervisor/resumable/_readahead.py): it fills the page cache, stays
within its limit, stops at an error and where the file system keeps nothing, and never holds up
the load it serves. Its speed is bench/checkpoint.py's (the load with and without it)."""

from __future__ import annotations

import ctypes
import mmap
import os
import subprocess
import threading
from collections.abc import Callable
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from waiting import EVENT_TIMEOUT_S, wait_for

from supervisor.drill.faultctl import FaultFS
from supervisor.format.layout import dcp_shard_filename
from supervisor.libc import libc_function
from supervisor.resumable._readahead import LIMIT, PROBE, _into_cache, _read_ahead, readahead
from supervisor.resumable._shard_writer import shard_writer

MIB = 1 << 20


PAGE = os.sysconf("SC_PAGE_SIZE")
_mmap = libc_function(
    "mmap",
    [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long],
    ctypes.c_void_p,
)
_munmap = libc_function("munmap", [ctypes.c_void_p, ctypes.c_size_t])
_mincore = libc_function("mincore", [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_char_p])


def cached(path: Path) -> list[bool]:
    """Whether each page of ``path`` is in the page cache, by mincore(2) on a mapping of it: a
    look that reads nothing in (a read with RWF_NOWAIT of a page not there starts its read-ahead)."""
    fd = os.open(path, os.O_RDONLY)
    try:
        size = os.fstat(fd).st_size
        addr = _mmap(None, size, mmap.PROT_READ, mmap.MAP_SHARED, fd, 0)
        assert addr not in (None, ctypes.c_void_p(-1).value), f"mmap of {path}: errno {ctypes.get_errno()}"
        try:
            vec = ctypes.create_string_buffer((size + PAGE - 1) // PAGE)
            assert _mincore(addr, size, vec) == 0, f"mincore of {path}: errno {ctypes.get_errno()}"
            return [b & 1 == 1 for b in vec.raw]
        finally:
            _munmap(addr, size)
    finally:
        os.close(fd)


def _advise_dontneed(path: Path, offset: int = 0, length: int = 0) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.posix_fadvise(fd, offset, length, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


def _drop(path: Path, what: str, gone: Callable[[], bool]) -> Path:
    """Wait until ``gone`` (which asks the kernel to drop pages, then looks) holds: a busy
    machine's kernel keeps some pages a while (one still on a CPU's LRU batch is not dropped).
    Skips where the file system keeps every page (tmpfs, ramfs: their files live in the cache)."""
    kind = subprocess.run(["stat", "-f", "-c", "%T", path], capture_output=True, text=True).stdout.strip()
    if kind in ("tmpfs", "ramfs"):
        pytest.skip(f"{path} is on {kind}: its pages are never dropped from the page cache")
    wait_for(gone, f"{what} of {path} out of the page cache", timeout=EVENT_TIMEOUT_S)
    return path


def cold_file(path: Path, size: int) -> Path:
    """A file of ``size`` random bytes on disk, none of them in the page cache."""
    path.write_bytes(os.urandom(size))
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)  # dirty pages are not dropped
    finally:
        os.close(fd)

    def gone() -> bool:
        _advise_dontneed(path)
        return not any(cached(path))

    return _drop(path, "every page", gone)


def cool_end(path: Path) -> Path:
    """``path`` with its last page out of the page cache, so the read-ahead does not take it as
    cached (call it with no read of the file under way: a page on its way in is not dropped).
    A read puts pages in the cache in folios of up to 2 MiB, and asking to drop part of one drops
    nothing: the tail asked for doubles until its last page is gone."""
    size = os.stat(path).st_size
    tail = [PAGE]

    def gone() -> bool:
        _advise_dontneed(path, size - tail[0], tail[0])
        tail[0] = min(2 * tail[0], size)
        return not cached(path)[-1]

    return _drop(path, "the last page", gone)


def resident(path: Path) -> bool:
    """Every page of ``path`` is in the page cache."""
    return all(cached(path))


def test_it_reads_the_files_into_the_page_cache(tmp_path: Path) -> None:
    first, shard = cold_file(tmp_path / "first", MIB // 2), cold_file(tmp_path / "shard", 40 * MIB)
    _read_ahead([first, shard], LIMIT, threading.Event())
    assert resident(first) and resident(shard)


def test_it_reads_at_most_the_limit_and_nothing_once_stopped(tmp_path: Path) -> None:
    sink = os.open(os.devnull, os.O_WRONLY)
    try:
        f = cold_file(tmp_path / "shard", 8 * MIB)
        assert _into_cache(f, 3 * MIB, sink, threading.Event()) == 3 * MIB
        whole = cold_file(tmp_path / "whole", 8 * MIB)  # (f's end may be on its way into the cache)
        assert _into_cache(whole, LIMIT, sink, threading.Event()) == 8 * MIB
        stopped = threading.Event()
        stopped.set()
        assert _into_cache(cold_file(tmp_path / "other", 8 * MIB), LIMIT, sink, stopped) == 0
    finally:
        os.close(sink)


def test_a_file_cached_at_both_ends_is_skipped_and_one_cold_at_its_end_is_read(tmp_path: Path) -> None:
    sink = os.open(os.devnull, os.O_WRONLY)
    try:
        f = cold_file(tmp_path / "shard", 8 * MIB)
        # read whole (nothing of it still on its way in), then its last page dropped
        assert _into_cache(f, LIMIT, sink, threading.Event()) == 8 * MIB
        assert _into_cache(cool_end(f), LIMIT, sink, threading.Event()) == 8 * MIB  # read on
        assert _into_cache(f, LIMIT, sink, threading.Event()) == 0  # cached at both ends: skipped
    finally:
        os.close(sink)


def test_where_nothing_is_kept_it_stops_after_the_first_probe(faultfs: FaultFS) -> None:
    """The fault filesystem serves reads with direct_io: reading ahead there would read it all
    twice. It reads the first file's first PROBE bytes and stops."""
    m = faultfs.mountpoint
    first, shard = m / "first", m / "shard"
    first.write_bytes(os.urandom(3 * PROBE))
    shard.write_bytes(os.urandom(PROBE))
    counted = faultfs.delay("/first", 0.001, ops=["read"])  # counts the reads
    never = faultfs.fail("/shard", "EIO", ops=["read"])
    _read_ahead([first, shard], LIMIT, threading.Event())
    assert faultfs.hits(counted) >= 1, "the probe reads the first file"
    assert faultfs.hits(never) == 0, "nothing after the probe is read"


def test_an_error_stops_it_quietly_and_a_file_not_there_is_skipped(faultfs: FaultFS, tmp_path: Path) -> None:
    """EIO is the load's to report: the read-ahead gives up, raises nothing. A file not there is
    one of two candidates (DCP's one index or the rank's own): the next is read."""
    m = faultfs.mountpoint
    broken, after, next_one = m / "broken", m / "after", m / "next"
    for f in (broken, after, next_one):
        f.write_bytes(b"x" * PROBE)
    eio = faultfs.fail("/broken", "EIO", ops=["read"])
    never = faultfs.fail("/after", "EIO", ops=["read"])
    _read_ahead([broken, after], LIMIT, threading.Event())
    assert faultfs.hits(eio) >= 1 and faultfs.hits(never) == 0
    counted = faultfs.delay("/next", 0.001, ops=["read"])  # counts the reads
    _read_ahead([tmp_path / "missing", next_one], LIMIT, threading.Event())
    assert faultfs.hits(counted) >= 1


def test_a_stalled_read_ahead_does_not_hold_up_the_load(faultfs: FaultFS) -> None:
    shard = faultfs.mountpoint / "shard"
    shard.write_bytes(b"z" * PROBE)
    rid = faultfs.block("/shard", ops=["read"])
    before = set(threading.enumerate())  # another test's read-ahead may still be finishing
    with readahead([shard]):
        (stalled,) = faultfs.wait_blocked(rid, timeout=EVENT_TIMEOUT_S)
    assert faultfs.blocked() == [stalled], "the with block ended while the read-ahead is stalled"
    (thread,) = [t for t in threading.enumerate() if t.name == "ckpt-readahead" and t not in before]
    faultfs.release(rid)
    thread.join(EVENT_TIMEOUT_S)
    assert not thread.is_alive()


def test_the_shard_it_reads_ahead_is_the_one_dcp_writes(tmp_path: Path) -> None:
    """Checkpointer.load reads ahead ``dcp_shard_filename(rank)``: DCP must name this rank's shard so."""
    ckpt = tmp_path / "step"
    dcp.save({"w": torch.arange(6.0)}, storage_writer=shard_writer(ckpt, tmp_path))
    assert sorted(p.name for p in ckpt.glob("*.distcp")) == [dcp_shard_filename(0)]
