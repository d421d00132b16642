"""I/O errors classified: which ones prove something about a checkpoint, which ones only say the
storage did not answer, and a bounded retry for the latter.

A checkpoint is quarantined only on *content evidence* (a manifest that does not parse, a size or
checksum that differs, a file missing from a listing that succeeded). An OSError on the way is
evidence only when it says the namespace is not what the layout says (a directory where a file
must be, a symlink loop); every other one (EIO, ESTALE, EACCES, EMFILE, ETIMEDOUT, ENOSPC...) makes
the checkpoint *unknown*: it is retried, never quarantined. An errno this module has never heard of
counts as unknown too: when in doubt, keep the checkpoint and say so.

Pure apart from the injected clock and sleep; tenacity is imported on the first retry only, so a
login-node command that never retries does not pay for it.
"""

from __future__ import annotations

import errno
import time
from collections.abc import Callable
from enum import Enum
from typing import TYPE_CHECKING, TypeVar

from supervisor.backoff import Backoff
from supervisor.errors import StorageError
from supervisor.format.capped import NotRegular, TooLarge

if TYPE_CHECKING:
    import random

T = TypeVar("T")

# The path is not what the layout says: proof enough, like a size that differs. ENOENT is here
# because a file listed in a manifest and absent from a listing that succeeded is missing; callers
# first tell a whole checkpoint that vanished ("gone": pruned or quarantined meanwhile) from that.
STRUCTURAL_ERRNOS = frozenset({errno.ENOENT, errno.ENOTDIR, errno.EISDIR, errno.ELOOP, errno.ENAMETOOLONG})
IO_RETRY_S = 120.0
RETRY_INITIAL_S = 0.5
RETRY_MAX_S = 15.0


class Evidence(str, Enum):
    OK = "ok"
    CORRUPT = "corrupt"  # content evidence: quarantine it
    UNKNOWN = "unknown"  # could not be read: retry, never quarantine
    # Whole, but not signed with the run's key (only with --signing-key; docs/security.md): never
    # loaded, never quarantined (a checkpoint from before the key was set is not corrupt).
    UNTRUSTED = "untrusted"


class StorageUnavailable(StorageError):
    """Transient I/O errors outlasted the retry window; ``str(e)`` is one line naming the path,
    the errno, how long it was retried and the fix."""

    def __init__(self, msg: str, *, path: str = "", error: OSError | None = None, retried_s: float = 0.0):
        super().__init__(msg)
        self.path, self.error, self.retried_s = path, error, retried_s


def is_structural(e: OSError) -> bool:
    """The path is not what the layout says: a structural errno, something other than a regular
    file where one must be (a FIFO, a device: ``capped.NotRegular``), or a file larger than its
    kind or its listing allows (``capped.TooLarge``)."""
    return isinstance(e, NotRegular | TooLarge) or e.errno in STRUCTURAL_ERRNOS


def evidence_of(e: OSError) -> Evidence:
    """What an OSError met while reading a checkpoint proves about it."""
    return Evidence.CORRUPT if is_structural(e) else Evidence.UNKNOWN


def is_transient(e: BaseException) -> bool:
    """Worth retrying: an OSError with an errno that is not structural. An OSError without errno
    (filelock's Timeout: another process holds a lock) is not a storage failure and is not."""
    return isinstance(e, OSError) and e.errno is not None and not is_structural(e)


def describe(e: OSError) -> str:
    """``EIO (Input/output error)``: the errno name a person can search for, and its text."""
    name = errno.errorcode.get(e.errno, f"errno {e.errno}") if e.errno is not None else type(e).__name__
    return f"{name} ({e.strerror or e})"


# Storage retries: 0.5 s doubling up to 8 s, each drawn from the upper half (equal jitter).
STORAGE_BACKOFF = Backoff(RETRY_INITIAL_S, RETRY_MAX_S, spread=0.5)


def retry_transient(
    fn: Callable[[], T],
    *,
    deadline_s: float,
    what: str,
    fix: Callable[[OSError], str],
    on_retry: Callable[[str], None] | None = None,
    clock: Callable[[], float] = time.monotonic,
    sleep: Callable[[float], None] = time.sleep,
    rng: random.Random | None = None,
) -> T:
    """``fn()``, retried while it raises a transient OSError, for at most ``deadline_s`` seconds
    (0: one attempt); each retry is announced through ``on_retry(msg)`` before its wait. Past the
    deadline: StorageUnavailable naming the last error's path and ``fix(error)``. Other exceptions
    propagate at once."""
    from tenacity import RetryCallState, Retrying, retry_if_exception

    t0 = clock()
    if rng is None:
        import random  # here, with tenacity: a command that never retries pays for neither

        rng = random.Random()

    def elapsed() -> float:
        return clock() - t0

    def wait(rs: RetryCallState) -> float:
        return min(STORAGE_BACKOFF.wait_s(rs.attempt_number, rng), max(0.0, deadline_s - elapsed()))

    def announce(rs: RetryCallState) -> None:
        # tenacity calls this only after a failed attempt that `retry` accepted: a transient OSError
        e = rs.outcome.exception() if rs.outcome else None
        if on_retry is None or not isinstance(e, OSError):
            return
        wait_s = rs.next_action.sleep if rs.next_action else 0.0
        on_retry(
            f"{e.filename or what}: {describe(e)}, not proof of corruption; retrying {what} in "
            f"{wait_s:.1f}s ({elapsed():.0f}s of {deadline_s:.0f}s)"
        )

    retrying = Retrying(
        retry=retry_if_exception(is_transient),
        stop=lambda _rs: elapsed() >= deadline_s,
        wait=wait,
        sleep=sleep,
        before_sleep=announce,
        reraise=True,
    )
    try:
        return retrying(fn)
    except OSError as e:
        if not is_transient(e):
            raise
        where = str(e.filename or what)
        raise StorageUnavailable(
            f"{where}: {describe(e)} for {elapsed():.0f}s of retries ({what}); {fix(e)}",
            path=where,
            error=e,
            retried_s=elapsed(),
        ) from e
