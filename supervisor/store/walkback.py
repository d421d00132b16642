"""The walk-back before a resume: ``pick`` chooses the newest *valid* checkpoint, quarantining the
corrupt ones it walks past (content evidence only), and points ``latest`` at it; ``rollback`` and
``quarantine_step`` move checkpoints aside by hand.

Mutations (pointer update, quarantine, prune) hold the root's file lock; readers take no lock, so
every mutation a reader can see is one rename. Nothing is hashed under the lock (deep checksums run
before it is taken), so a trainer's commit never waits behind a login-node command.

An error that is not proof of corruption (ioerrors.py) makes a checkpoint unknown: ``pick`` retries
the whole walk for ``io_retry_s``, then raises StorageUnavailable; it never quarantines for it and
never gives up the run's progress without being told to.
"""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from supervisor.errors import refine
from supervisor.format.exitcodes import Exit
from supervisor.format.layout import parse_committed, step_dirname
from supervisor.format.manifest import (
    ProgressFn,
)
from supervisor.store.checkpoints import (
    CheckpointRef,
    Expectation,
    StoreError,
    Verdict,
    backfill_reasons,
    check_compatible,
    identity,
    latest_raw,
    list_checkpoints,
    list_quarantined,
    quarantine_locked,
    read_latest,
    require_root,
    root_lock,
    validate,
    write_latest,
)
from supervisor.store.ioerrors import IO_RETRY_S, Evidence, retry_transient


class NoUsableCheckpoint(StoreError):
    """No valid checkpoint, but the run has history (quarantined or unusable checkpoints): starting
    from step 0 would silently drop its progress. ``result`` is what the pick did."""

    codes = refine(StoreError.codes, command=Exit.FOUND_PROBLEM, trainer=Exit.NO_USABLE_CHECKPOINT)

    def __init__(self, msg: str, result: PickResult):
        super().__init__(msg)
        self.result = result


@dataclass(frozen=True)
class PickResult:
    """What a pick before a resume chose, and what it moved aside on the way."""

    chosen: Verdict | None
    quarantined: tuple[tuple[str, str], ...] = ()
    latest_before: str | None = None
    latest_after: str | None = None
    dry_run: bool = False
    # With a signing key: (name, reason) of the checkpoints skipped as untrusted, newest first.
    untrusted: tuple[tuple[str, str], ...] = ()


# ---------------------------------------------------------------- pick


# Cached verdicts of the unlocked deep pass: path -> (identity when it was validated, verdict).
_Cache = dict[Path, tuple[tuple[int, ...] | None, Verdict]]


def pick(  # noqa: PLR0913  keyword-only options, one per CLI flag of `ckpt pick` / `watch`
    root: str | Path,
    *,
    deep: bool = False,
    expect: Expectation | None = None,
    dry_run: bool = False,
    progress: ProgressFn | None = None,
    io_retry_s: float = IO_RETRY_S,
    on_retry: Callable[[str], None] | None = None,
    allow_fresh_start: bool = False,
    key: bytes | None = None,
) -> PickResult:
    """The checkpoint a resume must use: the newest valid one.

    Walks back past corrupt checkpoints, quarantining each with its reason, then repoints
    ``latest``. A checkpoint that cannot be read (UNKNOWN) stops the walk: nothing is changed,
    and the whole walk is retried with backoff (each retry reported through ``on_retry``) for
    ``io_retry_s`` seconds, then StorageUnavailable. With no valid checkpoint left while the run
    has history (anything quarantined), NoUsableCheckpoint, unless ``allow_fresh_start``. A config
    or data mismatch on the newest valid one raises MismatchError and moves nothing more.
    ``dry_run`` decides the same but changes nothing.

    With a signing ``key``, a checkpoint not signed with it (UNTRUSTED) is skipped: never chosen,
    never quarantined, listed in ``untrusted``; with nothing trusted left, NoUsableCheckpoint
    unless ``allow_fresh_start``.
    """
    expect = expect or Expectation()
    cache: _Cache = {}
    return retry_transient(
        lambda: _pick_once(root, deep, expect, dry_run, progress, cache, allow_fresh_start, key),
        deadline_s=io_retry_s,
        what=f"the checkpoint pick in {root}",
        fix=lambda e: unreadable_fix(root, e.filename),
        on_retry=on_retry,
    )


def _pick_once(
    root: str | Path,
    deep: bool,
    expect: Expectation,
    dry_run: bool,
    progress: ProgressFn | None,
    cache: _Cache,
    allow_fresh_start: bool,
    key: bytes | None,
) -> PickResult:
    """One attempt; raises the OSError of the first checkpoint it could not read."""
    root = require_root(root)
    while True:
        if deep:  # minutes on a large checkpoint: never under the lock
            _deep_pass(root, progress, cache, key)
        with root_lock(root):
            walk = _walk_locked(root, deep, cache, key)
            if walk is None:  # changed since it was hashed: hash again, outside the lock
                continue
            chosen, bad, skipped = walk
            latest_before = read_latest(root)
            if not dry_run:
                backfill_reasons(root)
                for v in bad:
                    quarantine_locked(root, v.ref, v.reason)
            if chosen is not None:
                check_compatible(chosen, expect)
            latest_after = chosen.ref.name if chosen else None
            want = None if latest_after is None else latest_after + "\n"
            if not dry_run and latest_raw(root) != want:  # also clears a garbage or dangling pointer
                write_latest(root, latest_after)
        break
    untrusted = tuple((v.ref.name, v.reason) for v in skipped)
    res = PickResult(
        chosen, tuple((v.ref.name, v.reason) for v in bad), latest_before, latest_after, dry_run, untrusted
    )
    if chosen is None and not allow_fresh_start:
        history = [(v.ref.name, v.reason) for v in bad] if dry_run else []
        history += [(q.name, q.reason) for q in list_quarantined(root)]
        if history or untrusted:
            raise NoUsableCheckpoint(no_usable_message(root, history, list(untrusted)), res)
    return res


def _deep_pass(root: Path, progress: ProgressFn | None, cache: _Cache, key: bytes | None) -> None:
    """Deep-validate newest first up to the first valid one, reusing verdicts of directories
    unchanged since; raises the error of the first one it cannot read."""
    for ref in list_checkpoints(root):
        ident = identity(ref)
        hit = cache.get(ref.path)
        if hit is not None and hit[0] == ident:
            v = hit[1]
        else:
            v = validate(ref, deep=True, progress=progress, key=key)
            if v.unknown:
                raise _error(v)
            cache[ref.path] = (ident, v)
        if v.ok:
            return


def _walk_locked(
    root: Path, deep: bool, cache: _Cache, key: bytes | None
) -> tuple[Verdict | None, list[Verdict], list[Verdict]] | None:
    """Under the lock: the chosen checkpoint, the corrupt ones newer than it and the untrusted ones
    newer than it, from quick checks (and, when ``deep``, the deep pass's verdicts of directories
    still the same); None when one changed since the deep pass (not hashed here). Raises the
    error of one it cannot read."""
    bad: list[Verdict] = []
    untrusted: list[Verdict] = []
    for ref in list_checkpoints(root):
        v = validate(ref, key=key)
        if v.gone:  # removed meanwhile: nothing to quarantine
            continue
        if v.unknown:
            raise _error(v)
        if deep and v.ok:
            hit = cache.get(ref.path)
            if hit is None or hit[0] != identity(ref):
                return None
            v = hit[1]
        elif deep and (hit := cache.get(ref.path)) is not None and hit[1].ok:
            cache.pop(ref.path)  # was whole when hashed, is not now: the deep pass must see it again
            return None
        if v.ok:
            return v, bad, untrusted
        if v.evidence is Evidence.UNTRUSTED:  # not corrupt: skipped, left where it is
            untrusted.append(v)
        else:
            bad.append(v)
    return None, bad, untrusted


def _error(v: Verdict) -> OSError:
    """The error that made ``v`` unknown (validate always records it)."""
    assert v.error is not None, v.reason
    return v.error


def unreadable_fix(root: str | Path, filename: str | bytes | os.PathLike[str] | None) -> str:
    """What to tell a person when ``filename`` under ``root`` stays unreadable."""
    fix = "check the file system (mount, server, permissions, quota) and retry, or allow a longer --io-retry"
    rel = os.path.relpath(os.fsdecode(filename), root) if filename else ""
    step = parse_committed(rel.split(os.sep, 1)[0]) if rel and not rel.startswith("..") else None
    if step is None:
        return fix
    return (
        f"{fix}; if it stays unreadable, move {step_dirname(step)} aside with "
        f"`python -m supervisor ckpt quarantine --ckpt-root {root} {step}`"
    )


def no_usable_message(
    root: str | Path, history: list[tuple[str, str]], untrusted: list[tuple[str, str]] | None = None
) -> str:
    """One line: what the run has that could not be used, and the flag that starts it over.
    ``history``: quarantined checkpoints; ``untrusted``: ones skipped for their signature."""
    if untrusted:
        name, reason = max(untrusted, key=lambda h: h[0].rsplit("/", 1)[-1])  # remote ones: URL/step_N
        n, q = len(untrusted), len(history)
        also = f", and {q} quarantined" if q else ""
        why = reason.removeprefix(name.rsplit("/", 1)[-1] + ": ")
        return (
            f"{root}: no trusted checkpoint: {n} checkpoint{'s are' if n > 1 else ' is'} not signed with "
            f"this run's key{also} (newest {name}: {why}); check --signing-key, "
            f"inspect with `python -m supervisor ckpt verify --signing-key ... --ckpt-root {root}`, "
            "or pass --allow-fresh-start to start from step 0"
        )
    newest_name, newest_reason = max(history, key=lambda h: h[0])
    why = newest_reason.removeprefix(newest_name.split("-", 1)[0] + ": ")
    n = len(history)
    return (
        f"{root}: no usable checkpoint, but {n} checkpoint{'s are' if n > 1 else ' is'} quarantined "
        f"(newest {newest_name}: {why}); inspect with `python -m supervisor ckpt list --ckpt-root {root}`, "
        "or pass --allow-fresh-start to start from step 0"
    )


# ---------------------------------------------------------------- by hand


def quarantine_step(root: str | Path, step: int, reason: str) -> Path:
    """Move committed ``step_N`` aside by hand (e.g. a file that stays unreadable); ``latest`` is
    removed when it named it (the next pick points it at the newest valid one)."""
    root = require_root(root)
    ref = CheckpointRef(step, root / step_dirname(step))
    with root_lock(root):
        if not ref.path.is_dir():
            raise StoreError(f"{ref.path}: no such committed checkpoint (see `ckpt list`)")
        dest = quarantine_locked(root, ref, reason)
        if read_latest(root) == ref.name:
            write_latest(root, None)
    return dest


@dataclass(frozen=True)
class RollbackResult:
    """What `ckpt rollback` did, or would do with ``dry_run``."""

    to: str  # the checkpoint the run resumes from now
    moved: tuple[tuple[str, str], ...]  # (name, where in quarantine/) newest first; with dry_run, none
    newer: tuple[str, ...]  # the committed checkpoints newer than ``to``, newest first
    latest_before: str | None
    dry_run: bool = False


def rollback(root: str | Path, step: int, *, dry_run: bool = False) -> RollbackResult:
    """Make ``step_N`` the newest checkpoint: move every committed checkpoint newer than it to
    ``quarantine/`` (reason "rolled back", never deleted; valid or not, a rename reads nothing
    in it) and point ``latest`` at it, all under the root's lock, so a commit waits or comes
    after. StoreError when ``step_N`` is not a valid checkpoint (quick check); the OSError of one
    that cannot be read. A crash midway leaves some moved and ``latest`` old: run it again.
    The caller makes sure no run is live (a running trainer would commit past it)."""
    root = require_root(root)
    name = step_dirname(step)
    with root_lock(root):
        v = validate(CheckpointRef(step, root / name))
        if v.unknown:
            raise _error(v)
        if not v.ok:
            why = "no such committed checkpoint" if v.gone or not v.ref.path.is_dir() else v.reason
            raise StoreError(
                f"{root / name}: cannot roll back to it: {why}; pick a valid one from `ckpt list`"
            )
        newer = [r for r in list_checkpoints(root) if r.step > step]
        latest_before = read_latest(root)
        moved = []
        if not dry_run:
            for r in newer:
                reason = f"{r.name}: rolled back to {name} (`ckpt rollback`)"
                moved.append((r.name, str(quarantine_locked(root, r, reason))))
            write_latest(root, name)
    return RollbackResult(name, tuple(moved), tuple(r.name for r in newer), latest_before, dry_run)
