"""Both tiers side by side, for ``supervisor status`` and ``ckpt list`` to render.

Quick checks only (manifest and sizes on each tier; no checksums), so it is cheap on a login node.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from supervisor.format.layout import step_dirname
from supervisor.store import list_checkpoints, validate
from supervisor.store.ioerrors import Evidence
from supervisor.tiers.plan import RemoteState
from supervisor.tiers.remote import RemoteTier, RemoteUnavailable
from supervisor.tiers.uploader import RemoteStatus, read_remote_status

_LOCAL_STATE = {Evidence.UNTRUSTED: "untrusted"}


@dataclass(frozen=True)
class TierRow:
    step: int
    name: str
    # "valid", "invalid: <reason>", "unknown: <reason>" (unreadable), "untrusted: <reason>" (with a
    # signing key) or "-" when absent
    local: str
    remote: (
        str  # "complete", "incomplete", "corrupt: <reason>", "untrusted: <reason>", "-" or "?" (unreachable)
    )
    bytes: int

    @property
    def where(self) -> str:
        """local+remote, local, remote or none: where a usable copy lives."""
        places = [
            t for t, ok in (("local", self.local == "valid"), ("remote", self.remote == "complete")) if ok
        ]
        return "+".join(places) or "none"


@dataclass(frozen=True)
class TierListing:
    url: str  # "" when the run has no remote
    rows: tuple[TierRow, ...]  # newest first
    remote_error: str = ""  # why the remote column is "?"
    status: RemoteStatus | None = None  # the uploader's last report (lag, last error)

    @property
    def lag_steps(self) -> int | None:
        """Newest valid local step minus newest complete remote step; None without a remote view."""
        if not self.url or self.remote_error:
            return None
        newest_local = max((r.step for r in self.rows if r.local == "valid"), default=0)
        newest_remote = max((r.step for r in self.rows if r.remote == "complete"), default=0)
        return max(0, newest_local - newest_remote)


def list_tiers(root: str | Path, remote: RemoteTier | None, key: bytes | None = None) -> TierListing:
    """Every checkpoint of either tier, newest first; the remote column is "?" when unreachable.
    ``key``: judge local signatures too (give ``remote`` the same key for its column)."""
    local = {}
    for ref in list_checkpoints(root):
        v = validate(ref, key=key)
        size = v.manifest.total_bytes if v.manifest else 0
        word = "unknown" if v.unknown else _LOCAL_STATE.get(v.evidence, "invalid")
        state = "valid" if v.ok else f"{word}: {v.reason}"
        local[ref.step] = (state, size)
    remote_v = {}
    error = ""
    if remote is not None:
        try:
            remote_v = {v.step: v for v in remote.scan()}
        except RemoteUnavailable as e:
            error = str(e)
    rows = []
    for step in sorted(set(local) | set(remote_v), reverse=True):
        lstate, size = local.get(step, ("-", 0))
        rv = remote_v.get(step)
        if rv is None:
            rstate = "?" if error else "-"
        elif rv.state in (RemoteState.CORRUPT, RemoteState.UNTRUSTED):
            rstate = f"{rv.state.value}: {rv.reason}"
        else:
            rstate = rv.state.value
        if rv is not None and rv.manifest is not None:
            size = size or rv.manifest.total_bytes
        rows.append(TierRow(step, step_dirname(step), lstate, rstate, size))
    return TierListing(remote.url if remote else "", tuple(rows), error, read_remote_status(root))
