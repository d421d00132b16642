"""A node's heartbeats in one file: what each node's watchdog publishes into the run directory.

Ranks under a watchdog write their heartbeats on their own node (layout.node_heartbeat_dir: in
memory, /dev/shm, by default); the watchdog reads them there and publishes
``heartbeats/node_NNNNN.json`` every ``--summary-interval``: one atomic write per node per interval,
whatever the ranks per node. The file is two JSON lines:

    1. the header: node, host, watchdog pid, when it was written (wall and monotonic clock, boot),
       the interval and the age past which it is stale, the watchdog's state (status, reason, exit
       code, launches, restarts: what state.nodeN.json says, so `status` need not parse 2,048
       state files with their launch histories), the current launch, the last launch's verdict
       and culprit, counts (ranks, phases, step span, median step time) and the ranks
       that need a look (stale, unknown, an exit code, failed saves) as the watchdog judged them
    2. ``{"heartbeats": [...], "problems": [...]}``: every rank's record exactly as the rank wrote
       it (fields this code does not know travel too), and the rank files that could not be read

`status` on a big run parses the headers only (its cost grows with nodes, not ranks), and the
records of a node when it lists every rank or one of them needs a look.
"""

from __future__ import annotations

import json
import operator
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from supervisor.format.atomic import atomic_write_bytes
from supervisor.format.capped import SUMMARY_MAX, read_capped
from supervisor.format.heartbeat import (
    HeartbeatSnapshot,
    heartbeat_from_dict,
    load_object,
    read_heartbeat_folder,
    read_heartbeats,
)
from supervisor.format.layout import (
    HEARTBEATS,
    RunDir,
    node_local_base,
    parse_node_summary_filename,
    per_node_files,
    run_key,
)

# A summary not rewritten for this many intervals is stale: its watchdog is gone or stuck, or the
# node is lost (or the shared filesystem refuses its writes).
STALE_INTERVALS = 3
STALE_MIN_S = 10.0


def stale_after(interval_s: float) -> float:
    return max(STALE_INTERVALS * interval_s, STALE_MIN_S)


@dataclass(frozen=True)
class StragglerNote:
    """A rank the judging watchdog (node 0's) flags as a straggler (supervisor/watch/stragglers.py):
    ``kind`` compute, network or late; ``value`` its compute ratio to its peers' median, or one
    plus its lateness at the step boundary; flagged since ``since_step``, last judged at ``step``."""

    rank: int
    host: str
    kind: str
    value: float
    since_step: int
    step: int
    text: str = ""  # the verdict in words, as the event said it

    @classmethod
    def parse(cls, d: object) -> StragglerNote:
        if not isinstance(d, dict):
            raise ValueError(f"straggler {d!r:.60} is not an object")
        return cls(
            rank=_check(d, "rank", int),
            host=_check(d, "host", str),
            kind=_check(d, "kind", str),
            value=float(_check(d, "value", _NUM)),
            since_step=_check(d, "since_step", int),
            step=_check(d, "step", int),
            text=_check(d, "text", str) if "text" in d else "",
        )


# A node's part in a run whose launches follow a roster (SLURM's hot spares, docs/slurm.md):
ROLE_TRAIN = "train"  # in the roster's launch
ROLE_SPARE = "spare"  # waiting, imports done, to take a lost node's place
ROLE_OUT = "out"  # left out by the roster (a bad node) and not a spare


@dataclass  # not frozen: `status` parses 2,048; frozen, its __init__ took 3.1 us instead of 0.6
class SummaryHeader:
    """The first line of a node summary: the node's watchdog and its ranks in counts, enough for
    `status` without the records."""

    node: int
    host: str
    watchdog_pid: int
    wall_time: float
    interval_s: float
    stale_after_s: float
    mono_time: float = 0.0
    boot_id: str = ""
    status: str = ""  # the watchdog's state, as in its state file (events.RunState)
    reason: str = ""
    exit_code: int | None = None
    launch_count: int = 0
    restarts: int = 0
    launch_id: str = ""
    verdict: str = ""  # the last launch's reason (its outcome in words)
    culprit: str = ""  # who hung the last hung launch, from the stack dumps
    ranks: int = 0  # rank files on the node, readable or not
    phases: dict[str, int] = field(default_factory=dict)
    step_min: int | None = None
    step_max: int | None = None
    live_step_max: int | None = None  # over the ranks that need no look
    last_step_s: float | None = None  # median over those in phase train
    attention: tuple[int, ...] = ()
    # Under a roster (--roster): ROLE_*, the generation of its last launch, and the one it waits
    # for (0: not waiting); '' and 0 without one.
    role: str = ""
    roster_gen: int = 0
    roster_wait: int = 0
    stragglers: tuple[StragglerNote, ...] = ()  # the judge's verdicts (node 0's summary)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["attention"] = list(self.attention)
        d["stragglers"] = [asdict(n) for n in self.stragglers]
        return d


@dataclass(frozen=True)
class RankProblem:
    """A rank file on the node that could not be used, and why."""

    rank: int
    path: str
    problem: str


def summary_bytes(header: SummaryHeader, records: list[dict[str, Any]], problems: list[RankProblem]) -> bytes:
    body = {"heartbeats": records, "problems": [asdict(p) for p in problems]}
    return (json.dumps(header.to_dict(), separators=(",", ":")) + "\n" + json.dumps(body) + "\n").encode()


def write_summary(
    root: str | Path, header: SummaryHeader, records: list[dict[str, Any]], problems: list[RankProblem]
) -> None:
    atomic_write_bytes(
        RunDir.of(root).node_summary(header.node), summary_bytes(header, records, problems), root
    )


_NUM = (int, float)


def _check(d: dict[str, Any], key: str, types: type | tuple[type, ...], optional: bool = False) -> Any:
    if key not in d and not optional:
        raise ValueError(f"field {key!r} missing")
    v = d.get(key)
    if (v is None and optional) or (isinstance(v, types) and not isinstance(v, bool)):
        return v
    raise ValueError(f"field {key!r} is {v!r:.60}")


_N = type(None)
# Each header field's JSON types (bool is not an int here); float fields take ints too.
_HEADER_TYPES: dict[str, tuple[type, ...]] = {
    "node": (int,),
    "host": (str,),
    "watchdog_pid": (int,),
    "wall_time": (float, int),
    "interval_s": (float, int),
    "stale_after_s": (float, int),
    "mono_time": (float, int),
    "boot_id": (str,),
    "status": (str,),
    "reason": (str,),
    "exit_code": (int, _N),
    "launch_count": (int,),
    "restarts": (int,),
    "launch_id": (str,),
    "verdict": (str,),
    "culprit": (str,),
    "ranks": (int,),
    "phases": (dict,),
    "step_min": (int, _N),
    "step_max": (int, _N),
    "live_step_max": (int, _N),
    "last_step_s": (float, int, _N),
    "attention": (list,),
    "role": (str,),
    "roster_gen": (int,),
    "roster_wait": (int,),
    "stragglers": (list,),
}
# Fields a summary of an older version lacks, and what they are then.
_LATER_FIELDS: dict[str, Any] = {"role": "", "roster_gen": 0, "roster_wait": 0, "stragglers": []}
_FIELDS = tuple(_HEADER_TYPES)  # SummaryHeader's fields, in its order
_GET = operator.itemgetter(*_FIELDS)
_ALLOWED = frozenset((k, t) for k, types in _HEADER_TYPES.items() for t in types)
_FLOATS = tuple(_FIELDS.index(k) for k in ("wall_time", "interval_s", "stale_after_s", "mono_time"))
_INTS = frozenset({int})
_PHASES, _ATTENTION = _FIELDS.index("phases"), _FIELDS.index("attention")
_STRAGGLERS = _FIELDS.index("stragglers")


def parse_header(line: bytes | str) -> SummaryHeader:
    """Raise ValueError (with a short reason) unless ``line`` is a summary header. `status` parses
    2,048 of them: one pass in C over a type table (itemgetter, map, zip), and the field-by-field
    check only to say what is wrong or to fill optional fields left out."""
    d = load_object(line)
    try:
        v = list(_GET(d))
    except KeyError:
        return _parse_header_slowly(d)
    phases, attention = v[_PHASES], v[_ATTENTION]
    if (
        _ALLOWED.issuperset(zip(_FIELDS, map(type, v), strict=True))
        and _INTS.issuperset(map(type, phases.values()))
        and _INTS.issuperset(map(type, attention))
    ):
        for i in _FLOATS:
            v[i] = float(v[i])
        v[_ATTENTION] = tuple(attention)
        v[_STRAGGLERS] = tuple(map(StragglerNote.parse, v[_STRAGGLERS]))  # none on most nodes
        return SummaryHeader(*v)
    return _parse_header_slowly(d)


def _parse_header_slowly(d: dict[str, Any]) -> SummaryHeader:
    """``parse_header`` field by field: the ValueError names the first field that is wrong."""
    d = {**_LATER_FIELDS, **d}
    phases = _check(d, "phases", dict)
    attention = _check(d, "attention", list)
    if not all(isinstance(v, int) for v in (*phases.values(), *attention)):
        raise ValueError("field 'phases' or 'attention' is not all integers")
    return SummaryHeader(
        node=_check(d, "node", int),
        host=_check(d, "host", str),
        watchdog_pid=_check(d, "watchdog_pid", int),
        wall_time=float(_check(d, "wall_time", _NUM)),
        interval_s=float(_check(d, "interval_s", _NUM)),
        stale_after_s=float(_check(d, "stale_after_s", _NUM)),
        mono_time=float(_check(d, "mono_time", _NUM)),
        boot_id=_check(d, "boot_id", str),
        status=_check(d, "status", str),
        reason=_check(d, "reason", str),
        exit_code=_check(d, "exit_code", int, optional=True),
        launch_count=_check(d, "launch_count", int),
        restarts=_check(d, "restarts", int),
        launch_id=_check(d, "launch_id", str),
        verdict=_check(d, "verdict", str),
        culprit=_check(d, "culprit", str),
        ranks=_check(d, "ranks", int),
        phases=phases,
        step_min=_check(d, "step_min", int, optional=True),
        step_max=_check(d, "step_max", int, optional=True),
        live_step_max=_check(d, "live_step_max", int, optional=True),
        last_step_s=_check(d, "last_step_s", _NUM, optional=True),
        attention=tuple(attention),
        role=_check(d, "role", str),
        roster_gen=_check(d, "roster_gen", int),
        roster_wait=_check(d, "roster_wait", int),
        stragglers=tuple(map(StragglerNote.parse, _check(d, "stragglers", list))),
    )


@dataclass(frozen=True)
class NodeSummary:
    """One summary file as read: its header parsed, its records parsed only when asked for."""

    path: str
    header: SummaryHeader
    body: bytes = field(default=b"", repr=False)
    size: int = 0  # bytes read: `status` counts them in the disk use without a stat

    def snapshots(self) -> list[HeartbeatSnapshot]:
        """Every rank of the node; ValueError when the records line is not one."""
        return parse_records(self.path, self.body)


def read_summary(path: str | Path) -> NodeSummary:
    """The summary at ``path``. Raises OSError (cannot be read) or ValueError (not a summary: a
    foreign or damaged file, with the reason)."""
    data = read_capped(path, SUMMARY_MAX)
    head, _, body = data.partition(b"\n")
    return NodeSummary(str(path), parse_header(head), body, len(data))


def parse_records(path: str, body: bytes) -> list[HeartbeatSnapshot]:
    """The ranks of a summary's second line; a record that is not a heartbeat is an unknown rank."""
    d = load_object(body)
    out = []
    for rec in _check(d, "heartbeats", list):
        try:
            hb = heartbeat_from_dict(rec)
        except ValueError as e:
            rank = rec.get("rank") if isinstance(rec, dict) else None
            if isinstance(rank, int):
                out.append(HeartbeatSnapshot(rank, path, None, f"in the node summary: {e}"))
            continue
        out.append(HeartbeatSnapshot(hb.rank, path, hb, record=rec))
    for p in _check(d, "problems", list):
        if isinstance(p, dict) and isinstance(p.get("rank"), int):
            out.append(
                HeartbeatSnapshot(p["rank"], str(p.get("path", path)), None, str(p.get("problem", "")))
            )
    return out


def summary_paths(root: str | Path) -> list[tuple[int, str]]:
    """(node, path) of every summary file of the run, by node."""
    return per_node_files(os.path.join(root, HEARTBEATS), parse_node_summary_filename)


def local_folders(root: str | Path) -> list[Path]:
    """This machine's node-local heartbeat folders of the run (any job, any node), under the
    default base (layout.node_local_base)."""
    user = node_local_base() / f"supervisor-{os.getuid()}"
    return sorted(user.glob(f"*-{run_key(root)}/node*"))


def read_run_heartbeats(root: str | Path, watched_as: str | Path | None = None) -> list[HeartbeatSnapshot]:
    """Every rank of the run as freshly as this machine can see it, by rank: the run directory's
    rank files, the node summaries, and this machine's node-local folders of the run; per rank
    the newest readable record wins. For tools on a node (the drill, tests, benchmarks); `status`
    reads the summaries (report.py). ``watched_as``: the path the watchdog was given, when the
    caller reads the run dir by another (the drill reads a fault mount's backing dir): the
    node-local folders are keyed by the watchdog's path."""
    snaps = list(read_heartbeats(root))
    for _node, path in summary_paths(root):
        try:
            snaps += read_summary(path).snapshots()
        except (OSError, ValueError):
            continue
    for folder in local_folders(watched_as or root):
        snaps += read_heartbeat_folder(folder)
    return newest_per_rank(snaps)


def newest_per_rank(snaps: list[HeartbeatSnapshot]) -> list[HeartbeatSnapshot]:
    """One snapshot per rank: the readable one written last, else the first unreadable one."""
    best: dict[int, HeartbeatSnapshot] = {}
    for s in snaps:
        cur = best.get(s.rank)
        if cur is None or (
            s.heartbeat is not None
            and (cur.heartbeat is None or s.heartbeat.wall_time > cur.heartbeat.wall_time)
        ):
            best[s.rank] = s
    return [best[r] for r in sorted(best)]
