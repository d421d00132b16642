"""Exit codes shared by the trainer, the watchdog and the login-node commands, with what each
means to whoever gets it (``MEANINGS``: README's exit-code table is generated from it,
supervisor/docgen.py).

torchrun reports 1 for any failed worker, so the trainer also records its deliberate exit code in
its last heartbeat (``exit_code``); the watchdog reads it from there to classify a launch.
"""

from __future__ import annotations

from dataclasses import dataclass
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
    # Watchdog (--roster): a training node of the job was lost and no spare was left to take its
    # place; the caller (SLURM job) requeues it against its failure budget, bad nodes excluded.
    NODE_LOST = 15


NON_RETRYABLE = frozenset(
    {Exit.USAGE, Exit.MISMATCH, Exit.NO_USABLE_CHECKPOINT, Exit.UNTRUSTED, Exit.BAD_CONFIG}
)


@dataclass(frozen=True)
class Meaning:
    code: str  # the number, or a pattern ("128+N")
    who: str  # which program exits with it
    text: str


def _m(code: Exit | str, who: str, text: str) -> Meaning:
    return Meaning(str(int(code)) if isinstance(code, Exit) else code, who, text)


MEANINGS: tuple[Meaning, ...] = (
    _m(Exit.OK, "all", "done / ok"),
    _m(
        Exit.FOUND_PROBLEM,
        "`ckpt verify`, `ckpt pick`, `drill`",
        "a check found a problem (an invalid or, with `--signing-key`, untrusted checkpoint; no valid "
        "one; a drill check failed: `drill --json` says which)",
    ),
    _m(
        "1",
        "trainer",
        "a crash (torchrun reports 1 for any failed worker; the heartbeat's `exit_code` says more)",
    ),
    _m(
        Exit.USAGE,
        "all but `watch`",
        "bad usage or bad input: one line names the path and the fix (`watch`: bad options only); "
        "`ckpt rollback` refused: nothing changed",
    ),
    _m(
        Exit.UNREADABLE,
        "`ckpt`",
        "storage could not be read (an I/O error, not proof of corruption; `pick` retried it for "
        "`--io-retry`): nothing moved; retry later",
    ),
    _m(Exit.BUDGET_EXHAUSTED, "`watch`", "restart budget exhausted (total, or N per window)"),
    _m(
        Exit.NO_PROGRESS,
        "`watch`",
        "no progress: K launches in a row without a newer checkpoint, or dying at the same step",
    ),
    _m(
        Exit.CHILD_NONRETRYABLE,
        "`watch`",
        f"the child failed non-retryably ({', '.join(str(int(c)) for c in sorted(NON_RETRYABLE))}), "
        "or COMMAND cannot be started",
    ),
    _m(
        Exit.REQUEUE_REQUESTED,
        "`watch --requeue-exit`",
        "preempted and checkpointed: requeue the job (`sbatch/job.sh` does, against `MAX_PREEMPT_REQUEUES`)",
    ),
    _m(
        Exit.STORAGE_UNAVAILABLE,
        "`watch`",
        "storage unavailable past `--io-retry`: committed checkpoints intact; requeue the job "
        "(`sbatch/job.sh` does, against `MAX_REQUEUES`)",
    ),
    _m(
        Exit.NODE_LOST,
        "`watch --roster`",
        "a training node was lost and no spare was left: requeue the job (`sbatch/job.sh` does, "
        "against `MAX_REQUEUES`, its bad nodes excluded)",
    ),
    _m(
        Exit.MISMATCH,
        "trainer",
        "refused: the checkpoint was made for another model config or data (the fields named; nothing moved)",
    ),
    _m(
        Exit.NO_USABLE_CHECKPOINT,
        "trainer",
        "no usable checkpoint, but some are quarantined (or unsigned with `--signing-key`): "
        "not starting from step 0 without `--allow-fresh-start`",
    ),
    _m(
        Exit.STORAGE,
        "trainer",
        "storage failed: unreadable past `--io-retry` at resume, saves failing past "
        "`--max-failed-saves` / `--max-unsaved-s`, or a preemption's checkpoint failed (retryable)",
    ),
    _m(
        Exit.REQUEUE,
        "trainer",
        "preempted (SIGTERM, SIGUSR1 or `$REQUEUE_SIGNAL`): the last step's checkpoint committed; relaunch",
    ),
    _m(
        Exit.WAIT_GAVE_UP,
        "trainer",
        "a rank gave up waiting for its peers in one of a save's exchanges (each bounded at half the "
        "save/commit timeout): a peer died, is stuck or is in another collective; the watchdog takes "
        "it as a hang (stacks, culprit) and relaunches",
    ),
    _m(
        Exit.UNTRUSTED,
        "trainer",
        "refused a checkpoint whose `.metadata` or a pickled item would have run code (one line names "
        "the file; nothing of it ran) [docs/security.md](docs/security.md)",
    ),
    _m(Exit.BAD_CONFIG, "trainer", "bad configuration"),
    _m("128+N", "`watch`", "stopped by signal N"),
)
