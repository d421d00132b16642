"""The per-node launch command: the watchdog around torchrun, with a c10d rendezvous on the first
host of the job (port derived from the job id unless RDZV_PORT is set). Pure."""

from __future__ import annotations

import re
from dataclasses import dataclass

from supervisor.slurm.env import JobEnv, Knobs

# Default rendezvous port: BASE + job id mod SPAN, below Linux's ephemeral range (32768+), so two
# jobs sharing a node rarely pick the same port.
RDZV_PORT_BASE = 20000


RDZV_PORT_SPAN = 10000


TORCHRUN_MODULE = "torch.distributed.run"


def default_rdzv_port(job_id: str) -> int:
    digits = re.sub(r"\D", "", job_id) or "0"
    return RDZV_PORT_BASE + int(digits) % RDZV_PORT_SPAN


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
        nnodes=knobs.nnodes or str(knobs.train_nodes(job)),
    )


def roster_key(job: JobEnv) -> str:
    """The roster of this run of the job (a requeued run starts its own: JOBID.RESTARTCOUNT)."""
    return f"{job.requeue_id}.{job.restart_count}"


# Under a roster the node summary is each node's readiness and liveness: written this many times
# per node timeout, so a silent node is told from a slow write.
SUMMARIES_PER_TIMEOUT = 4


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


def roster_torchrun_args(knobs: Knobs) -> list[str]:
    """torchrun's arguments under a roster: the node's ranks alone (``--standalone``); they join
    the generation's group at the trainer's gate (supervisor.resumable.wait_if_standby)."""
    ckpt = [knobs.ckpt_flag, str(knobs.run_dir)] if knobs.ckpt_flag else []
    return [
        "--standalone",
        f"--nproc-per-node={knobs.nproc_per_node}",
        *knobs.torchrun_opts,
        *knobs.train_args,
        *ckpt,
    ]


def launch_command(knobs: Knobs, rdzv: Rendezvous, roster: str = "") -> list[str]:
    """What each node's srun task runs: the watchdog (taking REQUEUE_SIGNAL as the notice), whose
    child is torchrun started through ``slurm torchrun`` (which ignores that signal: SLURM signals
    every process of a step, and torchrun would die of the notice meant for the watchdog and the
    ranks). ``roster``: with SPARE_NODES, the roster's key: the watchdog follows it, keeps its
    next launch started ahead (``--standby``: a spare's imports done, a survivor's too) and
    publishes its summary often enough to be told lost within NODE_TIMEOUT_S."""
    py, sig = knobs.python, knobs.requeue_signal
    watch = [py, "-m", "supervisor", "watch", "--ckpt-root", str(knobs.run_dir), "--requeue-exit"]
    watch += ["--notice-signal", sig]
    if knobs.stop_grace_s is not None:
        watch += ["--stop-grace", f"{knobs.stop_grace_s:g}"]
    if roster:
        every = knobs.node_timeout_s / SUMMARIES_PER_TIMEOUT
        watch += ["--roster", roster, "--standby", "--summary-interval", f"{every:g}"]
    child = [
        py,
        "-m",
        "supervisor",
        "slurm",
        "torchrun",
        "--ignore-signal",
        sig,
        "--",
        *(roster_torchrun_args(knobs) if roster else torchrun_args(knobs, rdzv)),
    ]
    return [*watch, *knobs.watch_opts, "--", *child]
