"""Which file a process is stuck on, from /proc: each thread's current syscall
(``/proc/<pid>/task/<tid>/syscall``) and, for a file syscall, the file (the fd's link in
``/proc/<pid>/fd``, or the path argument read from the process's memory).

A rank in a read that never returns (an NFS or FUSE server that stopped answering) writes no
heartbeat and no stack dump (it sits in the kernel, state D, where not even SIGKILL reaches it), so
this is the only way to name the path it is blocked on. Parsing is pure; reading is best effort
(an unreadable entry yields nothing, never an error) and never touches the file itself.
"""

from __future__ import annotations

import os
import platform
import threading
from dataclasses import dataclass

from supervisor.format.layout import is_collectives_request

# How each file syscall names its file: "fd" (arg 0 is a descriptor), "path" (arg 0 is a path),
# "at" (arg 0 a directory descriptor, arg 1 a path relative to it). Numbers per architecture.
_X86_64 = {
    0: ("read", "fd"),
    1: ("write", "fd"),
    2: ("open", "path"),
    3: ("close", "fd"),
    4: ("stat", "path"),
    5: ("fstat", "fd"),
    6: ("lstat", "path"),
    17: ("pread64", "fd"),
    18: ("pwrite64", "fd"),
    19: ("readv", "fd"),
    20: ("writev", "fd"),
    21: ("access", "path"),
    74: ("fsync", "fd"),
    75: ("fdatasync", "fd"),
    76: ("truncate", "path"),
    77: ("ftruncate", "fd"),
    78: ("getdents", "fd"),
    82: ("rename", "path"),
    83: ("mkdir", "path"),
    84: ("rmdir", "path"),
    87: ("unlink", "path"),
    217: ("getdents64", "fd"),
    257: ("openat", "at"),
    258: ("mkdirat", "at"),
    262: ("newfstatat", "at"),
    263: ("unlinkat", "at"),
    264: ("renameat", "at"),
    269: ("faccessat", "at"),
    285: ("fallocate", "fd"),
    295: ("preadv", "fd"),
    296: ("pwritev", "fd"),
    306: ("syncfs", "fd"),
    316: ("renameat2", "at"),
    326: ("copy_file_range", "fd"),
    327: ("preadv2", "fd"),
    328: ("pwritev2", "fd"),
    332: ("statx", "at"),
    437: ("openat2", "at"),
    439: ("faccessat2", "at"),
}
_AARCH64 = {
    34: ("mkdirat", "at"),
    35: ("unlinkat", "at"),
    38: ("renameat", "at"),
    46: ("ftruncate", "fd"),
    47: ("fallocate", "fd"),
    48: ("faccessat", "at"),
    56: ("openat", "at"),
    57: ("close", "fd"),
    61: ("getdents64", "fd"),
    63: ("read", "fd"),
    64: ("write", "fd"),
    65: ("readv", "fd"),
    66: ("writev", "fd"),
    67: ("pread64", "fd"),
    68: ("pwrite64", "fd"),
    69: ("preadv", "fd"),
    70: ("pwritev", "fd"),
    79: ("newfstatat", "at"),
    80: ("fstat", "fd"),
    82: ("fsync", "fd"),
    83: ("fdatasync", "fd"),
    267: ("syncfs", "fd"),
    276: ("renameat2", "at"),
    285: ("copy_file_range", "fd"),
    286: ("preadv2", "fd"),
    287: ("pwritev2", "fd"),
    291: ("statx", "at"),
    437: ("openat2", "at"),
    439: ("faccessat2", "at"),
}
FILE_SYSCALLS = {"x86_64": _X86_64, "aarch64": _AARCH64}.get(platform.machine(), {})
AT_FDCWD = -100
PATH_MAX = 4096
MEM_READ_S = 0.5  # reading another process's memory can wait on its mm lock: never for long


@dataclass(frozen=True)
class Syscall:
    """One line of /proc/<pid>/task/<tid>/syscall: the call number and its six arguments."""

    nr: int
    args: tuple[int, ...]


@dataclass(frozen=True)
class BlockedCall:
    pid: int
    tid: int
    call: str  # the syscall's name, e.g. "read"
    path: str  # the file it is on; '' when it could not be found

    def describe(self) -> str:
        return f"{self.call}({self.path or '?'})"


def parse_syscall(line: str) -> Syscall | None:
    """``'0 0x3 0x7f.. 0x1000 ...'`` -> Syscall; None for ``running``, ``-1 ...`` (blocked outside
    a syscall, e.g. a page fault) or garbage."""
    parts = line.split()
    try:
        nr = int(parts[0])
        args = tuple(int(a, 16) for a in parts[1:7])
    except (IndexError, ValueError):
        return None
    return Syscall(nr, args) if nr >= 0 and len(args) == 6 else None


def file_arg(sc: Syscall, table: dict[int, tuple[str, str]] = FILE_SYSCALLS) -> tuple[str, str, int] | None:
    """(name, how, value) of a file syscall's file argument: how is "fd", "path" (value: the
    address of a path) or "at" (value: the address; the directory descriptor is ``args[0]``);
    None for a syscall that names no file."""
    known = table.get(sc.nr)
    if known is None:
        return None
    name, how = known
    return name, how, sc.args[1] if how == "at" else sc.args[0]


def signed32(v: int) -> int:
    """A descriptor argument as the kernel reads it (AT_FDCWD is -100, printed as 0xffffff9c or
    as a 64-bit pattern)."""
    v &= 0xFFFFFFFF
    return v - (1 << 32) if v >= 1 << 31 else v


def is_file(target: str) -> bool:
    """An fd link to a file or directory, not a socket, pipe or anon inode (a rank waiting on
    its peers reads a socket: that is not storage)."""
    return target.startswith("/")


# ---------------------------------------------------------------- reading /proc


def blocked_io(pid: int) -> list[BlockedCall]:
    """The threads of ``pid`` that are in a file syscall, with the file each is on (threads on
    a socket or pipe are left out). Empty when none, or when /proc cannot be read."""
    try:
        tids = sorted(int(t) for t in os.listdir(f"/proc/{pid}/task") if t.isdigit())
    except OSError:
        return []
    out = []
    for tid in tids:
        try:
            with open(f"/proc/{pid}/task/{tid}/syscall") as f:
                sc = parse_syscall(f.read())
        except OSError:
            continue
        if sc is None or (arg := file_arg(sc)) is None:
            continue
        name, how, value = arg
        if how == "fd":
            path = _fd_target(pid, signed32(value))
            if path and (not is_file(path) or is_collectives_request(path)):
                continue
        else:
            path = _read_path(pid, value)
            if how == "at" and path and not path.startswith("/"):
                base = _fd_target(pid, signed32(sc.args[0]))
                path = os.path.join(base, path) if base else path
        out.append(BlockedCall(pid, tid, name, path))
    return out


def _fd_target(pid: int, fd: int) -> str:
    link = f"/proc/{pid}/cwd" if fd == AT_FDCWD else f"/proc/{pid}/fd/{fd}"
    try:
        return os.readlink(link)
    except OSError:
        return ""


def _read_path(pid: int, addr: int) -> str:
    """The NUL-terminated string at ``addr`` in ``pid``'s memory; '' when it cannot be read in
    MEM_READ_S (the read waits on the process's memory lock, which a stuck fault may hold)."""
    got: list[str] = []

    def read() -> None:
        try:
            with open(f"/proc/{pid}/mem", "rb", buffering=0) as f:
                f.seek(addr)
                got.append(f.read(PATH_MAX).split(b"\0", 1)[0].decode(errors="replace"))
        except (OSError, ValueError, OverflowError):
            pass

    t = threading.Thread(target=read, name=f"read-path-{pid}", daemon=True)
    t.start()
    t.join(MEM_READ_S)
    return got[0] if got else ""
