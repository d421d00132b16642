"""Pure decisions of the tier protocol: the remote commit marker, what to upload, what to prune.

The remote commit marker: ``manifest.json`` present, parseable, for this step, and every listed
object present at its listed size with nothing unlisted beside it. Object stores give no xxh3, so
checksums are verified at both ends instead: before uploading (the local source against its
manifest) and after downloading (what landed against the manifest).
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from enum import Enum

from supervisor.format.layout import MANIFEST, SIGNATURE
from supervisor.format.manifest import NOT_LISTED, Manifest, ManifestError, parse_manifest
from supervisor.signing import Signature, Untrusted, verify
from supervisor.store import Candidate, RetentionPolicy, plan_retention


class RemoteState(str, Enum):
    COMPLETE = "complete"  # the commit marker holds: usable
    INCOMPLETE = "incomplete"  # no manifest yet: an upload in flight or killed; never used
    CORRUPT = "corrupt"  # a manifest, but the objects do not match it: quarantine
    # Complete, but not signed with the resuming run's key (docs/security.md): skipped, never
    # downloaded, never quarantined.
    UNTRUSTED = "untrusted"


@dataclass(frozen=True)
class RemoteVerdict:
    name: str
    step: int
    state: RemoteState
    reason: str = ""
    manifest: Manifest | None = None
    signature: Signature | None = None  # judged with a key and trusted: what it signs

    @property
    def ok(self) -> bool:
        return self.state is RemoteState.COMPLETE


def judge_listing(
    name: str,
    step: int,
    sizes: Mapping[str, int],
    manifest_bytes: bytes | None,
    key: bytes | None = None,
    sig_bytes: bytes | None = None,
) -> RemoteVerdict:
    """Apply the commit marker to one listed checkpoint prefix (sizes relative to it). With a
    signing ``key``, a complete one is also checked against its ``manifest.sig`` (``sig_bytes``,
    None when it has none): UNTRUSTED when unsigned or badly signed."""
    if manifest_bytes is None:
        return RemoteVerdict(name, step, RemoteState.INCOMPLETE, f"{name}: {MANIFEST} is missing")

    def corrupt(why: str) -> RemoteVerdict:
        return RemoteVerdict(name, step, RemoteState.CORRUPT, f"{name}: {why}")

    try:
        m = parse_manifest(manifest_bytes)
    except ManifestError as e:
        return corrupt(str(e))
    if m.step != step:
        return corrupt(f"{MANIFEST} is for step {m.step}, not {step}")
    for rel, entry in sorted(m.files.items()):
        if rel not in sizes:
            return corrupt(f"{rel} is missing")
        if sizes[rel] != entry.size:
            return corrupt(f"{rel} is {sizes[rel]} bytes, manifest says {entry.size}")
    unlisted = sorted(set(sizes) - set(m.files) - NOT_LISTED)
    if unlisted:
        return corrupt(f"{unlisted[0]} is not listed in {MANIFEST}")
    if key is None:
        return RemoteVerdict(name, step, RemoteState.COMPLETE, "", m)
    try:
        sig = verify(manifest_bytes, sig_bytes if SIGNATURE in sizes else None, m.files, key)
    except Untrusted as e:
        return RemoteVerdict(name, step, RemoteState.UNTRUSTED, f"{name}: {e}", m)
    return RemoteVerdict(name, step, RemoteState.COMPLETE, "", m, sig)


def same_content(a: Manifest, b: Manifest) -> bool:
    """Two manifests describe the same bytes (wall times may differ)."""
    return a.step == b.step and dict(a.files) == dict(b.files)


@dataclass(frozen=True)
class UploadPlan:
    todo: tuple[int, ...]  # steps to upload, in order
    skipped: tuple[int, ...]  # local steps that will never be uploaded (superseded)


def plan_uploads(local: Iterable[int], remote: Iterable[int], milestone_every: int) -> UploadPlan:
    """Newest first: the newest local step when the remote lacks it, then local milestones the
    remote lacks. Older non-milestone steps are superseded: uploading them would only delay the
    newest one."""
    loc = sorted(set(local), reverse=True)
    rem = set(remote)
    if not loc:
        return UploadPlan((), ())
    todo = [loc[0]] if loc[0] not in rem else []
    newest_remote = max(rem, default=-1)
    for s in loc[1:]:
        if s not in rem and milestone_every > 0 and s % milestone_every == 0:
            todo.append(s)
    skipped = tuple(s for s in loc[1:] if s not in rem and s not in todo and s > newest_remote)
    return UploadPlan(tuple(todo), skipped)


@dataclass(frozen=True)
class RemotePrunePlan:
    delete: tuple[str, ...]  # complete checkpoints beyond retention
    clean: tuple[str, ...]  # leftovers of killed uploads, older than the newest complete one


def plan_remote_prune(verdicts: Iterable[RemoteVerdict], keep: int, milestone_every: int) -> RemotePrunePlan:
    """Keep the newest ``keep`` complete checkpoints and every milestone; clean incomplete prefixes
    older than the newest complete one. Corrupt ones are left for the quarantine (never deleted)."""
    vs = list(verdicts)
    complete = {v.step: v.name for v in vs if v.state is RemoteState.COMPLETE}
    newest = max(complete, default=None)
    kept = plan_retention([Candidate(s) for s in complete], RetentionPolicy(keep, milestone_every))
    delete = tuple(complete[s] for s in sorted(complete, reverse=True) if s not in kept)
    clean = tuple(
        v.name
        for v in sorted(vs, key=lambda v: v.step, reverse=True)
        if v.state is RemoteState.INCOMPLETE and newest is not None and v.step < newest
    )
    return RemotePrunePlan(delete, clean)


@dataclass(frozen=True)
class Lag:
    steps: int  # newest local step minus newest remote step (0 when in sync)
    seconds: float  # age of the oldest local commit newer than the remote's newest (0 when in sync)


def upload_lag(local: Mapping[int, float], newest_remote: int | None, now: float) -> Lag:
    """How far the remote trails: ``local`` maps local steps to their commit wall times."""
    floor = -1 if newest_remote is None else newest_remote
    behind = {s: t for s, t in local.items() if s > floor}
    if not behind:
        return Lag(0, 0.0)
    return Lag(max(behind) - max(floor, 0), max(0.0, now - min(behind.values())))
