"""The verdict: is the faulted run the same run as the golden one? Pure functions over records.

Every check returns a reason a person can act on; a scenario passes only when every check holds.
"""

from __future__ import annotations

import itertools
import statistics
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import Protocol

from supervisor.drill.diverge import diagnose
from supervisor.drill.plan import (
    DISK_FULL_FAILURES,
    HANGS,
    NO_RESUME,
    SELF_INFLICTED,
    STORAGE,
    Fault,
    Kind,
    steps_redone_bound,
)
from supervisor.drill.switch import BLOCKING_FUNCTION, INSTEAD_OP, SKIPPED_OP, SKIPPING_FUNCTION
from supervisor.format import eventtypes as ev
from supervisor.format.eventtypes import Event, Logged
from supervisor.format.exitcodes import Exit
from supervisor.format.launches import Outcome
from supervisor.format.statediff import Comparison

# slow-storage: the resumed launch's verify + load must take this many times their timeout, or
# the scenario proves nothing about long phases.
SLOW_FACTOR = 3.0
# Every hang is found within its phase timeout + this.
HANG_LATE_S = 0.5
# Where the culprit of each hang the drill makes must be seen: a function of its stack, or the part
# of a file's path (the DataLoader's, for a rank whose worker deadlocked).
_CULPRIT_FRAME = {
    Kind.HANG: BLOCKING_FUNCTION,
    Kind.HANG_DURING_SAVE: BLOCKING_FUNCTION,
    Kind.HANG_COLLECTIVE: SKIPPING_FUNCTION,
    Kind.HANG_LOADER: "torch/utils/data/",
}
# Hangs whose verdict must name the collective the others wait in (a SIGSTOPped rank runs on once
# the watchdog's SIGCONT reaches it, so its peers' collective may finish while they are asked).
COLLECTIVE_NAMED = frozenset({Kind.HANG, Kind.HANG_DURING_SAVE, Kind.HANG_COLLECTIVE, Kind.HANG_LOADER})


@dataclass(frozen=True)
class StepRecord:
    """What the judge reads of a metrics.jsonl record (supervisor.format.metrics), and ``seen``:
    when the drill first read it."""

    step: int
    loss: float
    lr: float
    launch: str
    seen: float = 0.0


@dataclass(frozen=True)
class Resume:
    """A launch that continued the run: it started after ``ckpt_step``, having reached ``reached``."""

    launch: str
    ckpt_step: int
    reached: int
    first_seen: float

    @property
    def redone(self) -> int:
        return self.reached - self.ckpt_step


@dataclass(frozen=True)
class StorageFacts:
    """What a storage fault's driver saw (storage.py), judged by ``storage_checks``."""

    rule_hits: int = 0  # operations the fault filesystem's rule failed or slowed
    quarantined: tuple[str, ...] = ()  # the run's quarantine/ at the end
    tmp_left: tuple[str, ...] = ()  # checkpoint tmp dirs at the end
    committed_before: tuple[int, ...] = ()  # disk-full: steps committed when the disk filled
    committed_after: tuple[int, ...] = ()  # ... and when it was freed
    verify_s: float | None = None  # slow-storage: the resumed launch's verify and load, measured
    load_s: float | None = None
    beat_gap_s: float = 0.0  # slow-storage: the largest gap between two beats of a rank in them
    timeout_s: float = 0.0  # slow-storage: the watchdog's --verify-timeout and --load-timeout
    planted: tuple[str, ...] = ()  # hostile: what was planted in the run dir
    outside_changed: tuple[str, ...] = ()  # hostile: what changed in the sentinel beside the run dir
    commands: tuple[str, ...] = ()  # hostile: how the login-node commands ended on the planted run dir


@dataclass(frozen=True)
class Check:
    name: str
    ok: bool
    detail: str


@dataclass(frozen=True)
class Verdict:
    scenario: str
    checks: tuple[Check, ...]
    resumes: tuple[Resume, ...] = ()
    skipped: str = ""  # why the scenario could not run here (not a pass, not a failure)

    @property
    def ok(self) -> bool:
        return all(c.ok for c in self.checks)

    @property
    def result(self) -> str:
        return "SKIPPED" if self.skipped else "PASS" if self.ok else "FAIL"

    def failures(self) -> list[str]:
        return [f"{c.name}: {c.detail}" for c in self.checks if not c.ok]


def find_resumes(records: Sequence[StepRecord]) -> list[Resume]:
    """Each launch after the first, with the checkpoint step it resumed from and how far the run
    had got before it (records are in file order; a launch's steps are consecutive)."""
    resumes: list[Resume] = []
    reached = 0
    current = None
    for r in records:
        if current is not None and r.launch != current:
            resumes.append(Resume(r.launch, r.step - 1, reached, r.seen))
        current = r.launch
        reached = max(reached, r.step)
    return resumes


def typical_step_change(golden: Sequence[StepRecord]) -> tuple[float, float]:
    """Median and largest |loss(s+1) - loss(s)| of the golden run: normal step-to-step variation."""
    deltas = [abs(b.loss - a.loss) for a, b in itertools.pairwise(golden)]
    return (statistics.median(deltas), max(deltas)) if deltas else (0.0, 0.0)


class Evidence(Protocol):
    """What the drill saw of one scenario's run (runner.ScenarioRun is one)."""

    @property
    def injected(self) -> Sequence[Fault]: ...  # in order; one fault_times and save_in_flight each
    @property
    def fault_times(self) -> Sequence[float]: ...
    @property
    def save_in_flight(self) -> Sequence[bool]: ...
    @property
    def records(self) -> Sequence[StepRecord]: ...
    @property
    def digest(self) -> str | None: ...
    @property
    def latest_violations(self) -> Sequence[str]: ...
    @property
    def events(self) -> Sequence[Logged[Event]]: ...  # the watchdog's: they judge hangs and storage
    @property
    def storage(self) -> StorageFacts | None: ...  # what a storage fault's driver saw
    @property
    def comparison(self) -> Comparison | None: ...  # its checkpoints vs golden's, when the digest differs


@dataclass(frozen=True)
class Case:
    """One scenario to judge: its plan, what the drill saw, and the golden run to match.
    ``loss_tol`` is 0 on CPU: the resumed run must match golden exactly."""

    scenario: str
    faults: Sequence[Fault]
    run: Evidence
    golden: Sequence[StepRecord]
    golden_digest: str
    steps: int
    save_every: int
    loss_tol: float = 0.0
    hang_timeout_s: float = (
        0.0  # the watchdog's train timeout (0: a hang's latency is judged on its verdict alone)
    )
    memory_every: int = 1  # the memory tier's interval the drill set (0: the trainer's own)

    @cached_property
    def resumes(self) -> list[Resume]:
        return find_resumes(self.run.records)

    @cached_property
    def gold(self) -> dict[int, StepRecord]:
        return {r.step: r for r in self.golden}

    @cached_property
    def resumable(self) -> list[tuple[Fault, bool]]:
        """Injected faults with a resume to judge, and whether a save was in flight at each (a fault
        the job rides out in the same launch, a full disk, has none)."""
        pairs = zip(self.run.injected, self.run.save_in_flight, strict=False)
        return [(f, s) for f, s in pairs if f.kind not in NO_RESUME]


def judge(case: Case) -> Verdict:
    """Every check of ``CHECKS`` on one scenario; it passes only when each holds."""
    return Verdict(case.scenario, tuple(c for check in CHECKS for c in check(case)), tuple(case.resumes))


def faults_injected(case: Case) -> list[Check]:
    injected = case.run.injected
    missing = [f.describe() for f in case.faults if f not in injected]
    detail = f"{len(injected)} of {len(case.faults)}" + (
        f"; not injected: {'; '.join(missing)}" if missing else ""
    )
    return [Check("faults injected", not missing, detail)]


def resumed_after_each(case: Case) -> list[Check]:
    if not case.resumable and case.run.injected:
        return []
    n, want = len(case.resumes), len(case.resumable)
    return [Check("resumed after each fault", n >= want, f"{n} resume(s) for {want} fault(s)")]


def steps_redone(case: Case) -> list[Check]:
    over = []
    for res, (fault, in_flight) in zip(case.resumes, case.resumable, strict=False):
        bound = steps_redone_bound(fault.kind, case.save_every, in_flight, case.memory_every)
        if res.redone > bound:
            lost = f"; {lost_preemption(case, fault)}" if fault.kind == Kind.PREEMPT else ""
            over.append(f"{fault.kind.value} redid {res.redone} steps (bound {bound}){lost}")
    redone = ", ".join(str(r.redone) for r in case.resumes) or "none"
    return [Check("steps redone within bound", not over, "; ".join(over) or f"redone: {redone}")]


def lost_preemption(case: Case, fault: Fault) -> str:
    """Why a preemption redid steps: its checkpoint was lost, and the watchdog's word on how the
    launch ended (what died, with the root cause a rank recorded: a DataLoader worker killed by
    the job's SIGTERM takes its rank down before the step boundary that would have saved)."""
    t0 = next((t for f, t in zip(case.run.injected, case.run.fault_times, strict=False) if f == fault), 0.0)
    end = next((e for e in ev.every(case.run.events, ev.LaunchEnd) if e.t >= t0), None)
    how = end.msg if end else "the watchdog logged no end of the preempted launch"
    return f"the preemption checkpoint was lost: {how}"


def memory_resumes(case: Case) -> list[Check]:
    """A kill under the memory tier (the memory scenario): its resume came from the snapshot the
    watchdog picked and verified, a step newer than the newest disk checkpoint; a resume from the
    disk would mean the tier saved nothing."""
    results = []
    for res, (fault, _) in zip(case.resumes, case.resumable, strict=False):
        if fault.kind != Kind.MEMORY:
            continue
        t0 = next(
            (t for f, t in zip(case.run.injected, case.run.fault_times, strict=False) if f == fault), 0.0
        )
        pick = next((e.event for e in ev.every(case.run.events, ev.MemoryPick) if e.t >= t0), None)
        if pick is None:
            fell = next((e.msg for e in ev.every(case.run.events, ev.MemoryFallback) if e.t >= t0), "")
            results.append(
                (False, f"resumed from step {res.ckpt_step}, no memory pick ({fell or 'none logged'})")
            )
            continue
        disk = "none" if pick.disk_step is None else f"step {pick.disk_step}"
        newer = pick.disk_step is None or pick.step > pick.disk_step
        results.append(
            (
                pick.step == res.ckpt_step and newer,
                f"resumed from step {res.ckpt_step}; the memory snapshot picked: step {pick.step}, on disk: {disk}",
            )
        )
    return [_check("resumed from the memory tier", results)] if results else []


def hangs(case: Case) -> list[Check]:
    if not any(f.kind in HANGS for f in case.faults):
        return []
    windows = fault_windows(case.run.events, case.run.fault_times, case.resumes)
    return hang_checks(
        hang_trials(case.run.injected, windows, case.resumes, case.save_every, case.hang_timeout_s)
    )


def storage_faults(case: Case) -> list[Check]:
    if not any(f.kind in STORAGE for f in case.faults):
        return []
    facts = case.run.storage or StorageFacts()
    return storage_checks(case.run.injected, facts, case.run.events, case.run.fault_times, case.resumes)


def lr_continuous(case: Case) -> list[Check]:
    drill, gold = case.run.records, case.gold
    bad = [r for r in drill if r.step in gold and r.lr != gold[r.step].lr]
    detail = (
        f"LR differs from the schedule at step {bad[0].step}: {bad[0].lr} vs {gold[bad[0].step].lr}"
        if bad
        else "LR equals golden at every step, resumed steps included"
    )
    return [Check("LR continuous", not bad, detail)]


def loss_continuous(case: Case) -> list[Check]:
    """No jump at a resume larger than golden's own step-to-step change, and no deviation from
    golden beyond ``loss_tol``."""
    drill, gold = case.run.records, case.gold
    median_d, max_d = typical_step_change(case.golden)
    by_launch_step = {(r.launch, r.step): r for r in drill}
    jumps = []
    for res in case.resumes:
        after, before = by_launch_step.get((res.launch, res.ckpt_step + 1)), gold.get(res.ckpt_step)
        if after and before:
            jumps.append(abs(after.loss - before.loss))
    worst_jump = max(jumps, default=0.0)
    worst_dev, worst_step = max(
        ((abs(r.loss - gold[r.step].loss), r.step) for r in drill if r.step in gold), default=(0.0, 0)
    )
    return [
        Check(
            "loss continuous",
            worst_dev <= case.loss_tol and worst_jump <= max_d,
            f"largest jump at a resume {worst_jump:.4g} (golden step-to-step: median {median_d:.4g}, "
            f"max {max_d:.4g}); largest deviation from golden {worst_dev:.3g}"
            + (f" at step {worst_step}" if worst_dev > case.loss_tol else ""),
        )
    ]


def latest_complete(case: Case) -> list[Check]:
    bad = case.run.latest_violations
    detail = bad[0] if bad else "watched during the whole run"
    return [Check("latest never named an incomplete checkpoint", not bad, detail)]


def completed(case: Case) -> list[Check]:
    last = max((r.step for r in case.run.records), default=0)
    return [Check("run completed", last == case.steps, f"last step {last} of {case.steps}")]


def short_digest(digest: str) -> str:
    """A digest for a verdict line: 16 hex digits of each part ("<params> ema <average>")."""
    return " ".join(part[:16] for part in digest.split())


def digest_equal(case: Case) -> list[Check]:
    got, want = case.run.digest, case.golden_digest
    return [
        Check(
            "final digest equals golden",
            got == want,
            f"{short_digest(got or 'missing')} vs golden {short_digest(want)}",
        )
    ]


def first_difference(case: Case) -> list[Check]:
    """When the digest differs: the first step and state item where the run's checkpoints left
    golden's, and the likely cause (supervisor/drill/diverge.py)."""
    if case.run.digest == case.golden_digest or case.run.comparison is None:
        return []
    line = diagnose(case.run.comparison, [r.ckpt_step for r in case.resumes])
    return [Check("first state that differs from golden", False, line)]


# The checks of every scenario, in the verdict table's order; each returns no Check when it does
# not apply (hang checks without a hang, storage checks without a storage fault).
CHECKS: tuple[Callable[[Case], list[Check]], ...] = (
    faults_injected,
    resumed_after_each,
    steps_redone,
    memory_resumes,
    hangs,
    storage_faults,
    lr_continuous,
    loss_continuous,
    latest_complete,
    completed,
    digest_equal,
    first_difference,
)


def fault_windows(
    events: Sequence[Logged[Event]], fault_times: Sequence[float], resumes: Sequence[Resume]
) -> list[list[Logged[Event]]]:
    """The watchdog's events from each fault to the first step resumed after it (to the end for a
    fault not followed by a resume)."""
    ends = [r.first_seen for r in resumes]
    return [
        [e for e in events if t0 <= e.t <= (ends[i] if i < len(ends) else float("inf"))]
        for i, t0 in enumerate(fault_times)
    ]


NAMED = "hang verdict names the culprit and its stack"
COLLECTIVE = "hang verdict names the collective"
IN_TIME = f"hang detected within the timeout + {HANG_LATE_S:g}s"
KILLED = "hung launch needed SIGKILL"
PERIODIC = "resumed from the last periodic checkpoint"


def hang_trials(
    injected: Sequence[Fault],
    windows: Sequence[Sequence[Logged[Event]]],
    resumes: Sequence[Resume],
    save_every: int,
    timeout_s: float = 0.0,
) -> list[tuple[Fault, dict[str, tuple[bool, str]]]]:
    """Each hang with its checks (name -> (ok, detail)): the watchdog named the rank the drill hung,
    with its stack, and the collective the others wait in (where the kind involves one), in time
    (``timeout_s``: the train timeout; 0: only the verdict's own lateness is judged); a
    self-inflicted one (no signal cures it) also needed SIGKILL, and resumed from the newest
    periodic checkpoint, not from one the hung launch wrote on its way out (exit 75), or, under
    the memory tier, from the snapshot the watchdog picked (taken at a step end every rank
    reached, never by a hung launch; not older than the disk's newest)."""
    out = []
    for i, (fault, window) in enumerate(zip(injected, windows, strict=False)):
        if fault.kind not in HANGS:
            continue
        got = {NAMED: _culprit_named(fault, window)}
        if fault.kind in COLLECTIVE_NAMED:
            got[COLLECTIVE] = _collective_named(fault, window)
        got[IN_TIME] = _in_time(fault, window, timeout_s)
        if fault.kind in SELF_INFLICTED:
            got[KILLED] = _sigkilled(fault, window)
            got[PERIODIC] = _resumed_periodic(
                fault, window, resumes[i] if i < len(resumes) else None, save_every
            )
        out.append((fault, got))
    return out


def hang_checks(trials: Sequence[tuple[Fault, dict[str, tuple[bool, str]]]]) -> list[Check]:
    """``hang_trials``' checks, each over every hang (it holds when it holds for each)."""
    names = dict.fromkeys(n for _, got in trials for n in got) or {NAMED: None, IN_TIME: None}
    return [_check(n, [got[n] for _, got in trials if n in got]) for n in names]


def _check(name: str, results: Sequence[tuple[bool, str]]) -> Check:
    bad = [d for ok, d in results if not ok]
    return Check(
        name, bool(results) and not bad, "; ".join(bad or [d for _, d in results]) or "no hang injected"
    )


def _funcs(frames: object) -> list[str]:
    return [str(f.get("func")) for f in frames if isinstance(f, dict)] if isinstance(frames, list) else []


def _culprit_named(fault: Fault, window: Sequence[Logged[Event]]) -> tuple[bool, str]:
    kind = fault.kind.value
    hang = ev.first(window, ev.Hang)
    if hang is None:
        return False, f"{kind}: no hang event after the fault"
    culprits = [c for c in hang.event.culprits if isinstance(c, dict)]
    ranks = [c.get("rank") for c in culprits]
    if ranks != [fault.rank]:
        return False, f"{kind}: the drill hung rank {fault.rank}, the watchdog named {ranks or 'no culprit'}"
    c = culprits[0]
    funcs = _funcs(c.get("frames"))
    at = [f for f in c.get("at") or [] if isinstance(f, dict)]
    stack = " <- ".join(funcs) or "no frames"
    if not funcs:
        return False, f"{kind}: culprit rank {fault.rank} named without its stack"
    want = _CULPRIT_FRAME.get(fault.kind)
    places = [
        f"{f.get('func')} {f.get('file')}" for f in [*(c.get("frames") or []), *at] if isinstance(f, dict)
    ]
    if want and not any(want in p for p in places):
        return False, f"{kind}: culprit rank {fault.rank} named, but its stack ({stack}) lacks {want}"
    shown = " <- ".join(_funcs(at)) or stack
    return True, f"{kind}: culprit rank {fault.rank} (pid {c.get('pid')}, {c.get('where')}): {shown}"


def _collective_named(fault: Fault, window: Sequence[Logged[Event]]) -> tuple[bool, str]:
    """The hang event names the collective the others wait in, and how the culprit failed it:
    entered another op under its number (hang-collective), or never entered it (the others)."""
    kind = fault.kind.value
    hang = ev.first(window, ev.Hang)
    stuck = hang.event.collective if hang else None
    if not stuck or not isinstance(stuck, dict):
        return False, f"{kind}: the hang event names no collective" + (
            f" ({hang.event.collectives})" if hang else ""
        )
    name = f"{stuck.get('op') or '?'} #{stuck.get('seq')} of {stuck.get('label')}"
    waiting = stuck.get("waiting") or []
    other = {o.get("rank"): str(o.get("entered")) for o in stuck.get("other") or [] if isinstance(o, dict)}
    missing = [m.get("rank") for m in stuck.get("missing") or [] if isinstance(m, dict)]
    if fault.kind == Kind.HANG_COLLECTIVE:
        ok = stuck.get("op") == SKIPPED_OP and other.get(fault.rank, "").startswith(f"{INSTEAD_OP} #")
        how = f"rank {fault.rank} entered {other.get(fault.rank) or 'nothing else'}"
    else:
        ok = fault.rank in missing
        how = f"rank {fault.rank} {'never entered it' if ok else 'is not named as missing from it'}"
    ok = ok and bool(waiting)
    said = "" if ok else f" (what each rank said: {hang.event.collectives if hang else {}})"
    return ok, f"{kind}: ranks {waiting} wait in {name}; {how}{said}"


def _in_time(fault: Fault, window: Sequence[Logged[Event]], timeout_s: float) -> tuple[bool, str]:
    """The verdict came at most HANG_LATE_S after the first rank's timeout ran out (as the
    watchdog sees the heartbeats), and at most the timeout + HANG_LATE_S after the ranks entered
    the collective they are stuck in (as their flight recorders saw it)."""
    kind = fault.kind.value
    hang = ev.first(window, ev.Hang)
    if hang is None:
        return False, f"{kind}: no hang event after the fault"
    late, stuck = hang.event.late_s, hang.event.stuck_s
    ok = late <= HANG_LATE_S and (stuck is None or not timeout_s or stuck <= timeout_s + HANG_LATE_S)
    since = f", {stuck:.2f}s after the ranks entered the stuck collective" if stuck is not None else ""
    return ok, f"{kind}: verdict {late:.3f}s after the timeout ran out{since}"


def _sigkilled(fault: Fault, window: Sequence[Logged[Event]]) -> tuple[bool, str]:
    kill = ev.first(window, ev.Kill)
    n = kill.event.sigkilled if kill else 0
    if n <= 0:
        how = kill.msg if kill else "no kill event"
        return False, f"{fault.kind.value}: SIGTERM ended a hang no signal should cure ({how})"
    return True, f"{fault.kind.value}: {n} process(es) SIGKILLed after SIGTERM's grace"


def _resumed_periodic(
    fault: Fault, window: Sequence[Logged[Event]], resume: Resume | None, save_every: int
) -> tuple[bool, str]:
    kind = fault.kind.value
    logged = ev.first(window, ev.LaunchEnd)
    if logged is None or resume is None:
        return False, f"{kind}: no end of the hung launch and resume seen"
    end = logged.event
    codes = sorted(set(end.rank_exit_codes.values()))
    newest = end.newest_checkpoint
    problems = []
    if end.outcome != Outcome.HANG:
        problems.append(f"the launch ended as {end.outcome}, not a hang")
    if Exit.REQUEUE in codes:
        problems.append(f"a rank exited {int(Exit.REQUEUE)}: it checkpointed, so it was not stuck")
    memory = next(
        (e.event for e in ev.every(window, ev.MemoryPick) if e.event.step == resume.ckpt_step), None
    )
    if memory is not None:  # the memory tier's snapshot: one every rank finished, at a step end
        if newest is not None and resume.ckpt_step < newest:
            problems.append(
                f"resumed from the memory snapshot of step {resume.ckpt_step}, older than step {newest} on disk"
            )
    elif resume.ckpt_step != newest or resume.ckpt_step % save_every:
        problems.append(f"resumed from step {resume.ckpt_step}, newest periodic checkpoint step {newest}")
    if problems:
        return False, f"{kind}: " + ", ".join(problems)
    source = "the memory snapshot of step" if memory is not None else "step"
    return True, f"{kind}: resumed from {source} {resume.ckpt_step} (rank exit codes {codes or 'none'})"


def storage_checks(
    injected: Sequence[Fault],
    facts: StorageFacts,
    events: Sequence[Logged[Event]],
    fault_times: Sequence[float],
    resumes: Sequence[Resume],
) -> list[Check]:
    """For a storage fault: nothing quarantined (an I/O error is no evidence of corruption), and
    the checks of its kind on the watchdog's events from the fault on."""
    checks = [_nothing_quarantined(facts, events)]
    for i, (fault, t0) in enumerate(zip(injected, fault_times, strict=False)):
        if fault.kind in _STORAGE_CHECKS:
            after = [e for e in events if e.t >= t0]
            resume = resumes[i] if i < len(resumes) else None
            checks += _STORAGE_CHECKS[fault.kind](facts, events, after, resume)
    return checks


def _nothing_quarantined(facts: StorageFacts, events: Sequence[Logged[Event]]) -> Check:
    moved = [e.event.why for e in ev.every(events, ev.Quarantine)] + list(facts.quarantined)
    return Check(
        "nothing quarantined",
        not moved,
        "; ".join(moved) or "quarantine/ is empty and the watchdog moved nothing",
    )


def _io_error_checks(
    facts: StorageFacts,
    events: Sequence[Logged[Event]],
    after: Sequence[Logged[Event]],
    resume: Resume | None,
) -> list[Check]:
    retries = len(ev.every(after, ev.IoRetry))
    hit = Check(
        "EIO met by the resume",
        facts.rule_hits > 0,
        f"{facts.rule_hits} checkpoint read(s) failed with EIO; the watchdog retried {retries} time(s)"
        if facts.rule_hits
        else "the EIO rule never fired: no checkpoint file was read after it was set (nothing was tested)",
    )
    end = ev.first(after, ev.LaunchEnd)
    newest = end.event.newest_checkpoint if end else None
    if resume is None or newest is None:
        detail = "no end of the faulted launch and resume seen"
    else:
        detail = (
            f"resumed from step {resume.ckpt_step}, newest committed when the launch ended: step {newest}"
        )
    return [
        hit,
        Check(
            "resumed from the newest committed checkpoint",
            resume is not None and newest is not None and resume.ckpt_step == newest,
            detail,
        ),
    ]


def _disk_full_checks(
    facts: StorageFacts,
    events: Sequence[Logged[Event]],
    after: Sequence[Logged[Event]],
    resume: Resume | None,
) -> list[Check]:
    failed, recovered = ev.every(after, ev.SaveFailed), ev.every(after, ev.SaveRecovered)
    most = max((e.event.save_failures for e in failed), default=0)
    recovered = [e for e in recovered if failed and e.t >= failed[-1].t]
    launches = ev.every(events, ev.Launch)
    before, kept = facts.committed_before, facts.committed_after
    lost = sorted(set(before) - set(kept))
    return [
        Check(
            "saves failed, then recovered",
            most >= DISK_FULL_FAILURES and bool(recovered),
            f"{len(failed)} save_failed event(s), up to {most} failed in a row"
            + (f" ({failed[-1].event.last_error})" if failed else "")
            + (f"; save_recovered at step {recovered[0].event.step}" if recovered else "; no save_recovered"),
        ),
        Check(
            "one launch, no relaunch",
            len(launches) == 1 and resume is None,
            f"{len(launches)} launch(es)" + (f", resumed from step {resume.ckpt_step}" if resume else ""),
        ),
        Check(
            "no tmp dir left",
            not facts.tmp_left,
            ", ".join(facts.tmp_left) or "no step_*.tmp.* dir in the run dir at the end",
        ),
        Check(
            "no committed checkpoint lost",
            bool(before) and not lost,
            f"committed when the disk filled: steps {_steps(before)}; when it was freed: {_steps(kept)}"
            + (f"; lost: {_steps(lost)}" if lost else ""),
        ),
    ]


def _slow_storage_checks(
    facts: StorageFacts,
    events: Sequence[Logged[Event]],
    after: Sequence[Logged[Event]],
    resume: Resume | None,
) -> list[Check]:
    hangs = ev.every(after, ev.Hang)
    ends = ev.every(after, ev.LaunchEnd)  # the faulted launch's, then the resumed one's
    outcome = ends[1].event.outcome if len(ends) > 1 else None
    t = facts.timeout_s
    if facts.verify_s is None or facts.load_s is None:
        slow, how = False, "the resumed launch's verify and load were not seen in its heartbeats"
    else:
        total = facts.verify_s + facts.load_s
        slow = t > 0 and total >= SLOW_FACTOR * t
        how = (
            f"verify {facts.verify_s:.1f}s + load {facts.load_s:.1f}s = {total:.1f}s: "
            f"{total / t if t else 0:.1f}x the --verify-timeout/--load-timeout {t:g}s (needs {SLOW_FACTOR:g}x); "
            f"a rank's heartbeats at most {facts.beat_gap_s:.1f}s apart"
        )
    return [
        Check("storage slower than the phase timeouts", slow, how),
        Check(
            "no hang verdict on slow storage",
            not hangs,
            hangs[0].msg if hangs else "no hang event after the throttle: progress kept it alive",
        ),
        Check(
            "resumed launch finished",
            outcome == Outcome.DONE,
            f"the resumed launch ended: {outcome or 'not seen'}",
        ),
    ]


def _hostile_checks(
    facts: StorageFacts,
    events: Sequence[Logged[Event]],
    after: Sequence[Logged[Event]],
    resume: Resume | None,
) -> list[Check]:
    calm = [c for c in facts.commands if not c.endswith(": calm")]
    return [
        Check(
            "nothing outside the run dir touched",
            bool(facts.planted) and not facts.outside_changed,
            "; ".join(facts.outside_changed)
            or f"planted {', '.join(facts.planted)}; the sentinel is as it was",
        ),
        Check(
            "commands calm on the planted run dir",
            bool(facts.commands) and not calm,
            "; ".join(calm)
            or f"{len(facts.commands)} command(s): no traceback, exit 0, 1 or 2, a line at most on stderr",
        ),
    ]


def _steps(steps: Sequence[int]) -> str:
    return ", ".join(map(str, steps)) or "none"


_STORAGE_CHECKS = {
    Kind.IO_ERROR: _io_error_checks,
    Kind.DISK_FULL: _disk_full_checks,
    Kind.SLOW_STORAGE: _slow_storage_checks,
    Kind.HOSTILE: _hostile_checks,
}
