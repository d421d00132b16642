"""Was it the OOM killer? What the kernel says, where it can be read: its log (``/dev/kmsg``, which
names the pid it killed; readable by root, or when ``kernel.dmesg_restrict`` is 0) and the memory
cgroup's count of OOM kills (cgroup v2 ``memory.events``, v1 ``memory.oom_control``: ``oom_kill
N``). Nothing here ever fails: unreadable evidence is no evidence. The parsers are pure.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterable

from supervisor import memroom
from supervisor.memroom import CGROUP_BASE, PROC_CGROUP

KMSG = "/dev/kmsg"
MAX_KMSG_RECORDS = 20_000  # the kernel's ring buffer holds a few thousand; a bound, not a limit

_OOM_KILL = re.compile(r"^oom_kill (\d+)$", re.MULTILINE)


def kill_line(records: Iterable[bytes], pid: int) -> str:
    """The kernel's line about the OOM killer killing ``pid`` (the last one), or ''. A kmsg record
    is ``prio,seq,usec,flags;text``; the OOM killer writes "Out of memory: Killed process 123
    (python) ..." (or "Memory cgroup out of memory: Killed process 123 ...")."""
    mark = re.compile(rf"Killed process {pid}\b")
    found = ""
    for rec in records:
        text = rec.decode(errors="replace").split(";", 1)[-1].split("\n", 1)[0].strip()
        if mark.search(text):
            found = text
    return found


def kernel_kill_line(pid: int, path: str = KMSG) -> str:
    """``kill_line`` over the kernel's log as it is now; '' when it cannot be read."""
    return kill_line(_kmsg_records(path), pid)


def _kmsg_records(path: str) -> list[bytes]:
    """Every record /dev/kmsg holds now (one per read; it ends with EAGAIN), or none."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
    except OSError:
        return []
    out: list[bytes] = []
    try:
        while len(out) < MAX_KMSG_RECORDS:
            try:
                out.append(os.read(fd, 8192))
            except BlockingIOError:
                break
            except OSError as e:  # EPIPE: a record was overwritten while reading; read on
                if e.errno != 32:
                    break
    finally:
        os.close(fd)
    return out


def parse_oom_count(text: str) -> int | None:
    """The ``oom_kill N`` of a cgroup's memory.events (v2) or memory.oom_control (v1)."""
    m = _OOM_KILL.search(text)
    return int(m.group(1)) if m else None


def cgroup_files(proc_cgroup: str, base: str = CGROUP_BASE) -> list[str]:
    """Where this process's memory cgroup counts OOM kills, from /proc/<pid>/cgroup's text: v2's
    memory.events, v1's memory.oom_control."""
    return [
        f"{folder}/{'memory.events' if version == 2 else 'memory.oom_control'}"
        for version, folder in memroom.memory_cgroups(proc_cgroup, base)
    ]


def cgroup_oom_kills(proc_cgroup: str = PROC_CGROUP, base: str = CGROUP_BASE) -> int | None:
    """This process's memory cgroup's count of OOM kills so far, or None where it cannot be read."""
    try:
        with open(proc_cgroup) as f:
            text = f.read()
    except OSError:
        return None
    for path in cgroup_files(text, base):
        try:
            with open(path) as f:
                n = parse_oom_count(f.read())
        except OSError:
            continue
        if n is not None:
            return n
    return None


def killed_note(pid: int, kernel: str, before: int | None, after: int | None) -> str:
    """What a rank gone without an exception or an exit code died of: the OOM killer when the
    kernel's log names its pid; "OOM killer?" when its cgroup counted a new OOM kill while it ran
    (``before`` and ``after`` the launch); else a signal, SIGKILL most likely."""
    if kernel:
        return f"killed by SIGKILL (signal 9) from the OOM killer (kernel: {kernel})"
    if before is not None and after is not None and after > before:
        return (
            "killed by a signal (no exception recorded, no exit code): the OOM killer? its memory cgroup "
            f"counted {after - before} OOM kill(s) while it ran"
        )
    return ""
