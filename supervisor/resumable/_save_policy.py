"""Failed saves: what one says (one line) and when to stop trying. Pure; tested without processes.

A save that fails (a full disk, a quota, EIO on any rank, a rank's file missing from the
committer's view) commits nothing: the newest committed checkpoint is still there, so going on
training costs only the steps a crash would now have to redo. The policy bounds that cost: after
``max_failed_saves`` failed saves in a row, or ``max_unsaved_s`` seconds without a durable
checkpoint, the launch stops with exit 74 (STORAGE, retryable) instead of training on while
nothing it does can be kept.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from torch.distributed.checkpoint.api import CheckpointException

from supervisor.store import IncompleteCommit
from supervisor.store.ioerrors import describe

DEFAULT_MAX_FAILED_SAVES = 3


@dataclass(frozen=True)
class SavePolicy:
    max_failed_saves: int = DEFAULT_MAX_FAILED_SAVES  # failed saves in a row that stop the launch
    max_unsaved_s: float = 0.0  # seconds without a durable checkpoint that stop it (0: no limit)

    def problem(self) -> str:
        """What is wrong with these values (one line naming the flag), or ''."""
        if self.max_failed_saves < 1:
            return f"--max-failed-saves {self.max_failed_saves}: give at least 1"
        if self.max_unsaved_s < 0:
            return f"--max-unsaved-s {self.max_unsaved_s:g}: give a number of seconds >= 0 (0: no limit)"
        return ""


def give_up(policy: SavePolicy, failures: int, unsaved_s: float) -> str:
    """Why the launch must stop now ('' to go on), after ``failures`` failed saves in a row with
    the last durable checkpoint (or the launch's start) ``unsaved_s`` seconds ago. Only a failed
    save can stop a launch: while saves succeed, nothing is unsaved for long."""
    if failures <= 0:
        return ""
    if failures >= policy.max_failed_saves:
        return f"{failures} saves failed in a row (--max-failed-saves {policy.max_failed_saves})"
    if policy.max_unsaved_s > 0 and unsaved_s >= policy.max_unsaved_s:
        return (
            f"no durable checkpoint for {unsaved_s:.0f}s after {failures} failed "
            f"save{'s' if failures > 1 else ''} (--max-unsaved-s {policy.max_unsaved_s:g})"
        )
    return ""


@dataclass(frozen=True)
class SaveError:
    """One rank's reason a save failed, as the ranks exchange it (picklable, one line)."""

    rank: int
    reason: str

    def __str__(self) -> str:
        return f"rank {self.rank}: {self.reason}"


def save_error(e: OSError | IncompleteCommit, rank: int, root: Path) -> SaveError:
    """What ``e``, met by ``rank`` while saving, says: the file (relative to ``root``) and the errno,
    or the missing file of an incomplete commit."""
    if isinstance(e, IncompleteCommit):
        return SaveError(rank, str(e).replace(str(root) + os.sep, ""))
    return SaveError(rank, _os_error_line(e, root))


def dcp_save_error(e: CheckpointException, root: Path) -> SaveError | None:
    """DCP raises one CheckpointException on every rank, wrapping each failed rank's exception: a
    storage failure (named after the lowest failed rank) when every wrapped one comes from an
    OSError; None otherwise (a bug must crash, not count as a failed save)."""
    wrapped = sorted(e.failures.items(), key=lambda kv: kv[0])
    causes = [(rank, storage_cause(exc)) for rank, (exc, _tb) in wrapped]
    found = [(rank, cause) for rank, cause in causes if cause is not None]
    if not causes or len(found) < len(causes):
        return None
    rank, cause = found[0]
    others = len(found) - 1
    more = f" (and {others} more rank{'s' if others > 1 else ''})" if others else ""
    return SaveError(rank, _os_error_line(cause, root) + more)


def storage_cause(e: BaseException) -> OSError | None:
    """The OSError behind ``e``: itself, or one it was raised from or while handling (the chain a
    traceback shows). torch's serializer turns a failed write of the Python stream it writes to
    (ENOSPC) into a RuntimeError raised while handling that OSError."""
    seen: set[int] = set()
    cur: BaseException | None = e
    while cur is not None and id(cur) not in seen:
        if isinstance(cur, OSError):
            return cur
        seen.add(id(cur))
        cur = cur.__cause__ or (None if cur.__suppress_context__ else cur.__context__)
    return None


def _os_error_line(e: OSError, root: Path) -> str:
    """``step_00000020.tmp.12.host/__1_0.distcp: ENOSPC (No space left on device)``."""
    if not e.filename:
        return describe(e)
    name = os.fsdecode(e.filename)
    rel = os.path.relpath(name, root)
    return f"{name if rel.startswith('..') else rel}: {describe(e)}"


def failure_line(
    step: int, error: str, failures: int, latest: str | None, policy: SavePolicy, tmp_removed: bool = True
) -> str:
    """The loud warning of a failed save that does not stop the launch: step, rank, file, errno,
    and what happens now."""
    kept = f"latest is still {latest}" if latest else "nothing committed in this run yet"
    tmp = "tmp dir removed" if tmp_removed else "tmp dir not removed yet (tried again before the next save)"
    return (
        f"SAVE FAILED at step {step}: {error}; nothing committed, {tmp}, {kept}; training "
        f"goes on ({failures} failed in a row; the launch stops at {policy.max_failed_saves})"
    )
