"""SLURM glue for ``sbatch/job.sh``: the job's knobs, the per-node launch command, and the requeue
decision with its budget, which lives in the run directory because a requeued job starts with
nothing in memory.

Pure functions decide (``decide``, ``launch_command``, ``expand_hostlist``); the thin functions at
the bottom touch files and run ``scontrol``. Torch-free, like everything in ``supervisor/``.
"""

from __future__ import annotations

import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import time
from collections.abc import Mapping, Sequence
from dataclasses import asdict, dataclass, field, replace
from pathlib import Path
from typing import Any

from supervisor.errors import UserError
from supervisor.exitcodes import Exit
from supervisor.fsutil import atomic_write_json
from supervisor.layout import RunDir

REQUEUE_VERSION = 1
KEEP_HISTORY = 50
# Default rendezvous port: BASE + job id mod SPAN, below Linux's ephemeral range (32768+), so two
# jobs sharing a node rarely pick the same port.
RDZV_PORT_BASE = 20000
RDZV_PORT_SPAN = 10000
SCONTROL_TIMEOUT_S = 60.0
TORCHRUN_MODULE = "torch.distributed.run"

_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")


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
        )


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
    max_requeues: int

    @classmethod
    def from_environ(cls, env: Mapping[str, str], argv: Sequence[str] = ()) -> Knobs:
        """``argv`` (the job script's arguments) is the trainer command; without it, TRAIN_ARGS.
        Lists are split like a shell splits words (``shlex``), never evaluated by one."""
        run_dir = env.get("RUN_DIR", "")
        if not run_dir:
            raise SlurmError(
                "RUN_DIR is not set: export RUN_DIR=/path/to/checkpoint/root (sbatch/job.sh sets a default)"
            )
        max_requeues = _env_int(env, "MAX_REQUEUES", -1)
        if max_requeues < 0:
            raise SlurmError(f"MAX_REQUEUES={env.get('MAX_REQUEUES', '')!r}: set it to a whole number >= 0")
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
        )
        check_nnodes(knobs.nnodes)
        return knobs


def _env_int(env: Mapping[str, str], name: str, default: int) -> int:
    raw = env.get(name, "")
    if raw == "":
        return default
    try:
        return int(raw)
    except ValueError:
        raise SlurmError(f"{name}={raw!r} is not a whole number") from None


def _split(env: Mapping[str, str], name: str) -> tuple[str, ...]:
    try:
        return tuple(shlex.split(env.get(name, "")))
    except ValueError as e:
        raise SlurmError(f"{name}={env.get(name, '')!r}: {e} (quote it as you would in a shell)") from None


def _port(raw: str) -> int:
    if not raw.isdigit() or not 0 < int(raw) < 65536:
        raise SlurmError(f"RDZV_PORT={raw!r}: set a TCP port between 1 and 65535")
    return int(raw)


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
    """What each node's srun task runs: the watchdog, whose child is torchrun started through
    ``slurm torchrun`` (which ignores SIGUSR1: SLURM signals every process of a step, and torchrun
    would die of the preemption notice meant for the watchdog and the ranks)."""
    py = knobs.python
    watch = [py, "-m", "supervisor", "watch", "--ckpt-root", str(knobs.run_dir), "--requeue-exit"]
    child = [py, "-m", "supervisor", "slurm", "torchrun", "--", *torchrun_args(knobs, rdzv)]
    return [*watch, *knobs.watch_opts, "--", *child]


# ---------------------------------------------------------------- requeue decision and budget


@dataclass(frozen=True)
class Decision:
    requeue: bool
    exit_code: int
    reason: str


_NO_REQUEUE: dict[int, str] = {
    Exit.CHILD_NONRETRYABLE: "non-retryable failure: a rerun would fail the same way",
    Exit.BUDGET_EXHAUSTED: "the watchdog's restart budget ran out inside this allocation",
    Exit.NO_PROGRESS: "launches kept failing without a newer checkpoint",
    Exit.USAGE: "bad usage or input (see the lines above)",
}


# Watchdog exits that requeue the job, while the requeue budget lasts, and why.
_REQUEUE: dict[int, str] = {
    Exit.REQUEUE_REQUESTED: "checkpointed after a preemption or time-limit notice",
    Exit.STORAGE_UNAVAILABLE: (
        "storage unavailable past the watchdog's retries (committed checkpoints intact); "
        "another allocation may see it back"
    ),
}


def decide(exit_code: int, requeues_used: int, max_requeues: int) -> Decision:
    """What the job does once its watchdogs are done: a preemption checkpoint (exit 13) or
    storage that stayed unavailable (14) requeues, and only while the budget lasts."""
    if exit_code == Exit.OK:
        return Decision(False, Exit.OK, "run finished")
    why = _REQUEUE.get(exit_code)
    if why is not None:
        if requeues_used < max_requeues:
            return Decision(True, Exit.OK, f"{why}; requeue {requeues_used + 1} of {max_requeues}")
        return Decision(
            False,
            exit_code,
            f"{why}, but the requeue budget is used up ({requeues_used} of {max_requeues}); "
            "resubmit, or raise MAX_REQUEUES",
        )
    known = _NO_REQUEUE.get(exit_code)
    what = f"{known} (watchdog exit {exit_code})" if known else f"failed with exit code {exit_code}"
    return Decision(False, exit_code, f"{what}; not requeueing")


@dataclass(frozen=True)
class RequeueState:
    """``ROOT/supervisor/slurm.json``: this job's requeues so far, so the budget survives them.
    A different job id (a fresh ``sbatch``) starts a fresh budget."""

    job_id: str
    requeues: int = 0
    max_requeues: int = 0
    restart_count: int = 0
    history: tuple[dict[str, Any], ...] = field(default=())
    version: int = REQUEUE_VERSION

    def with_event(self, event: str, **fields: Any) -> RequeueState:
        entry = {"time": round(time.time(), 3), "event": event, "job_id": self.job_id, **fields}
        return replace(self, history=(*self.history, entry)[-KEEP_HISTORY:])


def requeue_path(root: str | Path) -> Path:
    return RunDir.of(root).requeue_state


def parse_requeue_state(d: Any) -> RequeueState:
    if not isinstance(d, dict):
        raise ValueError("not a JSON object")
    try:
        return RequeueState(
            job_id=str(d["job_id"]),
            requeues=int(d["requeues"]),
            max_requeues=int(d.get("max_requeues", 0)),
            restart_count=int(d.get("restart_count", 0)),
            history=tuple(d.get("history", ())),
            version=int(d.get("version", REQUEUE_VERSION)),
        )
    except (KeyError, TypeError, ValueError) as e:
        raise ValueError(f"bad field ({e})") from None


def load_requeue_state(root: str | Path, job: JobEnv, max_requeues: int) -> tuple[RequeueState, str]:
    """This job's state, and a note for the log when the file was garbage (kept as ``.bad``),
    could not be read (the storage failed: SLURM's own restart count stands in for the count,
    an upper bound of this script's requeues), or belonged to another job."""
    path = requeue_path(root)
    fresh = RequeueState(job_id=job.job_id, max_requeues=max_requeues, restart_count=job.restart_count)
    try:
        prev = parse_requeue_state(json.loads(path.read_text()))
    except FileNotFoundError:
        return fresh, ""
    except OSError as e:
        note = f"{path} cannot be read ({e}); counting SLURM's restarts of this job ({job.restart_count}) instead"
        return replace(fresh, requeues=job.restart_count), note
    except ValueError as e:
        bad = path.with_name(path.name + ".bad")
        os.replace(path, bad)
        return fresh, f"{path} was unreadable ({e}); kept as {bad.name}, the requeue count starts over"
    if prev.job_id != job.job_id:
        note = (
            f"{path.name} counted job {prev.job_id}'s {prev.requeues} requeues; "
            f"job {job.job_id} starts a fresh budget"
        )
        return replace(fresh, history=prev.history), note
    return replace(prev, max_requeues=max_requeues, restart_count=job.restart_count), ""


def save_requeue_state(root: str | Path, state: RequeueState) -> None:
    path = requeue_path(root)
    path.parent.mkdir(parents=True, exist_ok=True)
    d = asdict(state)
    d["history"] = list(state.history)
    atomic_write_json(path, d)


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
