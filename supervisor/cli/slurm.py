"""``python -m supervisor slurm start|launch|torchrun|finish``: the steps of ``sbatch/job.sh``.

    start [--job-script PATH] -- TRAIN...   once per job start: log SLURM_RESTART_COUNT, check
                          knobs and the notice's --signal, record the start
    launch  -- TRAIN...   once per node (srun): exec the watchdog, which runs torchrun
    coordinate -- TRAIN...   beside srun (several nodes): lost nodes, incidents, the bad-node
                          list; with SPARE_NODES (or --standby in WATCH_OPTS) the roster, and
                          the job's exit code
    torchrun [--ignore-signal SIG] ARGS...   exec ``python -m torch.distributed.run ARGS`` with the
                          notice's signal ignored
    finish --exit-code N -- TRAIN...   after srun: requeue (exit 13, 14 or 15 and budget left,
                          the run's bad nodes excluded) or end

Knobs come from the environment (sbatch/job.sh documents and defaults them). Lines are printed to
stdout, which is the job's output file.
"""

from __future__ import annotations

import argparse
import os
import shlex
import shutil
import signal
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from supervisor import options, slurm
from supervisor.format import events
from supervisor.format.atomic import hostname
from supervisor.format.badnodes import BadNodes, bad_hosts_line, read_bad_nodes, write_bad_nodes
from supervisor.format.eventnames import RequeueEvent
from supervisor.format.exitcodes import Exit
from supervisor.format.notice import DEFAULT_NOTICE_SIGNAL, NoticeSignalError, notice_signal
from supervisor.options import option
from supervisor.redact import redact
from supervisor.slurm import JobEnv, Knobs, SlurmError

Handler = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class LaunchOptions:
    """``slurm start`` and ``slurm launch``: the trainer command (the job's knobs are its environment
    variables, declared on ``supervisor.slurm.Knobs``)."""

    train: tuple[str, ...] = option("-- TRAINER ARGS (default: $TRAIN_ARGS)", (), rest=True)


@dataclass(frozen=True, kw_only=True)
class StartOptions(LaunchOptions):
    job_script: Path | None = option("the batch script (job.sh's $0), read for its --signal line", None)


@dataclass(frozen=True, kw_only=True)
class FinishOptions(LaunchOptions):
    exit_code: int = option("srun's exit code (the watchdogs' highest)")


@dataclass(frozen=True)
class TorchrunOptions:
    ignore_signal: str = option("the notice's signal", DEFAULT_NOTICE_SIGNAL)
    args: tuple[str, ...] = option("torchrun's arguments", (), rest=True)


def register(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser(
        "slurm",
        help="steps of sbatch/job.sh (start, rostered, launch, coordinate, finish)",
        description=__doc__,
    )
    verbs = p.add_subparsers(dest="verb", required=True)
    for name, (func, helptext, opts) in VERBS.items():
        v = verbs.add_parser(name, help=helptext)
        options.add_options(v, opts)
        v.set_defaults(func=_guarded(func))


def say(msg: str) -> None:
    """One line in the job's output, stamped like the watchdog's lines; URLs redacted (a trainer
    command's --remote or --remote-endpoint may carry credentials)."""
    print(f"[slurm {time.strftime('%Y-%m-%dT%H:%M:%SZ', time.gmtime())}] {redact(msg)}", flush=True)


def _guarded(func: Handler) -> Handler:
    """A problem the operator must fix (SlurmError, a bad notice signal) -> one line in the job's
    output (stdout, stamped like every line of these hooks, where cli.main would print it unstamped
    on stderr) and exit 2, no traceback."""

    def run(args: argparse.Namespace) -> int:
        try:
            return int(func(args))
        except (SlurmError, NoticeSignalError) as e:
            say(f"error: {e}")
            return Exit.USAGE

    return run


def _context(args: argparse.Namespace) -> tuple[JobEnv, Knobs]:
    train = list(args.train)
    if train[:1] == ["--"]:
        train = train[1:]
    return JobEnv.from_environ(os.environ), Knobs.from_environ(os.environ, train)


def _limits(knobs: Knobs) -> slurm.Budgets:
    return slurm.Budgets(preempt=knobs.max_preempt_requeues, failure=knobs.max_requeues)


def start(args: argparse.Namespace) -> int:
    job, knobs = _context(args)
    slurm.check_allocation(job, knobs)
    if knobs.requeue_signal != DEFAULT_NOTICE_SIGNAL and shutil.which("scancel") is None:
        raise SlurmError(
            f"REQUEUE_SIGNAL={knobs.requeue_signal} reaches the ranks through scancel (srun forwards only "
            "USR1 and USR2), and scancel is not on PATH; use REQUEUE_SIGNAL=USR1 or make scancel available"
        )
    state, note = slurm.load_requeue_state(knobs.run_dir, job, _limits(knobs))
    hosts, host_note = slurm.hostnames(job.nodelist)
    rdzv = slurm.rendezvous(job, knobs, hosts[0])
    say(
        f"job {job.job_id} start, SLURM_RESTART_COUNT={job.restart_count}, {job.num_nodes} node(s): "
        f"{','.join(hosts)}; run dir {knobs.run_dir}; {slurm.budget_line(state)}"
    )
    for line in (note, host_note):
        if line:
            say(line)
    ours = state.preempt_requeues + state.failure_requeues
    if job.restart_count > ours:
        say(
            f"SLURM restarted this job {job.restart_count} time(s), {ours} of them requeued "
            "by this script (the others by SLURM's preemption, a node failure or an operator)"
        )
    problem = _notice_problem(args.job_script, knobs.requeue_signal, knobs.run_dir)
    if problem:
        say(f"WARNING: job {job.job_id}: {problem}")
    partition = slurm.scontrol_show("partition", os.environ.get("SLURM_JOB_PARTITION", ""))
    stop_grace = knobs.stop_grace_s or slurm.TORCHRUN_TERM_WINDOW_S
    problem = slurm.grace_problem(partition, stop_grace)
    if problem:
        say(f"WARNING: job {job.job_id}: {problem}")
    if slurm.scontrol_path() is None:
        say(
            "WARNING: scontrol not found on PATH: this job cannot requeue itself; after a preemption or "
            "time-limit checkpoint it will end, and you resubmit it"
        )
    _say_bad_nodes(knobs, hosts)
    roster = slurm.roster_key(job) if knobs.rostered(job) else ""
    say(f"each node runs: {shlex.join(slurm.launch_command(knobs, rdzv, roster))}")
    slurm.save_requeue_state(
        knobs.run_dir, state.with_event(RequeueEvent.START, restart_count=job.restart_count, nodes=hosts)
    )
    return Exit.OK


def _bad_nodes(knobs: Knobs, then: str = "") -> BadNodes | None:
    """The run's bad-node list when a host is bad on it, else None (one that cannot be read is
    said, with ``then``: what follows from it)."""
    try:
        bad = read_bad_nodes(knobs.run_dir)
    except (OSError, ValueError) as e:
        say(f"bad-node list not readable ({e}){then}")
        return None
    return bad if bad is not None and bad.bad else None


def _say_bad_nodes(knobs: Knobs, hosts: list[str]) -> None:
    """The run's bad nodes, and those this allocation holds anyway (a fresh sbatch, or a requeue
    SLURM made itself): with spares they are left out while a spare can take their place."""
    bad = _bad_nodes(knobs)
    if bad is None:
        return
    say(f"the run's bad nodes: {bad_hosts_line(bad)}")
    here = sorted(set(bad.bad) & set(hosts))
    if here:
        what = (
            "left out of the launches while a spare can take their place"
            if knobs.spare_nodes
            else "used all the same (no spares); resubmit with --exclude to keep them out"
        )
        say(f"WARNING: this allocation holds bad nodes {', '.join(here)}: {what}")


def _notice_problem(script: Path | None, requeue_signal: str, run_dir: Path) -> str:
    """Why the job's notice can never arrive, or comes later than one checkpoint of this run
    takes (``slurm.lead_problem``), or ""."""
    try:
        spec, where = _job_signal(script)
    except OSError as e:
        return f"cannot read the job script {script} to check its --signal ({e})"
    if not where:
        return ""
    return slurm.notice_problem(spec, where, requeue_signal) or slurm.lead_problem(
        spec, where, slurm.last_save_time(run_dir)
    )


def _job_signal(script: Path | None) -> tuple[str | None, str]:
    """The job's --signal and where it was read: SBATCH_SIGNAL (it overrides the script's line),
    else the script's last ``#SBATCH --signal`` (None when it has none); (None, "") without a
    script. OSError when the script cannot be read."""
    env = os.environ.get("SBATCH_SIGNAL", "")
    if env:
        return env, "SBATCH_SIGNAL"
    if script is None:
        return None, ""
    return slurm.script_signal_spec(script.read_text(errors="replace")), f"#SBATCH lines of {script}"


def launch(args: argparse.Namespace) -> int:
    # A notice reaching this node before the watchdog installs its handler must not kill it; the
    # job script repeats the notice until the step ends, so ignoring one loses nothing.
    signal.signal(notice_signal(os.environ.get("REQUEUE_SIGNAL", "")), signal.SIG_IGN)
    job, knobs = _context(args)
    hosts, host_note = slurm.hostnames(job.nodelist)
    if host_note:
        say(host_note)
    roster = slurm.roster_key(job) if knobs.rostered(job) else ""
    cmd = slurm.launch_command(knobs, slurm.rendezvous(job, knobs, hosts[0]), roster)
    say(f"node {hostname()} (SLURM_NODEID={os.environ.get('SLURM_NODEID', '?')}): starting the watchdog")
    os.execvp(cmd[0], cmd)
    return Exit.USAGE  # not reached: exec replaced this process or raised


def coordinate(args: argparse.Namespace) -> int:
    job, knobs = _context(args)
    hosts, note = slurm.hostnames(job.nodelist)
    if note:
        say(note)
    code = slurm.Coordinator(job, knobs, hosts).coordinate()
    say(f"job {job.job_id}: the coordinator is done: job exit {code}")
    return code


def rostered(args: argparse.Namespace) -> int:
    """``1`` when a roster drives the job's launches (``Knobs.rostered``), else ``0``: job.sh's
    ROSTER, decided here once rather than again in bash."""
    job, knobs = _context(args)
    print(int(knobs.rostered(job)))
    return Exit.OK


def torchrun(args: argparse.Namespace) -> int:
    # SLURM delivers a step's signals to every process in it; torchrun has no handler for the
    # notice's signal and USR1 would kill it. Ignoring it here is inherited by torchrun and its
    # workers until the trainer installs its own handler.
    signal.signal(notice_signal(args.ignore_signal, "--ignore-signal"), signal.SIG_IGN)
    argv = list(args.args)
    if argv[:1] == ["--"]:
        argv = argv[1:]
    os.execv(sys.executable, [sys.executable, "-m", slurm.TORCHRUN_MODULE, *argv])
    return Exit.USAGE  # not reached


def finish(args: argparse.Namespace) -> int:
    job, knobs = _context(args)
    state, note = slurm.load_requeue_state(knobs.run_dir, job, _limits(knobs))
    if note:
        say(note)
    d = slurm.decide(args.exit_code, state.used, state.limits)
    why = _watchdog_reason(knobs) if args.exit_code not in (Exit.OK, Exit.REQUEUE_REQUESTED) else ""
    reason = f"{d.reason}: {why}" if why else d.reason
    if not d.requeue:
        say(f"job {job.job_id} ends: {reason} (exit {d.exit_code})")
        _record(knobs, state.with_event(RequeueEvent.END, exit_code=args.exit_code, reason=reason))
        return d.exit_code
    skip = slurm.why_not_requeue(slurm.scontrol_show("job", job.requeue_id), job.restart_count)
    if skip:
        say(f"job {job.job_id}: {reason}; {skip}: not requeueing it again")
        _record(knobs, state.with_event(RequeueEvent.REQUEUE_SKIPPED, exit_code=args.exit_code, reason=skip))
        return Exit.OK if skip.startswith("SLURM is requeueing") else args.exit_code
    # Count first: SLURM sends SIGTERM right after the requeue, and an uncounted requeue could
    # repeat forever. Where the count cannot be written (the storage is what failed, exit 14),
    # SLURM's own restart count bounds the requeues: load_requeue_state falls back to it.
    state = state.counted(d.kind).with_event(RequeueEvent.REQUEUE, exit_code=args.exit_code, reason=reason)
    _record(knobs, state)
    say(f"job {job.job_id}: {reason}; scontrol requeue {job.requeue_id}")
    # SLURM's SIGTERM follows the requeue at once; the exclusion comes after it (a running job's
    # ExcNodeList cannot be changed), so this process outlives that SIGTERM (KillWait's SIGKILL
    # comes seconds later; two scontrol calls take milliseconds).
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    try:
        slurm.scontrol_requeue(job.requeue_id)
    except SlurmError as e:
        say(f"error: {e}")
        _record(knobs, state.with_event(RequeueEvent.REQUEUE_FAILED, reason=str(e)))
        return args.exit_code
    _keep_bad_nodes_out(job, knobs, state)
    return d.exit_code


def _keep_bad_nodes_out(job: JobEnv, knobs: Knobs, state: slurm.RequeueState) -> None:
    """The requeued job excludes the run's bad nodes (``scontrol update JobId ExcNodeList``, added
    to what it excluded already); with BAD_NODE_ACTION=drain they are drained too."""
    bad = _bad_nodes(knobs, ": the requeued job excludes no node")
    if bad is None:
        return
    done = slurm.keep_out(job, sorted(bad.bad), knobs.bad_node_action, slurm.roster_key(job))
    for action in done.actions:
        bad = bad.did(action)
        say(f"job {job.job_id}: {action.what} {', '.join(action.hosts)}: {action.detail}")
        state = state.with_event(RequeueEvent(action.what), hosts=list(action.hosts), reason=action.detail)
    if done.actions:
        _record(knobs, state)
    for problem in done.problems:
        say(f"WARNING: {problem}")
    try:
        write_bad_nodes(knobs.run_dir, bad)
    except OSError as e:
        say(f"bad-node list not written ({e})")


def _record(knobs: Knobs, state: slurm.RequeueState) -> None:
    """Save the requeue count; a storage failure is said in the job's output, not fatal."""
    try:
        slurm.save_requeue_state(knobs.run_dir, state)
    except OSError as e:
        say(
            f"{slurm.requeue_path(knobs.run_dir)} not written ({e}); SLURM's restart count bounds the requeues"
        )


def _watchdog_reason(knobs: Knobs) -> str:
    """The first node's watchdog's last recorded reason, for the job's own last line."""
    try:
        st = events.read_state(events.state_path(knobs.run_dir, 0))
    except (ValueError, OSError):
        return ""
    return st.reason if st is not None else ""


# The verbs, their handlers (above) and their declared options.
VERBS: dict[str, tuple[Handler, str, type]] = {
    "start": (
        start,
        "log the start, check the knobs, record it in RUN_DIR/supervisor/slurm.json",
        StartOptions,
    ),
    "launch": (
        launch,
        "exec this node's watchdog + torchrun (run by srun, one task per node)",
        LaunchOptions,
    ),
    "coordinate": (
        coordinate,
        "watch the nodes: lost nodes, incidents, bad nodes, the spares' roster",
        LaunchOptions,
    ),
    "finish": (finish, "requeue the job or end it, from the watchdogs' exit code", FinishOptions),
    "rostered": (
        rostered,
        "print 1 when a roster drives the launches (spares, or --standby on several nodes), else 0",
        LaunchOptions,
    ),
    "torchrun": (
        torchrun,
        "exec torchrun with the notice's signal ignored (the watchdog's child)",
        TorchrunOptions,
    ),
}
