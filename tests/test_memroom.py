"""How much memory the memory tier may take (supervisor/memroom.py): the node's MemAvailable and a
memory cgroup's limit less what it cannot reclaim, the tighter one; an allocation must leave a
quarter of it."""

from __future__ import annotations

from pathlib import Path

import pytest

from supervisor import memroom
from supervisor.memroom import Room

GIB = 2**30
MEMINFO = "MemTotal:       16777216 kB\nMemFree:         1000 kB\nMemAvailable:    8388608 kB\nShmem: 10 kB\n"


def test_the_nodes_room_is_memavailable_of_memtotal() -> None:
    assert memroom.node_room(MEMINFO) == Room(8 * GIB, 16 * GIB, "the node")
    assert memroom.node_room("MemTotal: 5 kB\n") is None  # a kernel before MemAvailable
    assert memroom.node_room("") is None


@pytest.mark.parametrize(
    ("version", "limit", "usage", "stat", "room"),
    [
        # v2: page cache ("file") is reclaimable, its tmpfs part ("shmem") is not
        (
            2,
            "8589934592\n",
            "6442450944\n",
            "anon 1\nfile 4294967296\nshmem 1073741824\n",
            Room(5 * GIB, 8 * GIB, "memory cgroup /cg/job"),
        ),
        (2, "max\n", "6442450944\n", "", None),  # no limit
        # v1: the hierarchy's totals
        (
            1,
            "8589934592\n",
            "6442450944\n",
            "cache 9\ntotal_cache 4294967296\ntotal_shmem 0\n",
            Room(6 * GIB, 8 * GIB, "memory cgroup /cg/job"),
        ),
        (1, "", "1\n", "", None),  # unreadable
    ],
)
def test_a_cgroups_room_is_its_limit_less_what_it_cannot_reclaim(version, limit, usage, stat, room) -> None:
    assert memroom.cgroup_room(version, "/cg/job", limit, usage, stat) == room


def test_the_tighter_bound_counts_and_an_unlimited_v1_cgroup_bounds_nothing() -> None:
    node = Room(8 * GIB, 16 * GIB, "the node")
    job = Room(2 * GIB, 4 * GIB, "memory cgroup /job")
    unlimited = Room(2**63 - 4096 - 5 * GIB, 2**63 - 4096, "memory cgroup /")
    assert memroom.tighter(node, [job]) is job
    assert memroom.tighter(node, [unlimited]) is node
    assert memroom.tighter(None, [job]) is job
    assert memroom.tighter(None, []) is None


def test_an_allocation_must_leave_a_quarter_of_the_bound() -> None:
    room = Room(8 * GIB, 16 * GIB, "the node")
    assert memroom.refusal(4 * GIB, room) == ""  # leaves exactly 4 of 16
    why = memroom.refusal(4 * GIB + 1, room)
    assert why.startswith("4.00 GiB would leave 4.00 GiB of the node's 16.00 GiB available (8.00 GiB now)"), (
        why
    )
    assert "25%" in why
    assert memroom.refusal(100 * GIB, None) == ""  # nothing readable: fallocate decides
    assert memroom.refusal(0, Room(0, 16 * GIB, "the node")) == ""


def test_room_reads_the_cgroup_this_process_is_in(tmp_path: Path) -> None:
    (tmp_path / "meminfo").write_text(MEMINFO)
    (tmp_path / "cgroup").write_text("0::/job/step_0\n")
    cg = tmp_path / "cg" / "job" / "step_0"
    cg.mkdir(parents=True)
    (cg / "memory.max").write_text(f"{4 * GIB}\n")
    (cg / "memory.current").write_text(f"{3 * GIB}\n")
    (cg / "memory.stat").write_text(f"file {2 * GIB}\nshmem 0\n")
    found = memroom.room(str(tmp_path / "meminfo"), str(tmp_path / "cgroup"), str(tmp_path / "cg"))
    assert found == Room(3 * GIB, 4 * GIB, f"memory cgroup {cg}")
    (cg / "memory.max").write_text("max\n")
    assert memroom.room(str(tmp_path / "meminfo"), str(tmp_path / "cgroup"), str(tmp_path / "cg")) == Room(
        8 * GIB, 16 * GIB, "the node"
    )
    assert memroom.room(str(tmp_path / "none"), str(tmp_path / "none"), str(tmp_path)) is None


def test_this_machine_has_a_readable_bound() -> None:
    found = memroom.room()
    assert found is not None and 0 < found.available <= found.limit, found
