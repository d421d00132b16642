"""The memory folders of watchdogs gone without their cleanup (supervisor/watch/memory_owner.py):
real processes hold the folders' locks and are killed with SIGKILL, a real watchdog sweeps. A
memory folder is RAM (/dev/shm): one left behind is the node's memory gone until it reboots."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest
from commands import REPO
from watch_helpers import events, finish, of, start_watchdog

from supervisor.format.layout import job_key, node_memory_dir, owner_lock
from supervisor.watch import memory_owner

MiB = 2**20
# A process that holds a memory folder as a watchdog does: its lock taken, the folder made, a
# snapshot's worth of bytes in it; 'held' once it is, then it lives until stdin closes or a kill.
HOLDER = (
    "import sys; from pathlib import Path; from supervisor.watch import memory_owner as m; "
    "f = Path(sys.argv[1]); f.parent.mkdir(parents=True, exist_ok=True); fd = m.take(f); "
    "assert fd is not None; f.mkdir(); "
    "(f / 'slot0').write_bytes(b'x' * int(sys.argv[2])); print('held', flush=True); sys.stdin.read()"
)


class Holders:
    """Holder processes, killed on the way out."""

    def __init__(self) -> None:
        self.procs: list[subprocess.Popen] = []

    def hold(self, folder: Path, size: int = MiB) -> subprocess.Popen:
        p = subprocess.Popen(
            [sys.executable, "-c", HOLDER, str(folder), str(size)],
            cwd=REPO,
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
        )
        assert p.stdout is not None and p.stdout.readline().strip() == "held"
        self.procs.append(p)
        return p

    def dead(self, folder: Path, size: int = MiB) -> None:
        """A folder whose owner died by SIGKILL: its lock's file left, its folder full."""
        p = self.hold(folder, size)
        p.send_signal(signal.SIGKILL)
        p.wait()


@pytest.fixture
def holders() -> Iterator[Holders]:
    h = Holders()
    yield h
    for p in h.procs:
        p.kill()
        p.wait()


def test_the_sweep_removes_the_folders_of_dead_owners_and_keeps_the_living(tmp_path, holders):
    user = tmp_path / "supervisor-0"
    dead, alive, old = user / "7-aaaa" / "memory0", user / "7-aaaa" / "memory1", user / "8-bbbb" / "memory0"
    mine = user / "9-cccc" / "memory0"
    holders.dead(dead, 3 * MiB)
    holders.hold(alive)
    old.mkdir(parents=True)  # no lock at all: left by a version without one
    (old / "slot0").write_bytes(b"y" * MiB)
    (user / "8-bbbb" / "node0").mkdir()  # a heartbeat folder: not the sweep's
    mine.parent.mkdir()
    fd = memory_owner.take(mine)
    assert fd is not None
    mine.mkdir()

    swept = memory_owner.sweep(user, mine)

    assert sorted(s.path for s in swept) == sorted([str(dead), str(old)])
    assert {s.path: s.bytes for s in swept}[str(dead)] >= 3 * MiB
    assert not dead.exists() and not owner_lock(dead).exists() and not old.exists()
    assert alive.exists() and owner_lock(alive).exists() and mine.exists()
    assert (user / "8-bbbb" / "node0").exists()
    assert memory_owner.sweep(user, mine) == []
    memory_owner.release(mine, fd)
    assert not owner_lock(mine).exists()


def test_a_lock_held_by_a_live_process_is_refused_and_free_once_it_dies(tmp_path, holders):
    folder = tmp_path / "j-r" / "memory0"
    holder = holders.hold(folder)  # makes j-r
    assert memory_owner.take(folder) is None
    holder.send_signal(signal.SIGKILL)
    holder.wait()
    fd = memory_owner.take(folder)
    assert fd is not None
    memory_owner.release(folder, fd)


def test_a_lock_taken_while_a_sweeper_removes_it_is_the_file_left_at_the_path(tmp_path):
    """The sweeper holds a dead owner's lock while it removes the folder and the lock's file; a
    watchdog waiting for that lock meanwhile must end up holding the file the path names (else a
    third process could take the path's new file and sweep the live watchdog's folder)."""
    folder = tmp_path / "j-r" / "memory0"
    folder.parent.mkdir()
    sweeper = memory_owner.take(folder)
    assert sweeper is not None
    got: list[int | None] = []
    waiter = threading.Thread(target=lambda: got.append(memory_owner.take(folder, wait_s=60)))
    waiter.start()
    memory_owner.release(folder, sweeper)
    waiter.join()
    (fd,) = got
    assert fd is not None
    st, held = os.stat(owner_lock(folder)), os.fstat(fd)
    assert (st.st_dev, st.st_ino) == (held.st_dev, held.st_ino)
    assert memory_owner.take(folder) is None  # a third process finds it held
    memory_owner.release(folder, fd)


def test_the_watchdog_sweeps_at_start_and_refuses_a_folder_another_live_watchdog_holds(tmp_path, holders):
    """A real watchdog (fake trainer): at start it removes the dead owner's folder (the event names
    it and the bytes freed) and keeps the living one's; its own folder, held by a process still
    alive (the same job, run and node started twice), turns its memory tier off with the reason."""
    base, root = tmp_path / "shm", tmp_path / "run"
    user = base / f"supervisor-{os.getuid()}"
    dead, alive = user / "7-aaaa" / "memory0", user / "8-bbbb" / "memory0"
    holders.dead(dead, 2 * MiB)
    holders.hold(alive)
    cmd = [sys.executable, str(REPO / "tests" / "fake_trainer.py"), "--root", str(root), "--steps", "3"]
    watch = ["--node-dir", str(base), "--poll-interval", "0.1"]

    rc, out = finish(start_watchdog(root, watch, cmd))
    assert rc == 0, out
    evs = events(root)
    (swept,) = of(evs, "memory_swept")
    assert swept["paths"] == [str(dead)] and swept["bytes"] >= 2 * MiB, swept
    assert not dead.exists() and alive.exists()
    (made,) = of(evs, "memory_dir")
    mine = node_memory_dir(base, root, 0, job_key())
    assert made["path"] == str(mine) and not mine.exists() and not owner_lock(mine).exists()

    holders.hold(mine)
    rc, out = finish(start_watchdog(root, watch, cmd))
    assert rc == 0, out
    refused = of(events(root), "memory_dir")[-1]
    assert refused["path"] == "" and "another watchdog still running" in refused["msg"], refused
    assert mine.exists()  # the live holder's, untouched
