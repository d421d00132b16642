"""When every rank of a node entered a collective and none finished it, no rank of the node is the
culprit: a rank elsewhere is, or the network between them. The kernel can tell which: a TCP
connection whose sent bytes are not acknowledged, and that has already retransmitted (its
retransmission timer ran out at least once), is one the network does not deliver. A healthy
connection of a hung collective holds nothing unacknowledged: the ranks wait for data, they do not
send it.

Pure parsing of ``/proc/<pid>/net/tcp{,6}`` (the rank's network namespace), ``/proc/<pid>/net/route``
and ``/etc/hosts``, and a thin reader; the local interface toward each unreachable address is
named with its state (``/sys/class/net/IF/operstate``: a link that is down names the node cut off).
"""

from __future__ import annotations

import os
import socket
import sys
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

ESTABLISHED = 0x01
_TABLE_MAX = 4 << 20
_SMALL_MAX = 1 << 20


@dataclass(frozen=True)
class TcpRow:
    local: tuple[str, int]
    remote: tuple[str, int]
    state: int
    unacked: int  # tx_queue: bytes sent, not acknowledged
    retransmits: int  # retransmission timeouts in a row without an acknowledgement
    inode: int


def parse_tcp_table(text: str) -> list[TcpRow]:
    """The rows of a ``/proc/net/tcp`` or ``tcp6`` table (lines that do not parse are skipped)."""
    rows = []
    for line in text.splitlines()[1:]:
        f = line.split()
        try:
            tx = int(f[4].split(":")[0], 16)
            rows.append(TcpRow(_endpoint(f[1]), _endpoint(f[2]), int(f[3], 16), tx, int(f[6], 16), int(f[9])))
        except (IndexError, ValueError):
            continue
    return rows


def _endpoint(hexed: str) -> tuple[str, int]:
    addr, port = hexed.split(":")
    raw = bytes.fromhex(addr)
    if len(raw) == 4:
        return socket.inet_ntop(socket.AF_INET, raw[::-1]), int(port, 16)
    words = b"".join(raw[i : i + 4][::-1] for i in range(0, 16, 4))  # IPv6: four host-order words
    ip = socket.inet_ntop(socket.AF_INET6, words)
    return (ip[7:] if ip.startswith("::ffff:") else ip), int(port, 16)


def stalled(rows: Iterable[TcpRow], inodes: set[int]) -> list[TcpRow]:
    """The established connections among ``inodes`` that hold unacknowledged bytes and have
    retransmitted: what the network does not deliver."""
    return [
        r
        for r in rows
        if r.inode in inodes and r.state == ESTABLISHED and r.unacked > 0 and r.retransmits > 0
    ]


def parse_routes(text: str) -> list[tuple[str, int, int]]:
    """(interface, destination, mask) of each IPv4 route in ``/proc/net/route``, as integers."""
    out = []
    for line in text.splitlines()[1:]:
        f = line.split()
        try:  # printed as the kernel holds them: network order read as a host integer
            dest, mask = int(f[1], 16), int(f[7], 16)
        except (IndexError, ValueError):
            continue
        out.append((f[0], dest, mask))
    return out


def route_device(routes: Iterable[tuple[str, int, int]], ip: str) -> str:
    """The interface the longest matching route sends ``ip`` through ('' : none, or not IPv4)."""
    try:
        addr = int.from_bytes(socket.inet_aton(ip), sys.byteorder)  # as /proc/net/route prints it
    except OSError:
        return ""
    best = max(((bin(m).count("1"), dev) for dev, d, m in routes if addr & m == d), default=None)
    return best[1] if best else ""


def parse_hosts(text: str) -> dict[str, str]:
    """Address -> the first name ``/etc/hosts`` gives it."""
    out: dict[str, str] = {}
    for line in text.splitlines():
        f = line.split("#", 1)[0].split()
        if len(f) >= 2:
            out.setdefault(f[0], f[1])
    return out


@dataclass(frozen=True)
class Undelivered:
    """One rank's connections to one address that the network does not deliver."""

    rank: int
    remote: str  # the peer's address
    host: str  # its name in /etc/hosts ('' : none)
    connections: int
    unacked: int  # bytes, over those connections
    retransmits: int  # the most any of them retransmitted in a row
    device: str  # the local interface toward it ('' : unknown)
    device_state: str  # its operstate (up, down, lowerlayerdown...; '' : unknown)

    def describe(self) -> str:
        peer = f"{self.host} ({self.remote})" if self.host else self.remote
        link = (
            f"; the link {self.device} here is {self.device_state}"
            if self.device_state not in ("", "up", "unknown")
            else ""
        )
        return (
            f"the network does not deliver rank {self.rank}'s {self.connections} connection(s) to {peer}: "
            f"{self.unacked} bytes unacknowledged, retransmitted {self.retransmits} times{link}"
        )

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "remote": self.remote,
            "host": self.host,
            "connections": self.connections,
            "unacked": self.unacked,
            "retransmits": self.retransmits,
            "device": self.device,
            "device_state": self.device_state,
        }


def summarize(
    rank: int,
    rows: Iterable[TcpRow],
    routes: Iterable[tuple[str, int, int]],
    hosts: Mapping[str, str],
    states: Mapping[str, str],
) -> list[Undelivered]:
    """One ``Undelivered`` per peer address of ``rows`` (a rank's stalled connections)."""
    by_peer: dict[str, list[TcpRow]] = {}
    for r in rows:
        by_peer.setdefault(r.remote[0], []).append(r)
    routes = list(routes)
    out = []
    for ip, conns in sorted(by_peer.items()):
        dev = route_device(routes, ip)
        out.append(
            Undelivered(
                rank,
                ip,
                hosts.get(ip, ""),
                len(conns),
                sum(c.unacked for c in conns),
                max(c.retransmits for c in conns),
                dev,
                states.get(dev, ""),
            )
        )
    return out


# ---------------------------------------------------------------- reading /proc (thin)


def undelivered(targets: Mapping[int, int]) -> list[Undelivered]:
    """The connections of each rank (rank -> pid) that the network does not deliver."""
    hosts = parse_hosts(_read("/etc/hosts"))
    out = []
    for rank, pid in sorted(targets.items()):
        inodes = socket_inodes(pid)
        rows = [
            row for t in ("tcp", "tcp6") for row in parse_tcp_table(_read(f"/proc/{pid}/net/{t}", _TABLE_MAX))
        ]
        bad = stalled(rows, inodes)
        if bad:
            routes = parse_routes(_read(f"/proc/{pid}/net/route"))
            devs = {route_device(routes, r.remote[0]) for r in bad} - {""}
            states = {d: _read(f"/sys/class/net/{d}/operstate").strip() for d in devs if "/" not in d}
            out += summarize(rank, bad, routes, hosts, states)
    return out


def socket_inodes(pid: int) -> set[int]:
    """The inodes of the sockets ``pid`` holds open."""
    out: set[int] = set()
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError:
        return out
    for fd in fds:
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:
            continue
        if target.startswith("socket:[") and target.endswith("]"):
            out.add(int(target[8:-1]))
    return out


def _read(path: str | Path, cap: int = _SMALL_MAX) -> str:
    """At most ``cap`` bytes of a kernel table or /etc/hosts ('' : unreadable). Not read_capped: a
    /proc file has no size, and a short read of it is not its end."""
    try:
        with open(path, "rb") as f:
            return f.read(cap).decode(errors="replace")
    except OSError:
        return ""
