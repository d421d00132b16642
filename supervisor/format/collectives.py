"""What a rank's collectives were doing when its launch hung: the record a rank writes on the
watchdog's request, read from torch's flight recorder.

torch records every collective a process group runs, in a ring buffer per process, when
``TORCH_FR_BUFFER_SIZE`` (older: ``TORCH_NCCL_TRACE_BUFFER_SIZE``) is above 0: for NCCL, and in
torch 2.10 and later for gloo too (torch 2.13: each entry has its group, its sequence number in
the group, its op and sizes, and ``retired`` once it finished; each group its last enqueued and
last completed sequence number). The watchdog sets the variable for its launches (``watch
--flight-recorder``), so the trainer's own collectives (DDP's gradient all-reduce in C++, FSDP's
all-gathers, a manual all_reduce) are recorded at no cost to write (2-3 us each, measured in
docs/measured.md) and nothing to change in the trainer.

A hung rank cannot be asked in Python: its main thread is blocked. So the library (``Resumable``)
keeps a thread that sleeps on a FIFO next to the rank's heartbeat (``collectives_request_filename``)
and, when the watchdog writes a token into it, reads the flight recorder (``_dump_fr_trace_json``:
a C++ call that needs no other thread) and writes this summary (``collectives_filename``): per
process group, the last sequence numbers entered and finished and the last few collectives. The
watchdog compares the ranks' summaries (supervisor/watch/collectives.py): who waits in which
collective, who never entered it, who entered another one.

Torch's own dump (a pickle, for ``torchfrtrace``) is not written: the run directory may be another
user's to write, and a pickle there is code for whoever loads it (docs/security.md).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from typing import Any

ENV_FR_BUFFER = "TORCH_FR_BUFFER_SIZE"
ENV_NCCL_TRACE_BUFFER = "TORCH_NCCL_TRACE_BUFFER_SIZE"  # what torch read before TORCH_FR_BUFFER_SIZE
# Entries torch's ring buffer keeps per process (all groups together): a few steps of a large
# model's collectives; the summary keeps RECENT of them per group.
DEFAULT_FR_ENTRIES = 512
RECENT = 8
_SIZES_MAX = 80  # characters of an entry's sizes kept ("[[4096, 1024]]")
_TEXT_MAX = 200  # characters of any other string field


def recorder_entries(environ: Mapping[str, str]) -> int:
    """The flight recorder's size an environment asks torch for (0: off, or not a number)."""
    raw = environ.get(ENV_FR_BUFFER, environ.get(ENV_NCCL_TRACE_BUFFER, "0"))
    try:
        return max(int(raw), 0)
    except ValueError:
        return 0


def recorder_env(environ: Mapping[str, str], entries: int) -> dict[str, str]:
    """What a launch's environment gains so torch records its collectives: ``entries`` in
    ``TORCH_FR_BUFFER_SIZE``, unless the operator set either variable (theirs stands, 0 too)."""
    if entries <= 0 or ENV_FR_BUFFER in environ or ENV_NCCL_TRACE_BUFFER in environ:
        return {}
    return {ENV_FR_BUFFER: str(entries)}


@dataclass(frozen=True)
class Collective:
    """One collective a rank entered, as its flight recorder holds it."""

    seq: int  # its number in its group (torch's collective_seq_id): the same collective on every rank
    op: str  # all_reduce, all_gather, barrier... (the backend's prefix dropped)
    backend: str  # gloo, nccl
    done: bool  # it finished on this rank (torch retired it)
    sizes: str  # its input sizes, short
    t: float  # wall time it was entered

    def name(self) -> str:
        return f"{self.op} #{self.seq}"


@dataclass(frozen=True)
class GroupState:
    """One process group on one rank: how far it got, and its last collectives (oldest first)."""

    group: str  # the group's name ("0": the default group)
    desc: str  # what torch calls it (default_pg, or the group_desc given to new_group)
    entered: int  # the last sequence number this rank entered (-1: none)
    finished: int  # the last one that finished here (-1: none)
    recent: tuple[Collective, ...]

    @property
    def pending(self) -> bool:
        return self.entered > self.finished

    def at(self, seq: int) -> Collective | None:
        return next((c for c in self.recent if c.seq == seq), None)

    def label(self) -> str:
        return f"group {self.group}" + (f" ({self.desc})" if self.desc and self.desc != "undefined" else "")


@dataclass(frozen=True)
class CollectiveDump:
    """A rank's answer to one request: its groups, or why it has none (``problem``)."""

    rank: int
    pid: int
    token: str  # the request's, so the watchdog knows the answer is to this request
    source: str  # "torch 2.13.0 flight recorder"
    groups: tuple[GroupState, ...]
    problem: str = ""
    # The last step the rank finished, as its training loop knows it (-1: unknown); its heartbeat's
    # may be older: beats are written at most once a second.
    step: int = -1

    def group(self, name: str) -> GroupState | None:
        return next((g for g in self.groups if g.group == name), None)

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)

    def encode(self) -> bytes:
        return (json.dumps(self.to_dict(), sort_keys=True) + "\n").encode()


def parse_dump(data: str | bytes) -> CollectiveDump:
    """A dump as a rank wrote it; ValueError with a short reason for anything else."""
    try:
        d = json.loads(data)
    except (ValueError, RecursionError):
        raise ValueError("not valid JSON") from None
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    try:
        return CollectiveDump(
            rank=_int(d["rank"]),
            pid=_int(d["pid"]),
            token=_str(d["token"]),
            source=_str(d["source"]),
            groups=tuple(_group(g) for g in _list(d["groups"])),
            problem=_str(d.get("problem", "")),
            step=_int(d.get("step", -1)),
        )
    except KeyError as e:
        raise ValueError(f"field {e} missing") from None
    except (TypeError, ValueError, OverflowError) as e:
        raise ValueError(f"bad field ({e})") from None


def _group(g: object) -> GroupState:
    if not isinstance(g, dict):
        raise TypeError(f"group {g!r} is not an object")
    return GroupState(
        group=_str(g["group"]),
        desc=_str(g["desc"]),
        entered=_int(g["entered"]),
        finished=_int(g["finished"]),
        recent=tuple(_collective(c) for c in _list(g["recent"])),
    )


def _collective(c: object) -> Collective:
    if not isinstance(c, dict):
        raise TypeError(f"collective {c!r} is not an object")
    done = c["done"]
    if not isinstance(done, bool):
        raise TypeError(f"done {done!r} is not a boolean")
    t = c["t"]
    if isinstance(t, bool) or not isinstance(t, (int, float)):
        raise TypeError(f"t {t!r} is not a number")
    return Collective(
        seq=_int(c["seq"]),
        op=_str(c["op"]),
        backend=_str(c["backend"]),
        done=done,
        sizes=_str(c["sizes"])[:_SIZES_MAX],
        t=float(t),
    )


def _int(v: object) -> int:
    if isinstance(v, bool) or not isinstance(v, int):
        raise TypeError(f"{v!r} is not an integer")
    return v


def _str(v: object) -> str:
    if not isinstance(v, str):
        raise TypeError(f"{v!r} is not a string")
    return v[:_TEXT_MAX]


def _list(v: object) -> list[Any]:
    if not isinstance(v, list):
        raise TypeError(f"{v!r} is not a list")
    return v


# ---------------------------------------------------------------- from torch's flight recorder


def from_flight_recorder(trace: Mapping[str, Any], keep: int = RECENT) -> tuple[GroupState, ...]:
    """The groups of one ``_dump_fr_trace_json`` document (torch's JSON: ``entries``, and
    ``pg_status`` keyed by group id), each with its last ``keep`` collectives; point-to-point
    entries are left out (their numbering is per pair). Pure: what the rank's thread writes."""
    status = trace.get("pg_status")
    status = status if isinstance(status, dict) else {}
    entries = trace.get("entries")
    by_id: dict[str, list[Collective]] = {}
    named: dict[str, tuple[str, str]] = {}  # group id -> (name, desc): the name is the same on every rank
    for e in entries if isinstance(entries, list) else []:
        if not isinstance(e, dict) or e.get("is_p2p"):
            continue
        gid = str(e.get("pg_id", "?"))[:_TEXT_MAX]
        named.setdefault(gid, _group_of(e, gid))
        backend, _, op = str(e.get("profiling_name", "")).rpartition(":")
        by_id.setdefault(gid, []).append(
            Collective(
                seq=_as_int(e.get("collective_seq_id"), -1),
                op=op[:_TEXT_MAX] or "?",
                backend=backend[:_TEXT_MAX],
                done=bool(e.get("retired")),
                sizes=json.dumps(e.get("input_sizes", []), separators=(",", ":"))[:_SIZES_MAX],
                t=_as_int(e.get("time_created_ns"), 0) / 1e9,
            )
        )
    groups = []
    for gid in sorted(set(by_id) | {str(k)[:_TEXT_MAX] for k in status}, key=_group_order):
        recent = by_id.get(gid, [])[-keep:] if keep > 0 else []
        st = status.get(gid, {})
        st = st if isinstance(st, dict) else {}
        entered = _as_int(st.get("last_enqueued_collective"), max((c.seq for c in recent), default=-1))
        finished = _as_int(
            st.get("last_completed_collective"), max((c.seq for c in recent if c.done), default=-1)
        )
        name, desc = named.get(gid, (gid, ""))
        groups.append(GroupState(name, desc, entered, finished, tuple(recent)))
    return tuple(groups)


def _group_of(e: Mapping[str, Any], gid: str) -> tuple[str, str]:
    """(name, description) of an entry's group: ``process_group`` is [name, desc] in torch 2.13
    (the name is what every rank calls the group; its id is this process's count); the id where
    it is missing."""
    pg = e.get("process_group")
    if isinstance(pg, (list, tuple)) and len(pg) == 2:
        return str(pg[0])[:_TEXT_MAX], str(pg[1])[:_TEXT_MAX]
    return gid, ""


def _group_order(name: str) -> tuple[int, str]:
    return (int(name), "") if name.isdigit() else (1 << 30, name)


def _as_int(v: object, default: int) -> int:
    """torch writes its status numbers as strings ("4"); -1 stands for none."""
    if isinstance(v, bool):
        return default
    if isinstance(v, int):
        return v
    if isinstance(v, str):
        try:
            return int(v)
        except ValueError:
            return default
    return default
