"""The watchdog's configuration and its defaults; light, so the CLI can build its parser without
importing the loop (``supervisor status`` must start fast)."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path

from supervisor import shared_options as shared
from supervisor.format.collectives import DEFAULT_FR_ENTRIES, ENV_FR_BUFFER
from supervisor.format.notice import notice_signal
from supervisor.options import NOT_NEGATIVE, POSITIVE, nested, option
from supervisor.watch.liveness import DEFAULT_LEARN_FLOOR_S, PhaseTimeouts
from supervisor.watch.restart_policy import RestartPolicy
from supervisor.watch.stragglers import DEFAULT_FACTOR, DEFAULT_HOLD, DEFAULT_WINDOW

# torchrun + gloo: a restarted group that reuses the agent's TCPStore hangs or fails to connect
# (see docs/watchdog.md); set in the child's environment unless the operator set it.
SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# Set per launch (layout: supervisor/launches/<id>/): where a rank's @record (or Resumable) writes
# the exception that ended it, and torchrun's log dir (unless the operator set one), which holds
# each worker's.
ELASTIC_LOG_DIR_ENV = "PET_LOG_DIR"
DEFAULT_POLL_S = 0.5
DEFAULT_KILL_GRACE_S = 10.0
# Only a bound for a rank that never answers (its handler cannot run, its reporter thread cannot get
# the GIL): each wait ends as soon as every rank has answered. Generous, for a reporter thread starved
# of CPU on a loaded node (the answers lost at 2 s were most likely ranks killed by the dump racing
# the answer, which hangs.py now orders).
DEFAULT_DUMP_WAIT_S = 10.0
# The buddy replica's bandwidth cap: a tenth of a 100 Gb/s link, a snapshot of 10 GB in 8 s.
DEFAULT_REPLICA_MB_S = 1250.0
# With --remote and nothing valid locally, how long to wait for an unreachable remote before giving up.
DEFAULT_REMOTE_WAIT_S = 600.0
# After SIGKILL, how long to wait for the tree to be reaped before naming what is left (a process
# in state D on a hung mount cannot die until its I/O returns) and going on without it. A GPU
# process can take seconds to release its memory after SIGKILL.
DEFAULT_REAP_TIMEOUT_S = 30.0
# A rank gone without an exit code while others still run is dead after this; it covers the
# spread of ranks that exit 0 together but could not write their last heartbeat (a full disk).
DEFAULT_DEAD_RANK_GRACE_S = 1.0
# The node summary (heartbeats/node_NNNNN.json) is rewritten this often: one write per node per
# interval on the shared filesystem; status sees a rank's news at most this late.
DEFAULT_SUMMARY_INTERVAL_S = 5.0
# A preemption notice waits this long for ranks' heartbeats before going to the ranks found in /proc.
DEFAULT_PREEMPT_FALLBACK_S = 10.0


# Help sections of ``watch --help``.
HANG = "hang detection (seconds without progress, per phase: a long phase that progresses is no hang)"
STORAGE = "storage"
RESTARTS = "restart policy"
REMOTE = "remote tier (docs/tiers.md); pass the same --remote to the trainer"
STRAGGLERS = "stragglers (node 0's watchdog judges every rank's recent steps; docs/watchdog.md#stragglers)"


def _factor(value: float) -> str:
    """A factor of 1 or less would flag a rank no slower than its peers."""
    return "" if value == 0 or value > 1 else "must be above 1 (0: never flag)"


def parse_notice_signal(raw: str) -> signal.Signals:
    return notice_signal(raw, "--notice-signal")


@dataclass(frozen=True)
class WatchConfig:
    """Everything the watchdog is told; each option field is its ``watch`` flag (supervisor.options)."""

    root: Path = shared.ckpt_root()
    command: tuple[str, ...] = ()  # the positional COMMAND, not an option (cli/watch.py refuses none)
    deep_verify: bool = option(
        "check before each relaunch", False, flag="--verify", choices={"quick": False, "deep": True}
    )
    timeouts: PhaseTimeouts = nested(PhaseTimeouts, HANG)
    learn_factor: float | None = option(  # None: no learned train timeout
        "train timeout = max observed step time x FACTOR (at least --learn-floor) once steps are seen",
        None,
        flag="--learn-hang-timeout",
        metavar="FACTOR",
        group=HANG,
    )
    learn_floor_s: float = option(
        "the least learned train timeout, in seconds",
        DEFAULT_LEARN_FLOOR_S,
        flag="--learn-floor",
        group=HANG,
    )
    poll_s: float = option(
        "heartbeat check period (a silent rank is also checked the moment its timeout runs out)",
        DEFAULT_POLL_S,
        flag="--poll-interval",
        check=POSITIVE,
        group=HANG,
    )
    dump_wait_s: float = option(
        "wait for stack dumps, then as long for the ranks' collectives",
        DEFAULT_DUMP_WAIT_S,
        flag="--dump-wait",
        group=HANG,
    )
    flight_recorder: int = option(
        f"collectives torch's flight recorder keeps per rank ({ENV_FR_BUFFER}, set for each launch "
        "unless the environment sets it): on a hang the ranks report theirs, and the verdict names "
        "the collective they are stuck in and the rank that never entered it; 0: off",
        DEFAULT_FR_ENTRIES,
        metavar="ENTRIES",
        check=NOT_NEGATIVE,
        group=HANG,
    )
    kill_grace_s: float = option("SIGTERM to SIGKILL", DEFAULT_KILL_GRACE_S, flag="--kill-grace", group=HANG)
    # When the watchdog itself is told to stop (SIGTERM: a preemption with PreemptMode=REQUEUE
    # signals every process of the step), its ranks get this long to checkpoint; None: kill_grace_s.
    stop_grace_s: float | None = option(
        "when the watchdog itself gets SIGTERM/SIGINT: SIGTERM to SIGKILL for its ranks, room for "
        "their checkpoint (default: --kill-grace)",
        None,
        flag="--stop-grace",
        metavar="SECONDS",
        check=POSITIVE,
        group=HANG,
    )
    reap_timeout_s: float = option(
        "after SIGKILL, seconds to wait before naming what could not be reaped (state D) and going on",
        DEFAULT_REAP_TIMEOUT_S,
        flag="--reap-timeout",
        check=NOT_NEGATIVE,
        group=HANG,
    )
    dead_rank_grace_s: float = option(
        "seconds a rank gone without an exit code may be a clean exit before it counts as dead",
        DEFAULT_DEAD_RANK_GRACE_S,
        flag="--dead-rank-grace",
        check=NOT_NEGATIVE,
        group=HANG,
    )
    # The preemption notice's signal: taken from SLURM (through srun) and forwarded to the ranks.
    notice_signal: int = option(
        "the preemption notice's signal, taken and forwarded to the ranks: USR1 or URG",
        signal.SIGUSR1,
        parse=parse_notice_signal,
        metavar="SIG",
        group=HANG,
    )
    preempt_fallback_s: float = option(
        "seconds a preemption notice waits for heartbeats before going to the ranks found in /proc",
        DEFAULT_PREEMPT_FALLBACK_S,
        flag="--preempt-fallback",
        check=NOT_NEGATIVE,
        group=HANG,
    )
    io_retry_s: float = shared.io_retry("exit 14 (before a relaunch)", group=STORAGE)
    allow_fresh_start: bool = shared.allow_fresh_start(
        "relaunch from step 0 (pass the trainer's --allow-fresh-start too)", group=STORAGE
    )
    policy: RestartPolicy = nested(RestartPolicy, RESTARTS)
    reset_budget: bool = option("forget restarts recorded in state.json", False, group=RESTARTS)
    node: int = option(
        "this node's index (default $SLURM_NODEID or 0); node N>0 keeps state.nodeN.json",
        0,
        flag="--node-rank",
        env="SLURM_NODEID",
    )
    share_store_fix: bool = option(
        f"do not set {SHARE_STORE_ENV}=1 in the child's environment (set where torchrun may restart its "
        "ranks itself: more than one node, or --max-restarts above 0)",
        True,
        flag="--no-share-store-fix",
    )
    remote: str | None = option(  # URL of the remote tier (docs/tiers.md); None: local only
        "shared directory or s3://bucket/prefix to resume from after node loss", None, group=REMOTE
    )
    remote_endpoint: str | None = shared.remote_endpoint(group=REMOTE)
    remote_wait_s: float = option(
        "seconds to retry an unreachable remote when nothing local is valid, then stop",
        DEFAULT_REMOTE_WAIT_S,
        flag="--remote-wait",
        group=REMOTE,
    )
    # Base of the node-local heartbeat folders (layout.node_heartbeat_dir); None: layout.node_local_base().
    node_dir: Path | None = option(
        "node-local base folder of the ranks' heartbeats (default $SUPERVISOR_NODE_DIR, else /dev/shm, "
        "else $TMPDIR); the watchdog publishes them as one summary per node into DIR/heartbeats/",
        None,
        flag="--node-dir",
        metavar="BASE",
        group=HANG,
    )
    summary_interval_s: float = option(
        "seconds between two writes of the node summary to the run directory",
        DEFAULT_SUMMARY_INTERVAL_S,
        flag="--summary-interval",
        metavar="SECONDS",
        check=POSITIVE,
        group=HANG,
    )
    metrics_file: Path | None = option(
        "keep this node_exporter textfile (NAME.prom) current with the run's metrics: step, steps/s, "
        "launches, restarts, recovery by phase, checkpoint age, quarantined (docs/cli.md#metrics)",
        None,
        metavar="PATH",
    )
    metrics_interval_s: float = option(
        "seconds between two writes of --metrics-file",
        15.0,
        flag="--metrics-interval",
        metavar="SECONDS",
        check=POSITIVE,
    )
    # --signing-key's key (docs/security.md): picks skip checkpoints not signed with it. Never printed.
    sign_key: bytes | None = field(default=None, repr=False)
    require_heartbeat: bool = option(
        "a launch that writes no heartbeat within --startup-timeout is hung (a rendezvous that never "
        "returns); without it, a command that writes none is judged on its exit code alone",
        False,
        group=HANG,
    )
    memory_tier: bool = option(
        "keep each step's whole state in node-local shared memory (the ranks copy it there; this "
        "watchdog owns it, picks from it before a relaunch, removes it at the end), every step or "
        "every N so the copy costs at most 3 percent: a relaunch redoes at most N - 1 steps; a rank "
        "whose two slots would leave less than a quarter of the node's memory (or its cgroup's) "
        "takes none (default; docs/tiers.md#the-memory-tier)",
        True,
        off="--no-memory-tier",
        group=RESTARTS,
    )
    nodes: int = option(
        "nodes in the job (default $SLURM_JOB_NUM_NODES or 1): with the memory tier on and more than one, "
        "each node's watchdog keeps a replica of the next node's memory snapshots (its buddy: node "
        "i+1's of node i, in a ring)",
        1,
        env="SLURM_JOB_NUM_NODES",
        check=POSITIVE,
        group=RESTARTS,
    )
    replica_bandwidth: float = option(
        "MB a second at most for pushing this node's memory snapshot to its buddy's replica, so it "
        "never crowds the training network (0: no cap)",
        DEFAULT_REPLICA_MB_S,
        flag="--replica-bandwidth",
        metavar="MB_S",
        check=NOT_NEGATIVE,
        group=RESTARTS,
    )
    roster: str | None = option(
        "launch only as the run's roster (supervisor/roster.json) with this key says: this node at its "
        "node rank, or waiting as a spare with its standby's imports done; written by the SLURM job's "
        "coordinator (docs/slurm.md#hot-spares); COMMAND is a --standalone torchrun whose ranks join the "
        "group at supervisor.resumable.wait_if_standby",
        None,
        metavar="KEY",
        group=RESTARTS,
    )
    straggler_factor: float = option(
        "flag a rank whose own compute per step is FACTOR times its peers' median, or that arrives "
        "that late at the step boundary, over --straggler-window steps (0: never)",
        DEFAULT_FACTOR,
        metavar="FACTOR",
        check=_factor,
        group=STRAGGLERS,
    )
    straggler_window: int = option(
        "the steps each rank is judged on (their trimmed mean)",
        DEFAULT_WINDOW,
        metavar="STEPS",
        check=POSITIVE,
        group=STRAGGLERS,
    )
    straggler_hold: int = option(
        "judgements in a row, each on a newer window, that must score a rank --straggler-factor or "
        "more before it is flagged (one busy second fills a window of short steps)",
        DEFAULT_HOLD,
        metavar="TIMES",
        check=POSITIVE,
        group=STRAGGLERS,
    )
    standby: bool = option(
        "keep the next launch started ahead of a failure, its ranks waiting with their imports done "
        "(the gate at import supervisor.resumable), and release it on a relaunch; a torchrun of more than "
        "one node is refused (its standby would join the running launch's rendezvous): across nodes the "
        "SLURM roster keeps each node's standby and releases them together (SPARE_NODES)",
        False,
        group=RESTARTS,
    )
