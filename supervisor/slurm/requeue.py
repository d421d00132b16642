"""The requeue decision and its budget, which lives in the run directory (``supervisor/slurm.json``)
because a requeued job starts with nothing in memory.

Pure functions decide (``decide``, ``why_not_requeue``); the thin functions at the bottom touch
files and run ``scontrol``. Torch-free, like everything in ``supervisor/``.
"""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from supervisor.format import confined
from supervisor.format.atomic import atomic_write_json
from supervisor.format.capped import RECORD_MAX, TooLarge, read_capped
from supervisor.format.eventnames import RequeueEvent
from supervisor.format.exitcodes import Exit
from supervisor.format.layout import RunDir
from supervisor.slurm.env import JobEnv
from supervisor.slurm.scontrol import SCONTROL_TIMEOUT_S, SlurmError, last_line, scontrol_path

REQUEUE_VERSION = 2  # 2: separate preemption and failure counts (1 is read too)


KEEP_HISTORY = 50


_NO_REQUEUE: dict[int, str] = {
    Exit.CHILD_NONRETRYABLE: "non-retryable failure: a rerun would fail the same way",
    Exit.BUDGET_EXHAUSTED: "the watchdog's restart budget ran out inside this allocation",
    Exit.NO_PROGRESS: "launches kept failing without a newer checkpoint",
    Exit.USAGE: "bad usage or input (see the lines above)",
}


PREEMPT = "preempt"


FAILURE = "failure"


# The knob that sets each budget, for the "raise it" hint.
BUDGET_KNOB = {PREEMPT: "MAX_PREEMPT_REQUEUES", FAILURE: "MAX_REQUEUES"}


@dataclass(frozen=True)
class Budgets:
    """Requeues used, or allowed, per kind: a preemptible job is preempted dozens of times and must
    not run out for that, while one that keeps failing must stop."""

    preempt: int = 0
    failure: int = 0

    def of(self, kind: str) -> int:
        return self.preempt if kind == PREEMPT else self.failure

    def plus_one(self, kind: str) -> Budgets:
        return replace(self, **{kind: self.of(kind) + 1})


# Watchdog exits that requeue the job while their budget lasts: which budget, and why.
_REQUEUE: dict[int, tuple[str, str]] = {
    Exit.REQUEUE_REQUESTED: (PREEMPT, "checkpointed after a preemption or time-limit notice"),
    Exit.STORAGE_UNAVAILABLE: (
        FAILURE,
        "storage unavailable past the watchdog's retries (committed checkpoints intact); "
        "another allocation may see it back",
    ),
    Exit.NODE_LOST: (FAILURE, "a node was lost and no spare was left (its checkpoints intact)"),
}


@dataclass(frozen=True)
class Decision:
    requeue: bool
    exit_code: int
    reason: str
    kind: str = ""  # the budget a requeue counts against (PREEMPT or FAILURE)


def decide(exit_code: int, used: Budgets, limits: Budgets) -> Decision:
    """What the job does once its watchdogs are done: a preemption checkpoint (exit 13) requeues
    against the preemption budget, storage that stayed unavailable (14) or a node lost with no
    spare left (15) against the failure budget; anything else ends the job."""
    if exit_code == Exit.OK:
        return Decision(False, Exit.OK, "run finished")
    if exit_code in _REQUEUE:
        kind, why = _REQUEUE[exit_code]
        n, limit = used.of(kind), limits.of(kind)
        label = "preemption" if kind == PREEMPT else "failure"
        if n < limit:
            return Decision(True, Exit.OK, f"{why}; {label} requeue {n + 1} of {limit}", kind)
        return Decision(
            False,
            exit_code,
            f"{why}, but the {label} requeue budget is used up ({n} of {limit}); "
            f"resubmit, or raise {BUDGET_KNOB[kind]}",
            kind,
        )
    known = _NO_REQUEUE.get(exit_code)
    what = f"{known} (watchdog exit {exit_code})" if known else f"failed with exit code {exit_code}"
    return Decision(False, exit_code, f"{what}; not requeueing")


@dataclass(frozen=True)
class RequeueState:
    """``ROOT/supervisor/slurm.json``: this job's requeues so far, per budget, so the budgets
    survive them. A different job id (a fresh ``sbatch``) starts fresh budgets."""

    job_id: str
    preempt_requeues: int = 0
    failure_requeues: int = 0
    max_preempt_requeues: int = 0
    max_requeues: int = 0
    restart_count: int = 0
    history: tuple[dict[str, Any], ...] = field(default=())
    version: int = REQUEUE_VERSION

    @property
    def used(self) -> Budgets:
        return Budgets(self.preempt_requeues, self.failure_requeues)

    @property
    def limits(self) -> Budgets:
        return Budgets(self.max_preempt_requeues, self.max_requeues)

    def counted(self, kind: str) -> RequeueState:
        used = self.used.plus_one(kind)
        return replace(self, preempt_requeues=used.preempt, failure_requeues=used.failure)

    def with_limits(self, limits: Budgets) -> RequeueState:
        return replace(self, max_preempt_requeues=limits.preempt, max_requeues=limits.failure)

    def with_event(self, event: RequeueEvent, **fields: Any) -> RequeueState:
        entry = {"time": round(time.time(), 3), "event": event.value, "job_id": self.job_id, **fields}
        return replace(self, history=(*self.history, entry)[-KEEP_HISTORY:])


def budget_line(state: RequeueState) -> str:
    """Both budgets in one line, for the job log and ``supervisor status``."""
    return (
        f"requeues used: preemption {state.preempt_requeues} of {state.max_preempt_requeues}, "
        f"failure {state.failure_requeues} of {state.max_requeues}"
    )


def requeue_path(root: str | Path) -> Path:
    return RunDir.of(root).requeue_state


def parse_requeue_state(d: Any) -> RequeueState:
    """Version 2, or version 1 (one ``requeues`` count for both kinds): its requeues after exit 13
    found in the history count as preemptions, the rest as failures."""
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    try:
        job_id = str(d["job_id"])
        history = tuple(d.get("history", ()))
        if "preempt_requeues" in d:
            preempt, failure = int(d["preempt_requeues"]), int(d["failure_requeues"])
        else:
            total = int(d["requeues"])
            preempt = min(total, sum(_is_preempt_requeue(h, job_id) for h in history))
            failure = total - preempt
        return RequeueState(
            job_id=job_id,
            preempt_requeues=preempt,
            failure_requeues=failure,
            max_preempt_requeues=int(d.get("max_preempt_requeues", 0)),
            max_requeues=int(d.get("max_requeues", 0)),
            restart_count=int(d.get("restart_count", 0)),
            history=history,
            version=int(d.get("version", REQUEUE_VERSION)),
        )
    except (KeyError, TypeError, ValueError, OverflowError) as e:  # OverflowError: int(1e400)
        raise ValueError(f"bad field ({e})") from None


def _is_preempt_requeue(h: Any, job_id: str) -> bool:
    return (
        isinstance(h, dict)
        and h.get("event") == RequeueEvent.REQUEUE
        and str(h.get("job_id")) == job_id
        and h.get("exit_code") == Exit.REQUEUE_REQUESTED
    )


def read_requeue_state(root: str | Path) -> RequeueState | None:
    """The file as it is (None when there is none); ValueError or OSError when it cannot be used."""
    try:
        text = read_capped(requeue_path(root), RECORD_MAX)
    except FileNotFoundError:
        return None
    except TooLarge as e:  # garbage, not unreadable storage
        raise ValueError(str(e)) from None
    try:
        return parse_requeue_state(json.loads(text))
    except RecursionError:
        raise ValueError("nested too deep to be a requeue record") from None


def load_requeue_state(root: str | Path, job: JobEnv, limits: Budgets) -> tuple[RequeueState, str]:
    """This job's state, and a note for the log when the file was garbage (kept as ``.bad``),
    could not be read (the storage failed: SLURM's own restart count stands in for each count,
    an upper bound of this script's requeues), or belonged to another job."""
    path = requeue_path(root)
    fresh = RequeueState(job_id=job.job_id, restart_count=job.restart_count).with_limits(limits)
    try:
        prev = read_requeue_state(root)
    except OSError as e:
        note = f"{path} cannot be read ({e}); counting SLURM's restarts of this job ({job.restart_count}) instead"
        n = job.restart_count
        return replace(fresh, preempt_requeues=n, failure_requeues=n), note
    except ValueError as e:
        bad = path.with_name(path.name + ".bad")
        confined.rename(root, path, bad)
        return fresh, f"{path} was unreadable ({e}); kept as {bad.name}, the requeue counts start over"
    if prev is None:
        return fresh, ""
    if prev.job_id != job.job_id:
        note = (
            f"{path.name} counted job {prev.job_id}'s requeues ({budget_line(prev)}); "
            f"job {job.job_id} starts fresh budgets"
        )
        return replace(fresh, history=prev.history), note
    return replace(prev, restart_count=job.restart_count, version=REQUEUE_VERSION).with_limits(limits), ""


def save_requeue_state(root: str | Path, state: RequeueState) -> None:
    path = requeue_path(root)
    d = asdict(state)
    d["history"] = list(state.history)
    d["requeues"] = state.preempt_requeues + state.failure_requeues  # what version 1 readers count
    atomic_write_json(path, d, root)


def why_not_requeue(info: Mapping[str, str] | None, restart_count: int) -> str:
    """Why this script must not requeue the job itself, or "" when it must: SLURM requeued it
    already (its Restarts passed this run's SLURM_RESTART_COUNT: PreemptMode=REQUEUE at the end of
    a GraceTime, an operator's requeue), or the job is ending (a plain scancel leaves it
    COMPLETING, and `scontrol requeue` would bring a cancelled job back). Inside a preemption's
    grace the job is still RUNNING and SLURM does not requeue a job that ends by itself (seen
    here): the script must. ``info``: ``scontrol show job``'s fields, None when unknown."""
    if info is None:
        return ""
    restarts = info.get("Restarts", "")
    if restarts.isdigit() and int(restarts) > restart_count:
        return (
            f"SLURM is requeueing this job itself (Restarts={restarts}, this run started with "
            f"SLURM_RESTART_COUNT={restart_count}: a preemption's GraceTime ended, or an operator requeued it)"
        )
    state = info.get("JobState", "")
    if state and state != "RUNNING":
        return f"the job is ending (JobState={state}: cancelled, or its time limit passed)"
    return ""


def scontrol_requeue(job_id: str) -> None:
    """Ask SLURM to requeue this job; SLURM then sends SIGTERM to the batch shell, so the caller
    should exit right after."""
    scontrol = scontrol_path()
    if scontrol is None:
        raise SlurmError(
            "scontrol not found on PATH (a container without SLURM's client tools?): "
            f"job {job_id} cannot requeue itself; resubmit it, or make scontrol available in the job"
        )
    out = subprocess.run(
        [scontrol, "requeue", job_id], capture_output=True, text=True, timeout=SCONTROL_TIMEOUT_S, check=False
    )
    if out.returncode != 0:
        raise SlurmError(
            f"`scontrol requeue {job_id}` failed (exit {out.returncode}): {last_line(out.stderr)}; "
            "is the job requeueable (JobRequeue=1 or #SBATCH --requeue)?"
        )
