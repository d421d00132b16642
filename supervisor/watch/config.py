"""The watchdog's configuration and its defaults; light, so the CLI can build its parser without
importing the loop (``supervisor status`` must start fast)."""

from __future__ import annotations

import signal
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.ioerrors import IO_RETRY_S
from supervisor.watch import restart_policy
from supervisor.watch.restart_policy import PhaseTimeouts, RestartPolicy

# torchrun + gloo: a restarted group that reuses the agent's TCPStore hangs or fails to connect
# (see docs/watchdog.md); set in the child's environment unless the operator set it.
SHARE_STORE_ENV = "TORCH_DISABLE_SHARE_RDZV_TCP_STORE"
# Set per launch (layout: supervisor/launches/<id>/): where a rank's @record writes the exception
# that ended it, and torchrun's log dir (unless the operator set one), which holds each worker's.
ELASTIC_ERROR_FILE_ENV = "TORCHELASTIC_ERROR_FILE"
ELASTIC_LOG_DIR_ENV = "PET_LOG_DIR"
DEFAULT_POLL_S = 0.5
DEFAULT_KILL_GRACE_S = 10.0
DEFAULT_DUMP_WAIT_S = 2.0
# With --remote and nothing valid locally, how long to wait for an unreachable remote before giving up.
DEFAULT_REMOTE_WAIT_S = 600.0
# After SIGKILL, how long to wait for the tree to be reaped before naming what is left (a process
# in state D on a hung mount cannot die until its I/O returns) and going on without it. A GPU
# process can take seconds to release its memory after SIGKILL.
DEFAULT_REAP_TIMEOUT_S = 30.0
# A rank gone without an exit code while others still run is dead after this; it covers the
# spread of ranks that exit 0 together but could not write their last heartbeat (a full disk).
DEFAULT_DEAD_RANK_GRACE_S = 1.0
# A preemption notice waits this long for ranks' heartbeats before going to the ranks found in /proc.
DEFAULT_PREEMPT_FALLBACK_S = 10.0


@dataclass(frozen=True)
class WatchConfig:
    root: Path
    command: tuple[str, ...]
    node: int = 0
    deep_verify: bool = False
    timeouts: PhaseTimeouts = field(default_factory=PhaseTimeouts)
    learn_factor: float | None = None  # None: no learned train timeout
    learn_floor_s: float = restart_policy.DEFAULT_LEARN_FLOOR_S
    policy: RestartPolicy = field(default_factory=RestartPolicy)
    kill_grace_s: float = DEFAULT_KILL_GRACE_S
    # When the watchdog itself is told to stop (SIGTERM: a preemption with PreemptMode=REQUEUE
    # signals every process of the step), its ranks get this long to checkpoint; None: kill_grace_s.
    stop_grace_s: float | None = None
    dump_wait_s: float = DEFAULT_DUMP_WAIT_S
    poll_s: float = DEFAULT_POLL_S
    reset_budget: bool = False
    share_store_fix: bool = True
    remote: str | None = None  # URL of the remote tier (docs/tiers.md); None: local only
    remote_endpoint: str | None = None
    remote_wait_s: float = DEFAULT_REMOTE_WAIT_S
    io_retry_s: float = IO_RETRY_S  # transient storage errors are retried this long, then exit 14
    allow_fresh_start: bool = False  # start from step 0 although the run has quarantined checkpoints
    reap_timeout_s: float = DEFAULT_REAP_TIMEOUT_S
    dead_rank_grace_s: float = DEFAULT_DEAD_RANK_GRACE_S
    preempt_fallback_s: float = DEFAULT_PREEMPT_FALLBACK_S
    # The preemption notice's signal: taken from SLURM (through srun) and forwarded to the ranks.
    notice_signal: int = signal.SIGUSR1
    # --signing-key's key (docs/security.md): picks skip checkpoints not signed with it. Never printed.
    sign_key: bytes | None = field(default=None, repr=False)
    require_heartbeat: bool = field(
        default=False,
        metadata={
            "help": "a launch that writes no heartbeat within --startup-timeout is hung (a rendezvous "
            "that never returns); without it, a command that writes none is judged on its exit code alone"
        },
    )

    standby: bool = field(
        default=False,
        metadata={
            "help": "keep the next launch started ahead of a failure, its ranks waiting with their imports "
            "done (train_ref's standby gate), and release it on a relaunch; single-node or --standalone "
            "torchrun only (a standby must not join the running job's rendezvous)"
        },
    )


def help_of(name: str) -> str:
    """The help of a WatchConfig field, for its command-line option."""
    return str(WatchConfig.__dataclass_fields__[name].metadata["help"])
