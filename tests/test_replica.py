"""The memory tier's replica on a buddy node (supervisor/watch/replica.py), over real TCP sockets
on this machine: a node's committed snapshot pushed to a receiver that keeps it verified, in the
slot that does not hold its previous copy; a sender without the job's key, data altered on the
way (a relay that flips one byte) and a lying header are refused with the reason, the previous
replica left whole; the bandwidth cap holds."""

from __future__ import annotations

import contextlib
import socket
import threading
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from memsnap_helpers import index, written
from waiting import wait_for

from supervisor.format import memsnap
from supervisor.watch import replica
from supervisor.watch.replica import Moved, Receiver, ReplicaError, pull, push

KEY = b"k" * 32
# Two tensors of 1.5 MiB: more than one send chunk each.
BIG = (("float32", (3 << 17,)), ("int64", (3,)), ("bfloat16", (3 << 18,)))


def snapshot(folder: Path, step: int, slot: int = 0, ranks: int = 2) -> memsnap.NodeSnapshot:
    """Node-local ranks 0..ranks-1's snapshot of ``step`` in ``slot`` of ``folder``."""
    for r in range(ranks):
        written(folder, index(step, rank=r, local_rank=r, lws=ranks, tensors=BIG), slot)
    found, problems = memsnap.read_slots(folder)
    assert not problems, problems
    snap = next(s for s in memsnap.complete(folder, found) if s.step == step)
    return snap


@pytest.fixture
def receiver(tmp_path: Path) -> Iterator[tuple[Receiver, list[Moved]]]:
    """A receiver on 127.0.0.1 keeping replicas under tmp_path/buddy; what it heard of each request
    (``report``)."""
    heard: list[Moved] = []

    def on_request(op: str, m: Moved) -> None:
        heard.append(m)

    (tmp_path / "buddy").mkdir()
    rx = Receiver(tmp_path / "buddy", KEY, host="127.0.0.1", timeout=30, on_request=on_request).start()
    yield rx, heard
    rx.close()


def report(heard: list[Moved], n: int) -> Moved:
    """The receiver's report of its ``n``-th request (from 0). It reports a request once it has
    answered it, so the sender may be back before the report is in: wait for it."""
    wait_for(lambda: len(heard) > n, f"the receiver's report of request {n}")
    return heard[n]


def test_a_push_arrives_verified_and_the_next_goes_to_the_other_slot(tmp_path: Path, receiver) -> None:
    rx, heard = receiver
    own = tmp_path / "node3"
    first = push(rx.address, KEY, 3, snapshot(own, 10))
    assert (first.node, first.step, first.bytes) == (3, 10, snapshot(own, 10).size)
    kept = memsnap.replica_dir(tmp_path / "buddy", 3)
    commit = memsnap.read_commit(kept)
    assert commit is not None and (commit.step, commit.slot) == (10, 0)
    for r in range(2):
        assert memsnap.data_path(kept, 0, r).read_bytes() == memsnap.data_path(own, 0, r).read_bytes()
    push(rx.address, KEY, 3, snapshot(own, 11, slot=1))
    commit = memsnap.read_commit(kept)
    assert commit is not None and (commit.step, commit.slot) == (11, 1)
    found, problems = memsnap.read_slots(kept)
    snaps = memsnap.complete(kept, found)
    assert not problems and [s.step for s in snaps] == [11, 10], snaps  # both whole, newest first
    assert all(memsnap.verify(s) == "" for s in snaps)
    assert [(h.node, h.step, h.why) for h in (report(heard, 0), report(heard, 1))] == [
        (3, 10, ""),
        (3, 11, ""),
    ]


def _refused(
    tmp_path: Path, receiver, send: Callable[[], object], says: str, before: int = 0
) -> tuple[Moved, memsnap.Commit | None]:
    """``send`` (after ``before`` other requests) fails naming ``says``; what the receiver heard of
    it, and the replica's commit after."""
    with pytest.raises(ReplicaError, match=says):
        send()
    return report(receiver[1], before), memsnap.read_commit(memsnap.replica_dir(tmp_path / "buddy", 3))


def test_a_sender_without_the_key_is_refused_and_nothing_is_kept(tmp_path: Path, receiver) -> None:
    rx, _ = receiver
    snap = snapshot(tmp_path / "node3", 10)
    heard, commit = _refused(
        tmp_path, receiver, lambda: push(rx.address, b"x" * 32, 3, snap), "refused the handshake"
    )
    assert "the sender could not prove it holds the job's key" in heard.why and commit is None
    assert not memsnap.replica_dir(tmp_path / "buddy", 3).exists()


class FlipRelay:
    """A TCP relay to ``target`` that flips one bit of the sender's stream at byte ``at``."""

    def __init__(self, target: tuple[str, int], at: int) -> None:
        self.target, self.at = target, at
        self.server = socket.create_server(("127.0.0.1", 0))
        self.address = self.server.getsockname()[:2]
        threading.Thread(target=self._run, daemon=True).start()

    def _run(self) -> None:
        conn, _ = self.server.accept()
        up = socket.create_connection(self.target)
        back = threading.Thread(target=self._pipe, args=(up, conn, None), daemon=True)
        back.start()
        self._pipe(conn, up, self.at)
        back.join()
        for s in (conn, up, self.server):
            s.close()

    @staticmethod
    def _pipe(src: socket.socket, dst: socket.socket, flip_at: int | None) -> None:
        seen = 0
        with contextlib.suppress(OSError):  # the other side reset: nothing more to relay
            while data := src.recv(1 << 16):
                if flip_at is not None and seen <= flip_at < seen + len(data):
                    b = bytearray(data)
                    b[flip_at - seen] ^= 1
                    data = bytes(b)
                seen += len(data)
                dst.sendall(data)
            dst.shutdown(socket.SHUT_WR)


def test_data_altered_on_the_way_fails_its_checksum_and_the_last_replica_stays(
    tmp_path: Path, receiver
) -> None:
    rx, _ = receiver
    own = tmp_path / "node3"
    push(rx.address, KEY, 3, snapshot(own, 10))
    snap = snapshot(own, 11, slot=1)
    relay = FlipRelay(rx.address, at=2 << 20)  # inside rank 0's data
    heard, commit = _refused(
        tmp_path, receiver, lambda: push(relay.address, KEY, 3, snap), "checksum", before=1
    )
    assert "checksum" in heard.why and "rank_00000.data" in heard.why, heard
    assert (heard.node, heard.step) == (3, 11)  # named though refused
    assert commit is not None and commit.step == 10
    kept = memsnap.replica_dir(tmp_path / "buddy", 3)
    found, _ = memsnap.read_slots(kept)
    assert [s.step for s in memsnap.complete(kept, found)] == [10]  # the refused slot has no index


def test_an_index_that_contradicts_the_header_is_refused(tmp_path: Path, receiver) -> None:
    rx, _ = receiver
    snap = snapshot(tmp_path / "node3", 10)
    lying = memsnap.NodeSnapshot(snap.folder, 12, snap.launch, snap.slot, snap.ranks)  # header says 12
    heard, commit = _refused(
        tmp_path, receiver, lambda: push(rx.address, KEY, 3, lying), "says rank 0, step 10"
    )
    assert "the header: step 12" in heard.why and commit is None


def test_a_push_is_paced_to_the_bandwidth_cap(tmp_path: Path, receiver, monkeypatch) -> None:
    """A lower bound only: a paced push can never be faster than its bytes over the rate."""
    rx, _ = receiver
    monkeypatch.setattr(replica, "SEND_CHUNK", 256 << 10)
    snap = snapshot(tmp_path / "node3", 10)
    rate = snap.size / 1.5  # bytes a second: the push must take 1.5 s or more
    pushed = push(rx.address, KEY, 3, snap, rate=rate)
    assert pushed.seconds >= snap.size / rate, pushed


def test_a_node_taking_a_lost_ones_place_pulls_its_replica_from_the_buddy(tmp_path: Path, receiver) -> None:
    """Node 3 pushed its snapshot and was lost: the spare pulls node 3's replica from node 3's
    buddy into its own memory folder, whole and verified, bytes equal to what node 3 had; a pull
    of a node the buddy holds nothing of says so."""
    rx, heard = receiver
    own = tmp_path / "node3"
    push(rx.address, KEY, 3, snapshot(own, 10))
    spare = tmp_path / "spare"
    spare.mkdir()
    got = pull(rx.address, KEY, 3, spare)
    assert (got.node, got.step, got.bytes) == (3, 10, snapshot(own, 10).size)
    mine = memsnap.replica_dir(spare, 3)
    found, problems = memsnap.read_slots(mine)
    (snap,) = memsnap.complete(mine, found)
    assert not problems and snap.step == 10 and memsnap.verify(snap) == ""
    for r in range(2):
        assert memsnap.data_path(mine, snap.slot, r).read_bytes() == memsnap.data_path(own, 0, r).read_bytes()
    with pytest.raises(ReplicaError, match=r"the buddy has none: .*no complete replica"):
        pull(rx.address, KEY, 4, spare)
    nothing = report(heard, 2)  # after the push and the first pull
    assert nothing.why and nothing.node == 4, nothing
