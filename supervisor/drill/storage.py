"""Storage faults in the drill: the run dir on the fault filesystem (faultfs.py, mounted by the
runner over the scenario's dir), and one small driver per fault kind that sets its rule, strikes,
waits for the event that ends the fault, and records what it saw for the judge.

The watchdog and the trainer see the run dir through the mount; the drill reads the backing dir
(the truth on disk, past every rule), so its own reads neither meet nor use up a fault.
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import os
import subprocess
import tempfile
import time
from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.drill import hostile
from supervisor.drill.drivers import Driver
from supervisor.drill.faultctl import fuse_unavailable
from supervisor.drill.judge import StorageFacts
from supervisor.drill.plan import DISK_FULL_FAILURES, STORAGE, Fault, Kind
from supervisor.format import eventtypes as ev
from supervisor.format.events import events_path, read_logged
from supervisor.format.heartbeat import Phase
from supervisor.format.layout import COMMITTED_GLOB, DCP_SHARD_GLOB, STEP_PREFIX, TMP_GLOB
from supervisor.format.nodesummary import read_run_heartbeats
from supervisor.store import list_checkpoints, list_quarantined, list_tmp

if TYPE_CHECKING:
    from supervisor.drill.runner import DrillConfig, Scene

# io-error: this many reads of committed checkpoints' shard files fail (a count, not a time window:
# they land on the resume whenever it comes, and the count shows they did). Shards, because a
# running job reads none of them: its prune's quick checks read manifests, and once the commit got
# faster that prune began to land between the arming and the kill, and took the EIOs itself.
EIO_READS = 3
# Faults that strike a running job wait for this many committed checkpoints: one to resume from,
# one to fall back to.
MIN_COMMITTED = 2
# The watchdog's flags where a scenario is about the disk's resume (its reads, its pace): a resume
# from the memory tier (on by default) would read nothing from the disk.
DISK_RESUME = ("--no-memory-tier",)
# slow-storage: the throttle lets the newest checkpoint be read once in this many seconds. The
# resume reads it about three times (the watchdog's deep pick, the trainer's verify and its load);
# the verify and the load alone must take judge.SLOW_FACTOR (3) timeouts, so 2 reads of this many
# seconds leave a third to spare (at 6 s they took 13.6 s against 12 s once each rank loaded from
# its own index and no longer read part of another's shard)...
SLOW_READ_S = 8.0
# ... against these phase timeouts for the watchdog (--verify-timeout, --load-timeout): above a
# rank's heartbeat gap (a beat per second, a 64 KiB chunk at its share of the throttle, the
# watchdog's 0.5 s poll), well below the phases themselves.
SLOW_TIMEOUT_S = 4.0
# disk-full: what a full disk refuses in a checkpoint tmp dir (the dir itself included).
DISK_FULL_OPS = ("mkdir", "create", "write", "flush", "fsync", "rename")
IO_PHASES = (Phase.VERIFY, Phase.LOAD)


def unavailable() -> str | None:
    """Why the storage scenarios cannot run here (they are then skipped), or None."""
    why = fuse_unavailable()
    if why is None and importlib.util.find_spec("mfusepy") is None:
        why = "the Python package mfusepy is missing: pip install -e '.[drill]'"
    return why


def at_end(facts: StorageFacts, root: Path) -> StorageFacts:
    """``facts`` with what the run dir holds at the end: quarantined checkpoints, tmp dirs left."""
    return dataclasses.replace(
        facts,
        quarantined=tuple(q.path.name for q in list_quarantined(root)),
        tmp_left=tuple(t.path.name for t in list_tmp(root)),
    )


def committed_steps(root: Path) -> tuple[int, ...]:
    return tuple(sorted(c.step for c in list_checkpoints(root)))


def checkpoint_bytes(root: Path) -> int:
    """Size of the newest committed checkpoint (0 when there is none)."""
    newest = next(iter(list_checkpoints(root)), None)
    if newest is None:
        return 0
    return sum(e.stat().st_size for e in os.scandir(newest.path) if e.is_file())


def kill_under(scene: Scene, fault: Fault, launch: str, rule: str, what: str) -> bool:
    """With the fault filesystem's ``rule`` in force (``what`` says which), kill -9 the fault's
    rank, so its relaunch meets the rule. False (the rule cleared) when there was no rank to kill."""
    assert scene.fs is not None
    t0, in_flight = time.time(), scene.save_in_flight()
    scene.note(what)
    if not scene.kill(fault, launch):
        scene.fs.clear(rule)
        return False
    scene.struck(fault, t0, in_flight)
    return True


class IoError(Driver):
    """EIO on the next reads of committed shard files, then kill -9 a rank: the resume's pick
    (the watchdog's, then the trainer's) meets the errors and must retry, not quarantine. The
    memory tier is off (``DISK_RESUME``)."""

    kinds = frozenset({Kind.IO_ERROR})

    def job_args(self, cfg: DrillConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return DISK_RESUME, ()

    def drive(self, scene: Scene, fault: Fault) -> StorageFacts | None:
        assert scene.fs is not None
        launch = scene.reach(fault, MIN_COMMITTED)
        if launch is None:
            return None
        rule = scene.fs.fail(f"/{COMMITTED_GLOB}/{DCP_SHARD_GLOB}", "EIO", ops=["read"], count=EIO_READS)
        what = (
            f"EIO set on the next {EIO_READS} reads of committed shard files "
            f"(committed: steps {', '.join(map(str, committed_steps(scene.root)))})"
        )
        if not kill_under(scene, fault, launch, rule, what):
            return None
        scene.await_resume(fault, launch)
        hits = scene.fs.hits(rule)
        scene.note(f"the EIO rule fired {hits} time(s) of {EIO_READS}")
        return StorageFacts(rule_hits=hits)


class DiskFull(Driver):
    """ENOSPC on every writing operation into a checkpoint tmp dir (its mkdir, a file's create,
    write, close, fsync, rename) until the watchdog has logged DISK_FULL_FAILURES failed saves in a
    row (an event, not a time), then space again. The disk fills at a random moment of a save, not
    between two: the fault filesystem lets the plan's ``fill_after`` writing operations through
    first (a count, not a time). The job must ride it out in the same launch.

    Only checkpoint writes fail: heartbeats, metrics and the watchdog's own files on a truly full
    disk are tested with a real full tmpfs (tests/test_watch_faults.py, tests/test_train_storage.py).
    The trainer's give-up policy is set out of reach, so how soon the drill frees the disk cannot
    turn into a relaunch (the policy has tests of its own)."""

    kinds = frozenset({Kind.DISK_FULL})

    def job_args(self, cfg: DrillConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
        return (), ("--max-failed-saves", str(cfg.steps // cfg.save_every + 1))

    def drive(self, scene: Scene, fault: Fault) -> StorageFacts | None:
        assert scene.fs is not None
        launch = scene.reach(fault)
        if launch is None:
            return None
        before = committed_steps(scene.root)
        t0, in_flight = time.time(), scene.save_in_flight()
        rule = scene.fs.fail(f"/{TMP_GLOB}", "ENOSPC", ops=DISK_FULL_OPS, skip=fault.fill_after)
        scene.note(f"{fault.describe()}: set at step {scene.step()}")
        scene.struck(fault, t0, in_flight)

        def failures() -> int:
            """Failed saves in a row as the watchdog logged them: the disk stays full until the
            watchdog has seen them (a streak shorter than its poll would otherwise pass unseen)."""
            logged = ev.every(read_logged(events_path(scene.root)), ev.SaveFailed)
            return max((e.event.save_failures for e in logged if e.t >= t0), default=0)

        reported = scene.wait(lambda: failures() >= DISK_FULL_FAILURES)
        after, hits, seen = committed_steps(scene.root), scene.fs.hits(rule), failures()
        scene.fs.clear(rule)
        scene.note(
            f"space again at step {scene.step()}: the watchdog logged {seen} failed save(s) in a row"
            + ("" if reported else f" (waited for {DISK_FULL_FAILURES} in vain)")
            + f"; the disk filled after {fault.fill_after} writing operation(s) into tmp dirs, "
            + f"then {hits} failed with ENOSPC"
        )
        return StorageFacts(rule_hits=hits, committed_before=before, committed_after=after)


class SlowStorage(Driver):
    """Checkpoint reads and writes throttled so that the newest checkpoint takes SLOW_READ_S to read
    once, then kill -9 a rank: the resume's verify and load run for several times their timeouts
    (SLOW_TIMEOUT_S, passed to the watchdog) and must not be taken for a hang, since they progress.
    The throttle is lifted at the first resumed step. The memory tier is off (``DISK_RESUME``)."""

    kinds = frozenset({Kind.SLOW_STORAGE})

    def job_args(self, cfg: DrillConfig) -> tuple[tuple[str, ...], tuple[str, ...]]:
        t = f"{SLOW_TIMEOUT_S:g}"
        return ("--verify-timeout", t, "--load-timeout", t, *DISK_RESUME), ()

    def drive(self, scene: Scene, fault: Fault) -> StorageFacts | None:
        assert scene.fs is not None
        launch = scene.reach(fault, MIN_COMMITTED)
        if launch is None:
            return None
        size = checkpoint_bytes(scene.root)
        rate = max(size / SLOW_READ_S, 1.0)
        rule = scene.fs.throttle(f"/{STEP_PREFIX}*", rate)
        what = (
            f"checkpoint reads and writes throttled to {rate / 1024:.0f} KiB/s "
            f"(the newest checkpoint, {size / 1024:.0f} KiB, in {SLOW_READ_S:g}s)"
        )
        if not kill_under(scene, fault, launch, rule, what):
            return None
        clock = PhaseClock(scene.root, launch, watched_as=scene.job.root)
        scene.await_resume(fault, launch, observe=clock.poll)
        clock.poll()
        hits = scene.fs.hits(rule)
        scene.fs.clear(rule)
        verify_s, load_s = clock.time_in(Phase.VERIFY), clock.time_in(Phase.LOAD)
        scene.note(
            f"the resumed launch's verify took {_secs(verify_s)} and its load {_secs(load_s)} (the slowest "
            f"rank), a rank's "
            f"heartbeats at most {clock.gap:.1f}s apart (--verify-timeout/--load-timeout {SLOW_TIMEOUT_S:g}s); "
            f"{hits} reads and writes throttled; lifted at the first resumed step"
        )
        return StorageFacts(
            rule_hits=hits, verify_s=verify_s, load_s=load_s, beat_gap_s=clock.gap, timeout_s=SLOW_TIMEOUT_S
        )


class PhaseClock:
    """The phases of the launch after ``old_launch`` as its ranks' heartbeats tell them, read while
    it runs (the files are overwritten as it goes): when each rank entered each phase, and the
    largest gap between two beats of a rank held to the verify or load timeout."""

    def __init__(self, root: Path, old_launch: str, watched_as: Path | None = None) -> None:
        self.root, self.old_launch, self.watched_as = root, old_launch, watched_as
        self.stretches: dict[int, list[tuple[Phase, float]]] = {}  # rank -> (phase, first beat in it)
        self.gap = 0.0
        self._last: dict[int, float] = {}  # rank -> its last beat, while in verify or load

    def poll(self) -> None:
        for snap in read_run_heartbeats(self.root, self.watched_as):
            hb = snap.heartbeat
            if hb is None or not hb.launch_id or hb.launch_id == self.old_launch:
                continue
            seen = self.stretches.setdefault(hb.rank, [])
            if not seen or seen[-1][0] != hb.phase:
                seen.append((hb.phase, hb.wall_time))
            # A beat that leaves verify or load still closes a gap judged by their timeouts.
            if hb.phase in IO_PHASES or hb.rank in self._last:
                self.gap = max(self.gap, hb.wall_time - self._last.get(hb.rank, hb.wall_time))
                self._last[hb.rank] = hb.wall_time
            if hb.phase not in IO_PHASES:
                self._last.pop(hb.rank, None)

    def time_in(self, phase: Phase) -> float | None:
        """The longest a rank spent in ``phase`` (None: no rank was seen to leave it)."""
        per_rank = [
            [b[1] - a[1] for a, b in itertools.pairwise(seen) if a[0] == phase]
            for seen in self.stretches.values()
        ]
        return max((sum(spans) for spans in per_rank if spans), default=None)


class Hostile(Driver):
    """What an attacker with write access to the run dir plants there while the job runs (issue 39;
    the shapes are supervisor/drill/hostile.py's), then kill -9 a rank, so the watchdog's pick, the
    trainer's resume, verify, saves and prunes meet them, and `status`, `ckpt list`, `ckpt verify
    --deep` run on the run dir before and after the resume. Nothing outside the run dir may change
    (a sentinel folder beside it, ``Outside``), nothing is quarantined for what was planted, the
    commands stay calm, and the run ends bit-identical. The plants are removed once the run resumed."""

    kinds = frozenset({Kind.HOSTILE})

    def drive(self, scene: Scene, fault: Fault) -> StorageFacts | None:
        launch = scene.reach(fault, MIN_COMMITTED)
        if launch is None:
            return None
        out = hostile.Outside(scene.cfg.workdir / "outside" / scene.run.scenario)
        planted = plant_hostile(scene.root, out)
        t0, in_flight = time.time(), scene.save_in_flight()
        scene.note(f"planted at step {scene.step()}: {', '.join(planted)}")
        if not scene.kill(fault, launch):
            unplant_hostile(scene.root, planted)
            return None
        scene.struck(fault, t0, in_flight)
        commands = [_command(scene, argv) for argv in HOSTILE_COMMANDS]
        scene.await_resume(fault, launch)
        commands += [_command(scene, argv) for argv in HOSTILE_COMMANDS]
        unplant_hostile(scene.root, planted)
        changed = out.changes()
        scene.note(
            f"after the resume: {'; '.join(commands)}; outside the run dir: "
            + ("; ".join(changed) or "unchanged")
        )
        return StorageFacts(
            rule_hits=len(planted),
            planted=tuple(planted),
            outside_changed=tuple(changed),
            commands=tuple(commands),
        )


# The hostile plants (what, where under the run dir); a name the run already has is left alone.
QUARANTINE_LINK = "quarantine"  # -> another user's quarantine/: nothing moved there, nothing deleted
STEP_LINK = "step_99999990"  # -> another user's checkpoint: never listed, picked, loaded or moved
DEEP_TMP = "step_99999980.tmp.1.elsewhere"  # 1,200 nested dirs: os.walk's RecursionError in a prune
SPARSE = ("supervisor/retention.json", "heartbeats/node_00099.json")  # 2 GiB each: never read whole
HOSTILE_COMMANDS = (("status",), ("ckpt", "list"), ("ckpt", "verify", "--deep"))
COMMAND_POLL_S = 0.05  # how often a hostile command is looked at for its end
# A command's peak RSS on the planted run dir stays under this (reading a 2 GiB plant whole: 2 GiB).
HOSTILE_RSS_MAX = 256 << 20


def plant_hostile(root: Path, out: hostile.Outside) -> list[str]:
    """Plant into the run dir ``root``; the names planted."""
    planted = []
    if not os.path.lexists(root / QUARANTINE_LINK):
        hostile.plant_link(root / QUARANTINE_LINK, out.victim / "quarantine")
        planted.append(QUARANTINE_LINK)
    hostile.plant_link(root / STEP_LINK, out.victim / "step_00000020")
    hostile.plant_nest(root / DEEP_TMP)
    planted += [STEP_LINK, DEEP_TMP]
    for rel in SPARSE:
        hostile.plant_sparse(root / rel)
        planted.append(rel)
    return planted


def unplant_hostile(root: Path, planted: list[str]) -> None:
    """Remove what is still as it was planted (a record the run wrote over it since is its own)."""
    for rel in planted:
        p = root / rel
        if p.is_symlink() or (rel in SPARSE and p.is_file() and p.stat().st_size == hostile.GIB * 2):
            p.unlink()
        elif rel == DEEP_TMP and p.is_dir():
            hostile.remove_deep(p)


def _command(scene: Scene, argv: tuple[str, ...]) -> str:
    """``python -m supervisor ARGV --ckpt-root ROOT`` on the run dir as the job sees it: how it
    ended, "<command>: calm" when it exited 0, 1 (a problem found) or 2 (a refusal: `ckpt list`
    refuses a linked quarantine/ in one line naming it) with no traceback, at most one line on
    stderr and its peak RSS under HOSTILE_RSS_MAX; one still running after the drill's fault
    timeout is killed and named (a plant that hangs a command must fail the scenario, not the
    drill)."""
    cmd = [scene.cfg.python, "-m", "supervisor", *argv, "--ckpt-root", str(scene.job.root)]
    name, limit = " ".join(argv), scene.cfg.fault_timeout_s
    with tempfile.TemporaryFile() as err:
        p = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=err, env=scene.cfg.env())
        deadline = time.monotonic() + limit
        while (done := os.wait4(p.pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
            time.sleep(COMMAND_POLL_S)
        if done[0] == 0:
            p.kill()
            os.wait4(p.pid, 0)
            return f"{name}: still running after {limit:g}s: killed"
        _, status, usage = done
        p.returncode = os.waitstatus_to_exitcode(status)
        err.seek(0)
        text = err.read().decode(errors="replace")
    rss = usage.ru_maxrss << 10
    if (
        p.returncode in (0, 1, 2)
        and "Traceback" not in text
        and len(text.splitlines()) <= 1
        and rss < HOSTILE_RSS_MAX
    ):
        return f"{name}: calm"
    return f"{name}: exit {p.returncode}, peak RSS {rss >> 20} MiB, {text.strip()[-300:] or 'no output'}"


def _secs(s: float | None) -> str:
    return "?" if s is None else f"{s:.1f}s"


DRIVERS: dict[Kind, type[Driver]] = {k: d for d in (IoError, DiskFull, SlowStorage, Hostile) for k in d.kinds}
assert set(DRIVERS) == set(STORAGE), "a driver for every storage fault kind"


def driver_for(faults: list[Fault]) -> Driver | None:
    """The driver of a storage scenario (its one fault), or None for any other scenario."""
    kinds = {f.kind for f in faults if f.kind in DRIVERS}
    if not kinds:
        return None
    if len(faults) != 1:
        raise ValueError(
            f"a storage scenario injects one fault, not {', '.join(f.kind.value for f in faults)}"
        )
    return DRIVERS[faults[0].kind]()
