"""The memory tier's replica on a buddy node (issue 40, item 2): a node's watchdog pushes its
newest committed memory snapshot to its buddy's watchdog, which keeps it in its own memory folder
(``memsnap.replica_dir``), so the state of a node lost with its shared memory is one node away; the
node that takes the lost one's place pulls it from there.

Torch-free: one TCP connection per request, bytes and JSON only.

    client (a sender, or a node taking a lost one's place)      receiver (the buddy)
    connect                                                 ->
                                                            <-   magic, nonce_r
    nonce_s, mac(key, "send", nonce_r, nonce_s)             ->
                                                            <-   mac(key, "recv", nonce_s, nonce_r)
    request {"op": "push"} or {"op": "pull", "node": n}, its mac
    push: the snapshot (below)                              ->
                                                            <-   verdict {"ok": ..., "why": ...}
    pull:                                                   <-   the replica of node n (below)

    a snapshot: a header (node, step, launch, each rank's index and data sizes) and its mac; then
    each rank's index and its mac, and its data, paced to the bandwidth cap

Authenticated by the job's key: each side proves it holds the key over both nonces (no replay, no
impersonation without it), and every frame but the data carries an HMAC-SHA256 under a key made
from both nonces. An index holds its data's checksum (xxh3-128), so data altered on the way, or
read by the sender while its ranks overwrote the slot, fails the checksum of an index that came
from a holder of the key. The data itself carries no MAC: an attacker on the path who can rewrite
a TCP stream and forge an xxh3 collision is outside what this defends (docs/tiers.md).

On arrival everything is checked before it is kept: the header's sizes capped (an index at
``memsnap.INDEX_MAX``, the whole snapshot at the free space of the memory folder), every index
parsed as a rank's own (``memsnap.parse_index``) with the header's rank, step and size, every
rank's data verified, every local rank of the node there. It is written into the replica's slot
that does not hold its newest complete copy (its indexes removed first, the data, the indexes by
rename, the commit record last), so a transfer that fails anywhere leaves the previous replica as
it was, and a reader never sees a half-written one.
"""

from __future__ import annotations

import contextlib
import hashlib
import hmac
import json
import os
import secrets
import select
import shutil
import socket
import struct
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.format import memsnap
from supervisor.format.capped import RECORD_MAX

__all__ = ["Moved", "Receiver", "ReplicaError", "pull", "push"]

MAGIC = b"RSNPREP1"
NONCE = 32
MAC = 32
_LEN = struct.Struct(">I")
# Bytes per send: the unit the pacer meters (a small multiple of a socket buffer).
SEND_CHUNK = 1 << 20
# What a push must leave free in the receiver's memory folder, beyond its own size.
FREE_MARGIN = 64 << 20
PUSH, PULL = "push", "pull"


class ReplicaError(Exception):
    """A push that did not arrive whole and verified: one line saying why (the sender's or the
    receiver's verdict)."""


def _mac(key: bytes, *parts: bytes) -> bytes:
    return hmac.new(key, b"".join(_LEN.pack(len(p)) + p for p in parts), hashlib.sha256).digest()


# ---------------------------------------------------------------- framing


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    buf = bytearray(n)
    view = memoryview(buf)
    got = 0
    while got < n:
        k = sock.recv_into(view[got:], n - got)
        if not k:
            raise ReplicaError(f"the connection closed {n - got} bytes short")
        got += k
    return bytes(buf)


def _send_frame(sock: socket.socket, payload: bytes, key: bytes | None = None) -> None:
    mac = _mac(key, payload) if key is not None else b""
    sock.sendall(_LEN.pack(len(payload)) + payload + mac)


def _recv_frame(sock: socket.socket, cap: int, key: bytes | None = None, what: str = "frame") -> bytes:
    (n,) = _LEN.unpack(_recv_exact(sock, _LEN.size))
    if n > cap:
        raise ReplicaError(f"{what} of {n} bytes, over its cap of {cap}")
    payload = _recv_exact(sock, n)
    if key is not None and not hmac.compare_digest(_recv_exact(sock, MAC), _mac(key, payload)):
        raise ReplicaError(f"{what}: its MAC does not match (not from a holder of the job's key, or altered)")
    return payload


def _json(payload: bytes, what: str) -> dict[str, Any]:
    try:
        d = json.loads(payload)
    except (ValueError, UnicodeDecodeError) as e:
        raise ReplicaError(f"{what} is not JSON ({e})") from None
    if not isinstance(d, dict):
        raise ReplicaError(f"{what} is not a JSON object")
    return d


# ---------------------------------------------------------------- the handshake


def _prove_sender(sock: socket.socket, key: bytes) -> bytes:
    """The sender's side: the session key once both sides proved they hold ``key``."""
    hello = _recv_exact(sock, len(MAGIC) + NONCE)
    if hello[: len(MAGIC)] != MAGIC:
        raise ReplicaError("the buddy did not answer as a replica receiver (wrong port, or another version)")
    nonce_r, nonce_s = hello[len(MAGIC) :], secrets.token_bytes(NONCE)
    sock.sendall(nonce_s + _mac(key, b"send", nonce_r, nonce_s))
    try:
        proof = _recv_exact(sock, MAC)
    except ReplicaError:
        raise ReplicaError("the buddy refused the handshake (does it hold the job's key?)") from None
    if not hmac.compare_digest(proof, _mac(key, b"recv", nonce_s, nonce_r)):
        raise ReplicaError("the buddy could not prove it holds the job's key")
    return _mac(key, b"session", nonce_r, nonce_s)


def _prove_receiver(sock: socket.socket, key: bytes) -> bytes:
    """The receiver's side of ``_prove_sender``."""
    nonce_r = secrets.token_bytes(NONCE)
    sock.sendall(MAGIC + nonce_r)
    got = _recv_exact(sock, NONCE + MAC)
    nonce_s, proof = got[:NONCE], got[NONCE:]
    if not hmac.compare_digest(proof, _mac(key, b"send", nonce_r, nonce_s)):
        raise ReplicaError("the sender could not prove it holds the job's key")
    sock.sendall(_mac(key, b"recv", nonce_s, nonce_r))
    return _mac(key, b"session", nonce_r, nonce_s)


# ---------------------------------------------------------------- pacing


class _Pacer:
    """Keeps a stream at or under ``rate`` bytes a second (0: unpaced): sleeps before each chunk
    that would run ahead of the rate since the first."""

    def __init__(self, rate: float, clock: Callable[[], float] = time.monotonic) -> None:
        self.rate, self.clock = rate, clock
        self.t0 = clock()
        self.sent = 0

    def wait(self, n: int) -> None:
        if self.rate > 0:
            ahead = (self.sent + n) / self.rate - (self.clock() - self.t0)
            if ahead > 0:
                time.sleep(ahead)
        self.sent += n


# ---------------------------------------------------------------- a snapshot on the wire


@dataclass(frozen=True)
class Moved:
    """A snapshot that arrived whole and verified (``why`` empty), or why not: for the event log."""

    node: int
    step: int
    bytes: int
    seconds: float
    why: str = ""


def _stream(sock: socket.socket, session: bytes, node: int, snap: memsnap.NodeSnapshot, rate: float) -> None:
    """Node ``node``'s snapshot ``snap`` on ``sock``: the header, then each rank's index and data,
    paced to ``rate`` bytes a second (0: unpaced); stops early when the other side has answered
    (a refusal: the rest would be drained for nothing)."""
    ranks = sorted(snap.ranks.items())
    indexes = {r: json.dumps(ix.to_dict()).encode() for r, ix in ranks}
    header = {
        "node": node,
        "step": snap.step,
        "launch": snap.launch,
        "ranks": [[r, len(indexes[r]), ix.size] for r, ix in ranks],
    }
    _send_frame(sock, json.dumps(header).encode(), session)
    pacer = _Pacer(rate)
    for r, ix in ranks:
        if _answered(sock):
            return
        _send_frame(sock, indexes[r], session)
        if not _send_data(sock, memsnap.data_path(snap.folder, snap.slot, r), ix.size, pacer):
            return


class _NotKept(ReplicaError):
    """A snapshot whose header was read, refused or not kept: which one, and why."""

    def __init__(self, node: int, step: int, size: int, why: str) -> None:
        super().__init__(why)
        self.node, self.step, self.size = node, step, size


def _take(sock: socket.socket, session: bytes, folder: Path) -> tuple[int, int, int]:
    """A snapshot ``_stream`` sends, kept in ``folder``'s replica of its node; (node, step, bytes).
    ReplicaError or SnapshotError (one line) for a header refused; _NotKept once it was read."""
    node, step, launch, ranks = _header(_recv_frame(sock, RECORD_MAX, session, "the header"))
    size = sum(d for _, _, d in ranks)
    try:
        _room(folder, size)
        _keep(sock, session, memsnap.replica_dir(folder, node), step, launch, ranks)
    except (OSError, ReplicaError, memsnap.SnapshotError) as e:
        raise _NotKept(node, step, size, _why(e)) from None
    return node, step, size


def _why(e: Exception) -> str:
    if isinstance(e, OSError) and not isinstance(e, socket.timeout):
        return f"{e.filename + ': ' if e.filename else ''}{e.strerror or e}"
    return str(e) or type(e).__name__


# ---------------------------------------------------------------- the two requests


def push(
    address: tuple[str, int],
    key: bytes,
    node: int,
    snap: memsnap.NodeSnapshot,
    rate: float = 0.0,
    timeout: float = 60.0,
) -> Moved:
    """Send node ``node``'s snapshot ``snap`` (every local rank's index and data) to the receiver
    at ``address``, paced to ``rate`` bytes a second (0: unpaced); ReplicaError (one line) unless
    the receiver kept it."""
    t0 = time.monotonic()
    try:
        with socket.create_connection(address, timeout=timeout) as sock:
            session = _prove_sender(sock, key)
            _send_frame(sock, json.dumps({"op": PUSH}).encode(), session)
            _stream(sock, session, node, snap, rate)
            sock.shutdown(socket.SHUT_WR)
            verdict = _json(_recv_frame(sock, RECORD_MAX, session, "the verdict"), "the verdict")
    except OSError as e:
        raise ReplicaError(f"push of step {snap.step} to {address[0]}:{address[1]}: {_why(e)}") from None
    if verdict.get("ok") is not True:
        raise ReplicaError(f"the buddy refused step {snap.step}: {verdict.get('why') or 'no reason given'}")
    return Moved(node, snap.step, snap.size, time.monotonic() - t0)


def pull(address: tuple[str, int], key: bytes, node: int, folder: Path, timeout: float = 60.0) -> Moved:
    """Fetch the receiver's replica of node ``node`` (its newest complete one) into ``folder``'s
    replica of that node, verified as a push is: what a node taking a lost node's place resumes
    from. ReplicaError (one line) when there is none or it does not arrive whole."""
    t0 = time.monotonic()
    where = f"pull of node {node}'s replica from {address[0]}:{address[1]}"
    try:
        with socket.create_connection(address, timeout=timeout) as sock:
            session = _prove_sender(sock, key)
            _send_frame(sock, json.dumps({"op": PULL, "node": node}).encode(), session)
            got, step, size = _take(sock, session, folder)
    except (OSError, ReplicaError, memsnap.SnapshotError) as e:
        raise ReplicaError(f"{where}: {_why(e)}") from None
    if got != node:
        raise ReplicaError(f"{where}: the buddy sent node {got}'s")
    return Moved(node, step, size, time.monotonic() - t0)


def _send_data(sock: socket.socket, path: Path, size: int, pacer: _Pacer) -> bool:
    """``size`` bytes of the data file at ``path`` (its ranks may overwrite it meanwhile: the
    receiver's checksum catches that); False when the receiver answered before the end."""
    with open(path, "rb", opener=_nofollow) as f:
        sent = 0
        while sent < size:
            if _answered(sock):
                return False
            n = min(SEND_CHUNK, size - sent)
            pacer.wait(n)
            k = sock.sendfile(f, sent, n)
            if not k:
                raise ReplicaError(f"{path}: ended at {sent} of {size} bytes")
            sent += k
    return True


def _answered(sock: socket.socket) -> bool:
    return bool(select.select([sock], [], [], 0)[0])


def _nofollow(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)


# ---------------------------------------------------------------- the receiver


class Receiver:
    """Serves the buddies, one request at a time: keeps each push in ``folder``'s replica of its
    node, answers each pull with the replica it holds of the node asked for (paced to ``rate``).
    ``on_request`` hears of each (done or refused). ``start`` starts the thread, ``close`` stops it."""

    def __init__(
        self,
        folder: Path,
        key: bytes,
        host: str = "",
        port: int = 0,
        rate: float = 0.0,
        timeout: float = 60.0,
        on_request: Callable[[str, Moved], None] = lambda op, m: None,
    ) -> None:
        self.folder, self.key, self.rate, self.timeout = folder, key, rate, timeout
        self.on_request = on_request
        self._sock = socket.create_server((host, port))
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._serve, name="replica-receiver", daemon=True)

    @property
    def address(self) -> tuple[str, int]:
        host, port = self._sock.getsockname()[:2]
        return str(host), int(port)

    def start(self) -> Receiver:
        self._thread.start()
        return self

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._sock.shutdown(socket.SHUT_RDWR)
        self._sock.close()
        self._thread.join(timeout=self.timeout)

    def _serve(self) -> None:
        while not self._stop.is_set():
            try:
                conn, _ = self._sock.accept()
            except OSError:
                return  # closed
            with conn:
                conn.settimeout(self.timeout)
                self._answer(conn)

    def _answer(self, conn: socket.socket) -> None:
        t0 = time.monotonic()
        op, node, step, size, session = "?", -1, -1, 0, None
        try:
            session = _prove_receiver(conn, self.key)
            op, asked = _request(_recv_frame(conn, RECORD_MAX, session, "the request"))
            if op == PUSH:
                node, step, size = _take(conn, session, self.folder)
            else:
                node = asked
                snap = _newest(memsnap.replica_dir(self.folder, node))
                step, size = snap.step, snap.size
                _stream(conn, session, node, snap, self.rate)
            why = ""
        except (OSError, ReplicaError, memsnap.SnapshotError) as e:
            why = _why(e)
            if isinstance(e, _NotKept):
                node, step, size = e.node, e.step, e.size
        if session is not None and op == PUSH:
            with contextlib.suppress(OSError):
                _send_frame(conn, json.dumps({"ok": not why, "why": why}).encode(), session)
                while why and conn.recv(SEND_CHUNK):  # a refusal: the sender stops once it sees it
                    pass
        elif session is not None and why and step < 0:  # a pull of nothing: say so in the header's place
            with contextlib.suppress(OSError):
                _send_frame(conn, json.dumps({"error": why}).encode(), session)
        self.on_request(op, Moved(node, step, size, time.monotonic() - t0, why))


def _request(payload: bytes) -> tuple[str, int]:
    d = _json(payload, "the request")
    op, node = d.get("op"), d.get("node", -1)
    if op == PUSH:
        return op, -1
    if op == PULL and memsnap.natural(node):
        return op, node
    raise ReplicaError(f"the request {str(d)[:80]} is neither a push nor a pull of a node")


def _newest(dest: Path) -> memsnap.NodeSnapshot:
    """The replica's newest complete snapshot: the one its commit record names."""
    snap = memsnap.named(dest, memsnap.read_commit(dest))
    if snap is None:
        raise ReplicaError(f"{dest}: no complete replica here")
    return snap


def _header(payload: bytes) -> tuple[int, int, str, list[tuple[int, int, int]]]:
    """(node, step, launch, [(rank, index bytes, data bytes)]), every field checked."""
    d = _json(payload, "the header")
    if isinstance(d.get("error"), str):
        raise ReplicaError(f"the buddy has none: {d['error'][:500]}")
    node, step, launch, ranks = d.get("node"), d.get("step"), d.get("launch"), d.get("ranks")
    if not (
        memsnap.natural(node)
        and memsnap.natural(step)
        and isinstance(launch, str)
        and isinstance(ranks, list)
        and ranks
    ):
        raise ReplicaError("the header lacks node, step, launch or ranks")
    out = []
    for r in ranks:
        if not (isinstance(r, list) and len(r) == 3 and all(memsnap.natural(v) for v in r)):
            raise ReplicaError(
                f"the header's rank entry {str(r)[:80]} is not [rank, index bytes, data bytes]"
            )
        if r[1] > memsnap.INDEX_MAX:
            raise ReplicaError(f"rank {r[0]}'s index of {r[1]} bytes, over its cap of {memsnap.INDEX_MAX}")
        out.append((r[0], r[1], r[2]))
    if len({r for r, _, _ in out}) != len(out):
        raise ReplicaError("the header names a rank twice")
    return node, step, launch, out


def _room(folder: Path, size: int) -> None:
    st = os.statvfs(folder)
    free = st.f_bavail * st.f_frsize
    if free < size + FREE_MARGIN:
        raise ReplicaError(f"{folder}: {free} bytes free, the push needs {size} (+{FREE_MARGIN} to spare)")


def _keep(
    conn: socket.socket,
    session: bytes,
    dest: Path,
    step: int,
    launch: str,
    ranks: Sequence[tuple[int, int, int]],
) -> None:
    """Receive every rank's index and data into the slot of ``dest`` not holding its newest
    complete copy; verified, then the indexes, then the commit record."""
    committed = memsnap.read_commit(dest)
    slot = (committed.slot + 1) % memsnap.SLOTS if committed is not None else 0
    where = memsnap.slot_dir(dest, slot)
    _empty(where)
    kept: list[memsnap.RankIndex] = []
    for rank, index_len, data_len in ranks:
        raw = _recv_frame(conn, index_len, session, f"rank {rank}'s index")
        ix = memsnap.parse_index(raw, f"rank {rank}'s index from the buddy")
        if (ix.rank, ix.step, ix.launch, ix.size) != (rank, step, launch, data_len):
            raise ReplicaError(
                f"rank {rank}'s index says rank {ix.rank}, step {ix.step}, launch {ix.launch}, "
                f"{ix.size} bytes; the header: step {step}, launch {launch}, {data_len} bytes"
            )
        _recv_file(conn, memsnap.data_path(dest, slot, rank), data_len)
        why = memsnap.verify_rank(dest, slot, ix)
        if why:
            raise ReplicaError(why)
        kept.append(ix)
    if not memsnap.complete(dest, [(slot, ix) for ix in kept]):
        raise ReplicaError(f"step {step}: not every local rank of the node was pushed")
    for ix in kept:
        memsnap.write_record(memsnap.index_path(dest, slot, ix.rank), ix.to_dict())
    memsnap.write_record(dest / memsnap.COMMITTED, memsnap.Commit(step, slot, launch, time.time()).to_dict())


def _empty(slot: Path) -> None:
    """The slot made empty and private: its indexes first (a reader then sees no snapshot in it)."""
    if slot.is_symlink():
        raise ReplicaError(f"{slot}: a link where a replica slot goes")
    if slot.exists():
        for p in slot.glob(f"*{memsnap.INDEX_SUFFIX}"):
            p.unlink()
        shutil.rmtree(slot)
    slot.mkdir(mode=0o700, parents=True)


def _recv_file(conn: socket.socket, path: Path, size: int) -> None:
    """``size`` bytes from ``conn`` into a new private file at ``path``."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o600)
    try:
        buf = memoryview(bytearray(min(SEND_CHUNK, max(size, 1))))
        got = 0
        while got < size:
            k = conn.recv_into(buf, min(len(buf), size - got))
            if not k:
                raise ReplicaError(f"{path}: the connection closed at {got} of {size} bytes")
            done = 0
            while done < k:
                done += os.write(fd, buf[done:k])
            got += k
    finally:
        os.close(fd)
