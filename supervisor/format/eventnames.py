"""Every event name the logs (``supervisor/events*.jsonl``) and the SLURM job's history
(``supervisor/slurm.json``) hold, in one place (docs/watchdog.md, docs/tiers.md, docs/slurm.md
describe them). Import-free, so the pure policy module names events too."""

from __future__ import annotations

from enum import Enum


class EventName(str, Enum):
    """A str Enum: JSON holds, and comparisons see, the plain value ("pick"), as before."""

    # The watchdog's (events.jsonl)
    WATCHDOG_START = "watchdog_start"
    PICK = "pick"
    LAUNCH = "launch"
    LAUNCH_END = "launch_end"
    KILL = "kill"
    STOP = "stop"
    RANK_DIED = "rank_died"
    BLOCKED_IO = "blocked_io"
    HANG = "hang"
    STACK_DUMP = "stack_dump"
    RELAUNCH = "relaunch"
    EXIT = "exit"
    PREEMPT = "preempt"
    QUARANTINE = "quarantine"
    UNTRUSTED = "untrusted"
    IO_RETRY = "io_retry"
    STATE_UNREADABLE = "state_unreadable"
    REMOTE_UNAVAILABLE = "remote_unavailable"
    SAVE_FAILED = "save_failed"
    SAVE_RECOVERED = "save_recovered"
    ROOT_CAUSE = "root_cause"  # the exception that ended a launch (torchelastic's error files)
    STANDBY = "standby"  # the next launch started ahead of a failure (--standby)
    RECOVERY = "recovery"  # a relaunch's phases, from the failure's verdict to the first step
    HEARTBEAT_DIR = "heartbeat_dir"  # where this node's ranks write their heartbeats, and why there
    MEMORY_DIR = "memory_dir"  # where this node's memory snapshots live (the memory tier), or why none
    MEMORY_SWEPT = "memory_swept"  # memory folders of watchdogs gone without their cleanup, removed at start
    MEMORY_PICK = "memory_pick"  # a relaunch resumes from a memory snapshot
    MEMORY_FALLBACK = "memory_fallback"  # a memory snapshot could not be used: the reason, then the disk
    REPLICA = "replica"  # the buddy replica: this node's receiver listens, or why there is none
    REPLICA_PUSHED = "replica_pushed"  # this node's snapshot kept by its buddy (the first, then each minute)
    REPLICA_FAILED = "replica_failed"  # a push to the buddy failed (each new reason once)
    REPLICA_SERVED = "replica_served"  # the receiver refused a push, or answered a pull
    STRAGGLER = "straggler"  # the judge (node 0) flags a rank: it computes, or arrives, late (stragglers.py)
    STRAGGLER_CLEARED = "straggler_cleared"  # a flagged rank keeps up again
    ROSTER = "roster"  # --roster: this node trains in a roster generation, at a node rank
    SPARE = "spare"  # --roster: this node waits as a spare in a generation (or is left out)
    # The SLURM job's coordinator's (events.job.jsonl; docs/slurm.md#hot-spares)
    GENERATION = "generation"  # a roster generation written (who trains, the spares), or its stop
    NODE_LOST = "node_lost"  # a node's watchdog silent past NODE_TIMEOUT_S, or its slurmd down
    INCIDENT = "incident"  # a failure pinned on a host, with the evidence
    BAD_NODE = "bad_node"  # a host reached BAD_NODE_INCIDENTS incidents
    BAD_NODES_UNREADABLE = "bad_nodes_unreadable"  # the bad-node list could not be read or written
    JOB_EXIT = "job_exit"  # every live node's watchdog ended: the job's exit code
    # Picking across tiers (the watchdog's log; the trainer's events.remote.jsonl when it picks)
    DOWNLOAD_WAIT = "download_wait"
    DOWNLOADED = "downloaded"
    LOCAL_QUARANTINED = "local_quarantined"
    REMOTE_QUARANTINED = "remote_quarantined"
    REMOTE_UNREACHABLE = "remote_unreachable"
    # The uploader's, in the trainer (events.remote.jsonl)
    UPLOAD_OK = "upload_ok"
    UPLOAD_SKIPPED = "upload_skipped"
    UPLOAD_REFUSED = "upload_refused"
    UPLOAD_DEFERRED = "upload_deferred"
    REMOTE_DOWN = "remote_down"
    REMOTE_BACK = "remote_back"
    REMOTE_PRUNED = "remote_pruned"
    LOCAL_PRUNED = "local_pruned"

    def __str__(self) -> str:
        return self.value


class RequeueEvent(str, Enum):
    """The SLURM job's history in ``supervisor/slurm.json`` (``supervisor slurm start|end``)."""

    START = "start"  # a job (or a requeued run of it) started
    END = "end"  # it ended without a requeue
    REQUEUE = "requeue"  # it asked SLURM to requeue it (counted against a budget)
    REQUEUE_SKIPPED = "requeue_skipped"  # a requeue was due, but not done (the reason says why)
    REQUEUE_FAILED = "requeue_failed"  # scontrol requeue failed
    EXCLUDED = "excluded"  # the requeued job excludes the run's bad nodes (scontrol update ExcNodeList)
    DRAINED = "drained"  # bad nodes drained (BAD_NODE_ACTION=drain)

    def __str__(self) -> str:
        return self.value
