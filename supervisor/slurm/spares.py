"""Hot spares: the roster's decisions as pure functions (the coordinator, ``coordinator.py``, gathers
the facts and writes what these decide). docs/slurm.md#hot-spares.

A job of N+k nodes trains on N and keeps k spares waiting, imports done. Each generation of the
roster is one launch of the whole group. When every training node's watchdog waits for the next
generation (its launch ended: a crash, a lost peer) or is lost, the next one is written: the same
nodes at the same node ranks, a spare in each lost node's place (and in a bad node's, while a
spare is left). A lost node with no spare left stops the job with exit 15 (NODE_LOST), which
requeues it. A training node whose watchdog ended by itself (done, preempted, out of budget...)
stops the others with its exit code, once no training node runs any more.
"""

from __future__ import annotations

import time
from collections.abc import Collection, Mapping, Sequence
from dataclasses import dataclass

from supervisor.format.exitcodes import Exit
from supervisor.format.nodesummary import ROLE_SPARE
from supervisor.format.roster import Roster
from supervisor.format.runstatus import RunStatus

# A node whose watchdog has never published a summary is lost only after this many node timeouts
# (at least START_GRACE_MIN_S): a watchdog starting on a loaded node takes seconds to import.
START_GRACE_TIMEOUTS = 3
START_GRACE_MIN_S = 120.0


@dataclass(frozen=True)
class NodeView:
    """What the coordinator knows of one node now: its summary's header, how long it has been
    silent (by the coordinator's clock: no clock of another node is compared), and SLURM's word."""

    node: int
    host: str
    seen: bool = False  # a summary of this job's run was read at least once
    silent_s: float = 0.0  # since its summary last changed (or since the coordinator started)
    status: str = ""
    exit_code: int | None = None
    reason: str = ""
    role: str = ""
    roster_gen: int = 0
    roster_wait: int = 0
    slurm_down: str = ""  # SLURM's state of the node when it says it is down or not responding

    @property
    def exited(self) -> bool:
        try:
            return RunStatus(self.status).ended
        except ValueError:
            return False


def lost_now(views: Mapping[int, NodeView], lost: Collection[int], node_timeout_s: float) -> dict[int, str]:
    """The nodes lost now (not already ``lost``), with the evidence: SLURM says its slurmd is down
    or not responding; or its watchdog (and with it its ranks) went silent for ``node_timeout_s``
    without exiting (a watchdog that never published: ``START_GRACE_TIMEOUTS`` times that)."""
    grace = max(START_GRACE_TIMEOUTS * node_timeout_s, START_GRACE_MIN_S)
    out = {}
    for n, v in sorted(views.items()):
        if n in lost or v.exited:
            continue
        if v.slurm_down:
            out[n] = f"SLURM says {v.host} is {v.slurm_down} (its slurmd does not respond)"
        elif v.seen and v.silent_s >= node_timeout_s:
            out[n] = f"its watchdog's summary silent for {v.silent_s:.1f}s (timeout {node_timeout_s:g}s)"
        elif not v.seen and v.silent_s >= grace:
            out[n] = f"no watchdog published for {v.silent_s:.0f}s since the job started"
    return out


def first_roster(
    key: str, hosts: Sequence[str], train: int, bad: Collection[str], master_port: int
) -> Roster:
    """Generation 1: the first ``train`` hosts that are not bad train (node index order), the other
    good ones are spares; bad hosts train only where the good ones are too few."""
    good = [n for n, h in enumerate(hosts) if h not in bad]
    rest = [n for n, h in enumerate(hosts) if h in bad]
    nodes = (good + rest)[:train]
    spares = [n for n in good if n not in nodes]
    left_out = [hosts[n] for n in rest if n not in nodes]
    why = f"bad nodes left out: {', '.join(left_out)}" if left_out else "first launch"
    return Roster(
        key,
        1,
        tuple(hosts),
        tuple(sorted(nodes)),
        tuple(spares),
        master_port,
        reason=why,
        written=time.time(),
    )


def next_roster(
    roster: Roster, views: Mapping[int, NodeView], lost: Mapping[int, str], bad: Collection[str]
) -> Roster | None:
    """What to write now: the next generation, a stop, or None (wait). ``lost``: lost nodes and
    the evidence; ``bad``: the bad hosts (swapped out while a spare is left)."""
    if roster.stop:
        return None
    g = roster.generation
    alive = [n for n in roster.nodes if n not in lost]
    ended = [n for n in alive if views[n].exited]
    running = [n for n in alive if not views[n].exited and views[n].roster_wait <= g]
    if running:
        return None
    if ended:
        code = max(views[n].exit_code or 0 for n in ended)
        first = next(n for n in ended if (views[n].exit_code or 0) == code)
        why = f"{roster.host(first)}'s watchdog ended (exit {code}: {views[first].reason or views[first].status})"
        return _stop(roster, code, why)
    spares = [
        n
        for n in roster.spares
        if n not in lost
        and views[n].seen
        and not views[n].exited
        and views[n].role == ROLE_SPARE
        and roster.host(n) not in bad
    ]
    nodes, replaced, reasons = list(roster.nodes), {}, []
    swaps = [(n, f"{roster.host(n)} lost ({lost[n]})") for n in roster.nodes if n in lost]
    swaps += [(n, f"{roster.host(n)} is a bad node") for n in alive if roster.host(n) in bad]
    for n, why in swaps:
        if not spares:
            if n in lost:
                return _stop(roster, Exit.NODE_LOST, f"{why}, and no spare left: requeue")
            reasons.append(f"{why}, kept: no spare left")
            continue
        s = spares.pop(0)
        nodes[nodes.index(n)] = s
        replaced[roster.host(n)] = roster.host(s)
        reasons.append(f"{why}: {roster.host(s)} takes its place")
    return Roster(
        roster.key,
        g + 1,
        roster.hosts,
        tuple(nodes),
        tuple(spares),
        roster.master_port,
        reason="; ".join(reasons) or f"relaunch after generation {g}",
        replaced=replaced,
        written=time.time(),
    )


def _stop(roster: Roster, code: int, why: str) -> Roster:
    return Roster(
        roster.key,
        roster.generation,
        roster.hosts,
        roster.nodes,
        roster.spares,
        roster.master_port,
        stop=True,
        exit_code=int(code),
        reason=why,
        replaced=dict(roster.replaced),
        written=time.time(),
    )


def job_exit(views: Mapping[int, NodeView], lost: Collection[int]) -> int | None:
    """The job's exit code once every node that is not lost has its watchdog ended: the highest
    of theirs (as srun reports its tasks'); None while one still runs."""
    live = [v for n, v in views.items() if n not in lost]
    if not live or not all(v.exited for v in live):
        return None
    return max(v.exit_code or 0 for v in live)
