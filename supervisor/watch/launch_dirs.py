"""Retention of launch directories (supervisor/launches/<launch id>/: torchelastic's error file,
torchrun's worker logs, a standby's release file).

Each launch makes one per node, so a run relaunched often for weeks would pile them up. A node's
watchdog keeps the directories of the launches its state file still records (the last
``events.KEEP_LAUNCHES``) and the standby it holds, and removes its node's others; another node's
are its own watchdog's to keep. The decision is pure; the removal is best effort (a directory
that cannot be removed now is tried again after the next launch).
"""

from __future__ import annotations

import os
from collections.abc import Collection, Iterable

from supervisor.format import confined
from supervisor.format.layout import LAUNCHES, RunDir, launch_node, safe_host


def stale(names: Iterable[str], node: int, keep: Collection[str]) -> list[str]:
    """Directory names under launches/ that node ``node`` should remove: its own, not in ``keep``
    (launch ids, as recorded)."""
    kept = {safe_host(k) for k in keep}
    return sorted(n for n in names if launch_node(n) == node and n not in kept)


def prune(run: RunDir, node: int, keep: Collection[str]) -> list[str]:
    """Remove node ``node``'s stale launch directories; those not removed, as 'name: why'."""
    base = run.supervisor / LAUNCHES
    try:
        names = os.listdir(base)
    except OSError:
        return []  # none made yet, or unreadable now: next time
    failed = []
    for name in stale(names, node, keep):
        try:  # through no link: a planted supervisor/launches/ must not lead the removal elsewhere
            confined.remove_tree(run.root, base / name)
        except OSError as e:
            failed.append(f"{name}: {e.strerror or e}")
            continue
        if os.path.lexists(base / name):
            failed.append(f"{name}: not all of it could be removed")
    return failed
