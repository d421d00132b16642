"""Keeping a run's bad nodes out of its requeued job: ``scontrol update JobId=ID ExcNodeList=...``
(what the job excluded already, and the bad hosts), and with BAD_NODE_ACTION=drain the hosts
drained too (``scontrol update NodeName=... State=DRAIN``: needs an operator's rights). Run by
``slurm finish`` right after ``scontrol requeue``: SLURM refuses to change a running job's
ExcNodeList, and takes it on the pending job the requeue leaves."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass

from supervisor.format.badnodes import Action
from supervisor.slurm.env import DRAIN, JobEnv
from supervisor.slurm.hostlist import expand_hostlist
from supervisor.slurm.scontrol import SlurmError, scontrol_show, scontrol_update

EXCLUDED = "excluded"
DRAINED = "drained"


@dataclass(frozen=True)
class KeptOut:
    actions: tuple[Action, ...]
    problems: tuple[str, ...]


def exclusion_list(current: str, bad: Sequence[str]) -> list[str]:
    """The job's ExcNodeList as ``scontrol show job`` gives it (compact, or ``(null)``), with the
    bad hosts added, in order and without repeats."""
    try:
        already = [] if current in ("", "(null)") else expand_hostlist(current)
    except SlurmError:
        already = []  # a list the built-in parser cannot read: the bad hosts alone, SLURM keeps its own
    return list(dict.fromkeys([*already, *bad]))


def keep_out(job: JobEnv, bad: Sequence[str], action: str, key: str) -> KeptOut:
    info = scontrol_show("job", job.requeue_id) or {}
    hosts = exclusion_list(info.get("ExcNodeList", ""), bad)
    actions: list[Action] = []
    problems: list[str] = []
    exc = f"ExcNodeList={','.join(hosts)}"
    problem = scontrol_update(f"JobId={job.requeue_id}", exc)
    if problem:
        problems.append(f"the requeued job {job.requeue_id} may land on the bad nodes again: {problem}")
    else:
        actions.append(Action(EXCLUDED, tuple(bad), key, time.time(), exc))
    if action == DRAIN:
        reason = f"Reason=resumable-training: bad node of job {job.job_id} (see its run's bad_nodes.json)"
        problem = scontrol_update(f"NodeName={','.join(bad)}", "State=DRAIN", reason)
        if problem:
            problems.append(f"BAD_NODE_ACTION=drain: {problem} (draining needs an operator's rights)")
        else:
            actions.append(Action(DRAINED, tuple(bad), key, time.time(), reason))
    return KeptOut(tuple(actions), tuple(problems))
