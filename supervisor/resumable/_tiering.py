"""The remote tier in the trainer (docs/tiers.md): rank 0's background uploader, and the resume
across both tiers before the local pick.

Only supervisor.tiers is imported here; s3fs is loaded by ``open_remote`` for s3:// URLs only, so a
run without ``--remote`` (or with a directory remote) never touches it.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from supervisor import shared_options as shared
from supervisor import store
from supervisor.options import option
from supervisor.tiers.remote import RemoteTier, open_remote
from supervisor.tiers.resume import ResumeResult, prepare_resume
from supervisor.tiers.uploader import BUSY_SKIP, BUSY_WAIT, Uploader, UploadPolicy

log = logging.getLogger("resumable")

# A preemption's flush must fit in SLURM's grace period (sbatch --signal=B:USR1@120 leaves 120 s
# for one local checkpoint plus this), whatever --remote-flush-timeout says for a normal end.
PREEMPT_FLUSH_TIMEOUT_S = 30.0
# A long final flush is waited for in slices, with a heartbeat after each, so the watchdog sees a
# live rank and not a hang.
FLUSH_SLICE_S = 5.0


@dataclass(frozen=True)
class RemoteOptions:
    """The remote tier's options (``ResumeOptions.remote``); without ``url``, no remote tier."""

    url: str | None = option("DIR, file://DIR or s3://BUCKET/PREFIX", None, flag="--remote", metavar="URL")
    endpoint: str | None = shared.remote_endpoint()
    keep: int = option("newest complete checkpoints kept remotely", 5, flag="--remote-keep")
    milestone_every: int = option("also keep every N-th step remotely", 0, metavar="N")
    busy: str = option(
        "a commit while an upload runs: skip its upload (the next one catches up) or wait for it",
        BUSY_SKIP,
        flag="--remote-busy",
        choices=(BUSY_SKIP, BUSY_WAIT),
    )
    wait_timeout_s: float = option(
        "longest submit wait (busy=wait)", 60.0, flag="--remote-wait-timeout", metavar="SECONDS"
    )
    flush_timeout_s: float = option(
        "upload wait at the end", 300.0, flag="--remote-flush-timeout", metavar="SECONDS"
    )
    attempts: int = option("tries per cycle before 'down'", 4, flag="--remote-attempts", metavar="N")

    def policy(self, local_keep: int) -> UploadPolicy:
        """The upload policy; RemoteConfigError (a StoreError, one line) for impossible values."""
        return UploadPolicy(
            busy=self.busy,
            wait_timeout_s=self.wait_timeout_s,
            attempts=max(1, self.attempts),
            remote_keep=self.keep,
            milestone_every=self.milestone_every,
            local_keep=local_keep,
        )


def resume(
    root: Path,
    remote: RemoteOptions,
    expect: store.Expectation,
    *,
    deep: bool,
    key: bytes | None,
    io_retry_s: float,
    allow_fresh_start: bool,
    on_retry: Callable[[str], None],
) -> ResumeResult:
    """Make the newest valid checkpoint of either tier the local ``latest`` (downloading and
    verifying it when only the remote has it). Raises RemoteUnavailable when nothing local is valid
    and the remote cannot be reached; MismatchError, StorageUnavailable and NoUsableCheckpoint as
    ``store.pick`` does."""
    return prepare_resume(
        root,
        _open(remote, key),
        deep=deep,
        expect=expect,
        io_retry_s=io_retry_s,
        on_retry=on_retry,
        allow_fresh_start=allow_fresh_start,
        key=key,
    )


def start_uploader(root: Path, remote: RemoteOptions, local_keep: int) -> Uploader:
    """Rank 0's uploader; its first cycle catches up on what the remote lacks."""
    up = Uploader(root, _open(remote), remote.policy(local_keep)).start()
    log.info("remote tier %s: uploads in the background (busy policy %s)", up.remote.url, remote.busy)
    return up


def _open(remote: RemoteOptions, key: bytes | None = None) -> RemoteTier:
    assert remote.url, "the remote tier is only used with --remote"
    return open_remote(remote.url, remote.endpoint, key=key)


def close_uploader(up: Uploader, timeout_s: float, beat: Callable[[], object]) -> None:
    """Wait up to ``timeout_s`` for the remote to catch up (``beat`` between slices), then stop;
    say so if it did not. Each slice also starts a new cycle, so a remote that comes back during
    the wait is retried at once."""
    deadline = time.monotonic() + timeout_s
    synced = False
    while not synced and (left := deadline - time.monotonic()) > 0:
        synced = up.flush(min(left, FLUSH_SLICE_S))
        beat()
    up.close()
    if synced:
        log.info("remote tier in sync: newest checkpoint uploaded")
        return
    st = up.status()
    log.warning(
        "remote tier not in sync after %.0fs (state %s, newest remote step %s, lag %d steps%s); "
        "the next launch's uploader catches up from the local checkpoints",
        timeout_s,
        st.state,
        st.newest_remote,
        st.lag_steps,
        f", last error: {st.last_error}" if st.last_error else "",
    )
