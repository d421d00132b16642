"""How much memory this node still has for a process to take, so that the memory tier, on by
default, never takes what training needs (docs/tiers.md#the-memory-tier).

Two bounds, the tighter one counts:

- the node's: ``/proc/meminfo``'s MemAvailable, of MemTotal. What /dev/shm already holds is never
  in MemAvailable (tmpfs pages cannot be reclaimed without swap), so the tier's own slots are not
  counted twice;
- the memory cgroup's, where this process has one with a limit (a SLURM job under
  ``ConstrainRAMSpace``): its limit less what it uses that cannot be reclaimed. A tmpfs page is
  charged to the cgroup of the process that wrote it, so a snapshot in /dev/shm counts against the
  job's own limit. What the cgroup counts includes the page cache, which a job reading its data
  fills up to the limit; only its shared memory (tmpfs) is kept out of what can be reclaimed.

Everything here is torch-free and never raises: memory that cannot be read bounds nothing (then the
tier's ``posix_fallocate`` is the only check, ENOSPC on a full /dev/shm). The parsers are pure.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from supervisor.format.capped import read_capped

MEMINFO = "/proc/meminfo"
PROC_CGROUP = "/proc/self/cgroup"
CGROUP_BASE = "/sys/fs/cgroup"
# What an allocation must leave available, as a fraction of the bound (the node's memory or the
# cgroup's limit): training's own growth (a larger batch, an evaluation, a loader's prefetch).
KEEP_FRACTION = 0.25
_READ_LIMIT = 1 << 16  # these files are a few KB; a bound, not a limit


@dataclass(frozen=True)
class Room:
    """What is still available (bytes) of ``limit`` (bytes), and where (for the reason)."""

    available: int
    limit: int
    where: str


def memory_cgroups(proc_cgroup: str, base: str = CGROUP_BASE) -> list[tuple[int, str]]:
    """This process's memory cgroup folders from /proc/<pid>/cgroup's text, with their version:
    the v2 ``0::/path`` entry and the v1 ``N:memory:/path`` one."""
    found = []
    for line in proc_cgroup.splitlines():
        parts = line.split(":", 2)
        if len(parts) != 3:
            continue
        if parts[0] == "0" and parts[1] == "":
            found.append((2, f"{base}{parts[2].rstrip('/')}"))
        elif "memory" in parts[1].split(","):
            found.append((1, f"{base}/memory{parts[2].rstrip('/')}"))
    return found


def keyed(text: str) -> dict[str, int]:
    """``key value`` (memory.stat) and ``Key:  value kB`` (/proc/meminfo) lines, in bytes for kB."""
    out = {}
    for line in text.splitlines():
        parts = line.replace(":", " ").split()
        if len(parts) >= 2 and parts[1].isdigit():
            out[parts[0]] = int(parts[1]) * (1024 if parts[2:3] == ["kB"] else 1)
    return out


def node_room(meminfo: str) -> Room | None:
    """The node's bound from /proc/meminfo's text."""
    values = keyed(meminfo)
    if "MemAvailable" not in values or not values.get("MemTotal"):
        return None
    return Room(values["MemAvailable"], values["MemTotal"], "the node")


def cgroup_room(version: int, folder: str, limit_text: str, usage_text: str, stat_text: str) -> Room | None:
    """A memory cgroup's bound from its files' texts (v2: memory.max, memory.current, memory.stat;
    v1: memory.limit_in_bytes, memory.usage_in_bytes, memory.stat); None without a limit. Used is
    what it counts less its page cache, its shared memory (tmpfs) kept in."""
    limit, usage = limit_text.strip(), usage_text.strip()
    if not limit.isdigit() or not usage.isdigit():
        return None  # "max" (v2): no limit
    stat = keyed(stat_text)
    prefix = "" if version == 2 else "total_"
    cache = stat.get(f"{prefix}file" if version == 2 else f"{prefix}cache", 0)
    shmem = stat.get(f"{prefix}shmem", 0)
    used = max(0, int(usage) - cache + shmem)
    return Room(max(0, int(limit) - used), int(limit), f"memory cgroup {folder}")


def tighter(node: Room | None, cgroups: list[Room]) -> Room | None:
    """The bound that leaves the least; a cgroup "limit" above the node's memory bounds nothing
    (v1 writes an unlimited cgroup's limit as 2^63 rounded to a page)."""
    real = [r for r in cgroups if node is None or r.limit < node.limit]
    return min([*([node] if node else []), *real], key=lambda r: r.available, default=None)


def refusal(need: int, room: Room | None, keep: float = KEEP_FRACTION) -> str:
    """Why allocating ``need`` bytes would take memory training needs ('' : it would not): it must
    leave ``keep`` of the bound available."""
    if room is None or need <= 0:
        return ""
    left = room.available - need
    if left >= keep * room.limit:
        return ""
    return (
        f"{_gib(need)} would leave {_gib(max(0, left))} of {room.where}'s {_gib(room.limit)} available "
        f"({_gib(room.available)} now), less than the {keep:.0%} kept for training"
    )


def _gib(n: int) -> str:
    return f"{n / 2**30:.2f} GiB"


def _read(path: str) -> str:
    """The file's text, '' when it cannot be read or is over ``_READ_LIMIT`` (``read_capped``)."""
    try:
        return read_capped(path, _READ_LIMIT).decode("ascii", errors="replace")
    except OSError:
        return ""


def room(meminfo: str = MEMINFO, proc_cgroup: str = PROC_CGROUP, base: str = CGROUP_BASE) -> Room | None:
    """This process's tighter bound now (None: nothing readable)."""
    cgroups = []
    for version, folder in memory_cgroups(_read(proc_cgroup), base):
        names = (
            ("memory.max", "memory.current")
            if version == 2
            else ("memory.limit_in_bytes", "memory.usage_in_bytes")
        )
        found = cgroup_room(
            version,
            folder,
            _read(os.path.join(folder, names[0])),
            _read(os.path.join(folder, names[1])),
            _read(os.path.join(folder, "memory.stat")),
        )
        if found is not None:
            cgroups.append(found)
    return tighter(node_room(_read(meminfo)), cgroups)
