"""What a process is blocked in, from /proc: the pure parsing, and real processes blocked on a FIFO
(opening it, then reading it: a file path either way) or on a pipe (not storage: left out).
A read from a hung mount is in tests/test_watch_faults.py (faultfs)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
from waiting import wait_for

from supervisor.watch.blocked import (
    FILE_SYSCALLS,
    BlockedCall,
    Syscall,
    blocked_io,
    file_arg,
    is_file,
    parse_syscall,
    signed32,
)
from supervisor.watch.process import describe_stuck, where_blocked

X86 = {0: ("read", "fd"), 257: ("openat", "at"), 4: ("stat", "path")}


def test_parse_syscall_lines():
    sc = parse_syscall("0 0x3 0x7ffd5c0 0x1000 0x0 0x0 0x0 0x7ffd5b8 0x7f12ab\n")
    assert sc == Syscall(0, (3, 0x7FFD5C0, 0x1000, 0, 0, 0))
    assert parse_syscall("running") is None
    assert parse_syscall("-1 0x7ffd5b8 0x7f12ab") is None  # blocked outside a syscall (a fault)
    assert parse_syscall("") is None and parse_syscall("0 0x3") is None and parse_syscall("x 0x1") is None


def test_file_arg_by_kind():
    args = (5, 0xAB, 0xCD, 0, 0, 0)
    assert file_arg(Syscall(0, args), X86) == ("read", "fd", 5)
    assert file_arg(Syscall(257, args), X86) == ("openat", "at", 0xAB)  # the path; dirfd is args[0]
    assert file_arg(Syscall(4, args), X86) == ("stat", "path", 5)
    assert file_arg(Syscall(232, args), X86) is None  # epoll_wait: names no file


def test_descriptor_arguments_and_targets():
    assert signed32(0xFFFFFF9C) == signed32(0xFFFFFFFFFFFFFF9C) == -100  # AT_FDCWD
    assert signed32(3) == 3
    assert is_file("/ckpt/run/step_00000005/x.distcp")
    assert not any(is_file(t) for t in ("socket:[1234]", "pipe:[99]", "anon_inode:[eventfd]"))
    assert BlockedCall(1, 1, "read", "/x").describe() == "read(/x)"
    assert BlockedCall(1, 1, "openat", "").describe() == "openat(?)"


READER = "import sys; f = open(sys.argv[1], 'rb'); f.read()"


@pytest.mark.skipif(not FILE_SYSCALLS, reason="syscall numbers known for x86_64 and aarch64 only")
def test_a_process_blocked_on_a_fifo_is_named_with_its_path(tmp_path: Path):
    fifo = tmp_path / "fifo"
    os.mkfifo(fifo)
    p = subprocess.Popen([sys.executable, "-c", READER, str(fifo)])
    try:
        # open() of a FIFO blocks until a writer comes: the path is an argument in its memory.
        # (Python's own start-up opens files too: wait for the FIFO's.)
        (call,) = wait_for(
            lambda: [c for c in blocked_io(p.pid) if c.path == str(fifo)], "the reader blocked in open"
        )
        assert call.call in ("open", "openat") and call.pid == p.pid
        w = os.open(fifo, os.O_WRONLY)  # now it reads, and blocks there: the path of its fd
        try:
            wait_for(lambda: [c for c in blocked_io(p.pid) if c.call == "read"], "the reader blocked in read")
            assert blocked_io(p.pid) == [BlockedCall(p.pid, p.pid, "read", str(fifo))]
            where = where_blocked(p.pid)
            assert where.startswith(f"read({fifo}) (state S, wchan ") and not where.endswith("wchan ?)")
            assert describe_stuck(p.pid).startswith(f"pid {p.pid} (state S, wchan ")
            assert f"in read({fifo})" in describe_stuck(p.pid)
        finally:
            os.close(w)
    finally:
        p.kill()
        p.wait()


def in_syscall(pid: int, name: str) -> bool:
    sc = parse_syscall(Path(f"/proc/{pid}/syscall").read_text())
    return sc is not None and FILE_SYSCALLS.get(sc.nr, ("",))[0] == name


@pytest.mark.skipif(not FILE_SYSCALLS, reason="syscall numbers known for x86_64 and aarch64 only")
def test_a_pipe_or_a_process_that_is_gone_is_not_storage():
    p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
    try:
        wait_for(lambda: in_syscall(p.pid, "read"), "the reader blocked in read")
        assert blocked_io(p.pid) == [] and where_blocked(p.pid) == ""
    finally:
        p.kill()
        p.wait()
    assert blocked_io(p.pid) == []
    assert describe_stuck(p.pid) == f"pid {p.pid} (state ?, wchan ?)"
