"""How a rank stops on purpose, and the one line it says: the exit code into its heartbeat (torchrun
itself reports only 1; the watchdog classifies ours), the line on rank 0, never a traceback.
"""

from __future__ import annotations

import errno
import logging
import os
import sys
from pathlib import Path

import torch.distributed as dist

from supervisor.errors import Program, ToolkitError, exit_code
from supervisor.format.exitcodes import Exit
from supervisor.format.heartbeat import HeartbeatWriter, Phase
from supervisor.store.ioerrors import describe

__all__ = ["deliberate_exit", "refuse_start", "run_dir", "tell", "trainer_code"]

log = logging.getLogger("resumable")


def tell(line: str) -> None:
    """A line every operator needs (where the run resumed from, and what was checked), on rank 0:
    through the ``resumable`` logger when the trainer's logging shows it, else on stderr; once
    either way, whatever the trainer did or did not configure."""
    if log.isEnabledFor(logging.INFO) and log.hasHandlers():
        log.info("%s", line)
    else:
        print(f"resumable: {line}", file=sys.stderr, flush=True)


def deliberate_exit(
    hb: HeartbeatWriter, rank: int, step: int, phase: Phase, code: Exit, msg: str = ""
) -> int:
    """Record a deliberate exit code in the heartbeat (torchrun itself reports only 1); rank 0
    says ``msg`` on stderr."""
    if msg and rank == 0:
        print(f"resumable: {msg}", file=sys.stderr, flush=True)
    hb.beat(step, phase, exit_code=int(code))
    return int(code)


def trainer_code(e: ToolkitError) -> Exit:
    """The trainer's exit code for one of the toolkit's errors (supervisor/errors.py's table)."""
    return exit_code(e, Program.TRAINER)


# A run directory that cannot be made for these is the storage's trouble (74: retried); for any
# other reason (a file in the way, no permission, read-only) the command line's (78).
_STORAGE_DID_NOT_ANSWER = frozenset(
    {errno.EIO, errno.ESTALE, errno.ETIMEDOUT, errno.EAGAIN, errno.ENOSPC, errno.EDQUOT, errno.EINTR}
)


def run_dir(root: str | Path) -> Path:
    """The run directory, made if missing; one that cannot be used stops the rank with one line
    naming it and the fix (exit 78, or 74 when the storage did not answer: retried), never a
    traceback. Nothing can be recorded in it, so the line is all there is."""
    path = Path(root)
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        code = Exit.STORAGE if e.errno in _STORAGE_DID_NOT_ANSWER else Exit.BAD_CONFIG
        print(
            f"resumable: {path}: cannot use it as the run directory ({describe(e)}); "
            "give --ckpt-root a directory this rank can create and write",
            file=sys.stderr,
            flush=True,
        )
        raise SystemExit(int(code)) from None
    return path


def refuse_start(root: str | Path, message: str, code: Exit = Exit.BAD_CONFIG) -> int:
    """A refusal before a ``Resumable`` exists (a config this rank cannot train with), on every
    rank after ``init_process_group``: the exit code into this rank's heartbeat (the watchdog
    classifies it: 78 is not retried), ``message`` on rank 0's stderr. Returns the code to exit with."""
    rank = dist.get_rank()
    hb = HeartbeatWriter(
        run_dir(root),
        rank=rank,
        local_rank=int(os.environ.get("LOCAL_RANK", "0")),
        world_size=dist.get_world_size(),
    )
    return deliberate_exit(hb, rank, 0, Phase.STARTUP, code, message)
