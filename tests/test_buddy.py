"""The watchdog's side of the buddy replica (supervisor/watch/buddy.py): two nodes' Buddies on this
machine, one run dir, each with its own memory folder, over real sockets: each node's committed
snapshot ends up verified in the other's replica of it, and the event logs say so; the job's key
is made once and shared; a key file others can read turns the replica off, saying why."""

from __future__ import annotations

import os
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from memsnap_helpers import index, written
from waiting import wait_for

from supervisor.format import eventtypes as ev
from supervisor.format import memsnap
from supervisor.format.events import EventLog, events_path, read_logged
from supervisor.format.layout import RunDir
from supervisor.watch.buddy import Buddy, job_key
from supervisor.watch.memory import Memory


def commit(folder: Path, step: int, slot: int) -> None:
    """Two local ranks' snapshot of ``step`` in ``slot``, committed (as the ranks leave it)."""
    for r in range(2):
        written(folder, index(step, rank=r, local_rank=r, lws=2), slot)
    memsnap.write_record(folder / memsnap.COMMITTED, memsnap.Commit(step, slot, "L").to_dict())


@pytest.fixture
def ring(tmp_path: Path) -> Iterator[Callable[[int], tuple[RunDir, list[Buddy]]]]:
    """``ring(nodes)``: that many Buddies, node i with its memory folder tmp_path/mem<i>, started;
    all closed after the test."""
    started: list[Buddy] = []

    def make(nodes: int) -> tuple[RunDir, list[Buddy]]:
        run = RunDir.of(tmp_path / "run")
        run.supervisor.mkdir(parents=True)
        for node in range(nodes):
            folder = tmp_path / f"mem{node}"
            folder.mkdir()
            b = Buddy(EventLog(run.root, node), run, folder, node, nodes, rate_mb_s=0, poll_s=0.05)
            b.start(None)
            started.append(b)
        return run, started

    yield make
    for b in started:
        b.close()


def logged(run: RunDir, node: int, kind: type[ev.Event]) -> list[ev.Event]:
    return [e.event for e in read_logged(events_path(run.root, node)) if isinstance(e.event, kind)]


def test_each_nodes_snapshot_is_kept_verified_by_the_next(ring) -> None:
    run, (b0, b1) = ring(2)
    assert [e.buddy for e in logged(run, 0, ev.Replica)] == [1]  # type: ignore[attr-defined]
    assert memsnap.read_endpoint(run.replica_endpoint(1)) is not None
    commit(b0.folder, 7, 0)
    commit(b1.folder, 7, 0)
    for me, keeper in ((b0, b1), (b1, b0)):
        kept = memsnap.replica_dir(keeper.folder, me.node)
        wait_for(
            lambda kept=kept: memsnap.read_commit(kept), f"node {keeper.node} to keep node {me.node}'s step 7"
        )
        found, problems = memsnap.read_slots(kept)
        (snap,) = memsnap.complete(kept, found)
        assert not problems and snap.step == 7 and memsnap.verify(snap) == ""
    wait_for(lambda: logged(run, 0, ev.ReplicaPushed), "node 0's replica_pushed event")
    pushed = logged(run, 0, ev.ReplicaPushed)[0]
    assert (pushed.step, pushed.buddy) == (7, 1)  # type: ignore[attr-defined]
    commit(b0.folder, 8, 1)
    wait_for(lambda: b0.pushed == 8, "node 0's next snapshot pushed")
    commit_kept = memsnap.read_commit(memsnap.replica_dir(b1.folder, 0))
    assert commit_kept is not None and commit_kept.step == 8


def test_a_buddy_without_a_receiver_is_a_failure_said_once(tmp_path: Path) -> None:
    run = RunDir.of(tmp_path / "run")
    run.supervisor.mkdir(parents=True)
    folder = tmp_path / "mem0"
    folder.mkdir()
    b = Buddy(EventLog(run.root, 0), run, folder, 0, 2, rate_mb_s=0, poll_s=0.05)
    b.start(None)
    try:
        commit(folder, 3, 0)
        wait_for(lambda: logged(run, 0, ev.ReplicaFailed), "the failure's event")
        commit(folder, 4, 1)
        wait_for(lambda: b.tried == 4, "a push of the next commit tried")
    finally:
        b.close()
    failed = logged(run, 0, ev.ReplicaFailed)
    assert len(failed) == 1 and "node 1 published no receiver" in failed[0].reason, failed  # type: ignore[attr-defined]


def test_the_jobs_key_is_made_once_and_a_readable_one_turns_the_replica_off(tmp_path: Path) -> None:
    run = RunDir.of(tmp_path / "run")
    run.supervisor.mkdir(parents=True)
    first = job_key(run, None)
    assert job_key(run, None) == first and len(first) == 32
    assert oct(run.replica_key.stat().st_mode & 0o777) == "0o600"
    assert job_key(run, b"s" * 32) not in (first, b"s" * 32)  # derived: the signing key never on the wire
    os.chmod(run.replica_key, 0o644)
    folder = tmp_path / "mem0"
    folder.mkdir()
    b = Buddy(EventLog(run.root, 0), run, folder, 0, 2, rate_mb_s=0, poll_s=0.05)
    b.start(None)
    b.close()
    (off,) = read_logged(events_path(run.root, 0))
    assert isinstance(off.event, ev.Replica) and off.event.host == ""
    assert "not a private file" in off.msg and "chmod 600" in off.msg


@pytest.mark.parametrize("spare", [1, 2], ids=["keeps it (its buddy)", "pulls it from the buddy"])
def test_a_node_standing_in_for_a_lost_one_picks_its_replica(ring, spare: int) -> None:
    """Node 0 pushed its snapshot of step 7 to node 1 and was lost. The node taking its place
    picks node 0's replica for its ranks: node 1 from what it keeps, node 2 by pulling it from
    node 1; the pick names the replica's folder, and its ranks read it there."""
    run, buddies = ring(3)
    commit(buddies[0].folder, 7, 0)
    wait_for(lambda: buddies[0].pushed == 7, "node 0's snapshot kept by node 1")
    buddies[0].close()
    me = buddies[spare]
    memory = Memory(EventLog(run.root, spare))
    memory.folder = me.folder
    assert memory.pick(2, disk_step=5, stand_in=0, fetch=me.fetch) == 7
    pick = memsnap.read_pick(me.folder)
    assert pick is not None and (pick.launch, pick.step, pick.folder) == (2, 7, "replica/0")
    kept = me.folder / pick.folder
    found, _ = memsnap.read_slots(kept)
    (snap,) = memsnap.complete(kept, found)
    assert memsnap.verify(snap) == "" and snap.slot == pick.slot
    (picked,) = logged(run, spare, ev.MemoryPick)
    assert picked.folder == str(kept)  # type: ignore[attr-defined]


def test_a_stand_in_without_a_replica_falls_back_to_the_disk_saying_why(ring) -> None:
    run, buddies = ring(3)
    buddies[1].close()  # node 0's keeper is gone: nothing to pull
    memory = Memory(EventLog(run.root, 2))
    memory.folder = buddies[2].folder
    assert memory.pick(2, disk_step=5, stand_in=0, fetch=buddies[2].fetch) is None
    (fell,) = logged(run, 2, ev.MemoryFallback)
    assert "node 1, which keeps node 0's replica, published no receiver" in fell.reason, fell  # type: ignore[attr-defined]


def test_the_slot_being_pushed_is_pinned_for_the_push_only(tmp_path: Path, ring) -> None:
    """While node 0's snapshot goes to node 1 (paced to 2 MB/s: about a second), its slot is
    pinned (the ranks write none into it meanwhile); once kept, the pin is gone."""
    _, (b0, _) = ring(2)
    b0.rate = 2e6
    for r in range(2):
        written(b0.folder, index(9, rank=r, local_rank=r, lws=2, tensors=(("float32", (1 << 18,)),)), 1)
    memsnap.write_record(b0.folder / memsnap.COMMITTED, memsnap.Commit(9, 1, "L").to_dict())
    pinned = wait_for(lambda: memsnap.read_pinned(b0.folder), "the pin of the slot being pushed")
    assert (pinned.slot, pinned.step) == (1, 9)
    wait_for(lambda: b0.pushed == 9, "the push done")
    assert memsnap.read_pinned(b0.folder) is None


@pytest.mark.parametrize("spare", [1, 2], ids=["kept here", "pulled from the keeper"])
def test_a_replica_corrupted_where_it_is_kept_is_caught_and_the_pick_falls_back_saying_why(
    ring, spare: int
) -> None:
    """A byte of node 0's replica flips on node 1 after it was kept verified (memory going bad,
    a stray write). The node taking node 0's place never loads it: node 1 finds it in the check
    before its pick, node 2 when the pulled bytes fail their checksum; either falls back to the disk
    with the reason in its event."""
    run, buddies = ring(3)
    commit(buddies[0].folder, 7, 0)
    wait_for(lambda: buddies[0].pushed == 7, "node 0's snapshot kept by node 1")
    buddies[0].close()
    kept = memsnap.replica_dir(buddies[1].folder, 0)
    kept_commit = memsnap.read_commit(kept)
    assert kept_commit is not None
    data = memsnap.data_path(kept, kept_commit.slot, 1)
    raw = bytearray(data.read_bytes())
    raw[-1] ^= 0x01
    data.write_bytes(bytes(raw))
    memory = Memory(EventLog(run.root, spare))
    memory.folder = buddies[spare].folder
    assert memory.pick(2, disk_step=5, stand_in=0, fetch=buddies[spare].fetch) is None
    assert memsnap.read_pick(buddies[spare].folder) is None
    (fell,) = logged(run, spare, ev.MemoryFallback)
    assert f"{data.name}: checksum" in fell.reason, fell  # type: ignore[attr-defined]
