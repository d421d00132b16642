"""Stragglers for real: two ranks of the reference trainer (ddp, which marks where its compute
ends) under the watchdog on this machine (its configs' global batch of 8 does not split over 3;
4 would load a 2-core CI machine for no more evidence: each rank is judged against its peers;
`make straggler-sweep` runs 4). One rank held to a quarter of the CPU it used (a cgroup CPU
quota, tests/straggler_helpers.py) is named in a ``straggler`` event, kind compute. Every wait is
on an event (a step in the heartbeats, the event itself).

Not asserted: that no other rank is ever flagged, nor that a run left alone has no straggler
event. On a 2-core machine under a CI load (load average 9) one of two runs left alone flagged
rank 0 for a second (1.56x its peer over a 10-step window), and one run here flagged rank 0 as
late (network) while rank 1 was held back: the scheduler's noise on steps of tens of ms, and
train_ref's per-rank random sequence length, are what the judge measures on such a machine."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
from straggler_helpers import cpu_cgroup_root, cpu_limit, cpu_seconds, watched_ddp
from waiting import PATIENCE_S, wait_for, watchdog_events

from supervisor.format.heartbeat import Heartbeat, Phase, read_heartbeat_folder
from supervisor.watch.stragglers import DEFAULT_FACTOR

RANKS = 2
SLOW = 1  # the rank held back
WINDOW = 20  # the watchdog's default --straggler-window


def beats(root: Path) -> dict[int, Heartbeat]:
    """Each rank's newest beat, from the node-local folder the watchdog named."""
    found = watchdog_events(root, "heartbeat_dir")
    if not found:
        return {}
    snaps = read_heartbeat_folder(Path(found[0]["path"]))
    return {s.heartbeat.rank: s.heartbeat for s in snaps if s.heartbeat is not None}


def all_at(root: Path, step: int) -> dict[int, Heartbeat] | None:
    """Every rank's beat once all of them train at ``step`` or later."""
    b = beats(root)
    done = len(b) == RANKS and all(h.phase == Phase.TRAIN and h.step >= step for h in b.values())
    return b if done else None


def test_a_rank_held_to_a_quarter_of_its_cpu_is_named_a_compute_straggler(tmp_path: Path) -> None:
    if cpu_cgroup_root() is None:
        pytest.skip("no writable cgroup cpu controller here")
    root = tmp_path / "run"
    root.mkdir()
    with watched_ddp(root, RANKS, "tiny", 100_000, 1.0, PATIENCE_S) as proc:
        warm = wait_for(lambda: all_at(root, 5), "every rank at step 5", proc=proc)
        pid, first = warm[SLOW].pid, warm[SLOW].step
        cpu0, t0 = cpu_seconds(pid), time.monotonic()
        wait_for(lambda: all_at(root, first + WINDOW), f"every rank at step {first + WINDOW}", proc=proc)
        used = (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0)  # the CPUs it got, whatever else runs
        with cpu_limit([pid], used / 4):
            (event,) = wait_for(
                lambda: [e for e in watchdog_events(root, "straggler") if e["rank"] == SLOW],
                f"a straggler event naming rank {SLOW}",
                proc=proc,
            )
    log = (tmp_path / "job.log").read_text(errors="replace")[-3000:]
    assert event["kind"] == "compute" and event["value"] >= DEFAULT_FACTOR, f"{event}\n{log}"
