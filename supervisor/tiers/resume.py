"""The watchdog's side of the remote tier: before each launch, make the newest valid checkpoint of
either tier the local ``latest``.

Local first (``store.pick``: walk back, quarantine). Then every remote checkpoint newer than the
local choice, newest first: a corrupt one (objects do not match its manifest, or a checksum fails
while downloading) is quarantined on the remote with its reason and the walk goes on; the first good
one is downloaded into a tmp dir, verified and committed locally, and becomes ``latest``. The
trainer then loads ``latest`` as it always does.

The remote unreachable: with a valid local checkpoint, resume from it (logged, ``remote_error``
set); with none, raise RemoteUnavailable rather than start from scratch over a remote that may hold
the run's progress (the watchdog retries later, like any transient launch failure).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path

from supervisor.store import CheckpointRef, Expectation, check_compatible, pick, validate
from supervisor.tiers.events import EmitFn, remote_event_log
from supervisor.tiers.plan import RemoteState
from supervisor.tiers.remote import IntegrityError, RemoteTier, RemoteUnavailable

log = logging.getLogger("supervisor.tiers")


@dataclass(frozen=True)
class ResumeResult:
    chosen: CheckpointRef | None  # what the trainer will load (local path); None: start fresh
    source: str  # "local", "remote" (downloaded now) or "none"
    local_quarantined: tuple[tuple[str, str], ...] = ()
    remote_quarantined: tuple[tuple[str, str], ...] = ()
    remote_error: str = ""  # the remote was unreachable; the local choice was not compared with it
    downloaded_bytes: int = 0
    download_s: float = 0.0


def prepare_resume(
    root: str | Path,
    remote: RemoteTier | None,
    *,
    deep: bool = False,
    expect: Expectation | None = None,
    on_event: EmitFn | None = None,
) -> ResumeResult:
    """Pick across both tiers; download when the remote holds the newest valid checkpoint.

    Raises MismatchError (as ``store.pick`` does) when the chosen checkpoint was made for another
    config or data, and RemoteUnavailable when nothing local is valid and the remote is unreachable.
    """
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)  # node loss: the whole run directory may be gone
    emit = on_event or remote_event_log(root)
    local = pick(root, deep=deep)
    for name, reason in local.quarantined:
        emit("local_quarantined", f"{name} quarantined locally: {reason}", name=name, reason=reason)
    chosen = local.chosen
    result = ResumeResult(chosen.ref if chosen else None, "local" if chosen else "none", local.quarantined)
    if remote is not None:
        result = _from_remote(root, remote, result, emit)
        if result.source == "remote" and result.chosen is not None:
            chosen = validate(result.chosen)
    if chosen is not None and chosen.ok:
        check_compatible(chosen, expect or Expectation())
    return result


def _from_remote(root: Path, remote: RemoteTier, local: ResumeResult, emit: EmitFn) -> ResumeResult:
    floor = local.chosen.step if local.chosen else -1
    quarantined: list[tuple[str, str]] = []
    try:
        candidates = [v for v in remote.scan() if v.step > floor and v.state is not RemoteState.INCOMPLETE]
        for v in candidates:
            if not v.ok:
                _quarantine(remote, v.name, v.reason, quarantined, emit)
                continue
            t0 = time.monotonic()
            try:
                ref = remote.download(v.step, root)
            except IntegrityError as e:
                _quarantine(remote, v.name, str(e), quarantined, emit)
                continue
            seconds = time.monotonic() - t0
            size = v.manifest.total_bytes if v.manifest else 0
            msg = (
                f"resuming from {v.name} downloaded from {remote.url} ({size} B in {seconds:.2f}s, verified)"
            )
            log.info("remote: %s", msg)
            emit("downloaded", msg, name=v.name, bytes=size, seconds=round(seconds, 3), url=remote.url)
            return ResumeResult(ref, "remote", local.local_quarantined, tuple(quarantined), "", size, seconds)
    except RemoteUnavailable as e:
        if local.chosen is None:
            raise RemoteUnavailable(
                f"{e}; no valid local checkpoint in {root}, so not starting from scratch: "
                "retry when the remote is back, or run without --remote to start fresh"
            ) from e
        msg = f"{e}; resuming from local {local.chosen.name}; a newer remote one, if any, is not used"
        log.warning("remote: %s", msg)
        emit("remote_unreachable", msg, error=str(e), resuming_from=local.chosen.name)
        return ResumeResult(local.chosen, "local", local.local_quarantined, tuple(quarantined), str(e))
    return ResumeResult(local.chosen, local.source, local.local_quarantined, tuple(quarantined))


def _quarantine(remote: RemoteTier, name: str, reason: str, out: list[tuple[str, str]], emit: EmitFn) -> None:
    dest = remote.quarantine(name, reason)
    out.append((name, reason))
    msg = f"remote {name} quarantined to {remote.url}/{dest}: {reason}"
    log.warning("remote: %s", msg)
    emit("remote_quarantined", msg, name=name, reason=reason, moved_to=dest, url=remote.url)
