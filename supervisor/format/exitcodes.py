"""Exit codes shared by the trainer, the watchdog and the login-node commands (see README).

torchrun reports 1 for any failed worker, so the trainer also records its deliberate exit code in
its last heartbeat (``exit_code``); the watchdog reads it from there to classify a launch.
"""

from __future__ import annotations

from enum import IntEnum


class Exit(IntEnum):
    OK = 0
    # Login-node commands: a check found a problem (verify: an invalid checkpoint; pick: none valid).
    FOUND_PROBLEM = 1
    # Any command: bad usage or bad input (missing root, not a run dir, unreadable file).
    USAGE = 2
    # Login-node commands: storage could not be read (a transient I/O error, not proof of
    # corruption: verify found a checkpoint unknown; pick's retries ran out). Nothing was moved for
    # it; retry later, or move the checkpoint aside with `ckpt quarantine` if it stays unreadable.
    UNREADABLE = 3
    # Trainer: the checkpoint was made for another model config or data (not corruption).
    MISMATCH = 65
    # Trainer (sysexits EX_NOINPUT): no usable checkpoint, but the run has history (quarantined
    # checkpoints); starting from step 0 needs --allow-fresh-start. Not retryable.
    NO_USABLE_CHECKPOINT = 66
    # Trainer (sysexits EX_IOERR): storage failed beyond the trainer's policy (e.g. the resume's
    # pick met unreadable checkpoints past --io-retry). Committed checkpoints are intact; retryable.
    STORAGE = 74
    # Trainer (sysexits EX_NOPERM): refused to load a checkpoint that would have run code (DCP's
    # .metadata or a pickled state item names something outside its allowlist; docs/security.md).
    # Not retryable: nothing of it was run, a person must look at it.
    UNTRUSTED = 77
    # Trainer (sysexits EX_PROTOCOL): a rank gave up waiting for its peers in one of a save's
    # exchanges (bounded at half the save/commit timeout): a peer is stuck, or the ranks are in
    # different collectives. The watchdog takes it as a hang of the launch (stack dumps, the
    # culprit named, a relaunch). Retryable.
    WAIT_GAVE_UP = 76
    # Trainer: bad configuration (unknown config name, impossible batch split...).
    BAD_CONFIG = 78
    # Trainer: preempted; a checkpoint was saved at the step boundary. Relaunch / requeue me.
    REQUEUE = 75
    # Watchdog: restart budget (total or windowed rate) exhausted.
    BUDGET_EXHAUSTED = 10
    # Watchdog: K launches in a row ended without committing a newer checkpoint.
    NO_PROGRESS = 11
    # Watchdog: the child failed with a non-retryable code; the reason is in the event log.
    CHILD_NONRETRYABLE = 12
    # Watchdog: preempted and the child checkpointed; the caller (SLURM job) should requeue.
    REQUEUE_REQUESTED = 13
    # Watchdog: storage stayed unreadable or unwritable past its retry window (its own pick before
    # a relaunch, or launches that kept ending 74 without a newer checkpoint). Committed
    # checkpoints are intact; the caller (SLURM job) requeues it like 13, against its budget.
    STORAGE_UNAVAILABLE = 14


NON_RETRYABLE = frozenset(
    {Exit.USAGE, Exit.MISMATCH, Exit.NO_USABLE_CHECKPOINT, Exit.UNTRUSTED, Exit.BAD_CONFIG}
)
