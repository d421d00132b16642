"""Which rank hung a launch: a pure reading of the hung ranks' stack dumps and /proc state.

When one rank hangs, the others soon wait for it in a collective and every heartbeat goes silent at
the same step, so silence cannot name the culprit. Where each rank waits can:

- a rank *stopped* by a signal (state T) is the culprit (the others wait for it);
- a rank whose main thread's innermost Python frame is inside ``torch.distributed`` (or autograd's
  backward, where DDP's gradient all-reduce waits) is *waiting* for its peers in a collective;
- a rank whose main thread is anywhere else (a read that never returns, a loop, a lock) is the
  culprit, when some rank waits in a collective or it is the only one there;
- a rank that wrote no dump cannot be placed (in uninterruptible sleep, D, not even faulthandler's
  SIGUSR2 handler runs): a *suspect*, said so with its state and kernel wait channel.

Each watchdog judges its own node's ranks: if all of them wait in a collective, the culprit is on
another node (or the ranks called different collectives, which their dumps show).
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from enum import Enum
from typing import Any

COLLECTIVE_PATH = "torch/distributed/"
# DDP all-reduces gradients from autograd hooks in C++: a rank waiting for its peers' gradients
# shows only the backward pass's entry into the engine as its innermost Python frame.
BACKWARD = ("torch/autograd/", "_engine_run_backward")
INNERMOST = 3  # frames of a culprit's stack named in the hang event; the full dump is in stack_dump

_HEADER = re.compile(r"^(Current thread|Thread) 0x[0-9a-fA-F]+.*\(most recent call first\):|^Stack \(most")
_STDLIB = re.compile(r"/lib/python3\.[0-9]+/")
_FRAME = re.compile(r'^\s+File "(?P<file>.*)", line (?P<line>\d+|\?+) in (?P<func>.+)$')


@dataclass(frozen=True)
class Frame:
    file: str
    line: int
    func: str

    def short(self) -> str:
        """``func (dir/file.py:line)``: enough to find it, short enough for a one-line message."""
        where = "/".join(self.file.replace("\\", "/").split("/")[-2:])
        return f"{self.func} ({where}:{self.line})"

    def to_dict(self) -> dict[str, Any]:
        return {"func": self.func, "file": self.file, "line": self.line}


@dataclass(frozen=True)
class Thread:
    current: bool  # the thread that ran the dump handler ("Current thread")
    frames: tuple[Frame, ...]  # innermost first, as faulthandler writes them


def parse_dump(text: str) -> list[Thread]:
    """The threads of a faulthandler dump (all threads, or the single-stack form)."""
    threads: list[Thread] = []
    frames: list[Frame] = []
    current, open_ = False, False
    for line in text.splitlines():
        if _HEADER.match(line):
            if open_:
                threads.append(Thread(current, tuple(frames)))
            current, frames, open_ = line.startswith("Current thread"), [], True
        elif open_ and (m := _FRAME.match(line)):
            n = m["line"]
            frames.append(Frame(m["file"], int(n) if n.isdigit() else 0, m["func"]))
    if open_:
        threads.append(Thread(current, tuple(frames)))
    return threads


def main_thread(text: str) -> tuple[Frame, ...] | None:
    """The main thread's frames, innermost first; None when the text holds no dump. The main
    thread is the one that started in a module (``<module>``, or runpy for ``python -m``), not in
    ``threading``; the last such one when the text holds several dumps."""
    threads = parse_dump(text)
    if not threads:
        return None
    mains = [t for t in threads if t.frames and _started_in_module(t.frames[-1])]
    if mains:
        return mains[-1].frames
    return next((t.frames for t in threads if t.current), threads[-1].frames)


def _started_in_module(outermost: Frame) -> bool:
    return outermost.func == "<module>" or "runpy" in outermost.file


def in_collective(frames: Sequence[Frame]) -> bool:
    """The innermost Python frame is torch.distributed's, or autograd's backward (where DDP's
    gradient all-reduce waits): the rank waits for its peers."""
    if not frames:
        return False
    path = frames[0].file.replace("\\", "/")
    return COLLECTIVE_PATH in path or (BACKWARD[0] in path and frames[0].func == BACKWARD[1])


@dataclass(frozen=True)
class Probe:
    """What the watchdog saw of one hung rank (gathered in launcher.py / watch.py)."""

    rank: int
    pid: int
    state: str = ""  # /proc state letter when the hang was found (before any SIGCONT); '' unknown
    wchan: str = ""  # kernel function it sleeps in; '' when running or unknown
    dump: str | None = None  # the faulthandler text it wrote for this hang; None: none came


class Where(str, Enum):
    STOPPED = "stopped"
    COLLECTIVE = "collective"
    ELSEWHERE = "elsewhere"
    NO_DUMP = "no_dump"


@dataclass(frozen=True)
class Finding:
    rank: int
    pid: int
    where: Where
    state: str
    wchan: str
    frames: tuple[Frame, ...]  # main thread, innermost first

    @property
    def at(self) -> int:
        """The index of the innermost frame that is not the standard library's (a wait in
        ``queue.get`` or ``selectors.select`` says little; the DataLoader that called it does)."""
        return next((i for i, f in enumerate(self.frames) if not _stdlib(f.file)), 0)

    def describe(self) -> str:
        who = f"rank {self.rank} (pid {self.pid})"
        kernel = f" [state {self.state or '?'}{f', in {self.wchan}' if self.wchan else ''}]"
        shown = self.frames[self.at : self.at + INNERMOST]
        stack = " <- ".join(f.short() for f in shown) or "no Python frame"
        if self.at:
            stack = f"{stack} (waiting in {self.frames[0].short()})"
        if self.where == Where.STOPPED:
            return f"{who} is stopped (SIGSTOP?): {stack}"
        if self.where == Where.NO_DUMP:
            return f"{who} wrote no stack dump{kernel}: cannot tell where it is"
        if self.where == Where.COLLECTIVE:
            return f"{who} waits in a collective: {stack}"
        return f"{who} is not in a collective: {stack}{kernel}"

    def to_dict(self) -> dict[str, Any]:
        return {
            "rank": self.rank,
            "pid": self.pid,
            "where": self.where.value,
            "state": self.state,
            "wchan": self.wchan,
            "frames": [f.to_dict() for f in self.frames[:INNERMOST]],
            "at": [f.to_dict() for f in self.frames[self.at : self.at + INNERMOST]],
        }


def _stdlib(path: str) -> bool:
    """A file of Python's standard library, as a dump names it (``<frozen runpy>``, or under
    ``lib/python3.X/`` outside site-packages)."""
    p = path.replace("\\", "/")
    return p.startswith("<") or (bool(_STDLIB.search(p)) and "-packages/" not in p)


@dataclass(frozen=True)
class Diagnosis:
    findings: tuple[Finding, ...]
    culprits: tuple[Finding, ...]
    suspects: tuple[Finding, ...]  # wrote no dump

    @property
    def waiting(self) -> list[int]:
        return [f.rank for f in self.findings if f.where == Where.COLLECTIVE]

    def summary(self, collective: str = "") -> str:
        """One line for the hang event and the launch's reason; '' when no rank was probed.
        ``collective``: what the ranks' collectives say (collectives.Stuck.describe), first; it
        replaces the guess from the stacks of where the culprit is."""
        if not self.findings:
            return collective
        parts = [collective] if collective else []
        parts += [f"culprit {f.describe()}" for f in self.culprits]
        parts += [f"suspect {f.describe()}" for f in self.suspects]
        waiting = self.waiting
        if collective:  # it says who waits, and where
            return "; ".join(parts)
        if waiting and len(waiting) == len(self.findings):
            parts.append(
                "every rank here waits in a collective: the culprit is on another node, or the ranks "
                "wait in different collectives (compare their stack dumps)"
            )
        elif waiting:
            parts.append(f"{_ranks(waiting)} {'waits' if len(waiting) == 1 else 'wait'} in a collective")
        elif not self.culprits and not self.suspects:
            elsewhere = [f.rank for f in self.findings if f.where == Where.ELSEWHERE]
            parts.append(
                f"no rank waits in a collective ({_ranks(elsewhere)} are elsewhere): no culprit named"
            )
        return "; ".join(parts)


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def locate(p: Probe) -> Finding:
    frames = main_thread(p.dump) if p.dump else None
    if p.state in ("T", "t"):
        where = Where.STOPPED
    elif frames is None:
        where = Where.NO_DUMP
    else:
        where = Where.COLLECTIVE if in_collective(frames) else Where.ELSEWHERE
    return Finding(p.rank, p.pid, where, p.state, p.wchan, frames or ())


def diagnose(probes: Iterable[Probe], blamed: Iterable[int] = ()) -> Diagnosis:
    """Culprits: the stopped ranks if any; else the ranks the collectives blame (``blamed``: they
    never entered the collective the others wait in, or entered another one: collectives.py),
    wherever their stacks are; else the ranks outside a collective, when some rank waits in one
    (or only one rank is outside). Ranks without a dump are suspects unless blamed."""
    found = tuple(locate(p) for p in sorted(probes, key=lambda p: p.rank))
    stopped = tuple(f for f in found if f.where == Where.STOPPED)
    named = set(blamed)
    by_collective = tuple(f for f in found if f.rank in named)
    elsewhere = tuple(f for f in found if f.where == Where.ELSEWHERE)
    waiting = any(f.where == Where.COLLECTIVE for f in found)
    culprits = stopped or by_collective or (elsewhere if waiting or len(elsewhere) == 1 else ())
    suspects = tuple(f for f in found if f.where == Where.NO_DUMP and f not in culprits)
    return Diagnosis(found, culprits, suspects)
