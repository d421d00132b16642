"""The run's bad-node list (``supervisor/bad_nodes.json``): every failure the SLURM job's
coordinator could pin on a host (an ``Incident``, with its evidence), and the hosts with
``threshold`` incidents or more, which the next launch leaves out when a spare can take their place
and the requeue excludes (docs/slurm.md#bad-nodes). Hosts, not node indexes: a requeued job gets
other indexes, a host stays the host. Written by the coordinator and ``slurm finish`` only (one at a
time: the coordinator has exited when finish runs); read by `status`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import asdict, dataclass, replace
from enum import Enum
from pathlib import Path
from typing import Any

from supervisor.format.atomic import atomic_write_json
from supervisor.format.capped import read_record
from supervisor.format.layout import RunDir

BAD_NODES_VERSION = 1
DEFAULT_THRESHOLD = 2
KEEP_PER_HOST = 20  # incidents kept per host (the oldest go)
KEEP_ACTIONS = 50


class Why(str, Enum):
    """What pinned a failure on a host."""

    LOST = "lost"  # its watchdog and ranks gone (its summary silent past the timeout)
    SLURMD = "slurmd"  # SLURM says its slurmd does not respond (DOWN, NOT_RESPONDING)
    DIED_FIRST = "died_first"  # its rank failed first, the others' failures followed
    HANG = "hang"  # its rank was the culprit of a hang (outside the collective the others wait in)
    STRAGGLER = "straggler"  # its rank was flagged a straggler (with STRAGGLER_ACTION=bad-node)

    def __str__(self) -> str:
        return self.value


_LOSS = frozenset({Why.LOST.value, Why.SLURMD.value})


@dataclass(frozen=True)
class Incident:
    host: str
    why: tuple[str, ...]  # Why values: one failure's kinds of evidence
    time: float
    job: str  # the SLURM job (JOBID.RESTARTCOUNT) it happened in
    evidence: tuple[str, ...]  # one line per piece of evidence

    def describe(self) -> str:
        when = _utc(self.time)
        return f"{'+'.join(self.why)} in job {self.job} at {when}: {'; '.join(self.evidence)}"

    def merged(self, other: Incident) -> Incident:
        why = tuple(dict.fromkeys((*self.why, *other.why)))
        return replace(self, why=why, evidence=tuple(dict.fromkeys((*self.evidence, *other.evidence))))


@dataclass(frozen=True)
class Action:
    """What was done about the bad hosts: ``excluded`` from a requeued job, ``drained``, or ``left
    out`` of a launch."""

    what: str
    hosts: tuple[str, ...]
    job: str
    time: float
    detail: str = ""


@dataclass(frozen=True)
class BadNodes:
    threshold: int = DEFAULT_THRESHOLD
    incidents: tuple[Incident, ...] = ()
    actions: tuple[Action, ...] = ()
    version: int = BAD_NODES_VERSION

    def of(self, host: str) -> list[Incident]:
        return [i for i in self.incidents if i.host == host]

    @property
    def bad(self) -> dict[str, list[Incident]]:
        """The hosts with ``threshold`` incidents or more, and those incidents."""
        counts: dict[str, list[Incident]] = {}
        for i in self.incidents:
            counts.setdefault(i.host, []).append(i)
        return {h: its for h, its in sorted(counts.items()) if len(its) >= self.threshold}

    def add(self, incident: Incident) -> tuple[BadNodes, bool]:
        """With ``incident``, and whether it was a new one. A node lost is lost for the rest of its
        job: its loss found again (its slurmd found down, SlurmdTimeout later) is the same
        incident, its evidence merged; every other failure is one more."""
        mine = self.of(incident.host)
        last = mine[-1] if mine else None
        if last is not None and last.job == incident.job and {*last.why, *incident.why} <= _LOSS:
            merged = last.merged(incident)
            return replace(self, incidents=tuple(merged if i is last else i for i in self.incidents)), False
        kept = [i for i in self.incidents if i.host != incident.host] + [*mine, incident][-KEEP_PER_HOST:]
        return replace(self, incidents=tuple(sorted(kept, key=lambda i: i.time))), True

    def did(self, action: Action) -> BadNodes:
        return replace(self, actions=(*self.actions, action)[-KEEP_ACTIONS:])

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["bad"] = sorted(self.bad)  # for people reading the file
        return d


def _utc(t: float) -> str:
    import time  # here: the module is imported by `status`, which formats few of these

    return time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime(t))


def _strs(d: Mapping[str, Any], key: str) -> tuple[str, ...]:
    v = d.get(key, [])
    if not isinstance(v, list) or not all(isinstance(x, str) for x in v):
        raise ValueError(f"'{key}' is {v!r:.60}, not a list of strings")
    return tuple(v)


def _num(d: Mapping[str, Any], key: str) -> float:
    v = d.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        raise ValueError(f"'{key}' is {v!r:.40}, not a number")
    return float(v)


def _str(d: Mapping[str, Any], key: str) -> str:
    v = d.get(key, "")
    if not isinstance(v, str):
        raise ValueError(f"'{key}' is {v!r:.40}, not a string")
    return v


def _objects(d: Mapping[str, Any], key: str) -> Iterable[Mapping[str, Any]]:
    v = d.get(key, [])
    if not isinstance(v, list) or not all(isinstance(x, dict) for x in v):
        raise ValueError(f"'{key}' is {v!r:.60}, not a list of objects")
    return v


def parse_bad_nodes(d: Any) -> BadNodes:
    """BadNodes from parsed JSON; ValueError (a short reason) when it is not one."""
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    threshold = d.get("threshold", DEFAULT_THRESHOLD)
    if isinstance(threshold, bool) or not isinstance(threshold, int) or threshold < 1:
        raise ValueError(f"'threshold' is {threshold!r:.40}, not a whole number >= 1")
    incidents = tuple(
        Incident(_str(i, "host"), _strs(i, "why"), _num(i, "time"), _str(i, "job"), _strs(i, "evidence"))
        for i in _objects(d, "incidents")
    )
    actions = tuple(
        Action(_str(a, "what"), _strs(a, "hosts"), _str(a, "job"), _num(a, "time"), _str(a, "detail"))
        for a in _objects(d, "actions")
    )
    return BadNodes(threshold, incidents, actions)


def read_bad_nodes(root: str | Path) -> BadNodes | None:
    """The list as it is (None when there is none); ValueError when it is garbage, OSError when it
    cannot be read."""
    return read_record(RunDir.of(root).bad_nodes, parse_bad_nodes)


def write_bad_nodes(root: str | Path, bad: BadNodes) -> None:
    atomic_write_json(RunDir.of(root).bad_nodes, bad.to_dict(), root)


def bad_hosts_line(bad: BadNodes) -> str:
    """One line per bad host for the job log and `status`: its incidents and their evidence."""
    return "; ".join(
        f"{host} ({len(its)} incidents: {' | '.join(i.describe() for i in its)})"
        for host, its in bad.bad.items()
    )
