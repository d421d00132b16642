"""Mount and steer the fault filesystem (supervisor/drill/faultfs.py) from tests, the drill or a
shell.

    with FaultFS.start(backing, mountpoint) as fs:       # mounted when start() returns
        rid = fs.fail("*/step_10/*", "EIO", ops=["read"], count=3)
        ...
        assert fs.hits(rid) == 3                          # the fault really fired

    python -m supervisor.drill.faultctl SOCKET add '{"action": "error", "errno": "EIO", "pattern": "*.distcp"}'
    python -m supervisor.drill.faultctl SOCKET status | clear [ID] | wait-blocked [ID]

Torch-free and mfusepy-free: only the filesystem's own process imports mfusepy.
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import importlib.util
import json
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

from supervisor.drill.mounts import is_mounted, unmount

START_TIMEOUT_S = 60.0
STOP_GRACE_S = 10.0  # after a lazy unmount: for files still open to be closed, before SIGTERM
KILL_WAIT_S = 10.0
CALL_MARGIN_S = 10.0  # a control call may take this much longer than the wait it asks for
APT_LOCK_TIMEOUT_S = 300  # other jobs on the machine may hold dpkg's lock
# Held while this project installs a package (fuse3 here, SLURM in tests/slurm/cluster.sh, which
# names the same file): two test workers starting on a fresh machine would otherwise run apt-get
# at once, and the one refused apt's lists lock skipped every test that needed the package.
APT_INSTALL_LOCK = Path(tempfile.gettempdir()) / "resumable-training-apt.lock"
REPO = Path(__file__).resolve().parents[2]  # for the filesystem process, also when not installed


class FaultFSError(RuntimeError):
    """The filesystem refused a request (bad rule, unknown id) or could not be reached."""


@dataclass(frozen=True)
class Blocked:
    """An operation held by a block rule right now."""

    rules: tuple[str, ...]
    op: str
    path: str  # inside the mount
    pid: int  # the calling process (-1 once it is gone)
    tid: int  # the calling thread
    since: float  # wall-clock time it blocked


@dataclass(frozen=True)
class Status:
    ops: dict[str, int]  # operations seen, by FUSE name
    rules: dict[str, dict[str, Any]]  # id -> the rule, "hits" and "active"
    blocked: list[Blocked]

    @classmethod
    def from_reply(cls, r: Mapping[str, Any]) -> Status:
        return cls(
            ops=dict(r["ops"]),
            rules={d["id"]: d for d in r["rules"]},
            blocked=[Blocked(**{**b, "rules": tuple(b["rules"])}) for b in r["blocked"]],
        )


class Controller:
    """The control socket's client. Every call is one connection, so threads and processes may
    share one filesystem; a rule is in force when the call that set it returns."""

    def __init__(self, control: str | os.PathLike[str]) -> None:
        self.control = str(control)

    def call(self, req: Mapping[str, Any], timeout: float = 30.0) -> dict[str, Any]:
        with socket.socket(socket.AF_UNIX) as s:
            s.settimeout(timeout)
            try:
                s.connect(self.control)
                s.sendall((json.dumps(req) + "\n").encode())
                data = b""
                while not data.endswith(b"\n"):
                    chunk = s.recv(65536)
                    if not chunk:
                        break
                    data += chunk
            except OSError as e:
                raise FaultFSError(
                    f"faultfs control socket {self.control}: {e}: is the filesystem running?"
                ) from e
        reply = json.loads(data) if data else {"ok": False, "error": "no answer"}
        if not reply.get("ok"):
            raise FaultFSError(f"faultfs: {req.get('cmd')}: {reply.get('error')}")
        return reply

    # -- rules: each returns the rule id
    def add(self, rule: Mapping[str, Any]) -> str:
        return self.call({"cmd": "add", "rule": dict(rule)})["id"]

    def fail(self, pattern: str, errno: int | str, ops: Iterable[str] | None = None, **window: Any) -> str:
        """``ops`` on paths matching ``pattern`` fail with ``errno`` ("EIO", "ESTALE", "ENOSPC",
        ...). window: count=N (the first N), seconds=S, pids=[...] (those processes and children),
        skip=K (the first K matching operations let through before the window opens)."""
        return self.add(_rule("error", pattern, ops, errno=errno, **window))

    def delay(self, pattern: str, seconds: float, ops: Iterable[str] | None = None, **window: Any) -> str:
        """Each matching operation waits ``seconds`` first (added latency)."""
        return self.add(_rule("delay", pattern, ops, delay_s=seconds, **window))

    def throttle(
        self, pattern: str, bytes_per_s: float, ops: Iterable[str] | None = None, **window: Any
    ) -> str:
        """Reads and writes on matching paths move at most ``bytes_per_s``, all threads together."""
        return self.add(_rule("throttle", pattern, ops, bytes_per_s=bytes_per_s, **window))

    def block(self, pattern: str, ops: Iterable[str] | None = None, **window: Any) -> str:
        """Matching operations wait until the rule is cleared (the caller sits in the kernel, in
        state D or S, as on a hung NFS server). ops=["read"]: only reads; None: every operation,
        so the first stat (a path lookup) already hangs."""
        return self.add(_rule("block", pattern, ops, **window))

    def hide(self, pattern: str, **window: Any) -> str:
        """Matching paths are missing from the view (stat/open: ENOENT, listings leave them out),
        e.g. pids=[rank0_pid] for a file one rank does not see yet."""
        return self.add(_rule("hide", pattern, None, **window))

    def clear(self, rule_id: str | None = None) -> list[str]:
        """Remove a rule (all when None); operations it blocks go on. Returns the ids removed."""
        return self.call({"cmd": "clear", "id": rule_id})["cleared"]

    release = clear  # reads better after block()

    # -- observing
    def status(self) -> Status:
        return Status.from_reply(self.call({"cmd": "status"}))

    def hits(self, rule_id: str) -> int:
        """How often the rule fired (an operation it failed, delayed, metered, blocked or hid)."""
        return self.status().rules[rule_id]["hits"]

    def ops(self) -> dict[str, int]:
        return self.status().ops

    def blocked(self) -> list[Blocked]:
        return self.status().blocked

    def wait(
        self,
        rule_id: str | None = None,
        *,
        hits: int | None = None,
        blocked: int | None = None,
        timeout: float = 60.0,
    ) -> Status:
        """Wait (in the filesystem, an event, not a poll) until ``rule_id`` fired ``hits`` times
        and/or ``blocked`` operations are held (by that rule, or any). TimeoutError otherwise."""
        req = {"cmd": "wait", "id": rule_id, "hits": hits, "blocked": blocked, "timeout": timeout}
        reply = self.call(req, timeout=timeout + CALL_MARGIN_S)
        status = Status.from_reply(reply)
        if not reply["reached"]:
            want = ", ".join(f"{k}>={v}" for k, v in (("hits", hits), ("blocked", blocked)) if v is not None)
            raise TimeoutError(
                f"faultfs: rule {rule_id or 'any'}: {want} not reached in {timeout:.0f}s: {status}"
            )
        return status

    def wait_blocked(self, rule_id: str | None = None, n: int = 1, timeout: float = 60.0) -> list[Blocked]:
        status = self.wait(rule_id, blocked=n, timeout=timeout)
        return [b for b in status.blocked if rule_id is None or rule_id in b.rules]


def _rule(action: str, pattern: str, ops: Iterable[str] | None, **fields: Any) -> dict[str, Any]:
    d: dict[str, Any] = {"action": action, "pattern": pattern, **fields}
    if ops is not None:
        d["ops"] = [ops] if isinstance(ops, str) else list(ops)
    if "pids" in d and d["pids"] is not None:
        d["pids"] = list(d["pids"])
    return d


class FaultFS(Controller):
    """A mounted fault filesystem: its own process serving ``mountpoint`` from ``backing``, and
    the controller for it. ``start`` returns once the mount is up; ``stop`` always unmounts."""

    def __init__(
        self,
        backing: Path,
        mountpoint: Path,
        control: str,
        proc: subprocess.Popen[bytes],
        own_dir: Path | None,
    ):
        super().__init__(control)
        self.backing = backing
        self.mountpoint = mountpoint
        self.proc = proc
        self._own_dir = own_dir  # the temp dir of the socket and log, removed on stop

    @property
    def log(self) -> Path:
        return Path(self.control).with_suffix(".log")

    @classmethod
    def start(
        cls,
        backing: str | os.PathLike[str],
        mountpoint: str | os.PathLike[str],
        control: str | os.PathLike[str] | None = None,
        timeout: float = START_TIMEOUT_S,
    ) -> FaultFS:
        """Mount ``backing`` on ``mountpoint`` (both created if missing). The control socket goes
        to a fresh short temp dir unless given (Unix socket paths are limited to 107 bytes)."""
        if importlib.util.find_spec("mfusepy") is None:
            raise FaultFSError("faultfs needs mfusepy: pip install -e '.[dev]' (or '.[drill]')")
        backing, mountpoint = Path(backing).resolve(), Path(mountpoint).resolve()
        backing.mkdir(parents=True, exist_ok=True)
        mountpoint.mkdir(parents=True, exist_ok=True)
        own_dir = None
        if control is None:
            own_dir = Path(tempfile.mkdtemp(prefix="faultfs-"))
            control = own_dir / "control.sock"
        control = str(control)
        rfd, wfd = os.pipe()
        cmd = [sys.executable, "-m", "supervisor.drill.faultfs", str(backing), str(mountpoint)]
        env = {
            **os.environ,
            "PYTHONPATH": os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")])),
        }
        with open(Path(control).with_suffix(".log"), "ab") as log:
            proc = subprocess.Popen(
                [*cmd, "--control", control, "--ready-fd", str(wfd)],
                stdin=subprocess.DEVNULL, stdout=log, stderr=log, pass_fds=(wfd,), cwd="/", env=env,
                start_new_session=True,  # a Ctrl-C to the test run must not kill it before teardown
            )  # fmt: skip
        os.close(wfd)
        fs = cls(backing, mountpoint, control, proc, own_dir)
        try:
            ready, _, _ = select.select([rfd], [], [], timeout)
            line = os.read(rfd, 64) if ready else b""
            if line != b"ready\n":
                why = (
                    f"not mounted after {timeout:.0f}s"
                    if not ready
                    else f"exited with {proc.wait(timeout=10)}"
                )
                raise FaultFSError(f"faultfs on {mountpoint} {why}: {fs._log_tail()}")
            if not is_mounted(mountpoint):
                raise FaultFSError(f"faultfs said ready but {mountpoint} is not in /proc/self/mountinfo")
        except BaseException:
            fs.stop()
            raise
        finally:
            os.close(rfd)
        return fs

    def _log_tail(self, lines: int = 5) -> str:
        try:
            return (
                " | ".join(self.log.read_text(errors="replace").strip().splitlines()[-lines:])
                or "(no output)"
            )
        except OSError:
            return "(no log)"

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """Release everything blocked, unmount, and wait for the process to exit. A busy mount
        (files still open in it) is detached lazily and served until they are closed, for at most
        ``grace`` seconds; then the process is ended (SIGTERM, SIGKILL) and those files fail with
        ENOTCONN. Raises only if the mount is still there afterwards."""
        if self.proc.poll() is None:
            with contextlib.suppress(FaultFSError):  # not answering: the unmount and signals still end it
                self.call({"cmd": "shutdown"}, timeout=5.0)
        unmount(self.mountpoint, ("fusermount3", "-u"))
        for sig, wait in ((None, grace), (signal.SIGTERM, KILL_WAIT_S), (signal.SIGKILL, KILL_WAIT_S)):
            if sig is not None and self.proc.poll() is None:
                self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout=wait)
                break
            except subprocess.TimeoutExpired:
                continue
        unmount(self.mountpoint, ("fusermount3", "-u"))  # a process killed while mounted leaves it
        if self.log.exists() and self.log.stat().st_size:  # silent when all went well
            print(f"faultfs on {self.mountpoint} said: {self._log_tail()}", file=sys.stderr)
        if self._own_dir is not None:
            shutil.rmtree(self._own_dir, ignore_errors=True)

    def __enter__(self) -> FaultFS:
        return self

    def __exit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()


@functools.cache
def fuse_unavailable() -> str | None:
    """Why a FUSE mount cannot be made here, or None. Installs Debian's fuse3 when fusermount3 is
    missing and we are root, like tests/slurm/cluster.sh installs SLURM."""
    if not os.path.exists("/dev/fuse"):
        return "no /dev/fuse on this machine"
    if not os.access("/dev/fuse", os.R_OK | os.W_OK):
        return "/dev/fuse is not readable and writable by this user (not root?)"
    if shutil.which("fusermount3"):
        return None
    if os.geteuid() != 0:
        return "fusermount3 missing and not root, so apt-get cannot install fuse3"
    if not shutil.which("apt-get"):
        return "fusermount3 missing and no apt-get on this machine to install fuse3"
    from filelock import FileLock  # here: only a machine without fuse3 pays its import

    with FileLock(APT_INSTALL_LOCK):
        if shutil.which("fusermount3"):  # installed by whoever held the lock before
            return None
        env = {**os.environ, "DEBIAN_FRONTEND": "noninteractive"}
        lock = f"DPkg::Lock::Timeout={APT_LOCK_TIMEOUT_S}"
        for cmd in (
            ["apt-get", "-o", lock, "update", "-q"],
            ["apt-get", "-o", lock, "install", "-y", "-q", "--no-install-recommends", "fuse3"],
        ):
            r = subprocess.run(cmd, capture_output=True, text=True, env=env, timeout=900, check=False)
            if r.returncode != 0:
                last = (r.stderr.strip() or r.stdout.strip()).splitlines()[-1:] or ["no output"]
                return f"apt-get could not install fuse3 ({' '.join(cmd[3:5])}: {last[0]})"
    return None if shutil.which("fusermount3") else "apt-get installed fuse3 but fusermount3 is not on PATH"


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(
        prog="python -m supervisor.drill.faultctl",
        description="Steer a running faultfs through its control socket.",
    )
    ap.add_argument("control", help="the control socket given to faultfs --control")
    sub = ap.add_subparsers(dest="cmd", required=True)
    p = sub.add_parser("add", help="set a rule, given as JSON (see docs/storage-faults.md); prints its id")
    p.add_argument("rule")
    p = sub.add_parser("clear", help="remove a rule (all without ID); what it blocks goes on")
    p.add_argument("id", nargs="?")
    sub.add_parser("status", help="operation counters, rules with their hits, blocked operations (JSON)")
    p = sub.add_parser("wait-blocked", help="wait until an operation is blocked (by rule ID, or any)")
    p.add_argument("id", nargs="?")
    p.add_argument("--timeout", type=float, default=60.0)
    a = ap.parse_args(argv)
    ctl = Controller(a.control)
    try:
        if a.cmd == "add":
            print(ctl.add(json.loads(a.rule)))
        elif a.cmd == "clear":
            print(" ".join(ctl.clear(a.id)))
        elif a.cmd == "status":
            s = ctl.status()
            print(
                json.dumps(
                    {"ops": s.ops, "rules": s.rules, "blocked": [b.__dict__ for b in s.blocked]}, indent=1
                )
            )
        else:
            for b in ctl.wait_blocked(a.id, timeout=a.timeout):
                print(
                    f"{b.op} {b.path} pid {b.pid} blocked for {time.time() - b.since:.1f}s by {','.join(b.rules)}"
                )
    except (FaultFSError, TimeoutError, json.JSONDecodeError) as e:
        print(f"faultctl: {e}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
