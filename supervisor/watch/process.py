"""Start the command, signal it, dump its stacks, and kill it without leaving an orphan.

torchrun starts each worker in a session of its own, so the launched process group does not hold
the workers: killing the group would orphan them. The watchdog therefore makes itself a child
subreaper (Linux ``PR_SET_CHILD_SUBREAPER``): every descendant whose parent dies is re-parented to
the watchdog, so "the tree" is simply every descendant of the watchdog, found in /proc.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
import signal
import subprocess
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path

from supervisor.format.layout import STACK_DUMP_SIGNAL
from supervisor.libc import libc_function
from supervisor.watch.blocked import blocked_io

PR_SET_CHILD_SUBREAPER = 36
POLL_S = 0.05
MAX_DUMP_CHARS = 64_000


@dataclass(frozen=True)
class ProcInfo:
    pid: int
    ppid: int
    pgid: int
    state: str  # R, S, D, T (stopped), t, Z (zombie)...
    sid: int = 0  # session: torchrun starts each worker as a session leader (sid == pid)
    start: int = 0  # start time in clock ticks since boot: with the pid, names one process
    cpu_ticks: int = 0  # user + system time of all its threads, in clock ticks


def become_subreaper() -> bool:
    """Adopt orphaned descendants (Linux); False where the call is unavailable."""
    prctl = libc_function(
        "prctl", [ctypes.c_int, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong, ctypes.c_ulong]
    )
    return prctl is not None and prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) == 0


def _ignoring(signals: tuple[int, ...]) -> Callable[[], None] | None:
    """A ``preexec_fn`` that ignores ``signals`` in the child (SIG_IGN survives exec); it sets
    nothing but signal dispositions, so it is safe between fork and exec."""
    if not signals:
        return None

    def ignore() -> None:
        for s in signals:
            signal.signal(s, signal.SIG_IGN)

    return ignore


def read_proc(pid: int) -> ProcInfo | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            rest = f.read().rsplit(")", 1)[1].split()
    except (OSError, IndexError):
        return None
    return ProcInfo(
        pid, int(rest[1]), int(rest[2]), rest[0], int(rest[3]), int(rest[19]), int(rest[11]) + int(rest[12])
    )


def process_table() -> dict[int, ProcInfo]:
    out = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            info = read_proc(int(name))
            if info is not None:
                out[info.pid] = info
    return out


def descendants(root: int, table: Mapping[int, ProcInfo]) -> list[int]:
    """Every live (non-zombie) process below ``root`` in the parent tree."""
    children: dict[int, list[int]] = {}
    for p in table.values():
        children.setdefault(p.ppid, []).append(p.pid)
    out, todo = [], list(children.get(root, ()))
    while todo:
        pid = todo.pop()
        if table[pid].state != "Z":
            out.append(pid)
        todo.extend(children.get(pid, ()))
    return out


def stopped(pids: Iterable[int]) -> list[int]:
    """Those of ``pids`` that are stopped (SIGSTOP, or traced)."""
    return [p for p in pids if (info := read_proc(p)) is not None and info.state in ("T", "t")]


def proc_state(pid: int) -> tuple[str, str]:
    """``pid``'s state letter and the kernel function it sleeps in (wchan); '' where unknown."""
    info = read_proc(pid)
    try:
        wchan = Path(f"/proc/{pid}/wchan").read_text().strip()
    except OSError:
        wchan = ""
    return (info.state if info else ""), ("" if wchan == "0" else wchan)


def send(pids: Iterable[int], sig: int) -> list[int]:
    """Signal each pid; return those that existed."""
    hit = []
    for pid in pids:
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.kill(pid, sig)
            hit.append(pid)
    return hit


def kill_tree(root: int) -> list[int]:
    """SIGKILL ``root`` and every process below it; the pids signalled. torchrun starts each rank
    in a session of its own, so killing its process group leaves the ranks running (holding its
    output pipe, a GPU). The tree is stopped until no process joins it, then killed: none started
    between the look and the kill escapes. Each process is tried once: one that cannot be signalled
    (gone, another user's) does not keep the loop going."""
    tree: set[int] = set()
    while not (now := {root, *descendants(root, process_table())}) <= tree:
        send(now - tree, signal.SIGSTOP)
        tree |= now
    return send(tree, signal.SIGKILL)


def reap_adopted(keep: int | None = None) -> None:
    """Collect exit statuses of adopted orphans (never of ``keep``, which Popen waits for)."""
    for info in process_table().values():
        if info.ppid == os.getpid() and info.state == "Z" and info.pid != keep:
            with contextlib.suppress(ChildProcessError):
                os.waitpid(info.pid, os.WNOHANG)


class Child:
    """The launched command and everything it started.

    Every wait is bounded: a process that SIGKILL cannot end (state D, in a read from a hung
    mount that never returns) is named and left behind after ``reap_timeout_s``, recorded in
    ``abandoned`` (shared by the watchdog's launches) so later launches do not wait for it again.
    It dies the moment its I/O returns, as SIGKILL is pending; the watchdog reaps it then."""

    def __init__(
        self,
        argv: list[str],
        env: Mapping[str, str],
        *,
        reap_timeout_s: float,
        abandoned: set[tuple[int, int]] | None = None,
        own_subtree: bool = False,
        ignored: Iterable[int] = (),
    ) -> None:
        """``ignored``: signals the command starts with ignored, and keeps across exec: the
        preemption notice, which SLURM (``--signal`` without ``B:``) sends every process of the
        job, torchrun's agent among them; it has no handler and would die of SIGUSR1 while its
        ranks went on unsupervised. A rank installs its own handler (``install_signals``)."""
        self.reap_timeout_s = reap_timeout_s
        self.abandoned = set() if abandoned is None else abandoned
        self.unreaped: list[str] = []  # what kill() had to leave behind in this launch, described
        # A standby launch (watch --standby) is only the launched process and what is below it;
        # the running launch is every descendant but the trees rooted at ``excluded`` (a standby's).
        self.own_subtree = own_subtree
        self.excluded: set[int] = set()
        self.popen = subprocess.Popen(
            argv, env=dict(env), start_new_session=True, preexec_fn=_ignoring(tuple(ignored))
        )
        self.pid = self.popen.pid
        self.started = time.time()
        self.started_mono = time.monotonic()
        self.sigkilled = 0  # processes the last kill() had to SIGKILL: SIGTERM did not end them

    def poll(self) -> int | None:
        return self.popen.poll()

    def returncode(self) -> int:
        """Its exit code; -SIGKILL while it lingers after a kill (it cannot outlive the pending
        SIGKILL, and must never read as a clean exit)."""
        rc = self.poll()
        return -signal.SIGKILL if rc is None else rc

    def tree(self) -> list[int]:
        """The child and every descendant, adopted orphans included, but not the abandoned (nor
        a standby's tree; for a standby, only its own subtree)."""
        table = process_table()
        self.abandoned &= {(p.pid, p.start) for p in table.values()}
        if self.own_subtree:
            alive = self.pid in table and table[self.pid].state != "Z"
            pids = [*([self.pid] if alive else []), *descendants(self.pid, table)]
        else:
            others = {q for r in self.excluded for q in (r, *descendants(r, table))}
            pids = [p for p in descendants(os.getpid(), table) if p not in others]
        return [p for p in pids if (p, table[p].start) not in self.abandoned]

    def signal_tree(self, sig: int) -> list[int]:
        return send(self.tree(), sig)

    def workers(self) -> list[int]:
        """The ranks: the processes directly under the launched one that lead a session of their
        own (torchrun's workers), or the launched process itself (a plain script). Never their
        children: a DataLoader worker dies of a signal its rank handles."""
        table = process_table()
        ranks = [p.pid for p in table.values() if p.ppid == self.pid and p.sid == p.pid and p.state != "Z"]
        return ranks or ([self.pid] if self.pid in table else [])

    def kill(self, grace_s: float) -> str:
        """SIGTERM (and SIGCONT, so a stopped process can act on it) to the whole tree; SIGKILL
        what is left after ``grace_s``; what is still there ``reap_timeout_s`` later is named
        (pid, state, wchan, the file it is blocked on) and left behind. Returns a line saying how
        it ended."""
        t0 = time.monotonic()
        self.sigkilled = 0
        self.signal_tree(signal.SIGTERM)
        self.signal_tree(signal.SIGCONT)
        if not self._wait_empty(grace_s, resend=None):
            return f"tree exited {time.monotonic() - t0:.1f}s after SIGTERM"
        killed = self.signal_tree(signal.SIGKILL)
        self.sigkilled = len(killed)
        note = f"SIGKILL sent to {len(killed)} process(es) still alive {grace_s:g}s after SIGTERM"
        left = self._wait_empty(self.reap_timeout_s, resend=signal.SIGKILL)
        if not left:
            return note
        table = process_table()
        for pid in left:
            if pid in table:
                self.abandoned.add((pid, table[pid].start))
        stuck = [describe_stuck(pid) for pid in left]
        self.unreaped += stuck
        return (
            f"{note}; not reaped {self.reap_timeout_s:g}s after SIGKILL, left behind (each dies when "
            f"its I/O returns): {'; '.join(stuck)}"
        )

    def _wait_empty(self, timeout_s: float, resend: int | None) -> list[int]:
        """Reap until the tree is empty or ``timeout_s`` passed; what is left. ``resend``: signal
        processes that appeared meanwhile (forked during the kill) too."""
        deadline = time.monotonic() + timeout_s
        while True:
            self.poll()
            reap_adopted(keep=self.pid)
            left = self.tree()
            if not left or time.monotonic() >= deadline:
                return left
            if resend is not None:
                send(left, resend)
            time.sleep(POLL_S)

    def finish(self) -> str:
        """After the launched process exited: kill and reap anything it left behind (bounded);
        '' when nothing was left."""
        note = self.kill(grace_s=1.0) if self.tree() else ""
        reap_adopted(keep=self.pid)
        return note


def where_blocked(pid: int) -> str:
    """'read(/ckpt/run/step_00000120/__0_0.distcp) (state D, wchan fuse_...)' for a process in a
    file syscall (supervisor.watch.blocked); '' when it is in none."""
    calls = blocked_io(pid)
    if not calls:
        return ""
    state, wchan = proc_state(pid)
    return f"{'; '.join(c.describe() for c in calls)} (state {state or '?'}, wchan {wchan or '?'})"


def describe_stuck(pid: int) -> str:
    """'pid 123 (state D, wchan fuse_..., in read(/ckpt/run/step_00000120/__0_0.distcp))'."""
    state, wchan = proc_state(pid)
    calls = blocked_io(pid)
    where = f", in {'; '.join(c.describe() for c in calls)}" if calls else ""
    return f"pid {pid} (state {state or '?'}, wchan {wchan or '?'}{where})"


def dump_stacks(targets: Mapping[int, int], dump_path: Mapping[int, Path], wait_s: float) -> dict[int, str]:
    """Send the stack-dump signal to each rank's pid (``targets``: rank -> pid) and SIGCONT (a
    stopped process writes its dump once it runs); return rank -> the text each appended to its
    dump file, read once its handler has returned (faulthandler writes a dump in many small
    writes: one read as soon as the file grew got half a dump under load, without the main
    thread, which comes last). ``wait_s`` bounds the wait for a rank whose handler never runs."""
    before = {r: _size(dump_path[r]) for r in targets}
    masked = {r: _blocking(pid, STACK_DUMP_SIGNAL) for r, pid in targets.items()}
    send(targets.values(), STACK_DUMP_SIGNAL)
    send(targets.values(), signal.SIGCONT)
    deadline = time.monotonic() + wait_s
    grown: dict[int, str] = {}
    while len(grown) < len(targets):
        for r, pid in targets.items():
            # The size first: a dump begun by then is whole once the handler is seen to be done.
            if r not in grown and _size(dump_path[r]) > before[r] and _handled(pid, masked[r]):
                grown[r] = _read_from(dump_path[r], before[r])
        if len(grown) == len(targets) or time.monotonic() >= deadline:
            break
        time.sleep(POLL_S)
    return grown


def _handled(pid: int, masked: frozenset[int]) -> bool:
    """The stack-dump signal sent to ``pid`` is neither pending nor being handled: no thread
    blocks it now that did not before it was sent (the kernel blocks it in the thread running
    its handler), and it is pending for no thread and not for the process. True when pid is gone."""
    tasks = _task_status(pid)
    bit = 1 << (STACK_DUMP_SIGNAL - 1)
    return not any(
        (st.get("SigPnd", 0) | st.get("ShdPnd", 0)) & bit or (st.get("SigBlk", 0) & bit and tid not in masked)
        for tid, st in tasks.items()
    )


def _blocking(pid: int, sig: int) -> frozenset[int]:
    """The threads of ``pid`` that block ``sig``."""
    bit = 1 << (sig - 1)
    return frozenset(tid for tid, st in _task_status(pid).items() if st.get("SigBlk", 0) & bit)


def _task_status(pid: int) -> dict[int, dict[str, int]]:
    """Each thread of ``pid``: its signal masks from /proc (SigPnd, ShdPnd, SigBlk...); {} when gone."""
    out: dict[int, dict[str, int]] = {}
    try:
        tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
        return out
    for tid in tids:
        try:
            lines = Path(f"/proc/{pid}/task/{tid}/status").read_text().splitlines()
        except OSError:
            continue  # the thread ended
        masks = (line.split(":", 1) for line in lines if line.startswith(("Sig", "ShdPnd")))
        out[int(tid)] = {k: int(v.strip(), 16) for k, v in masks if _is_hex(v.strip())}
    return out


def _is_hex(text: str) -> bool:
    return bool(text) and all(c in "0123456789abcdefABCDEF" for c in text)


def _size(path: Path) -> int:
    try:
        return path.stat().st_size
    except OSError:
        return 0


def _read_from(path: Path, offset: int) -> str:
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            return f.read(MAX_DUMP_CHARS).decode(errors="replace")
    except OSError:
        return ""
