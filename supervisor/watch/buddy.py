"""This node's part in the memory tier's buddy replica (docs/tiers.md#the-buddy-replica): with
the memory tier on (the default) on a job of more than one node, each node's watchdog

- receives: listens for the previous node's pushes (node i-1 in a ring) and keeps them in its own
  memory folder (``memsnap.replica_dir``), and answers pulls of what it keeps (a node taking a lost
  one's place fetches the lost one's snapshot from there); its address goes into the run dir
  (``RunDir.replica_endpoint``) for the others to find;
- pushes: a thread sends each new committed snapshot of this node's ranks to the next node, one at
  a time, the newest only (a snapshot committed during a push waits; one overtaken is skipped),
  paced to ``--replica-bandwidth``.

The transfers themselves are ``replica.py``'s. The handshake's key is the ``--signing-key``'s
(derived: the key itself never goes on the wire), else the job's secret in the run dir
(``RunDir.replica_key``, made once by whichever node comes first, 0600; a key file others can read
turns the replica off).
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import os
import re
import secrets
import socket
import stat
import threading
import time
from pathlib import Path

from supervisor.format import eventtypes as ev
from supervisor.format import memsnap
from supervisor.format.events import EventLog
from supervisor.format.layout import RunDir
from supervisor.store.ioerrors import describe
from supervisor.watch.replica import Moved, Receiver, ReplicaError, pull, push

__all__ = ["Buddy", "job_key"]

KEY_BYTES = 32
# A push that works is logged at most this often (with how many since); a failure each new reason.
PUSHED_EVERY_S = 60.0
# What differs between two reports of one failure: steps, sizes, checksums.
_DIGITS = re.compile(r"[0-9a-f]{8,}|\d+")


class NoKey(Exception):
    """The job's replica key cannot be had (one line)."""


def job_key(run: RunDir, signing_key: bytes | None) -> bytes:
    """The handshake's key: derived from ``signing_key``, else the job's secret file, made here
    when no node made it yet (written whole under a temporary name, then linked into place: a
    node that reads it never sees half of one)."""
    if signing_key:
        return hmac.new(signing_key, b"supervisor memory replica", hashlib.sha256).digest()
    path = run.replica_key
    path.parent.mkdir(parents=True, exist_ok=True)
    if not path.exists():
        tmp = path.with_name(f".key.{os.getpid()}.{secrets.token_hex(4)}")
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o600)
        try:
            os.write(fd, secrets.token_hex(KEY_BYTES).encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        with contextlib.suppress(FileExistsError):  # another node was first: its key is the job's
            os.link(tmp, path)
        os.unlink(tmp)
    return _read_key(path)


def _read_key(path: Path) -> bytes:
    fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode) or st.st_mode & 0o077:
            raise NoKey(f"{path}: not a private file (mode {stat.filemode(st.st_mode)}): chmod 600 it")
        raw = os.read(fd, 2 * KEY_BYTES + 1)
    finally:
        os.close(fd)
    try:
        key = bytes.fromhex(raw.decode())
    except (UnicodeDecodeError, ValueError):
        key = b""
    if len(key) != KEY_BYTES:
        raise NoKey(f"{path}: not a key of {KEY_BYTES} bytes in hex: remove it, the next start makes one")
    return key


class Buddy:
    """The receiver and the pusher of node ``node`` of ``nodes`` (see above); ``start`` starts
    both (or says in the event log why not), ``close`` stops both and withdraws the address."""

    def __init__(
        self,
        log: EventLog,
        run: RunDir,
        folder: Path,
        node: int,
        nodes: int,
        rate_mb_s: float,
        poll_s: float,
    ) -> None:
        self.log, self.run, self.folder = log, run, folder
        self.node, self.nodes, self.buddy = node, nodes, (node + 1) % nodes
        self.rate = rate_mb_s * 1e6
        self.poll_s = poll_s
        self.key = b""
        self.receiver: Receiver | None = None
        self._stop = threading.Event()
        self._pusher = threading.Thread(target=self._push_loop, name="replica-pusher", daemon=True)
        self.pushed = -1  # the newest step the buddy kept
        self.tried = -1  # the newest step a push was tried for (a failed one is tried again)
        self._since = 0  # pushes since the last replica_pushed event
        self._logged_t = 0.0
        self._last_failure = ""

    def start(self, signing_key: bytes | None) -> None:
        try:
            self.key = job_key(self.run, signing_key)
            self.receiver = Receiver(self.folder, self.key, rate=self.rate, on_request=self._served).start()
            host, port = socket.gethostname(), self.receiver.address[1]
            endpoint = memsnap.Endpoint(self.node, host, port, os.getpid(), time.time())
            memsnap.write_record(self.run.replica_endpoint(self.node), endpoint.to_dict())
        except (OSError, NoKey) as e:
            why = describe(e) if isinstance(e, OSError) else str(e)
            if self.receiver is not None:
                self.receiver.close()
                self.receiver = None
            self.log.emit(ev.Replica(host="", port=0, buddy=self.buddy), f"no buddy replica: {why}")
            return
        self._pusher.start()
        self.log.emit(
            ev.Replica(host=host, port=port, buddy=self.buddy),
            f"buddy replica: this node keeps node {(self.node - 1) % self.nodes}'s "
            f"snapshots (listening on {host}:{port}) and pushes its own to node {self.buddy}",
        )

    def fetch(self, node: int) -> str:
        """Node ``node``'s replica brought into this node's memory folder from the buddy that keeps
        it (nothing to bring when that buddy is this node); '' or why not (one line)."""
        keeper = (node + 1) % self.nodes
        if keeper == self.node or self.receiver is None:
            return "" if keeper == self.node else "no buddy replica on this node"
        endpoint = memsnap.read_endpoint(self.run.replica_endpoint(keeper))
        if endpoint is None:
            return f"node {keeper}, which keeps node {node}'s replica, published no receiver"
        try:
            pull((endpoint.host, endpoint.port), self.key, node, self.folder)
        except ReplicaError as e:
            return str(e)
        return ""

    def close(self) -> None:
        self._stop.set()
        if self._pusher.is_alive():
            self._pusher.join()
        if self.receiver is not None:
            self.receiver.close()
            with contextlib.suppress(OSError):
                os.unlink(self.run.replica_endpoint(self.node))

    def _push_loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            commit = memsnap.read_commit(self.folder)
            if commit is None or commit.step == self.pushed:
                continue
            self._push(commit)

    def _push(self, commit: memsnap.Commit) -> None:
        self.tried = commit.step
        snap = memsnap.named(self.folder, commit)
        endpoint = memsnap.read_endpoint(self.run.replica_endpoint(self.buddy))
        pin = self.folder / memsnap.PINNED
        try:
            if snap is None:
                return  # overwritten since its commit: the next commit comes
            if endpoint is None:
                raise ReplicaError(
                    f"node {self.buddy} published no receiver ({self.run.replica_endpoint(self.buddy)})"
                )
            memsnap.write_record(pin, memsnap.Pinned(commit.slot, commit.step).to_dict())
            moved = push((endpoint.host, endpoint.port), self.key, self.node, snap, self.rate)
        except (ReplicaError, OSError) as e:
            self._failed(commit.step, str(e) if isinstance(e, ReplicaError) else describe(e))
            return
        finally:
            with contextlib.suppress(OSError):
                os.unlink(pin)
        self._kept(moved)

    def _kept(self, moved: Moved) -> None:
        self.pushed, self._last_failure = moved.step, ""
        self._since += 1
        now = time.monotonic()
        if not self._logged_t or now - self._logged_t >= PUSHED_EVERY_S:
            self.log.emit(
                ev.ReplicaPushed(
                    step=moved.step,
                    buddy=self.buddy,
                    bytes=moved.bytes,
                    seconds=round(moved.seconds, 3),
                    pushes=self._since,
                ),
                f"node {self.buddy} keeps this node's snapshot of step {moved.step} "
                f"({moved.bytes} bytes in {moved.seconds:.3f}s; {self._since} push(es) since the last such line)",
            )
            self._since, self._logged_t = 0, now

    def _failed(self, step: int, why: str) -> None:
        kind = _DIGITS.sub("#", why)  # the same failure at another step, with another checksum
        if kind != self._last_failure:
            self._last_failure = kind
            self.log.emit(
                ev.ReplicaFailed(step=step, buddy=self.buddy, reason=why),
                f"node {self.buddy} does not keep this node's snapshot of step {step}: {why}",
            )

    def _served(self, op: str, moved: Moved) -> None:
        if op == "push" and not moved.why:
            return  # the pusher's side logs the pushes that work
        self.log.emit(
            ev.ReplicaServed(
                op=op,
                node=moved.node,
                step=moved.step,
                bytes=moved.bytes,
                seconds=round(moved.seconds, 3),
                reason=moved.why,
            ),
            f"replica {op} of node {moved.node}: "
            + (
                f"refused ({moved.why})"
                if moved.why
                else f"step {moved.step}, {moved.bytes} bytes in {moved.seconds:.3f}s"
            ),
        )
