"""The watchdog's side of the remote tier: before each launch, make the newest valid checkpoint of
either tier the local ``latest``.

Local first (``store.pick``: walk back, quarantine what is corrupt, retry what cannot be read).
Then every remote checkpoint newer than the local choice, newest first: a corrupt one (objects do
not match its manifest, or a checksum fails while downloading) is quarantined on the remote with
its reason and the walk goes on; the first good one is downloaded into a tmp dir, verified and
committed locally, and becomes ``latest``. The trainer then loads ``latest`` as it always does.

One download per run directory: several nodes sharing a run dir each run this before their
launch. The remote part runs under the run dir's download lock (``.download.lock``; not the root
lock, which a trainer's commit must never wait behind for minutes), and after acquiring it the
local pick is redone if a checkpoint appeared meanwhile: the node that got the lock first
downloads, the others wait for it and resume from its copy.

The remote unreachable: with a valid local checkpoint, resume from it (logged, ``remote_error``
set); with none, raise RemoteUnavailable rather than start from scratch over a remote that may hold
the run's progress (the watchdog retries later, like any transient launch failure). Nothing valid
on either tier while either holds quarantined checkpoints: NoUsableCheckpoint, unless
``allow_fresh_start``.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from supervisor.format import eventtypes as ev
from supervisor.format.layout import QUARANTINE, RunDir
from supervisor.format.manifest import Manifest
from supervisor.store import (
    CheckpointRef,
    Expectation,
    NoUsableCheckpoint,
    PickResult,
    Verdict,
    check_compatible,
    file_lock,
    list_checkpoints,
    list_quarantined,
    no_usable_message,
    pick,
)
from supervisor.store.ioerrors import IO_RETRY_S, Evidence, retry_transient
from supervisor.tiers.events import EmitFn, remote_event_log
from supervisor.tiers.plan import RemoteState
from supervisor.tiers.remote import RemoteCorrupt, RemoteTier, RemoteUnavailable, RemoteUntrusted

log = logging.getLogger("supervisor.tiers")

# Another node's download may take a long time on a large checkpoint; past this, give up waiting
# (RemoteUnavailable: the watchdog retries later) rather than block forever behind a stuck node.
DOWNLOAD_LOCK_TIMEOUT_S = 3600.0


@dataclass(frozen=True)
class ResumeResult:
    chosen: CheckpointRef | None  # what the trainer will load (local path); None: start fresh
    source: str  # "local", "remote" (downloaded now) or "none"
    local_quarantined: tuple[tuple[str, str], ...] = ()
    remote_quarantined: tuple[tuple[str, str], ...] = ()
    remote_error: str = ""  # the remote was unreachable; the local choice was not compared with it
    downloaded_bytes: int = 0
    download_s: float = 0.0
    manifest: Manifest | None = None  # the chosen checkpoint's
    # With a signing key: (name, reason) of checkpoints skipped as not signed with it, either tier
    # (remote ones named by their URL).
    untrusted: tuple[tuple[str, str], ...] = ()


def prepare_resume(  # noqa: PLR0913  keyword-only options, as store.pick's plus the remote's
    root: str | Path,
    remote: RemoteTier | None,
    *,
    deep: bool = False,
    expect: Expectation | None = None,
    on_event: EmitFn | None = None,
    io_retry_s: float = IO_RETRY_S,
    on_retry: Callable[[str], None] | None = None,
    allow_fresh_start: bool = False,
    download_lock_timeout_s: float = DOWNLOAD_LOCK_TIMEOUT_S,
    key: bytes | None = None,
) -> ResumeResult:
    """Pick across both tiers; download when the remote holds the newest valid checkpoint.

    With a signing ``key`` (give ``remote`` the same one: ``open_remote(..., key=)``), checkpoints
    not signed with it are skipped on both tiers (``untrusted``, an ``untrusted`` event each),
    never loaded or quarantined, and count as history: nothing trusted is NoUsableCheckpoint.

    Raises MismatchError (as ``store.pick`` does) when the chosen checkpoint was made for another
    config or data, StorageUnavailable when local checkpoints stay unreadable past ``io_retry_s``,
    RemoteUnavailable when nothing local is valid and the remote is unreachable, and
    NoUsableCheckpoint when nothing is valid on either tier but either has quarantined ones.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)  # node loss: the whole run directory may be gone
    emit = on_event or remote_event_log(root)

    def local_pick() -> PickResult:
        res = pick(root, deep=deep, io_retry_s=io_retry_s, on_retry=on_retry, allow_fresh_start=True, key=key)
        for name, reason in res.quarantined:
            emit(ev.LocalQuarantined(name=name, reason=reason), f"{name} quarantined locally: {reason}")
        for name, reason in res.untrusted:
            emit(ev.Untrusted(checkpoint=name, why=reason), f"{name} skipped locally, not trusted: {reason}")
        return res

    def newer_than(step: int) -> bool:
        return retry_transient(
            lambda: any(r.step > step for r in list_checkpoints(root)),
            deadline_s=io_retry_s,
            what=f"listing {root}",
            fix=lambda _e: "check the file system (mount, server, permissions) and retry",
            on_retry=on_retry,
        )

    local = local_pick()
    result = _local_result(local)
    if remote is not None:
        with _download_lock(root, download_lock_timeout_s, emit):
            # The pick left nothing newer than its choice: anything newer now was committed
            # meanwhile (another node's download): pick again and use it.
            if newer_than(result.chosen.step if result.chosen else -1):
                result = _local_result(local_pick(), local.quarantined, local.untrusted)
            result = _from_remote(root, remote, result, emit)
    if result.chosen is None and not allow_fresh_start:
        _refuse_fresh_start(root, remote, local, result.untrusted)
    if result.chosen is not None and result.manifest is not None:
        check_compatible(Verdict(result.chosen, Evidence.OK, "", result.manifest), expect or Expectation())
    return result


@contextmanager
def _download_lock(root: Path, timeout_s: float, emit: EmitFn) -> Iterator[None]:
    """The run dir's download lock; waiting for it is announced (``download_wait``), and a wait
    past ``timeout_s`` is RemoteUnavailable (the watchdog retries later)."""
    path = RunDir.of(root).download_lock
    lock = file_lock(path)
    try:
        lock.acquire(timeout=0)
    except TimeoutError:  # filelock.Timeout: another process downloads into this run dir
        msg = f"another process is resuming {root} from the remote; waiting for it (at most {timeout_s:.0f}s)"
        log.info("remote: %s", msg)
        emit(ev.DownloadWait(lock=str(path)), msg)
        try:
            lock.acquire(timeout=timeout_s)
        except TimeoutError:
            raise RemoteUnavailable(
                f"{path}: another process has been resuming this run dir from the remote for "
                f"{timeout_s:.0f}s; retry later"
            ) from None
    try:
        yield
    finally:
        lock.release()


def _local_result(
    res: PickResult, earlier: tuple[tuple[str, str], ...] = (), untrusted: tuple[tuple[str, str], ...] = ()
) -> ResumeResult:
    chosen = res.chosen
    return ResumeResult(
        chosen.ref if chosen else None,
        "local" if chosen else "none",
        earlier + res.quarantined,
        manifest=chosen.manifest if chosen else None,
        untrusted=tuple(dict.fromkeys(untrusted + res.untrusted)),
    )


def _refuse_fresh_start(
    root: Path, remote: RemoteTier | None, local: PickResult, untrusted: tuple[tuple[str, str], ...]
) -> None:
    """Nothing valid on either tier: refuse to start from step 0 when either has history."""
    history = [(q.name, q.reason) for q in list_quarantined(root)]
    if remote is not None:
        try:
            history += [(f"{remote.url}/{QUARANTINE}/{q.name}", q.reason) for q in remote.list_quarantined()]
        except RemoteUnavailable as e:
            raise RemoteUnavailable(
                f"{e}; nothing valid locally, so not starting from scratch before the remote's "
                "quarantine has been looked at: retry when the remote is back"
            ) from e
    if history or untrusted:
        raise NoUsableCheckpoint(no_usable_message(root, history, list(untrusted)), local)


def _from_remote(root: Path, remote: RemoteTier, local: ResumeResult, emit: EmitFn) -> ResumeResult:
    floor = local.chosen.step if local.chosen else -1
    quarantined: list[tuple[str, str]] = []
    untrusted = list(local.untrusted)

    def skip(name: str, reason: str) -> None:
        where = f"{remote.url}/{name}"
        untrusted.append((where, reason))
        emit(ev.Untrusted(checkpoint=name, why=reason), f"remote {where} skipped, not trusted: {reason}")

    try:
        candidates = [v for v in remote.scan() if v.step > floor and v.state is not RemoteState.INCOMPLETE]
        for v in candidates:
            if v.state is RemoteState.UNTRUSTED:
                skip(v.name, v.reason)
                continue
            if not v.ok:
                _quarantine(remote, v.name, v.reason, quarantined, emit)
                continue
            t0 = time.monotonic()
            try:
                ref = remote.download(v.step, root)
            except RemoteCorrupt as e:
                _quarantine(remote, v.name, str(e), quarantined, emit)
                continue
            except RemoteUntrusted as e:
                skip(v.name, str(e))
                continue
            seconds = time.monotonic() - t0
            size = v.manifest.total_bytes if v.manifest else 0
            msg = (
                f"resuming from {v.name} downloaded from {remote.url} ({size} B in {seconds:.2f}s, verified)"
            )
            log.info("remote: %s", msg)
            emit(ev.Downloaded(name=v.name, bytes=size, seconds=round(seconds, 3), url=remote.url), msg)
            return ResumeResult(
                ref, "remote", local.local_quarantined, tuple(quarantined), "", size, seconds, v.manifest,
                tuple(untrusted),
            )  # fmt: skip
    except RemoteUnavailable as e:
        if local.chosen is None:
            raise RemoteUnavailable(
                f"{e}; no valid local checkpoint in {root}, so not starting from scratch: "
                "retry when the remote is back, or run without --remote to start fresh"
            ) from e
        msg = f"{e}; resuming from local {local.chosen.name}; a newer remote one, if any, is not used"
        log.warning("remote: %s", msg)
        emit(ev.RemoteUnreachable(error=str(e), resuming_from=local.chosen.name), msg)
        return ResumeResult(
            local.chosen,
            "local",
            local.local_quarantined,
            tuple(quarantined),
            str(e),
            manifest=local.manifest,
            untrusted=tuple(untrusted),
        )
    return ResumeResult(
        local.chosen,
        local.source,
        local.local_quarantined,
        tuple(quarantined),
        manifest=local.manifest,
        untrusted=tuple(untrusted),
    )


def _quarantine(remote: RemoteTier, name: str, reason: str, out: list[tuple[str, str]], emit: EmitFn) -> None:
    dest = remote.quarantine(name, reason)
    out.append((name, reason))
    msg = f"remote {name} quarantined to {remote.url}/{dest}: {reason}"
    log.warning("remote: %s", msg)
    emit(ev.RemoteQuarantined(name=name, reason=reason, moved_to=dest, url=remote.url), msg)
