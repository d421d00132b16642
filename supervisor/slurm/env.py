"""The job as SLURM describes it (``JobEnv``), the job script's knobs (``Knobs``), and the checks of
its signal, grace and torchrun settings before anything starts: each problem one line naming the
variable or ``#SBATCH`` line and the fix (``SlurmError``)."""

from __future__ import annotations

import math
import re
import shlex
import signal
import sys
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path

from supervisor.format.manifest import META_SAVE_S, ManifestError, read_manifest
from supervisor.format.notice import DEFAULT_NOTICE_SIGNAL, notice_signal
from supervisor.slurm.scontrol import SlurmError
from supervisor.store.checkpoints import list_checkpoints

# sbatch's --signal when no @TIME is given: 60 s before the limit.
SIGNAL_DEFAULT_LEAD_S = 60


# Hot spares and bad nodes (docs/slurm.md#hot-spares): a node whose watchdog's summary is silent
# this long is lost; a host with this many incidents is bad; what a requeue does with bad hosts.
DEFAULT_NODE_TIMEOUT_S = 30.0
DEFAULT_BAD_NODE_INCIDENTS = 2
EXCLUDE = "exclude"
DRAIN = "drain"
# What a straggler verdict is: reported (events, status), or an incident of its host too.
REPORT = "report"
BAD_NODE = "bad-node"


# torchrun SIGKILLs its workers this long after its SIGTERM (LocalElasticAgent._shutdown's timeout,
# fixed in torch; tests/test_slurm_unit.py checks it).
TORCHRUN_TERM_WINDOW_S = 30.0


# In WATCH_OPTS on more than one node: the roster keeps every node's standby (Knobs.rostered).
STANDBY_FLAG = "--standby"


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
    spare_nodes: int = 0  # of the allocation, kept waiting to replace a lost node (a roster)
    node_timeout_s: float = DEFAULT_NODE_TIMEOUT_S  # a node silent this long is lost
    bad_node_incidents: int = DEFAULT_BAD_NODE_INCIDENTS  # incidents that make a host bad
    bad_node_action: str = EXCLUDE  # what a requeue does with the bad hosts: exclude, or drain too
    straggler_action: str = REPORT  # a straggler verdict is reported, or an incident too (BAD_NODE)

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
            spare_nodes=_env_int(env, "SPARE_NODES", 0),
            node_timeout_s=_seconds(env, "NODE_TIMEOUT_S") or DEFAULT_NODE_TIMEOUT_S,
            bad_node_incidents=_env_int(env, "BAD_NODE_INCIDENTS", DEFAULT_BAD_NODE_INCIDENTS),
            bad_node_action=_choice(env, "BAD_NODE_ACTION", (EXCLUDE, DRAIN)),
            straggler_action=_choice(env, "STRAGGLER_ACTION", (REPORT, BAD_NODE)),
        )
        check_nnodes(knobs.nnodes)
        check_torchrun_opts(knobs.torchrun_opts)
        check_spares(knobs)
        return knobs

    def rostered(self, job: JobEnv) -> bool:
        """Whether a roster drives the job's launches (docs/slurm.md#hot-spares): with spares, and
        with --standby in WATCH_OPTS on more than one node, where each node's torchrun runs
        --standalone and its standby's ranks join the generation's group when all are released
        together (a torchrun of several nodes would take its standby into the running rendezvous).
        sbatch/job.sh asks (``slurm rostered``: its ROSTER, for srun and the coordinator's end)."""
        return self.spare_nodes > 0 or (job.num_nodes > 1 and STANDBY_FLAG in self.watch_opts)

    def train_nodes(self, job: JobEnv) -> int:
        """The nodes that train: NNODES, else the allocation's nodes less the spares."""
        return int(self.nnodes) if self.nnodes.isdigit() else job.num_nodes - self.spare_nodes


def check_spares(knobs: Knobs) -> None:
    """SPARE_NODES keeps whole nodes waiting beside a fixed number of training nodes."""
    if knobs.spare_nodes < 0:
        raise SlurmError(f"SPARE_NODES={knobs.spare_nodes}: set a whole number >= 0")
    if knobs.spare_nodes and ":" in knobs.nnodes:
        raise SlurmError(
            f"SPARE_NODES={knobs.spare_nodes} with NNODES={knobs.nnodes}: hot spares keep the world size "
            "fixed; set NNODES=N (or leave it unset: the allocation's nodes less the spares)"
        )
    if knobs.bad_node_incidents < 1:
        raise SlurmError(f"BAD_NODE_INCIDENTS={knobs.bad_node_incidents}: set a whole number >= 1")


def check_allocation(job: JobEnv, knobs: Knobs) -> None:
    """The allocation holds the training nodes and the spares."""
    train = knobs.train_nodes(job)
    if knobs.spare_nodes and (train < 1 or train + knobs.spare_nodes > job.num_nodes):
        raise SlurmError(
            f"SPARE_NODES={knobs.spare_nodes} with {train} training node(s) needs {train + knobs.spare_nodes} "
            f"nodes, and job {job.job_id} has {job.num_nodes}: submit with --nodes=N+{knobs.spare_nodes}"
        )


def _choice(env: Mapping[str, str], name: str, choices: tuple[str, ...]) -> str:
    raw = env.get(name, "") or choices[0]
    if raw not in choices:
        raise SlurmError(f"{name}={raw!r}: use one of {', '.join(choices)}")
    return raw


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


def check_nnodes(nnodes: str) -> None:
    """NNODES is N (fixed) or MIN:MAX (elastic), or empty for the allocation's node count."""
    if nnodes and not re.fullmatch(r"\d+(:\d+)?", nnodes):
        raise SlurmError(f"NNODES={nnodes!r}: use N, or MIN:MAX for an elastic run")
