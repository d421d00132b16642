"""Which collective a hung launch is stuck in, and which ranks never entered it: a pure reading of
the ranks' flight-recorder summaries (supervisor/format/collectives.py), and the thin code that
asks the ranks for them.

In each process group every rank numbers its collectives the same way (torch's sequence number),
so the first number some rank has not finished is the collective the group is stuck in. Against
it each rank of this node is:

- *waiting*: it entered that collective and it has not finished (its peers have not all come);
- *missing*: it never entered it (its last number is lower): the culprit, wherever its stack is
  (a DataLoader, a read, a branch that skipped the collective);
- *other*: it entered a different collective under that number (a skipped collective followed by
  the next one, the classic mismatch): the culprit is the rank whose op differs from the most
  common one; with no majority (two ranks, one op each) no rank can be named;
- *finished*: it finished it (a broadcast's root need not wait for its receivers).

When every rank of the node waits in the same collective and none is missing, the culprit is on
another node, or no rank is: they all came and cannot reach each other (the network; see
supervisor/watch/network.py).
"""

from __future__ import annotations

import os
import time
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from supervisor.format import confined
from supervisor.format.capped import RECORD_MAX, read_capped
from supervisor.format.collectives import Collective, CollectiveDump, GroupState, parse_dump
from supervisor.format.layout import collectives_filename, collectives_request_filename

POLL_S = 0.02


@dataclass(frozen=True)
class Stuck:
    """A collective some ranks of this node entered and did not finish, and where the others are."""

    group: str
    label: str  # "group 0 (default_pg)"
    seq: int
    op: str  # the op most ranks entered under ``seq`` ('' : no majority)
    waiting: tuple[int, ...]
    missing: tuple[tuple[int, Collective | None], ...]  # rank, the last collective it entered
    other: tuple[tuple[int, Collective], ...]  # rank, what it entered under ``seq`` instead
    finished: tuple[int, ...]
    entered_t: float  # when the first rank entered it (wall time; 0: unknown)

    @property
    def culprits(self) -> list[int]:
        """The ranks that never entered it or entered another op; none when there is no majority
        op (every rank is then in ``other``)."""
        if not self.op:
            return []
        return sorted([r for r, _ in self.missing] + [r for r, _ in self.other])

    @property
    def name(self) -> str:
        return f"{self.op or 'different collectives'} #{self.seq} of {self.label}"

    def describe(self, steps: Mapping[int, int], local_world: int, world: int) -> str:
        """One sentence: who waits in it (after which step), who never entered it or entered
        another; when all here wait and none is missing, that (and where the other ranks are)."""
        after = _after(steps, self.waiting or [r for r, _ in self.other])
        if not self.op:
            ops = ", ".join(f"rank {r} {c.name()}" for r, c in self.other)
            return (
                f"ranks entered different collectives under #{self.seq} of {self.label}{after}: {ops}: "
                "a collective mismatch, with no majority to tell which rank is wrong"
            )
        parts = [
            f"{_ranks(self.waiting)} {'waits' if len(self.waiting) == 1 else 'wait'} in {self.name}{after}"
        ]
        for r, last in self.missing:
            was = (
                f"its last: {last.name()}, {'finished' if last.done else 'not waited on (another rank finished it)'}"
                if last
                else "none recorded"
            )
            parts.append(f"rank {r} never entered it ({was})")
        parts += [f"rank {r} entered {c.name()} instead" for r, c in self.other]
        if self.finished:
            parts.append(f"{_ranks(self.finished)} finished it")
        if not self.culprits and set(self.waiting) and len(self.waiting) == local_world:
            where = f"; ranks on other nodes: {world - local_world}" if world > local_world else ""
            parts.append(f"every rank here entered it and none finished it: none is missing{where}")
        return "; ".join(parts)

    def to_dict(self) -> dict[str, Any]:
        return {
            "group": self.group,
            "label": self.label,
            "seq": self.seq,
            "op": self.op,
            "waiting": list(self.waiting),
            "missing": [{"rank": r, "last": last.name() if last else None} for r, last in self.missing],
            "other": [{"rank": r, "entered": c.name()} for r, c in self.other],
            "finished": list(self.finished),
            "culprits": self.culprits,
        }


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _after(steps: Mapping[int, int], ranks: Iterable[int]) -> str:
    seen = sorted({steps[r] for r in ranks if r in steps})
    if not seen:
        return ""
    return f", after step {seen[0]}" if len(seen) == 1 else f", after steps {seen[0]}-{seen[-1]}"


def find_stuck(dumps: Mapping[int, CollectiveDump]) -> list[Stuck]:
    """Every group some rank of ``dumps`` (rank -> its summary) has not finished, judged as the
    module says; those with a culprit first, then the longest stuck."""
    names = dict.fromkeys(g.group for d in dumps.values() for g in d.groups)
    out = [s for name in names if (s := _judge_group(name, dumps)) is not None]
    return sorted(out, key=lambda s: (not s.culprits, s.entered_t or float("inf")))


def _symmetric(op: str) -> bool:
    """An op no rank finishes before every rank of the group has entered it (all_reduce,
    all_gather, reduce_scatter, all_to_all, barrier); a broadcast's or a reduce's root may."""
    return "all" in op or "reduce_scatter" in op or op == "barrier"


def _done_by_all(members: Mapping[int, GroupState], seq: int) -> bool:
    """Some rank finished the symmetric collective ``seq``: every rank's part of it is in, whatever
    another rank's own record says (an async op it launched and has not waited on stays in flight
    there until the wait: a rank stuck before its wait is not stuck in that collective)."""
    return any(
        g.finished >= seq and (c := g.at(seq)) is not None and _symmetric(c.op) for g in members.values()
    )


def _judge_group(name: str, dumps: Mapping[int, CollectiveDump]) -> Stuck | None:
    members = {r: g for r, d in sorted(dumps.items()) if (g := d.group(name)) is not None}
    if not any(g.pending for g in members.values()):
        return None
    seq = min(g.finished for g in members.values()) + 1
    while _done_by_all(members, seq):
        seq += 1
    if all(g.entered < seq for g in members.values()):
        return None  # what some rank has in flight, another finished: nobody waits in a collective
    entered: dict[int, Collective | None] = {}
    missing: list[tuple[int, Collective | None]] = []
    finished: list[int] = []
    for r, g in members.items():
        if g.finished >= seq:
            finished.append(r)
        elif g.entered < seq:
            missing.append((r, g.at(g.entered)))
        else:
            entered[r] = g.at(seq)
    ops = Counter(c.op for c in entered.values() if c is not None)
    top = ops.most_common(2)
    op = top[0][0] if top and (len(top) == 1 or top[0][1] > top[1][1]) else ""
    waiting = tuple(r for r, c in entered.items() if c is None or (op and c.op == op))
    other = tuple((r, c) for r, c in entered.items() if c is not None and c.op != op)
    times = [c.t for c in entered.values() if c is not None and c.t > 0]
    label = next(g.label() for g in members.values())
    return Stuck(
        name, label, seq, op, waiting, tuple(missing), other, tuple(finished), min(times, default=0.0)
    )


# ---------------------------------------------------------------- asking the ranks (thin)


def request(folder: Path, ranks: Iterable[int], token: str) -> dict[int, str]:
    """Write ``token`` into each rank's request FIFO; rank -> why it could not be asked (no
    reporter: the flight recorder is off, or the rank is not the library's; a FIFO nobody reads)."""
    problems: dict[int, str] = {}
    for r in ranks:
        try:
            fd = confined.open_fifo(folder.parent, folder / collectives_request_filename(r))
        except FileNotFoundError:
            problems[r] = (
                "no request FIFO (the flight recorder is off, or the trainer does not use Resumable)"
            )
            continue
        except confined.Escape as e:  # a link, or no FIFO, planted where the rank's FIFO goes
            problems[r] = f"cannot ask it ({e})"
            continue
        except OSError as e:  # ENXIO: nobody reads it (the rank is gone)
            problems[r] = f"cannot ask it ({os.strerror(e.errno) if e.errno else e})"
            continue
        try:
            os.write(fd, token.encode() + b"\n")
        except OSError as e:
            problems[r] = f"cannot ask it ({os.strerror(e.errno) if e.errno else e})"
        finally:
            os.close(fd)
    return problems


def collect(folder: Path, ranks: Iterable[int], token: str, deadline: float) -> dict[int, CollectiveDump]:
    """The answers to ``token`` that arrive before ``deadline`` (monotonic), rank -> summary."""
    want = set(ranks)
    got: dict[int, CollectiveDump] = {}
    while True:
        for r in sorted(want - set(got)):
            d = read_answer(folder / collectives_filename(r), token)
            if d is not None and d.rank == r:
                got[r] = d
        if len(got) == len(want) or time.monotonic() >= deadline:
            return got
        time.sleep(POLL_S)


def read_answer(path: Path, token: str) -> CollectiveDump | None:
    """The summary at ``path`` when it answers ``token``; None when missing, unreadable, or older."""
    try:
        d = parse_dump(read_capped(path, RECORD_MAX, follow=False))
    except (OSError, ValueError):
        return None
    return d if d.token == token else None


def pending_line(groups: Sequence[GroupState]) -> str:
    """'group 0 (default_pg): in all_reduce #57' for each group with a collective in flight."""
    parts = []
    for g in groups:
        if g.pending:
            c = g.at(g.finished + 1)
            parts.append(f"{g.label()}: in {c.name() if c else f'#{g.finished + 1}'}")
    return "; ".join(parts) or "no collective in flight"
