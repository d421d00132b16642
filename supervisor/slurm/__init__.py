"""SLURM glue for ``sbatch/job.sh`` (torch-free), by concern: ``scontrol`` (SLURM's client, ``SlurmError``), ``env`` (the job and its knobs, the
checks of its settings), ``hostlist`` (host lists to names), ``launch`` (the per-node command),
``requeue`` (the requeue decision and its budget in the run directory), ``spares`` (the hot spares'
roster, pure), ``incidents`` (which host a failure is pinned on, pure), ``coordinator`` (the job's
watch over its nodes), ``exclude`` (bad nodes kept out of a requeued job). What other packages use
is this package's ``__all__``."""

from __future__ import annotations

from supervisor.slurm.coordinator import Coordinator
from supervisor.slurm.env import (
    TORCHRUN_TERM_WINDOW_S,
    JobEnv,
    Knobs,
    SaveTime,
    check_allocation,
    grace_problem,
    last_save_time,
    lead_problem,
    notice_problem,
    script_signal_spec,
)
from supervisor.slurm.exclude import keep_out
from supervisor.slurm.hostlist import (
    expand_hostlist,
    hostnames,
)
from supervisor.slurm.launch import (
    RDZV_PORT_BASE,
    TORCHRUN_MODULE,
    default_rdzv_port,
    launch_command,
    rendezvous,
    roster_key,
    torchrun_args,
)
from supervisor.slurm.requeue import (
    FAILURE,
    KEEP_HISTORY,
    PREEMPT,
    Budgets,
    RequeueState,
    budget_line,
    decide,
    load_requeue_state,
    read_requeue_state,
    requeue_path,
    save_requeue_state,
    scontrol_requeue,
    why_not_requeue,
)
from supervisor.slurm.scontrol import SlurmError, scontrol_path, scontrol_show

__all__ = [
    "FAILURE",
    "KEEP_HISTORY",
    "PREEMPT",
    "RDZV_PORT_BASE",
    "TORCHRUN_MODULE",
    "TORCHRUN_TERM_WINDOW_S",
    "Budgets",
    "Coordinator",
    "JobEnv",
    "Knobs",
    "RequeueState",
    "SaveTime",
    "SlurmError",
    "budget_line",
    "check_allocation",
    "decide",
    "default_rdzv_port",
    "expand_hostlist",
    "grace_problem",
    "hostnames",
    "keep_out",
    "last_save_time",
    "launch_command",
    "lead_problem",
    "load_requeue_state",
    "notice_problem",
    "read_requeue_state",
    "rendezvous",
    "requeue_path",
    "roster_key",
    "save_requeue_state",
    "scontrol_path",
    "scontrol_requeue",
    "scontrol_show",
    "script_signal_spec",
    "torchrun_args",
    "why_not_requeue",
]
