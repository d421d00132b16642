"""The remote tier in the trainer (docs/tiers.md): rank 0's background uploader, and the resume
across both tiers before the local pick.

Only supervisor.tiers is imported here; s3fs is loaded by ``open_remote`` for s3:// URLs only, so a
run without ``--remote`` (or with a directory remote) never touches it.
"""

from __future__ import annotations

import argparse
import logging
import time
from collections.abc import Callable
from pathlib import Path

from supervisor import store
from supervisor.tiers.remote import open_remote
from supervisor.tiers.resume import ResumeResult, prepare_resume
from supervisor.tiers.uploader import BUSY_SKIP, BUSY_WAIT, Uploader, UploadPolicy

log = logging.getLogger("train_ref")

# A preemption's flush must fit in SLURM's grace period (sbatch --signal=B:USR1@120 leaves 120 s
# for one local checkpoint plus this), whatever --remote-flush-timeout says for a normal end.
PREEMPT_FLUSH_TIMEOUT_S = 30.0
# A long final flush is waited for in slices, with a heartbeat after each, so the watchdog sees a
# live rank and not a hang.
FLUSH_SLICE_S = 5.0


def add_args(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("remote tier (docs/tiers.md)")
    g.add_argument("--remote", default=None, metavar="URL", help="DIR, file://DIR or s3://BUCKET/PREFIX")
    g.add_argument(
        "--remote-endpoint", default=None, metavar="URL", help="S3 endpoint (else AWS_ENDPOINT_URL)"
    )
    g.add_argument("--remote-keep", type=int, default=5, help="newest complete checkpoints kept remotely")
    g.add_argument("--milestone-every", type=int, default=0, help="also keep every N-th step remotely")
    g.add_argument("--remote-busy", choices=(BUSY_SKIP, BUSY_WAIT), default=BUSY_SKIP)
    g.add_argument("--remote-wait-timeout", type=float, default=60.0, help="longest submit wait (busy=wait)")
    g.add_argument("--remote-flush-timeout", type=float, default=300.0, help="upload wait at the end")
    g.add_argument("--remote-attempts", type=int, default=4, help="tries per cycle before 'down'")


def policy(args: argparse.Namespace) -> UploadPolicy:
    """The upload policy; RemoteConfigError (a StoreError, one line) for impossible values."""
    return UploadPolicy(
        busy=args.remote_busy,
        wait_timeout_s=args.remote_wait_timeout,
        attempts=max(1, args.remote_attempts),
        remote_keep=args.remote_keep,
        milestone_every=args.milestone_every,
        local_keep=args.keep,
    )


def resume(
    root: Path,
    args: argparse.Namespace,
    expect: store.Expectation,
    deep: bool,
    on_retry: Callable[[str], None],
) -> ResumeResult:
    """Make the newest valid checkpoint of either tier the local ``latest`` (downloading and
    verifying it when only the remote has it). Raises RemoteUnavailable when nothing local is valid
    and the remote cannot be reached; MismatchError, StorageUnavailable and NoUsableCheckpoint as
    ``store.pick`` does."""
    return prepare_resume(
        root,
        open_remote(args.remote, args.remote_endpoint, key=args.sign_key),
        deep=deep,
        expect=expect,
        io_retry_s=args.io_retry,
        on_retry=on_retry,
        allow_fresh_start=args.allow_fresh_start,
        key=args.sign_key,
    )


def start_uploader(root: Path, args: argparse.Namespace) -> Uploader:
    """Rank 0's uploader; its first cycle catches up on what the remote lacks."""
    up = Uploader(root, open_remote(args.remote, args.remote_endpoint), policy(args)).start()
    log.info("remote tier %s: uploads in the background (busy policy %s)", up.remote.url, args.remote_busy)
    return up


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
