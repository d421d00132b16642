"""SLURM glue for ``sbatch/job.sh`` (torch-free), by concern: ``scontrol`` (SLURM's client, ``SlurmError``), ``env`` (the job and its knobs, the
checks of its settings), ``hostlist`` (host lists to names), ``launch`` (the per-node command),
``requeue`` (the requeue decision and its budget in the run directory). What other packages use is
this package's ``__all__``."""

from __future__ import annotations

from supervisor.slurm.env import (
    TORCHRUN_TERM_WINDOW_S,
    JobEnv,
    Knobs,
    SaveTime,
    grace_problem,
    last_save_time,
    lead_problem,
    notice_problem,
    script_signal_spec,
)
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
    "JobEnv",
    "Knobs",
    "RequeueState",
    "SaveTime",
    "SlurmError",
    "budget_line",
    "decide",
    "default_rdzv_port",
    "expand_hostlist",
    "grace_problem",
    "hostnames",
    "last_save_time",
    "launch_command",
    "lead_problem",
    "load_requeue_state",
    "notice_problem",
    "read_requeue_state",
    "rendezvous",
    "requeue_path",
    "save_requeue_state",
    "scontrol_path",
    "scontrol_requeue",
    "scontrol_show",
    "script_signal_spec",
    "torchrun_args",
    "why_not_requeue",
]
