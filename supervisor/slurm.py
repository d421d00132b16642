"""SLURM glue for ``sbatch/job.sh``: the job's knobs, the per-node launch command, and the requeue
decision with its budget, which lives in the run directory because a requeued job starts with
nothing in memory.

Pure functions decide (``decide``, ``launch_command``, ``expand_hostlist``); the thin functions at
the bottom touch files and run ``scontrol``. Torch-free, like everything in ``supervisor/``.
"""

from __future__ import annotations

import json
import math
import re
import shlex
import shutil
import signal
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from supervisor.checkpoints import list_checkpoints
from supervisor.errors import UserError
from supervisor.format import confined
from supervisor.format.atomic import atomic_write_json
from supervisor.format.capped import RECORD_MAX, TooLarge, read_capped
from supervisor.format.eventnames import RequeueEvent
from supervisor.format.exitcodes import Exit
from supervisor.format.layout import RunDir
from supervisor.format.manifest import META_SAVE_S, ManifestError, read_manifest

REQUEUE_VERSION = 2  # 2: separate preemption and failure counts (1 is read too)
KEEP_HISTORY = 50
# Default rendezvous port: BASE + job id mod SPAN, below Linux's ephemeral range (32768+), so two
# jobs sharing a node rarely pick the same port.
RDZV_PORT_BASE = 20000
RDZV_PORT_SPAN = 10000
SCONTROL_TIMEOUT_S = 60.0
TORCHRUN_MODULE = "torch.distributed.run"

_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")
# The preemption notice's signal (REQUEUE_SIGNAL): SLURM sends it to the batch shell, which hands
# it to srun, which signals every process of the step. USR2 is the watchdog's stack-dump request
# (train_ref's faulthandler); HUP, INT, QUIT and TERM are torchrun's own shutdown signals; URG is
# ignored by default, so a process that does not expect it survives it.
NOTICE_SIGNALS = ("USR1", "URG")
DEFAULT_NOTICE_SIGNAL = "USR1"
# sbatch's --signal when no @TIME is given: 60 s before the limit.
SIGNAL_DEFAULT_LEAD_S = 60
# torchrun SIGKILLs its workers this long after its SIGTERM (LocalElasticAgent._shutdown's timeout,
# fixed in torch; tests/test_slurm_unit.py checks it).
TORCHRUN_TERM_WINDOW_S = 30.0


class SlurmError(UserError):
    """A problem the operator must fix; ``str(e)`` is one line saying what and how."""


# ---------------------------------------------------------------- the job and its knobs


@dataclass(frozen=True)
class JobEnv:
    """What SLURM tells the job about itself."""

    job_id: str
    nodelist: str
    num_nodes: int
    restart_count: int
    # What scontrol requeue and show take: an array task's own ARRAYID_TASKID (its job id alone
    # may be the array's id, which names every task), else the job id.
    requeue_id: str = ""

    @classmethod
    def from_environ(cls, env: Mapping[str, str]) -> JobEnv:
        job_id = env.get("SLURM_JOB_ID", "")
        if not job_id:
            raise SlurmError(
                "SLURM_JOB_ID is not set: not inside a SLURM job; submit with `sbatch sbatch/job.sh`"
            )
        nodelist = env.get("SLURM_JOB_NODELIST") or env.get("SLURM_NODELIST") or ""
        if not nodelist:
            raise SlurmError(f"job {job_id}: SLURM_JOB_NODELIST is not set; cannot place the rendezvous")
        return cls(
            job_id=job_id,
            nodelist=nodelist,
            num_nodes=_env_int(env, "SLURM_JOB_NUM_NODES", _env_int(env, "SLURM_NNODES", 1)),
            restart_count=_env_int(env, "SLURM_RESTART_COUNT", 0),
            requeue_id=array_task_id(env) or job_id,
        )


def array_task_id(env: Mapping[str, str]) -> str:
    """``ARRAYID_TASKID`` inside an array task, else ""."""
    array, task = env.get("SLURM_ARRAY_JOB_ID", ""), env.get("SLURM_ARRAY_TASK_ID", "")
    return f"{array}_{task}" if array and task else ""


@dataclass(frozen=True)
class Knobs:
    """The job script's environment variables (defaults are set and documented in sbatch/job.sh)."""

    run_dir: Path
    python: str
    train_args: tuple[str, ...]
    ckpt_flag: str
    nproc_per_node: str
    nnodes: str
    rdzv_host: str
    rdzv_port: int | None
    torchrun_opts: tuple[str, ...]
    watch_opts: tuple[str, ...]
    max_requeues: int  # requeues after a failure (storage unavailable, exit 14)
    max_preempt_requeues: int  # requeues after a preemption or time-limit checkpoint (exit 13)
    requeue_signal: str = DEFAULT_NOTICE_SIGNAL  # the notice's signal name, without SIG
    stop_grace_s: float | None = None  # the watchdog's SIGTERM-to-SIGKILL for its ranks (--stop-grace)

    @classmethod
    def from_environ(cls, env: Mapping[str, str], argv: Sequence[str] = ()) -> Knobs:
        """``argv`` (the job script's arguments) is the trainer command; without it, TRAIN_ARGS.
        Lists are split like a shell splits words (``shlex``), never evaluated by one."""
        run_dir = env.get("RUN_DIR", "")
        if not run_dir:
            raise SlurmError(
                "RUN_DIR is not set: export RUN_DIR=/path/to/checkpoint/root (sbatch/job.sh sets a default)"
            )
        max_requeues = _budget(env, "MAX_REQUEUES")
        max_preempt = _budget(env, "MAX_PREEMPT_REQUEUES")
        port = env.get("RDZV_PORT", "")
        train = tuple(argv) or _split(env, "TRAIN_ARGS")
        if not train:
            raise SlurmError(
                "no trainer command: pass it after the script "
                "(sbatch sbatch/job.sh -m train_ref.train ...) or set TRAIN_ARGS"
            )
        knobs = cls(
            run_dir=Path(run_dir),
            python=env.get("PYTHON", "") or sys.executable,
            train_args=train,
            ckpt_flag=env.get("CKPT_FLAG", ""),
            nproc_per_node=env.get("NPROC_PER_NODE", "") or "1",
            nnodes=env.get("NNODES", ""),
            rdzv_host=env.get("RDZV_HOST", ""),
            rdzv_port=_port(port) if port else None,
            torchrun_opts=_split(env, "TORCHRUN_OPTS"),
            watch_opts=_split(env, "WATCH_OPTS"),
            max_requeues=max_requeues,
            max_preempt_requeues=max_preempt,
            requeue_signal=notice_signal(env.get("REQUEUE_SIGNAL", "")).name.removeprefix("SIG"),
            stop_grace_s=_seconds(env, "STOP_GRACE_S"),
        )
        check_nnodes(knobs.nnodes)
        check_torchrun_opts(knobs.torchrun_opts)
        return knobs


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise SlurmError(f"{name}={raw!r} is not a whole number") from None


def _budget(env: Mapping[str, str], name: str) -> int:
    n = _env_int(env, name, -1)
    if n < 0:
        raise SlurmError(
            f"{name}={env.get(name, '')!r}: set it to a whole number >= 0 (sbatch/job.sh sets a default)"
        )
    return n


def _seconds(env: Mapping[str, str], name: str) -> float | None:
    raw = env.get(name, "")
    if raw == "":
        return None
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not value > 0:
        raise SlurmError(f"{name}={raw!r}: set a number of seconds > 0")
    return value


def _split(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(env.get(name, "")))
    except ValueError as e:
        raise SlurmError(f"{name}={env.get(name, '')!r}: {e} (quote it as you would in a shell)") from None


def _port(raw: str) -> int:
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise SlurmError(f"RDZV_PORT={raw!r}: set a TCP port between 1 and 65535")
    return int(raw)


def notice_signal(raw: str, var: str = "REQUEUE_SIGNAL") -> signal.Signals:
    """The preemption notice's signal from its name (``USR1``, ``SIGURG``); empty is the default."""
    name = (raw.strip() or DEFAULT_NOTICE_SIGNAL).upper().removeprefix("SIG")
    if name not in NOTICE_SIGNALS:
        raise SlurmError(
            f"{var}={raw!r}: use {' or '.join(NOTICE_SIGNALS)} (USR2 is the stack-dump signal; "
            "HUP, INT, QUIT and TERM make torchrun shut its workers down)"
        )
    return signal.Signals[f"SIG{name}"]


@dataclass(frozen=True)
class SignalSpec:
    """sbatch's ``--signal=[{R|B}:]SIG[@TIME]``."""

    flags: str
    signal: str  # the name without SIG, or the number as given
    lead_s: int


def parse_signal_spec(spec: str) -> SignalSpec:
    m = re.fullmatch(r"(?:([A-Za-z]+):)?([A-Za-z0-9]+)(?:@(\d+))?", spec.strip())
    if not m:
        raise SlurmError(f"cannot parse --signal={spec!r}: expected [B:]SIGNAL[@SECONDS]")
    flags, sig, lead = m.groups()
    if sig.isdigit() and int(sig) in {s.value for s in signal.Signals}:
        sig = signal.Signals(int(sig)).name
    return SignalSpec(
        (flags or "").upper(), sig.upper().removeprefix("SIG"), int(lead or SIGNAL_DEFAULT_LEAD_S)
    )


def script_signal_spec(script: str) -> str | None:
    """The last ``#SBATCH --signal`` of a job script, read as sbatch reads them: up to the first
    line that is neither blank nor a comment."""
    found = None
    for line in script.splitlines()[1:]:
        text = line.strip()
        if text and not text.startswith("#"):
            break
        m = re.match(r"#SBATCH\s+--signal(?:=|\s+)(\S+)", text)
        if m:
            found = m.group(1)
    return found


def notice_problem(spec: str | None, where: str, requeue_signal: str) -> str:
    """Why the job's preemption notice can never reach this script, or "" when it can. ``spec``
    is the job's --signal as found in ``where`` (None: none found)."""
    want = f"--signal=B:{requeue_signal}@120"
    if spec is None:
        return (
            f"no --signal found ({where}): no notice comes before the time limit, so the run loses "
            f"the steps since its last checkpoint there; add #SBATCH {want} (a --signal given on the "
            "sbatch command line cannot be seen from inside the job)"
        )
    try:
        s = parse_signal_spec(spec)
    except SlurmError as e:
        return f"{e} ({where}); use {want}"
    if "B" not in s.flags:
        return (
            f"--signal={spec} ({where}) has no B:, so SLURM signals the job steps but never this "
            f"script, and nothing requeues the job at the time limit; use --signal=B:{s.signal}@{s.lead_s}"
        )
    if s.signal != requeue_signal:
        return (
            f"--signal={spec} ({where}) sends SIG{s.signal} but REQUEUE_SIGNAL={requeue_signal}: the "
            f"notice would end this script instead of checkpointing; make them match ({want})"
        )
    return ""


@dataclass(frozen=True)
class SaveTime:
    """How long one checkpoint of the run took to save (its manifest's META_SAVE_S)."""

    checkpoint: str
    seconds: float


def last_save_time(root: str | Path) -> SaveTime | None:
    """The newest readable manifest's save duration; None before the first checkpoint, for a
    trainer that does not record it, or when the storage cannot be read now (advice only: it
    never stops a job, and the watchdog reports storage problems)."""
    try:
        refs = list_checkpoints(root)
    except OSError:
        return None
    for ref in refs:
        try:
            value = read_manifest(ref.path).meta.get(META_SAVE_S)
        except ManifestError:
            continue  # the watchdog quarantines it; the one before still tells the save time
        if isinstance(value, (int, float)) and not isinstance(value, bool) and value >= 0:
            return SaveTime(ref.name, float(value))
        return None
    return None


def lead_problem(spec: str | None, where: str, save: SaveTime | None) -> str:
    """Why the job's notice (``spec``, its --signal as found in ``where``) comes later than one
    checkpoint of this run takes, or "". The notice reaches the batch shell between @SECONDS and
    @SECONDS + 30 before the limit (slurmctld checks every 30 s), so @SECONDS is all it can count
    on; the ranks also need up to a step to reach the boundary, and seconds to exit and requeue."""
    if spec is None or save is None:
        return ""
    try:
        lead = parse_signal_spec(spec).lead_s
    except SlurmError:
        return ""  # notice_problem says so
    if lead >= save.seconds:
        return ""
    return (
        f"--signal={spec} ({where}) gives {lead} s notice before the time limit, but this run's last "
        f"checkpoint ({save.checkpoint}) took {save.seconds:.1f} s to save: the limit may end the job "
        f"before the notice's checkpoint commits, and the steps since the one before are lost; raise "
        f"@{lead} above {math.ceil(save.seconds)} plus a step and the time to exit and requeue"
    )


def check_torchrun_opts(opts: Sequence[str]) -> None:
    """torchrun's own restarts (--max-restarts > 0) would restart ranks that exited 75 (preempted,
    checkpointed), 65 or 78 (non-retryable) inside the grace window and fight the watchdog, which
    owns restarts and the exit-code contract."""
    for i, opt in enumerate(opts):
        m = re.fullmatch(r"--max[-_]restarts(?:=(.*))?", opt)
        if not m:
            continue
        value = m.group(1) if m.group(1) is not None else (opts[i + 1] if i + 1 < len(opts) else "")
        if value.strip() != "0":
            raise SlurmError(
                f"TORCHRUN_OPTS has --max-restarts {value}: torchrun would restart ranks that exit 75 "
                "(preempted), 65 or 78 (non-retryable) and fight the watchdog, which owns restarts; remove it "
                "(the watchdog relaunches torchrun, and an elastic torchrun re-forms the group at its rendezvous)"
            )


def grace_problem(partition: Mapping[str, str] | None, stop_grace_s: float) -> str:
    """Why a preemption on this partition leaves the ranks less time to checkpoint than the
    watchdog and torchrun give them, or "". ``partition``: ``scontrol show partition``'s fields."""
    if partition is None:
        return ""
    mode = partition.get("PreemptMode", "OFF").upper()
    grace = partition.get("GraceTime", "")
    if not {"REQUEUE", "CANCEL"} & set(mode.split(",")) or not grace.isdigit():
        return ""
    window = min(stop_grace_s, TORCHRUN_TERM_WINDOW_S)
    if int(grace) >= window:
        return ""
    return (
        f"partition {partition.get('PartitionName', '?')} has PreemptMode={mode} and GraceTime={grace}: a "
        f"preemption SIGKILLs the ranks {grace} s after its SIGTERM (KillWait when 0), less than the "
        f"{window:g} s they may need to checkpoint; ask for GraceTime >= {window:g}, or rely on a --signal notice"
    )


def scontrol_show(kind: str, name: str) -> dict[str, str] | None:
    """``scontrol show KIND -o NAME``'s KEY=VALUE fields; None when scontrol is missing or fails
    (the caller then acts as if SLURM had said nothing)."""
    scontrol = scontrol_path()
    if scontrol is None or not name:
        return None
    try:
        out = subprocess.run(
            [scontrol, "show", kind, "-o", name],
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def check_nnodes(nnodes: str) -> None:
    """NNODES is N (fixed) or MIN:MAX (elastic), or empty for the allocation's node count."""
    if nnodes and not re.fullmatch(r"\d+(:\d+)?", nnodes):
        raise SlurmError(f"NNODES={nnodes!r}: use N, or MIN:MAX for an elastic run")


def default_rdzv_port(job_id: str) -> int:
    digits = re.sub(r"\D", "", job_id) or "0"
    return RDZV_PORT_BASE + int(digits) % RDZV_PORT_SPAN


# ---------------------------------------------------------------- hostnames


def expand_hostlist(expr: str) -> list[str]:
    """SLURM's compact host list (``gpu[01-03,7],login-a``) as names, in order. Used only where
    ``scontrol`` is missing; SLURM's own expansion is the reference."""
    hosts: list[str] = []
    for item in _split_top_level(expr):
        hosts.extend(_expand_item(item))
    return hosts


def _split_top_level(expr: str) -> list[str]:
    items, depth, cur = [], 0, ""
    for ch in expr.strip():
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise SlurmError(f"cannot parse host list {expr!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise SlurmError(f"cannot parse host list {expr!r}: unbalanced brackets")
    return [i for i in [*items, cur] if i]


def _expand_item(item: str) -> list[str]:
    m = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
    if not m:
        return [item]
    prefix, ranges, rest = m.groups()
    out: list[str] = []
    for r in ranges.split(","):
        rm = _RANGE_RE.match(r)
        if not rm:
            raise SlurmError(f"cannot parse host list range {r!r} in {item!r}")
        lo, hi = rm.group(1), rm.group(2) or rm.group(1)
        width = len(lo)
        for n in range(int(lo), int(hi) + 1):
            out.extend(f"{prefix}{n:0{width}d}{tail}" for tail in _expand_item(rest))
    return out


def scontrol_path() -> str | None:
    return shutil.which("scontrol")


def hostnames(nodelist: str) -> tuple[list[str], str]:
    """The allocation's hosts (``scontrol show hostnames``), and a note when SLURM's expansion was
    not available and the built-in one was used."""
    scontrol = scontrol_path()
    if scontrol is None:
        note = "scontrol not found on PATH; expanded the host list with the built-in parser"
        return expand_hostlist(nodelist), note
    out = subprocess.run(
        [scontrol, "show", "hostnames", nodelist],
        capture_output=True,
        text=True,
        timeout=SCONTROL_TIMEOUT_S,
        check=False,
    )
    if out.returncode != 0 or not out.stdout.split():
        raise SlurmError(f"`scontrol show hostnames {nodelist}` failed: {_last_line(out.stderr)}")
    return out.stdout.split(), ""


def _last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"


# ---------------------------------------------------------------- the launch command


@dataclass(frozen=True)
class Rendezvous:
    host: str
    port: int
    run_id: str
    nnodes: str


def rendezvous(job: JobEnv, knobs: Knobs, first_host: str) -> Rendezvous:
    return Rendezvous(
        host=knobs.rdzv_host or first_host,
        port=knobs.rdzv_port or default_rdzv_port(job.job_id),
        run_id=job.job_id,
        nnodes=knobs.nnodes or str(job.num_nodes),
    )


def torchrun_args(knobs: Knobs, rdzv: Rendezvous) -> list[str]:
    """torchrun's arguments: c10d rendezvous on the first host, then the trainer command, then
    ``CKPT_FLAG RUN_DIR`` so the trainer and the watchdog share one root."""
    ckpt = [knobs.ckpt_flag, str(knobs.run_dir)] if knobs.ckpt_flag else []
    return [
        f"--nnodes={rdzv.nnodes}",
        f"--nproc-per-node={knobs.nproc_per_node}",
        "--rdzv-backend=c10d",
        f"--rdzv-endpoint={rdzv.host}:{rdzv.port}",
        f"--rdzv-id={rdzv.run_id}",
        *knobs.torchrun_opts,
        *knobs.train_args,
        *ckpt,
    ]


def launch_command(knobs: Knobs, rdzv: Rendezvous) -> list[str]:
    """What each node's srun task runs: the watchdog (taking REQUEUE_SIGNAL as the notice), whose
    child is torchrun started through ``slurm torchrun`` (which ignores that signal: SLURM signals
    every process of a step, and torchrun would die of the notice meant for the watchdog and the
    ranks)."""
    py, sig = knobs.python, knobs.requeue_signal
    watch = [py, "-m", "supervisor", "watch", "--ckpt-root", str(knobs.run_dir), "--requeue-exit"]
    watch += ["--notice-signal", sig]
    if knobs.stop_grace_s is not None:
        watch += ["--stop-grace", f"{knobs.stop_grace_s:g}"]
    child = [
        py,
        "-m",
        "supervisor",
        "slurm",
        "torchrun",
        "--ignore-signal",
        sig,
        "--",
        *torchrun_args(knobs, rdzv),
    ]
    return [*watch, *knobs.watch_opts, "--", *child]


# ---------------------------------------------------------------- requeue decision and budget


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
}


@dataclass(frozen=True)
class Decision:
    requeue: bool
    exit_code: int
    reason: str
    kind: str = ""  # the budget a requeue counts against (PREEMPT or FAILURE)


def decide(exit_code: int, used: Budgets, limits: Budgets) -> Decision:
    """What the job does once its watchdogs are done: a preemption checkpoint (exit 13) requeues
    against the preemption budget, storage that stayed unavailable (14) against the failure
    budget; anything else ends the job."""
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
            f"`scontrol requeue {job_id}` failed (exit {out.returncode}): {_last_line(out.stderr)}; "
            "is the job requeueable (JobRequeue=1 or #SBATCH --requeue)?"
        )
