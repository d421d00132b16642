"""A fault-injecting FUSE passthrough: the process that serves the mount.

    python -m supervisor.drill.faultfs BACKING MOUNTPOINT --control SOCKET

Every operation on MOUNTPOINT is forwarded to BACKING, after the rules set on the control socket
(supervisor/drill/faultrules.py) had their say: fail with an errno, wait, meter bytes, block until
the rule is cleared, or hide the path. Tests and the drill start it through
supervisor/drill/faultctl.py (mount, wait until ready, steer, unmount), not by hand.

Why a Unix socket and not a control file: a rule is in force when ``add`` returns (no polling
interval between writing a rule and the first operation it hits), the socket answers (counters,
who is blocked), and a wait ("until 1 read is blocked") is served by the filesystem itself as an
event instead of the test polling a file.

Faithful where the run dir needs it: attribute and entry caches are off (a rule hits the next
stat, not one after a cache timeout), unlinked open files are really removed (no .fuse_hidden
files in listings, rmdir works), inode numbers are the backing ones, O_APPEND and O_TRUNC reach
the backing file, byte-range and flock locks are kept by the kernel (correct for one host).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import errno
import json
import os
import socket
import socketserver
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

from supervisor.drill.faultrules import SIZED_OPS, RuleError, RuleState, parse_rule, throttle

MAX_THREADS = 64  # FUSE worker threads: blocked operations must never starve the others
MAX_IDLE_THREADS = 8  # given, or libfuse 3.14 logs a bogus "invalid max threads value" at start
WAIT_CAP_S = 3600.0  # the longest wait a control request may ask for


def proc_lineage(tid: int) -> tuple[int, ...]:
    """The process of thread ``tid`` and its ancestors, nearest first (empty once it is gone).
    FUSE names the calling thread, so a rule's pids are matched against this."""
    out: list[int] = []
    pid = tid
    try:
        while pid > 1 and len(out) < 64:
            fields = dict(
                line.split(":\t", 1)
                for line in Path(f"/proc/{pid}/status").read_text().splitlines()
                if ":\t" in line
            )
            tgid = int(fields["Tgid"])
            if not out or out[-1] != tgid:
                out.append(tgid)
            pid = int(fields["PPid"])
    except (OSError, KeyError, ValueError):
        pass
    return tuple(out)


class Faults:
    """The rules in force, the operation counters and the blocked operations of one mount; shared
    by the FUSE worker threads and the control server, all under one condition variable."""

    def __init__(self, clock: Callable[[], float] = time.monotonic) -> None:
        self._clock = clock
        self._cond = threading.Condition()
        self._rules: dict[str, RuleState] = {}
        self._next_id = 1
        self._ops: collections.Counter[str] = collections.Counter()
        self._blocked: list[dict[str, Any]] = []
        self._stop = threading.Event()  # shutdown: nothing blocks or sleeps any more

    # ---------------------------------------------------------------- control side

    def add(self, spec: Mapping[str, Any]) -> str:
        rule = parse_rule(spec)
        with self._cond:
            if self._stop.is_set():
                raise RuleError("the filesystem is shutting down: no new rules")
            rule_id = f"r{self._next_id}"
            self._next_id += 1
            self._rules[rule_id] = RuleState(rule_id, rule, self._clock())
            return rule_id

    def clear(self, rule_id: str | None = None) -> list[str]:
        """Remove one rule (or all); operations it blocks go on."""
        with self._cond:
            if rule_id is not None and rule_id not in self._rules:
                raise RuleError(f"no rule {rule_id}: set rules are {', '.join(self._rules) or 'none'}")
            ids = [rule_id] if rule_id is not None else list(self._rules)
            for i in ids:
                del self._rules[i]
            self._cond.notify_all()
            return ids

    def shutdown(self) -> None:
        """Before an unmount: clear every rule and wake every blocked or sleeping operation."""
        with self._cond:
            self._stop.set()
            self._rules.clear()
            self._cond.notify_all()

    def status(self) -> dict[str, Any]:
        with self._cond:
            now = self._clock()
            return {
                "ops": dict(self._ops),
                "rules": [rs.status(now) for rs in self._rules.values()],
                "blocked": [dict(b) for b in self._blocked],
            }

    def wait(self, rule_id: str | None, hits: int | None, blocked: int | None, timeout: float) -> bool:
        """Wait until ``rule_id`` fired ``hits`` times and/or ``blocked`` operations are blocked
        (by that rule, or by any when None). False on timeout."""

        def reached() -> bool:
            if rule_id is not None and rule_id not in self._rules:
                raise RuleError(f"no rule {rule_id} (cleared?)")
            if hits is not None and (rule_id is None or self._rules[rule_id].hits < hits):
                return False
            n = sum(1 for b in self._blocked if rule_id is None or rule_id in b["rules"])
            return blocked is None or n >= blocked

        if hits is not None and rule_id is None:
            raise RuleError("wait for hits needs a rule id")
        with self._cond:
            return self._cond.wait_for(reached, timeout=min(timeout, WAIT_CAP_S))

    def handle(self, req: Mapping[str, Any]) -> dict[str, Any]:
        """One control request (a JSON object) -> its answer."""
        cmd = req.get("cmd")
        if cmd == "add":
            return {"ok": True, "id": self.add(req.get("rule") or {})}
        if cmd == "clear":
            return {"ok": True, "cleared": self.clear(req.get("id"))}
        if cmd == "status":
            return {"ok": True, **self.status()}
        if cmd == "wait":
            reached = self.wait(
                req.get("id"), req.get("hits"), req.get("blocked"), float(req.get("timeout", 30))
            )
            return {"ok": True, "reached": reached, **self.status()}
        if cmd == "shutdown":
            self.shutdown()
            return {"ok": True}
        if cmd == "ping":
            return {"ok": True, "pid": os.getpid()}
        raise RuleError(f"unknown command {cmd!r}: use add, clear, status, wait, shutdown or ping")

    # ---------------------------------------------------------------- filesystem side

    def _hits(self, op: str, paths: tuple[str, ...], tid: int, actions: tuple[str, ...]) -> list[RuleState]:
        """The rules that hit this operation now (their hits counted); caller holds the lock."""
        now = self._clock()
        lineage: frozenset[int] | None = None
        out = []
        for rs in self._rules.values():
            if rs.rule.action not in actions or not rs.rule.matches(op, paths):
                continue
            if rs.rule.pids is not None and lineage is None:
                lineage = frozenset(proc_lineage(tid))
            if rs.fire(op, paths, now, lineage):
                out.append(rs)
        return out

    def gate(self, op: str, paths: tuple[str, ...], tid: int) -> None:
        """Before an operation: block while a block rule holds it, then sleep for delay rules,
        then raise the first error (or hide) rule's errno."""
        with self._cond:
            self._ops[op] += 1
            if not self._rules:
                return
            blocks = self._hits(op, paths, tid, ("block",))
            if blocks:
                lineage = proc_lineage(tid)
                ids = [rs.id for rs in blocks]
                entry = {
                    "rules": ids, "op": op, "path": paths[0], "pid": lineage[0] if lineage else tid,
                    "tid": tid, "since": time.time(),
                }  # fmt: skip
                self._blocked.append(entry)
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._stop.is_set() or not any(i in self._rules for i in ids))
                self._blocked.remove(entry)
                self._cond.notify_all()
            delay = sum(rs.rule.delay_s or 0.0 for rs in self._hits(op, paths, tid, ("delay",)))
            failing = self._first_error(op, paths, tid)
        if delay:
            self._stop.wait(delay)
        if failing is not None:
            raise OSError(failing, os.strerror(failing), paths[0])

    def _first_error(self, op: str, paths: tuple[str, ...], tid: int) -> int | None:
        for rs in self._rules.values():  # insertion order: the first rule that hits decides
            if rs.rule.action in ("error", "hide") and self._hits_one(rs, op, paths, tid):
                return rs.rule.errno if rs.rule.action == "error" else errno.ENOENT
        return None

    def _hits_one(self, rs: RuleState, op: str, paths: tuple[str, ...], tid: int) -> bool:
        lineage = frozenset(proc_lineage(tid)) if rs.rule.pids is not None else None
        return rs.fire(op, paths, self._clock(), lineage)

    def meter(self, op: str, path: str, tid: int, nbytes: int) -> None:
        """After a read or write of ``nbytes``: hold it back as long as the bandwidth caps say."""
        if op not in SIZED_OPS or not nbytes:
            return
        wait = 0.0
        with self._cond:
            now = self._clock()
            for rs in self._hits(op, (path,), tid, ("throttle",)):
                w, rs.free_at = throttle(rs.free_at, now, nbytes, rs.rule.bytes_per_s or 1.0)
                wait = max(wait, w)
        if wait:
            self._stop.wait(wait)

    def hidden(self, paths: list[str], tid: int) -> set[str]:
        """Which of ``paths`` (entries of a listing) are hidden from the caller (hits counted)."""
        with self._cond:
            hide = [rs for rs in self._rules.values() if rs.rule.action == "hide"]
            if not hide:
                return set()
            out = set()
            for p in paths:
                if any(self._hits_one(rs, "getattr", (p,), tid) for rs in hide):
                    out.add(p)
            return out


_STAT_KEYS = (
    "st_mode", "st_ino", "st_dev", "st_nlink", "st_uid", "st_gid", "st_size", "st_rdev", "st_blksize", "st_blocks",
)  # fmt: skip
_STATVFS_KEYS = (
    "f_bsize", "f_frsize", "f_blocks", "f_bfree", "f_bavail", "f_files", "f_ffree", "f_favail", "f_flag", "f_namemax",
)  # fmt: skip


def _stat_dict(st: os.stat_result) -> dict[str, int]:
    d = {k: getattr(st, k) for k in _STAT_KEYS}
    d.update(st_atime=st.st_atime_ns, st_mtime=st.st_mtime_ns, st_ctime=st.st_ctime_ns)
    return d


class Passthrough:
    """mfusepy operations forwarding to a backing directory, each after :meth:`Faults.gate`.
    Paths are the mount's ("/a/b"); file handles are backing file descriptors."""

    use_ns = True  # times in integer nanoseconds, exactly as the backing file has them

    def __init__(
        self, backing: str, faults: Faults, on_ready: Callable[[], None], context: Callable[[], int]
    ) -> None:
        self.root = os.path.realpath(backing)
        self.faults = faults
        self._on_ready = on_ready
        self._tid = context  # the calling thread's id, from the FUSE request
        self._fh_paths: dict[int, str] = {}  # for operations libfuse sends without a path (unlinked files)
        self._fh_lock = threading.Lock()

    def _full(self, path: str) -> str:
        return self.root + path if path != "/" else self.root

    def _gate(self, op: str, *paths: str | None) -> None:
        self.faults.gate(op, tuple(p for p in paths if p is not None) or ("?",), self._tid())

    def _fh_path(self, path: str | None, fh: int | None) -> str | None:
        return path if path is not None else self._fh_paths.get(fh) if fh is not None else None

    def init_with_config(self, conn_info: Any, config: Any) -> None:
        if config is not None:
            config.entry_timeout = config.attr_timeout = config.negative_timeout = 0.0
            config.use_ino = 1
            config.hard_remove = 1
            config.direct_io = 1
        self._on_ready()

    # -- metadata
    def getattr(self, path: str | None, fh: int | None = None) -> dict[str, int]:
        self._gate("getattr", self._fh_path(path, fh))
        return _stat_dict(os.fstat(fh) if fh is not None else os.lstat(self._full(path or "/")))

    def access(self, path: str, amode: int) -> int:
        self._gate("access", path)
        if not os.access(self._full(path), amode):
            raise OSError(errno.EACCES, os.strerror(errno.EACCES), path)
        return 0

    def chmod(self, path: str, mode: int) -> int:
        self._gate("chmod", path)
        os.chmod(self._full(path), mode)
        return 0

    def chown(self, path: str, uid: int, gid: int) -> int:
        self._gate("chown", path)
        os.chown(self._full(path), uid, gid, follow_symlinks=False)
        return 0

    def utimens(self, path: str, times: tuple[int, int] | None = None) -> int:
        self._gate("utimens", path)
        if times is None:
            os.utime(self._full(path), follow_symlinks=False)
        else:
            os.utime(self._full(path), ns=times, follow_symlinks=False)
        return 0

    def statfs(self, path: str) -> dict[str, int]:
        self._gate("statfs", path)
        sv = os.statvfs(self._full(path))
        return {k: getattr(sv, k) for k in _STATVFS_KEYS}

    def readlink(self, path: str) -> str:
        self._gate("readlink", path)
        return os.readlink(self._full(path))

    # -- names
    def mkdir(self, path: str, mode: int) -> int:
        self._gate("mkdir", path)
        os.mkdir(self._full(path), mode)
        return 0

    def rmdir(self, path: str) -> int:
        self._gate("rmdir", path)
        os.rmdir(self._full(path))
        return 0

    def unlink(self, path: str) -> int:
        self._gate("unlink", path)
        os.unlink(self._full(path))
        return 0

    def rename(self, old: str, new: str) -> int:
        self._gate("rename", old, new)
        os.rename(self._full(old), self._full(new))
        with self._fh_lock:  # open files keep their (new) name for rules
            for fh, p in self._fh_paths.items():
                if p == old:
                    self._fh_paths[fh] = new
        return 0

    def symlink(self, target: str, source: str) -> int:
        """mfusepy's order: the link ``target`` (a mount path) pointing to ``source``."""
        self._gate("symlink", target)
        os.symlink(source, self._full(target))
        return 0

    def link(self, target: str, source: str) -> int:
        self._gate("link", source, target)
        os.link(self._full(source), self._full(target))
        return 0

    # -- directories
    def opendir(self, path: str) -> int:
        self._gate("opendir", path)
        return os.open(self._full(path), os.O_RDONLY | os.O_DIRECTORY)

    def readdir(self, path: str, fh: int) -> Iterator[tuple[str, dict[str, int], int]]:
        self._gate("readdir", path)
        entries = {}
        with os.scandir(self._full(path)) as it:
            for e in it:
                st = e.stat(follow_symlinks=False)
                entries[e.name] = {"st_mode": st.st_mode, "st_ino": st.st_ino}
        prefix = path.rstrip("/") + "/"
        hidden = self.faults.hidden([prefix + n for n in entries], self._tid())
        yield ".", {"st_mode": 0o40755}, 0
        yield "..", {"st_mode": 0o40755}, 0
        for name, attrs in entries.items():
            if prefix + name not in hidden:
                yield name, attrs, 0

    def fsyncdir(self, path: str | None, datasync: int, fh: int) -> int:
        self._gate("fsyncdir", path)
        os.fsync(fh)
        return 0

    def releasedir(self, path: str | None, fh: int) -> int:
        self._gate("releasedir", path)
        os.close(fh)
        return 0

    # -- files
    def open(self, path: str, flags: int) -> int:
        self._gate("open", path)
        return self._track(path, os.open(self._full(path), flags))

    def create(self, path: str, mode: int, flags: int) -> int:
        self._gate("create", path)
        return self._track(path, os.open(self._full(path), flags | os.O_CREAT, mode))

    def _track(self, path: str, fh: int) -> int:
        with self._fh_lock:
            self._fh_paths[fh] = path
        return fh

    def read(self, path: str | None, size: int, offset: int, fh: int) -> bytes:
        p = self._fh_path(path, fh)
        self._gate("read", p)
        data = os.pread(fh, size, offset)
        self.faults.meter("read", p or "?", self._tid(), len(data))
        return data

    def write(self, path: str | None, data: bytes, offset: int, fh: int) -> int:
        p = self._fh_path(path, fh)
        self._gate("write", p)
        n = os.pwrite(fh, data, offset)  # an O_APPEND backing fd appends, as the caller asked
        self.faults.meter("write", p or "?", self._tid(), n)
        return n

    def truncate(self, path: str | None, length: int, fh: int | None = None) -> int:
        self._gate("truncate", self._fh_path(path, fh))
        if fh is not None:
            os.ftruncate(fh, length)
        else:
            os.truncate(self._full(path or "/"), length)
        return 0

    def flush(self, path: str | None, fh: int) -> int:
        """close(): like the kernel's own filesystems, flush by closing a duplicate."""
        self._gate("flush", self._fh_path(path, fh))
        os.close(os.dup(fh))
        return 0

    def fsync(self, path: str | None, datasync: int, fh: int) -> int:
        self._gate("fsync", self._fh_path(path, fh))
        (os.fdatasync if datasync else os.fsync)(fh)
        return 0

    def release(self, path: str | None, fh: int) -> int:
        self._gate("release", self._fh_path(path, fh))
        with self._fh_lock:
            self._fh_paths.pop(fh, None)
        os.close(fh)
        return 0


class _ControlServer(socketserver.ThreadingUnixStreamServer):
    daemon_threads = True  # a pending wait must not hold up the exit

    def __init__(self, path: str, faults: Faults) -> None:
        self.faults = faults
        super().__init__(path, _ControlHandler)


class _ControlHandler(socketserver.StreamRequestHandler):
    server: _ControlServer

    def handle(self) -> None:
        line = self.rfile.readline()
        try:
            resp = self.server.faults.handle(json.loads(line))
        except (ValueError, TypeError, KeyError) as e:  # RuleError is a ValueError
            resp = {"ok": False, "error": str(e)}
        self.wfile.write((json.dumps(resp) + "\n").encode())


def _fuse_class() -> type:
    """mfusepy's FUSE, with utimens passing UTIME_NOW/UTIME_OMIT through (mfusepy folds the
    timespec into nanoseconds, which garbles those two markers; touch uses UTIME_NOW)."""
    import mfusepy

    utime_now, utime_omit = (1 << 30) - 1, (1 << 30) - 2

    class FUSE(mfusepy.FUSE):
        def utimens_fuse_3(self, path: bytes | None, buf: Any, fip: Any) -> int:
            ops = self.operations
            p = None if path is None else path.decode(self.encoding, self.errors)
            if not buf:
                return ops.utimens(p, None)
            ts = (buf.contents.actime, buf.contents.modtime)
            if all(t.tv_nsec == utime_now for t in ts):
                return ops.utimens(p, None)
            full = ops._full(p or "/")
            st = os.lstat(full)
            old = (st.st_atime_ns, st.st_mtime_ns)
            now = time.time_ns()
            marked = {utime_now: now, utime_omit: None}
            ns = tuple(
                (old[i] if marked[t.tv_nsec] is None else now)
                if t.tv_nsec in marked
                else t.tv_sec * 10**9 + t.tv_nsec
                for i, t in enumerate(ts)
            )
            return ops.utimens(p, ns)

    return FUSE


def serve(backing: str, mountpoint: str, control: str, ready_fd: int | None = None) -> int:
    """Mount, serve until unmounted, clean up the control socket. Blocks in the FUSE loop."""
    os.environ.setdefault("FUSE_LIBRARY_NAME", "fuse3")  # mfusepy would take libfuse 2 if installed
    os.umask(0)  # the kernel already applied the caller's umask to every mode we receive
    fuse_cls = _fuse_class()
    import mfusepy

    if len(control.encode()) > 107:
        raise SystemExit(
            f"faultfs: control socket path {control} is longer than 107 bytes: choose a shorter one"
        )
    with contextlib.suppress(FileNotFoundError):
        probe = socket.socket(socket.AF_UNIX)
        try:
            probe.connect(control)
            raise SystemExit(
                f"faultfs: control socket {control} is in use by another faultfs: choose another path"
            )
        except ConnectionRefusedError:
            os.unlink(control)  # left by a faultfs that died
        finally:
            probe.close()
    faults = Faults()
    server = _ControlServer(control, faults)
    threading.Thread(target=server.serve_forever, name="faultfs-control", daemon=True).start()

    def on_ready() -> None:
        if ready_fd is not None:
            os.write(ready_fd, b"ready\n")
            os.close(ready_fd)
        else:
            print(f"faultfs: {backing} mounted on {mountpoint}; control socket {control}", file=sys.stderr)

    ops = Passthrough(backing, faults, on_ready, lambda: mfusepy.fuse_get_context()[2])
    try:
        fuse_cls(
            ops,
            mountpoint,
            foreground=True,
            fsname="faultfs",
            subtype="faultfs",
            max_threads=MAX_THREADS,
            max_idle_threads=MAX_IDLE_THREADS,
        )
    finally:
        faults.shutdown()
        server.server_close()  # its thread is a daemon: no need to wait out its poll interval
        with contextlib.suppress(FileNotFoundError):
            os.unlink(control)
    return 0


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m supervisor.drill.faultfs",
        description="Mount BACKING on MOUNTPOINT through a fault-injecting FUSE passthrough (foreground; "
        "Ctrl-C or fusermount3 -u MOUNTPOINT ends it). Steer it with python -m supervisor.drill.faultctl.",
    )
    ap.add_argument("backing")
    ap.add_argument("mountpoint")
    ap.add_argument("--control", required=True, help="Unix socket path for rules and counters")
    ap.add_argument("--ready-fd", type=int, help=argparse.SUPPRESS)  # faultctl: written once mounted
    a = ap.parse_args(argv)
    for what, p in (("backing", a.backing), ("mountpoint", a.mountpoint)):
        if not os.path.isdir(p):
            print(f"faultfs: {what} {p} is not a directory: create it first", file=sys.stderr)
            return 2
    return serve(a.backing, a.mountpoint, a.control, a.ready_fd)


if __name__ == "__main__":
    sys.exit(main())
