"""``python -m supervisor ckpt list|verify|pick|prune|quarantine|rollback``: the checkpoint store
from a login node.

Thin wiring: parse flags, call supervisor.store, print a table or stable JSON (docs/cli.md).
Exit codes (supervisor/format/exitcodes.py): 0 ok; 1 verify found an invalid checkpoint or pick found no
valid one; 2 bad input, with one line on stderr naming the path and the fix; 3 storage could not
be read (a transient I/O error, not proof of corruption), one line on stderr.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from functools import wraps
from pathlib import Path
from typing import Any

from supervisor import display, options
from supervisor import shared_options as shared
from supervisor.display import printable
from supervisor.format.atomic import hostname, pid_alive
from supervisor.format.confined import Escape
from supervisor.format.exitcodes import Exit
from supervisor.format.layout import MANIFEST, RunDir, looks_like_run_dir, step_dirname
from supervisor.format.manifest import NOT_LISTED, list_files
from supervisor.options import option
from supervisor.store import (
    FOREIGN_LABEL,
    QUARANTINE_KEEP,
    STALE_TMP_AFTER_S,
    Candidate,
    CheckpointRef,
    Evidence,
    ForeignKind,
    ForeignRef,
    ForeignVerdict,
    KeepReason,
    NoUsableCheckpoint,
    PickResult,
    RetentionPolicy,
    RollbackResult,
    StorageUnavailable,
    StoreError,
    TmpRef,
    Verdict,
    foreign_may_be_writing,
    list_checkpoints,
    list_deleting,
    list_foreign,
    list_quarantined,
    list_tmp,
    pick,
    plan_retention,
    prune,
    quarantine_foreign,
    quarantine_step,
    read_latest,
    read_policy,
    require_root,
    rollback,
    seal_foreign,
    tmp_is_stale,
    unreadable_fix,
    validate,
    validate_foreign,
)
from supervisor.store.ioerrors import describe, is_transient
from supervisor.store.retention_policy import add_retention_args, policy_from_args

JSON_SCHEMA = 1
Handler = Callable[[argparse.Namespace], int]


# ---------------------------------------------------------------- input checks


def open_run_dir(root: str) -> Path:
    """The root, made absolute, if it is a run directory (docs/store.md); else a one-line StoreError."""
    p = require_root(os.path.abspath(root))
    try:
        names = os.listdir(p)
    except OSError as e:
        if _not_answering(e):
            raise  # exit 3, not "bad input"
        raise StoreError(f"{p}: cannot list the checkpoint root ({e.strerror}); check permissions") from None
    if MANIFEST in names:
        raise StoreError(f"{p}: this is one checkpoint, not a run directory; pass its parent as --ckpt-root")
    if not looks_like_run_dir(names):
        raise StoreError(
            f"{p}: not a run directory (no step_*, latest, quarantine/ or heartbeats/ in it, nor "
            "torchtitan's step-N/ or Lightning's *.ckpt); point --ckpt-root at the run's checkpoint root"
        )
    return p


def _one_line_errors(func: Handler) -> Handler:
    """Storage that did not answer: one line on stderr and exit 3. Other OS and lock errors become
    the one-line StoreError that cli.main prints with exit 2."""

    @wraps(func)
    def run(args: argparse.Namespace) -> int:
        try:
            return func(args)
        except StorageUnavailable as e:
            return _unreadable(str(e))
        except OSError as e:
            if _not_answering(e):  # checked first: ETIMEDOUT is a TimeoutError too
                where = e.filename or args.ckpt_root
                return _unreadable(f"{where}: {describe(e)}; {unreadable_fix(args.ckpt_root, e.filename)}")
            if isinstance(e, TimeoutError):  # filelock.Timeout (no errno)
                raise StoreError(
                    f"{args.ckpt_root}: another process holds the root's lock (.lock); retry when it is done"
                ) from None
            if isinstance(e, Escape):  # a planted link: its line says what to do
                raise StoreError(str(e)) from None
            where = e.filename or args.ckpt_root
            raise StoreError(f"{where}: {e.strerror or e}; check the path and its permissions") from None

    return run


def _not_answering(e: OSError) -> bool:
    """Storage that did not answer (exit 3). A permission error outside a checkpoint (.lock, the
    root) is the user's to fix: bad input, exit 2."""
    return is_transient(e) and not isinstance(e, PermissionError)


def _signing_key(args: argparse.Namespace, root: Path) -> bytes | None:
    """The key of --signing-key (docs/security.md), or None; SigningKeyError (a UserError) when unusable."""
    if not args.signing_key:
        return None
    from supervisor.signing import load_key

    return load_key(args.signing_key, outside=(root, getattr(args, "remote", None)))


def _unreadable(line: str) -> int:
    print(f"error: {printable(line)}", file=sys.stderr)
    return Exit.UNREADABLE


# ---------------------------------------------------------------- rows


def _ckpt_row(
    v: Verdict, latest: str | None, now: float, kept: dict[int, tuple[KeepReason, ...]] | None = None
) -> dict[str, Any]:
    """``kept`` (list): why retention keeps each valid checkpoint; a valid one not in it would go
    at the next prune."""
    m = v.manifest
    if m is not None:
        wall, nbytes, nfiles = m.wall_time, m.total_bytes, len(m.files)
    else:
        try:
            wall = v.ref.path.stat().st_mtime
        except OSError:
            wall = now
        nbytes, nfiles = _on_disk(v.ref.path)
    return {
        "name": v.ref.name,
        "step": v.ref.step,
        "path": str(v.ref.path),
        "ok": v.ok,
        "evidence": v.evidence.value,
        "reason": v.reason,
        "wall_time": wall,
        "age_s": round(now - wall, 3),
        "bytes": nbytes,
        "files": nfiles,
        "latest": v.ref.name == latest,
        **({"signature": v.signature} if v.signature else {}),  # with --signing-key only
        **(
            {"kept": [r.value for r in kept.get(v.ref.step, ())] if v.ok else None}
            if kept is not None
            else {}
        ),
    }


def _foreign_row(fv: ForeignVerdict, now: float) -> dict[str, Any]:
    """Another trainer's checkpoint as a row of the same table: its kind, and ``mark`` saying
    whether its bytes are proven (sealed) or only its structure."""
    v, size = fv.verdict, fv.size
    return {
        "name": v.ref.name,
        "step": v.ref.step,
        "path": str(v.ref.path),
        "kind": fv.ref.kind.value,
        "ok": v.ok,
        "evidence": v.evidence.value,
        "reason": v.reason,
        "mark": fv.mark,
        "sealed": fv.sealed,
        "wall_time": size.wall_time,
        "age_s": round(now - size.wall_time, 3) if size.wall_time else None,
        "bytes": size.bytes,
        "files": size.files,
        "latest": False,
    }


def _foreign_verdicts(root: Path, deep: bool = False) -> list[ForeignVerdict]:
    return [fv for fv in (validate_foreign(r, deep=deep) for r in list_foreign(root)) if not fv.verdict.gone]


def _foreign_table(rows: list[dict[str, Any]]) -> str:
    return "other trainers' checkpoints (structural check; `ckpt seal` adds checksums):\n" + display.table(
        ["step", "name", "kind", "age", "size", "files", "status", "check"],
        [
            [
                r["step"] if r["step"] >= 0 else "?",
                r["name"],
                FOREIGN_LABEL[ForeignKind(r["kind"])],
                display.human_age(r["age_s"]) if r["age_s"] is not None else "-",
                display.human_bytes(r["bytes"]),
                r["files"],
                _STATUS[r["evidence"]],
                r["mark"] if r["ok"] else _why(r),
            ]
            for r in rows
        ],
    )


def _on_disk(path: Path) -> tuple[int, int]:
    """Bytes and count of the files an invalid checkpoint holds, its manifest aside (as for a
    valid one, whose numbers come from the manifest); 0, 0 when it cannot be listed."""
    nbytes = nfiles = 0
    try:
        names = list_files(path)
    except OSError:
        names = []
    for name in names:
        if name not in NOT_LISTED:
            with suppress(OSError):
                nbytes += os.stat(os.path.join(path, name)).st_size
                nfiles += 1
    return nbytes, nfiles


def _tmp_row(t: TmpRef, kind: str, me: str) -> dict[str, Any]:
    return {
        "name": t.path.name,
        "path": str(t.path),
        "kind": kind,
        "step": t.step,
        "pid": t.pid,
        "host": t.host,
        "age_s": round(t.age_s, 3),
        "stale": tmp_is_stale(t, me, pid_alive, STALE_TMP_AFTER_S),
    }


def _visible(verdicts: list[Verdict]) -> list[Verdict]:
    """Checkpoints that vanished while being read (pruned or quarantined meanwhile) are not shown."""
    return [v for v in verdicts if not v.gone]


def _ckpt_table(rows: list[dict[str, Any]]) -> str:
    """With a ``kept`` column when the rows have it (`list`)."""
    kept = bool(rows) and "kept" in rows[0]
    return display.table(
        ["", "step", "age", "size", "files", "status", *(["kept"] if kept else []), "reason"],
        [
            [
                "latest" if r["latest"] else "",
                r["step"],
                display.human_age(r["age_s"]),
                display.human_bytes(r["bytes"]),
                r["files"],
                _STATUS[r["evidence"]],
                *([_kept_cell(r["kept"])] if kept else []),
                _why(r),
            ]
            for r in rows
        ],
    )


def _kept_cell(reasons: list[str] | None) -> str:
    if reasons is None:  # not valid: retention does not count it
        return ""
    return ",".join(reasons) or "prunable"


_STATUS = {
    Evidence.OK.value: "ok",
    Evidence.CORRUPT.value: "INVALID",
    Evidence.UNKNOWN.value: "UNKNOWN",
    Evidence.UNTRUSTED.value: "UNTRUSTED",
}


def _why(row: dict[str, Any]) -> str:
    """The reason without the ``step_N: `` prefix the step column already shows."""
    return row["reason"].removeprefix(f"{row['name']}: ")


def _emit(args: argparse.Namespace, doc: dict[str, Any], human: str) -> None:
    if args.json:
        json.dump({"schema": JSON_SCHEMA, "command": args.ckpt_command, **doc}, sys.stdout, indent=1)
        sys.stdout.write("\n")
    elif human:
        print(printable(human))  # names, reasons and fields come from the run directory


@contextmanager
def _progress(
    refs: list[CheckpointRef], label: str, deep: bool, stop_at_valid: bool
) -> Iterator[Callable[[int], None] | None]:
    """A bar on stderr for a deep check when stderr is a terminal; None (no callback) otherwise."""
    if not (deep and sys.stderr.isatty()):
        yield None
        return
    bar = display.ProgressBar(_bytes_to_hash(refs, stop_at_valid), label)
    try:
        yield bar.advance
    finally:
        bar.close()


def _bytes_to_hash(refs: list[CheckpointRef], stop_at_valid: bool) -> int:
    """Bytes a deep check will read: every quick-valid checkpoint, or (pick) up to the first one."""
    total = 0
    for v in (validate(r) for r in refs):
        if v.ok and v.manifest is not None:
            total += v.manifest.total_bytes
            if stop_at_valid:
                break
    return total


# ---------------------------------------------------------------- commands


@_one_line_errors
def cmd_list(args: argparse.Namespace) -> int:
    root = open_run_dir(args.ckpt_root)
    key = _signing_key(args, root)
    now, me = time.time(), hostname()
    latest = read_latest(root)
    policy, source = _policy_in_force(args, root)
    verdicts = _visible([validate(r, key=key) for r in list_checkpoints(root)])
    kept = plan_retention([Candidate.of(v.manifest) for v in verdicts if v.ok and v.manifest], policy)
    rows = [_ckpt_row(v, latest, now, kept) for v in verdicts]
    quarantined = [{"name": q.name, "path": str(q.path), "reason": q.reason} for q in list_quarantined(root)]
    tmps = [_tmp_row(t, "tmp", me) for t in list_tmp(root, now)]
    tmps += [_tmp_row(t, "deleting", me) for t in list_deleting(root, now)]
    others = [_foreign_row(fv, now) for fv in _foreign_verdicts(root)]
    doc: dict[str, Any] = {
        "root": str(root),
        "latest": latest,
        "retention": {"policy": policy.to_dict(), "source": source},
        "checkpoints": rows,
        "foreign": others,
        "quarantined": quarantined,
        "tmp": tmps,
    }
    parts = [_ckpt_table(rows)] if rows else [] if others else [f"no committed checkpoints in {root}"]
    if rows:
        parts.append(f"kept: why retention keeps each one ({policy.describe()}; {source})")
    if others:
        parts.append(_foreign_table(others))
    if latest is not None and latest not in {r["name"] for r in rows}:
        parts.append(f"note: latest names {latest}, which is not a committed checkpoint here")
    if quarantined:
        parts.append(
            "quarantined (kept for inspection; `ckpt prune` keeps the newest, see --quarantine-keep):"
        )
        parts.append(display.table(["name", "reason"], [[q["name"], q["reason"]] for q in quarantined]))
    if tmps:
        parts.append("in progress or left behind (stale ones are removed by `ckpt prune`):")
        parts.append(
            display.table(
                ["name", "age", "writer", "state"],
                [
                    [t["name"], display.human_age(t["age_s"]), f"{t['pid']}@{t['host']}", _tmp_state(t)]
                    for t in tmps
                ],
            )
        )
    if args.remote:
        tiers = _tier_rows(root, args.remote, args.remote_endpoint, key)
        doc["tiers"] = tiers
        parts += ["", _tier_table(tiers)]
    _emit(args, doc, "\n".join(parts))
    return Exit.OK


def _policy_in_force(args: argparse.Namespace, root: Path) -> tuple[RetentionPolicy, str]:
    """The policy `prune` applies and `list` explains its kept column by, and where it comes
    from: the flags, else the one the trainer recorded (a prune by hand without flags must not
    delete what the trainer keeps, e.g. its best checkpoints), else the default."""
    given = policy_from_args(args)
    if given is not None:
        return given, "from the flags"
    recorded = read_policy(root)
    if recorded is not None:
        return recorded, f"recorded in {RunDir.of(root).retention}"
    return RetentionPolicy(), "the default; none recorded"


def _tier_rows(root: Path, url: str, endpoint: str | None, key: bytes | None) -> dict[str, Any]:
    """Both tiers side by side (supervisor/tiers/listing.py); the remote is reached only here."""
    from supervisor.tiers.listing import list_tiers
    from supervisor.tiers.remote import open_remote

    listing = list_tiers(root, open_remote(url, endpoint, key=key), key=key)
    st = listing.status
    return {
        "url": listing.url,
        "remote_error": listing.remote_error,
        "lag_steps": listing.lag_steps,
        "uploader": dict(st.__dict__, skipped=list(st.skipped)) if st else None,
        "rows": [
            {
                "step": r.step,
                "name": r.name,
                "where": r.where,
                "local": r.local,
                "remote": r.remote,
                "bytes": r.bytes,
            }
            for r in listing.rows
        ],
    }


def _tier_table(t: dict[str, Any]) -> str:
    head = f"tiers (remote {t['url']}"
    head += f": unreachable, {t['remote_error']})" if t["remote_error"] else f", lag {t['lag_steps']} steps)"
    rows = [
        [r["name"], r["where"], r["local"], r["remote"], display.human_bytes(r["bytes"])] for r in t["rows"]
    ]
    return head + "\n" + display.table(["name", "where", "local", "remote", "size"], rows)


def _tmp_state(t: dict[str, Any]) -> str:
    if t["kind"] == "deleting":
        return "being deleted" + (" (stale)" if t["stale"] else "")
    return "stale" if t["stale"] else "may be writing"


@_one_line_errors
def cmd_verify(args: argparse.Namespace) -> int:
    root = open_run_dir(args.ckpt_root)
    key = _signing_key(args, root)
    refs = list_checkpoints(root)
    now, latest = time.time(), read_latest(root)
    with _progress(refs, "verify", args.deep, stop_at_valid=False) as progress:
        verdicts = _visible([validate(r, deep=args.deep, progress=progress, key=key) for r in refs])
    rows = [_ckpt_row(v, latest, now) for v in verdicts]
    others = _foreign_verdicts(root, deep=args.deep)
    every = verdicts + [fv.verdict for fv in others]
    ok = all(v.ok for v in every)
    unknown = sum(v.unknown for v in every)
    foreign_rows = [_foreign_row(fv, now) for fv in others]
    doc = {
        "root": str(root),
        "deep": args.deep,
        "ok": ok,
        "unknown": unknown,
        "checkpoints": rows,
        "foreign": foreign_rows,
    }
    depth = "checksums, .metadata" if args.deep else "sizes; --deep also checks checksums and .metadata"
    if key is not None:
        depth += ", signatures" + (" and every file's sha256" if args.deep else "")
    summary = f"{sum(v.ok for v in verdicts)} of {len(verdicts)} checkpoints valid ({depth})"
    parts = [_ckpt_table(rows), summary] if rows else []
    if others:
        sealed = sum(fv.sealed and fv.verdict.ok for fv in others)
        complete = sum(fv.verdict.ok for fv in others)
        parts += [
            _foreign_table(foreign_rows),
            f"{complete} of {len(others)} other trainers' checkpoints complete "
            f"(structure{', CRC32s' if args.deep else ''}); {sealed} sealed"
            + (", checksums verified" if args.deep and sealed else "")
            + (f"; {complete - sealed} unverified: no checksums" if complete > sealed else ""),
        ]
    if unknown:
        parts.append(f"{unknown} could not be read (not proof of corruption: retry later)")
    _emit(args, doc, "\n".join(parts or [f"no committed checkpoints in {root}"]))
    return verify_exit(every)


def verify_exit(verdicts: list[Verdict]) -> Exit:
    """1 when a checkpoint is corrupt or (with a key) not trusted: a problem was found, whatever
    else could not be read; else 3 when one could not be read; else 0."""
    if any(v.evidence in (Evidence.CORRUPT, Evidence.UNTRUSTED) for v in verdicts):
        return Exit.FOUND_PROBLEM
    return Exit.UNREADABLE if any(v.unknown for v in verdicts) else Exit.OK


@_one_line_errors
def cmd_pick(args: argparse.Namespace) -> int:
    root = open_run_dir(args.ckpt_root)
    key = _signing_key(args, root)
    refs = list_checkpoints(root)
    if not refs and (others := list_foreign(root)):
        return _pick_foreign(args, root, others)
    no_usable = ""
    with _progress(refs, "pick", args.deep, stop_at_valid=True) as progress:
        try:
            res = pick(
                root,
                deep=args.deep,
                dry_run=args.dry_run,
                progress=progress,
                io_retry_s=args.io_retry,
                on_retry=lambda msg: print(f"warning: {printable(msg)}", file=sys.stderr, flush=True),
                allow_fresh_start=args.allow_fresh_start,
                key=key,
            )
        except NoUsableCheckpoint as e:
            res, no_usable = e.result, str(e)
    chosen = res.chosen
    doc = {
        "root": str(root),
        "deep": args.deep,
        "dry_run": res.dry_run,
        "chosen": None
        if chosen is None
        else {"name": chosen.ref.name, "step": chosen.ref.step, "path": str(chosen.ref.path)},
        "quarantined": [{"name": n, "reason": r} for n, r in res.quarantined],
        "latest_before": res.latest_before,
        "latest_after": res.latest_after,
        "no_usable": no_usable or None,
        **({"untrusted": [{"name": n, "reason": r} for n, r in res.untrusted]} if key is not None else {}),
    }
    _emit(args, doc, "\n".join(_pick_lines(root, res, no_usable)))
    return Exit.OK if chosen is not None else Exit.FOUND_PROBLEM


def _pick_foreign(args: argparse.Namespace, root: Path, refs: list[ForeignRef]) -> int:
    """Another trainer's checkpoints (no manifest, no ``latest``): the newest complete one, walking
    back; a broken one newer than it goes to quarantine/ (so torchtitan's ``max()`` and Lightning's
    ``last`` cannot pick it), unless it may still be being written (changed within the hour). What
    cannot be read stops the walk: exit 3, nothing moved past it."""
    now, chosen, moved, left, lines = time.time(), None, [], [], []
    verb = "would quarantine" if args.dry_run else "quarantined"
    for ref in refs:
        fv = validate_foreign(ref, deep=args.deep)
        v = fv.verdict
        if v.ok:
            chosen = fv
            break
        if v.unknown:
            return _unreadable(f"{v.reason}; nothing picked (retry when the storage answers)")
        if v.gone:
            continue
        if foreign_may_be_writing(ref, now):
            left.append({"name": ref.name, "reason": v.reason})
            why = _why({"name": ref.name, "reason": v.reason})
            lines.append(f"left alone {ref.name} (changed within the hour: a save in flight?): {why}")
            continue
        if not args.dry_run:
            quarantine_foreign(root, ref, v.reason)
        moved.append({"name": ref.name, "reason": v.reason})
        lines.append(f"{verb} {ref.name}: {_why({'name': ref.name, 'reason': v.reason})}")
    if chosen is None:
        lines.append(f"no complete checkpoint in {root}")
    else:
        label = FOREIGN_LABEL[chosen.ref.kind]
        lines.append(
            f"{'would pick' if args.dry_run else 'picked'} {chosen.ref.name} ({label}; {chosen.mark})"
        )
    doc = {
        "root": str(root),
        "deep": args.deep,
        "dry_run": args.dry_run,
        "chosen": None
        if chosen is None
        else {
            "name": chosen.ref.name,
            "step": chosen.ref.step,
            "path": str(chosen.ref.path),
            "kind": chosen.ref.kind.value,
            "mark": chosen.mark,
        },
        "quarantined": moved,
        "left_alone": left,
        "latest_before": None,
        "latest_after": None,
        "no_usable": None,
    }
    _emit(args, doc, "\n".join(lines))
    return Exit.OK if chosen is not None else Exit.FOUND_PROBLEM


@_one_line_errors
def cmd_seal(args: argparse.Namespace) -> int:
    root = open_run_dir(args.ckpt_root)
    refs = list_foreign(root)
    if args.step is not None:
        refs = [r for r in refs if r.step == args.step]
    done: list[dict[str, Any]] = [
        {"name": r.name, "step": r.step, "result": what} for r, what in seal_foreign(root, refs)
    ]
    lines = [f"{d['name']}: {d['result']}" for d in done] or [
        f"no checkpoint of another trainer in {root}"
        + (f" at step {args.step}" if args.step is not None else "")
    ]
    _emit(args, {"root": str(root), "sealed": done}, "\n".join(lines))
    broken = any(d["result"].startswith("not sealed") for d in done)
    return Exit.FOUND_PROBLEM if broken or not done else Exit.OK


def _pick_lines(root: Path, res: PickResult, no_usable: str) -> list[str]:
    chosen = res.chosen
    verb = "would quarantine" if res.dry_run else "quarantined"
    lines = [f"{verb} {n}: {_why({'name': n, 'reason': r})}" for n, r in res.quarantined]
    lines += [f"skipped {n} (not trusted): {_why({'name': n, 'reason': r})}" for n, r in res.untrusted]
    if no_usable:
        lines.append(no_usable)
    elif chosen is None:
        lines.append(f"no valid checkpoint in {root}: a resume starts from scratch")
    else:
        lines.append(f"{'would pick' if res.dry_run else 'picked'} {chosen.ref.name}")
    if res.latest_before != res.latest_after:
        lines.append(f"latest: {res.latest_before or '(none)'} -> {res.latest_after or '(none)'}")
    return lines


@_one_line_errors
def cmd_prune(args: argparse.Namespace) -> int:
    policy_from_args(args)  # a bad flag is refused before any work
    root = open_run_dir(args.ckpt_root)
    policy, source = _policy_in_force(args, root)
    res = prune(
        root,
        policy=policy,
        dry_run=args.dry_run,
        quarantine_keep=args.quarantine_keep,
        quarantine_max_bytes=args.quarantine_max_bytes,
    )
    doc = {
        "root": str(root),
        "dry_run": res.dry_run,
        "keep": policy.keep,
        "milestone_every": policy.milestone_every,
        "policy": policy.to_dict(),
        "policy_source": source,
        "quarantine_keep": args.quarantine_keep,
        "quarantine_max_bytes": args.quarantine_max_bytes,
        "deleted": list(res.deleted),
        "kept": list(res.kept),
        "why_kept": {n: [r.value for r in why] for n, why in res.why_kept.items()},
        "quarantined": [{"name": n, "reason": r} for n, r in res.quarantined],
        "stale_tmp_removed": list(res.stale_tmp_removed),
        "quarantine_removed": list(res.quarantine_removed),
        "unknown": [{"name": n, "reason": r} for n, r in res.unknown],
    }
    would = "would " if res.dry_run else ""
    lines = [f"{would}remove stale {n}" for n in res.stale_tmp_removed]
    lines += [f"{would}remove quarantined {n}" for n in res.quarantine_removed]
    lines += [f"{would}delete {n}" for n in res.deleted]
    lines += [f"{would}quarantine {n}: {_why({'name': n, 'reason': r})}" for n, r in res.quarantined]
    lines += [f"left alone {n}: {_why({'name': n, 'reason': r})}" for n, r in res.unknown]
    kept = [
        n + (f" ({', '.join(r.value for r in res.why_kept[n])})" if n in res.why_kept else "")
        for n in res.kept
    ]
    lines.append(f"kept {len(res.kept)} ({policy.describe()}; {source}): {', '.join(kept) or '(none)'}")
    _emit(args, doc, "\n".join(lines))
    return Exit.OK


@_one_line_errors
def cmd_quarantine(args: argparse.Namespace) -> int:
    root = open_run_dir(args.ckpt_root)
    try:
        name = step_dirname(args.step)
    except ValueError as e:
        raise StoreError(f"step {args.step}: {e}") from None
    reason = f"{name}: moved aside by hand (`ckpt quarantine`)" + (f": {args.reason}" if args.reason else "")
    dest = quarantine_step(root, args.step, reason)
    _emit(
        args,
        {"root": str(root), "name": name, "moved_to": str(dest), "reason": reason},
        f"quarantined {name} to {dest}",
    )
    return Exit.OK


@_one_line_errors
def cmd_rollback(args: argparse.Namespace) -> int:
    root = open_run_dir(args.ckpt_root)
    try:
        name = step_dirname(args.to)
    except ValueError as e:
        raise StoreError(f"step {args.to}: {e}") from None
    _refuse_live(root, name, args.run_stopped)
    res = rollback(root, args.to, dry_run=True)
    if not (args.dry_run or args.yes or _confirmed(res)):
        raise StoreError(
            f"{root}: rollback to {name} not confirmed: nothing changed (answer y, or pass --yes)"
        )
    if not args.dry_run:
        res = rollback(root, args.to)
    verb = "would move" if res.dry_run else "moved"
    lines = [f"{verb} {n} to quarantine (rolled back)" for n in res.newer]
    lines.append(
        f"latest: {res.latest_before or '(none)'} -> {res.to}" + (" (dry run)" if res.dry_run else "")
    )
    doc = {
        "root": str(root),
        "to": res.to,
        "dry_run": res.dry_run,
        "newer": list(res.newer),
        "moved": [{"name": n, "moved_to": dest} for n, dest in res.moved],
        "latest_before": res.latest_before,
        "latest_after": res.latest_before if res.dry_run else res.to,
    }
    _emit(args, doc, "\n".join(lines))
    return Exit.OK


def _refuse_live(root: Path, name: str, run_stopped: bool) -> None:
    """A rollback beside a live run would be undone by its next commit or resume: refused, as is
    one of a run with a remote tier (its next resume would download the newer checkpoints back)."""
    from supervisor.report import live_signs

    rd = RunDir.of(root)
    if rd.remote_status.exists():
        raise StoreError(
            f"{root}: this run has a remote tier ({rd.remote_status}): its next resume would download the "
            f"checkpoints newer than {name} back; rolling back both tiers is not supported yet"
        )
    signs = live_signs(root)
    here = [s for s in signs if s.here]
    if here or (signs and not run_stopped):
        sign = (here or signs)[0]
        also = "" if here else "; if that host is gone for good, pass --run-stopped"
        raise StoreError(f"{root}: the run is live ({sign.what}); stop it first, then roll back{also}")


def _confirmed(plan: RollbackResult) -> bool:
    """Ask on the terminal; a refusal without one (a script must say --yes)."""
    if not sys.stdin.isatty():
        raise StoreError(f"rollback to {plan.to}: stdin is not a terminal to ask on; pass --yes to confirm")
    newer = ", ".join(plan.newer) or "none"
    print(
        f"roll back to {plan.to}: move {len(plan.newer)} newer checkpoint(s) to quarantine ({newer}) "
        f"and point latest at {plan.to}? [y/N] ",
        end="",
        file=sys.stderr,
        flush=True,
    )
    return sys.stdin.readline().strip().lower() in ("y", "yes")


# ---------------------------------------------------------------- argparse


def _non_negative(text: str) -> int:
    n = int(text)
    if n < 0:
        raise argparse.ArgumentTypeError(f"{n} is negative")
    return n


def _count_or_all(text: str) -> int | None:
    """N >= 0, or ``all`` (no limit)."""
    return None if text == "all" else _non_negative(text)


_UNITS = {"": 1, "K": 1 << 10, "M": 1 << 20, "G": 1 << 30, "T": 1 << 40}


def _byte_count(text: str) -> int:
    """``500M``, ``20G``, ``1T`` (binary units) or plain bytes."""
    t = text.strip().upper().removesuffix("B").removesuffix("I")
    unit = t[-1:] if t[-1:] in _UNITS else ""
    try:
        n = float(t[: len(t) - len(unit)])
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not a size (e.g. 500M, 20G)") from None
    if n < 0:
        raise argparse.ArgumentTypeError(f"{text} is negative")
    return int(n * _UNITS[unit])


DRY_RUN = "decide and report, change nothing"


@dataclass(frozen=True, kw_only=True)
class Common:
    """Every ``ckpt`` subcommand's options."""

    ckpt_root: Path = shared.ckpt_root()
    json: bool = shared.as_json()


@dataclass(frozen=True, kw_only=True)
class ListOptions(Common):
    remote: str | None = option("also list the remote tier at this URL (docs/tiers.md)", None)
    remote_endpoint: str | None = shared.remote_endpoint()


@dataclass(frozen=True, kw_only=True)
class VerifyOptions(Common):
    deep: bool = option("also check every file's checksum and DCP's .metadata pickle", False)


@dataclass(frozen=True, kw_only=True)
class PickOptions(Common):
    deep: bool = option("check checksums too (reads every byte)", False)
    dry_run: bool = option(DRY_RUN, False)
    io_retry: float = shared.io_retry("exit 3")
    allow_fresh_start: bool = shared.allow_fresh_start("report 'start from scratch' instead of refusing")


@dataclass(frozen=True, kw_only=True)
class PruneOptions(Common):
    quarantine_keep: int | None = option(
        "newest quarantined checkpoints kept", QUARANTINE_KEEP, parse=_count_or_all, metavar="N|all"
    )
    quarantine_max_bytes: int | None = option(
        "also remove the oldest quarantined ones until they take at most this much (e.g. 200G)",
        None,
        parse=_byte_count,
        metavar="BYTES",
    )
    dry_run: bool = option(DRY_RUN, False)


@dataclass(frozen=True, kw_only=True)
class SealOptions(Common):
    step: int | None = option("only the checkpoint of this step", None, parse=_non_negative)


@dataclass(frozen=True, kw_only=True)
class QuarantineOptions(Common):
    step: int = option("the checkpoint's step", parse=_non_negative, positional=True)
    reason: str = option("why (written to its reason.txt)", "")


@dataclass(frozen=True, kw_only=True)
class RollbackOptions(Common):
    to: int = option("the valid checkpoint to go back to", parse=_non_negative, metavar="STEP")
    yes: bool = option("do not ask for confirmation", False)
    dry_run: bool = option(DRY_RUN, False)
    run_stopped: bool = option(
        "the run's watchdog or ranks on another host look live but are gone for good (a failed node)", False
    )


# Each subcommand's declared options (the signing key and the retention flags are added by their
# own declarations: supervisor/signing.py, supervisor/store/retention_policy.py).
OPTIONS: dict[str, type[Common]] = {
    "list": ListOptions,
    "verify": VerifyOptions,
    "pick": PickOptions,
    "prune": PruneOptions,
    "seal": SealOptions,
    "quarantine": QuarantineOptions,
    "rollback": RollbackOptions,
}


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from supervisor.signing import add_signing_key_arg

    ckpt = subparsers.add_parser("ckpt", help="list, verify, pick or prune checkpoints of a run")
    sub = ckpt.add_subparsers(dest="ckpt_command", required=True)

    def add(name: str, func: Handler, help_: str, opts: type[Common]) -> argparse.ArgumentParser:
        p = sub.add_parser(name, help=help_, description=help_)
        options.add_options(p, opts)
        p.set_defaults(func=func)
        return p

    p = add(
        "list", cmd_list, "committed checkpoints newest first, quarantined ones and tmp dirs", ListOptions
    )
    add_signing_key_arg(p)
    add_retention_args(p)  # the kept column explains this policy (default: the recorded one)
    p = add(
        "verify",
        cmd_verify,
        "check every committed checkpoint; exit 1 if one is invalid (or not trusted), 3 if one could not be read",
        VerifyOptions,
    )
    add_signing_key_arg(p)
    p = add(
        "pick",
        cmd_pick,
        "choose the newest valid checkpoint, quarantine newer invalid ones, repoint latest",
        PickOptions,
    )
    add_signing_key_arg(p)
    p = add(
        "prune",
        cmd_prune,
        "delete checkpoints beyond retention, stale tmp dirs, old quarantined ones",
        PruneOptions,
    )
    add_retention_args(p)
    add(
        "seal",
        cmd_seal,
        "record the checksums of other trainers' checkpoints (torchtitan's step-N/, Lightning's "
        ".ckpt) beside them, so `verify --deep` proves their bytes from then on",
        SealOptions,
    )
    add(
        "quarantine",
        cmd_quarantine,
        "move one committed checkpoint aside by hand, with a reason",
        QuarantineOptions,
    )
    add(
        "rollback",
        cmd_rollback,
        "resume from an older checkpoint: quarantine every newer one (never deleted), point latest at it",
        RollbackOptions,
    )
