"""Committed checkpoints: discovery, validation with its evidence, the ``latest`` pointer,
quarantine, and the root's lock. The base of the store (supervisor/store/ re-exports all of it;
callers use ``store.<name>``).

Validation never raises OSError: what it could not read makes the checkpoint UNKNOWN (retried by
``pick``, never quarantined); only content evidence makes it CORRUPT (supervisor/store/ioerrors.py).
"""

from __future__ import annotations

import errno
import os
import time
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from supervisor.errors import UserError, refine
from supervisor.format import confined
from supervisor.format.atomic import atomic_write_text, fsync_dir
from supervisor.format.capped import MANIFEST_MAX, RECORD_MAX, TooLarge, file_kind_problem, read_capped
from supervisor.format.exitcodes import Exit
from supervisor.format.layout import (
    MANIFEST,
    QUARANTINE_DELETING_PREFIX,
    REASON,
    SIGNATURE,
    RunDir,
    file_rank,
    is_dcp_index,
    parse_committed,
    quarantined_dirname,
)
from supervisor.format.manifest import (
    CHECKSUM_ALGO,
    NOT_LISTED,
    READ_CHUNK,
    Manifest,
    ManifestError,
    ProgressFn,
    hash_files,
    list_files,
    parse_manifest,
)
from supervisor.store.ioerrors import Evidence, describe, evidence_of, is_transient

if TYPE_CHECKING:
    from filelock import BaseFileLock

    from supervisor.signing import Signature, Untrusted

LOCK_TIMEOUT_S = 600.0
REASON_LOST = "reason unknown: the process that quarantined this checkpoint stopped before writing it"


class StoreError(UserError):
    """Bad input or state of a checkpoint root; ``str(e)`` is one line naming the file and the fix."""


class MismatchError(StoreError):
    """The newest valid checkpoint was made with another model config or data: not corruption."""

    codes = refine(StoreError.codes, trainer=Exit.MISMATCH)


@dataclass(frozen=True)
class CheckpointRef:
    """A committed checkpoint's directory and its step, as listed (nothing read yet)."""

    step: int
    path: Path

    @property
    def name(self) -> str:
        return self.path.name


@dataclass(frozen=True)
class Verdict:
    """A checkpoint's check: OK, corrupt (proof) or unknown (storage did not answer: not proof)."""

    ref: CheckpointRef
    evidence: Evidence
    reason: str = ""
    manifest: Manifest | None = None
    # The directory vanished while it was read (pruned or quarantined meanwhile): not corruption.
    gone: bool = False
    # UNKNOWN: the error that made it so (its filename names the file).
    error: OSError | None = field(default=None, compare=False, repr=False)
    # Validated with a signing key: "ok", "unsigned" or "bad signature" (supervisor/signing.py);
    # "" when no key was given or the content check failed first.
    signature: str = ""

    @property
    def ok(self) -> bool:
        return self.evidence is Evidence.OK

    @property
    def unknown(self) -> bool:
        """Could not be read (not gone): neither usable nor corrupt."""
        return self.evidence is Evidence.UNKNOWN and not self.gone


@dataclass(frozen=True)
class Expectation:
    """What the resuming run is; a checkpoint that differs is refused unless allowed."""

    model_config_hash: str | None = None
    data_fingerprint: str | None = None
    allow_config_change: bool = False
    allow_data_change: bool = False


# ---------------------------------------------------------------- root and lock


def require_root(root: str | Path) -> Path:
    """The root as a Path, or a one-line StoreError saying what is wrong with it. A root that
    cannot even be stat'ed raises its OSError (transient: retried by ``pick``)."""
    p = Path(root)
    if not p.exists():
        raise StoreError(f"{p}: checkpoint root does not exist (check --ckpt-root)")
    if not p.is_dir():
        raise StoreError(f"{p}: checkpoint root is not a directory (check --ckpt-root)")
    if not os.access(p, os.R_OK | os.X_OK):
        raise StoreError(f"{p}: checkpoint root is not readable (check permissions)")
    return p


@contextmanager
def root_lock(root: str | Path, timeout: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Exclusive lock on the root for mutations; re-entrant within one thread, exclusive between
    threads and processes. One FileLock object per path (singleton), else a nested acquire in the
    same process would wait on itself."""
    with file_lock(RunDir.of(root).lock).acquire(timeout=timeout):
        yield


def file_lock(path: Path) -> BaseFileLock:
    """The process's one FileLock object for ``path`` (``acquire(timeout=...)`` it)."""
    from filelock import FileLock  # here: read-only commands (`status`) never pay its import

    return FileLock(os.path.abspath(path), is_singleton=True)


# ---------------------------------------------------------------- latest


def write_latest(root: str | Path, name: str | None) -> None:
    """Point ``latest`` at ``name`` atomically, or remove it when there is nothing to point at."""
    path = RunDir.of(root).latest
    if name is None:
        if os.path.lexists(path):  # lexists: a dangling symlink left by another tool counts too
            confined.unlink(root, path)  # a link itself, never what it points to
            fsync_dir(path.parent)
        return
    atomic_write_text(path, name + "\n", root)


def latest_raw(root: str | Path) -> str | None:
    """The pointer's exact content (None when absent); a symlink or unreadable file never equals
    what ``write_latest`` writes, so ``pick`` rewrites it."""
    path = RunDir.of(root).latest
    if not os.path.lexists(path):
        return None
    if path.is_symlink():
        return "<symlink>"
    try:
        return read_capped(path, RECORD_MAX).decode(errors="replace")
    except (OSError, TooLarge):
        return "<unreadable>"


def read_latest(root: str | Path) -> str | None:
    """What ``latest`` says (a hint, never trusted alone), or None when missing or garbage.
    A path (``ckpt/step_00000050``) or a symlink, as other tools write it, reads as its last part."""
    path = RunDir.of(root).latest
    try:
        text = (
            os.readlink(path) if path.is_symlink() else read_capped(path, RECORD_MAX).decode(errors="replace")
        )
    except (OSError, TooLarge):
        return None
    name = text.strip().rstrip("/").rsplit("/", 1)[-1]
    return name if parse_committed(name) is not None else None


# ---------------------------------------------------------------- discovery and validation


def list_checkpoints(root: str | Path) -> list[CheckpointRef]:
    """Committed checkpoint directories, newest first. Tmp dirs are never checkpoints, nor is a
    symbolic link named like one: what it points to is not this run's (it is never loaded, moved
    or deleted; `ckpt quarantine` of its step says so).

    A root that cannot be listed raises its OSError (an unreadable root must never read as "no
    checkpoints": that would start the run from step 0). An entry whose type cannot be read is
    listed, not dropped: ``validate`` then says it is unknown."""
    root = Path(root)
    try:
        entries = os.scandir(root)
    except FileNotFoundError:
        return []
    refs = []
    with entries:
        for entry in entries:
            step = parse_committed(entry.name)
            if step is None:
                continue
            try:
                is_dir = entry.is_dir(follow_symlinks=False)
            except OSError as e:
                is_dir = is_transient(e)
            if is_dir:
                refs.append(CheckpointRef(step, root / entry.name))
    return sorted(refs, key=lambda r: r.step, reverse=True)


def validate(
    ref: CheckpointRef, deep: bool = False, progress: ProgressFn | None = None, key: bytes | None = None
) -> Verdict:
    """Quick: manifest parses, known schema, right step, every file present at its size, nothing
    unlisted, every rank of a format-2 manifest covered. Deep: also every checksum, and DCP's
    pickled ``.metadata`` names nothing outside its allowlist (supervisor/safepickle.py). The reason
    names the file and what is wrong. Never raises OSError: what cannot be read is UNKNOWN.

    With a signing ``key`` (docs/security.md), a checkpoint that passes is also checked against its
    ``manifest.sig`` (quick: the HMAC over the manifest; deep: every file's SHA-256, from the same
    read as the checksums): UNTRUSTED when it is unsigned or the signature is bad."""
    try:
        raw = read_capped(ref.path / MANIFEST, MANIFEST_MAX)
    except TooLarge:
        return _corrupt(ref, f"{MANIFEST} is larger than any manifest ({MANIFEST_MAX} bytes)")
    except OSError as e:
        return _unreadable(ref, e, MANIFEST)
    try:
        m = parse_manifest(raw)
    except ManifestError as e:
        return _corrupt(ref, str(e))
    if m.step != ref.step:
        return _corrupt(ref, f"{MANIFEST} is for step {m.step}, not {ref.step}")
    if (bad := _check_listing(ref, m)) is not None:
        return bad
    sig: Signature | None = None
    untrusted: Untrusted | None = None  # the key does not vouch for it
    if key is not None:
        checked = _check_signature(ref, raw, m, key)
        if isinstance(checked, Verdict):
            return checked
        sig, untrusted = checked
    if deep:
        v = check_files(ref, m, sorted(m.files), progress, sig=sig)
        if not v.ok:
            return v
    if untrusted is not None:
        return Verdict(ref, Evidence.UNTRUSTED, f"{ref.name}: {untrusted}", m, signature=untrusted.kind)
    return Verdict(ref, Evidence.OK, "", m, signature="ok" if key is not None else "")


def _check_listing(ref: CheckpointRef, m: Manifest) -> Verdict | None:
    """The quick file check: every listed file present at its size, nothing unlisted; None when
    it passes."""
    try:
        present = set(list_files(ref.path)) - NOT_LISTED
    except OSError as e:
        return _unreadable(ref, e, _rel(ref, e.filename, "the directory"))
    for name, entry in sorted(m.files.items()):
        if name not in present:
            return _corrupt(ref, f"{name} is missing")
        try:
            st = os.stat(os.path.join(ref.path, name))
        except OSError as e:
            return _unreadable(ref, e, name)
        if kind := file_kind_problem(st.st_mode):  # a FIFO, a link to /dev/zero: never read
            return _corrupt(ref, f"{name} is {kind}, not a regular file")
        if st.st_size != entry.size:
            return _corrupt(ref, f"{name} is {st.st_size} bytes, manifest says {entry.size}")
    unlisted = sorted(present - set(m.files))
    if unlisted:
        return _corrupt(ref, f"{unlisted[0]} is not listed in {MANIFEST}")
    outside = next(
        ((n, r) for n in sorted(m.files) if (r := file_rank(n)) is not None and r >= m.world_size), None
    )
    if outside is not None:  # a manifest edited to another world size than its files were written by
        name, rank = outside
        return _corrupt(ref, f"{name} is rank {rank}'s, but {MANIFEST} says world size {m.world_size}")
    return None


def _check_signature(
    ref: CheckpointRef, raw: bytes, m: Manifest, key: bytes
) -> tuple[Signature | None, Untrusted | None] | Verdict:
    """The quick signature check of a manifest that passed: (the verified signature, None) or
    (None, why it is untrusted); a Verdict when ``manifest.sig`` cannot be read."""
    from supervisor import signing

    try:
        sig_bytes: bytes | None = read_capped(ref.path / SIGNATURE, MANIFEST_MAX)
    except FileNotFoundError:
        sig_bytes = None
    except TooLarge:
        return None, signing.Untrusted(signing.BAD, f"{SIGNATURE} is larger than any signature")
    except OSError as e:
        return _unreadable(ref, e, SIGNATURE)
    try:
        return signing.verify(raw, sig_bytes, m.files, key), None
    except signing.Untrusted as e:
        return None, e


def check_files(
    ref: CheckpointRef,
    m: Manifest,
    names: Sequence[str],
    progress: ProgressFn | None = None,
    chunk: int = READ_CHUNK,
    sig: Signature | None = None,
) -> Verdict:
    """The deep part of ``validate`` for some of the files of ``m`` (each rank of a trainer checks
    its share of a checkpoint this way): OK; CORRUPT naming the first file whose checksum differs,
    or a pickled DCP index outside the allowlist; UNKNOWN naming one that cannot be read; with a
    verified signature ``sig``, UNTRUSTED naming a file whose SHA-256 is not the signed one. Never
    raises OSError."""
    from supervisor.signing import DIGEST_ALGO, Untrusted, check_digests  # stdlib only: cheap

    algos = (CHECKSUM_ALGO, DIGEST_ALGO) if sig is not None else (CHECKSUM_ALGO,)
    try:
        sums = hash_files(
            [os.path.join(ref.path, n) for n in names],
            algos,
            progress,
            chunk=chunk,
            limits=[m.files[n].size for n in names],  # a file that grew is not hashed on and on
        )
    except OSError as e:
        return _unreadable(ref, e, _rel(ref, e.filename, "a file"))
    for name, (actual, *_) in zip(names, sums, strict=True):
        expected = m.files[name].checksum
        if actual != expected:
            return _corrupt(ref, f"{name} checksum {actual[:12]}.. differs from manifest {expected[:12]}..")
    problem = _pickles_problem(ref, m, names)
    if isinstance(problem, OSError):
        return _unreadable(ref, problem, _rel(ref, problem.filename, "a file"))
    if problem:
        return _corrupt(ref, problem)
    if sig is not None:
        try:
            check_digests(sig, {n: s[1] for n, s in zip(names, sums, strict=True)})
        except Untrusted as e:
            return Verdict(ref, Evidence.UNTRUSTED, f"{ref.name}: {e}", m, signature=e.kind)
    return Verdict(ref, Evidence.OK, "", m, signature="ok" if sig is not None else "")


def _pickles_problem(ref: CheckpointRef, m: Manifest, names: Sequence[str]) -> str | OSError:
    """Why a pickled DCP index of the checkpoint may not be loaded ('' when none), or the OSError
    that kept it from being read."""
    from supervisor import safepickle

    for name in names:
        if is_dcp_index(name):
            try:
                data = read_capped(ref.path / name, m.files[name].size)
            except TooLarge:
                return f"{name} grew past its listed {m.files[name].size} bytes"
            except OSError as e:
                e.filename = e.filename or os.path.join(ref.path, name)
                return e
            try:
                safepickle.check(data, name)
            except safepickle.UnsafePickle as e:
                return str(e)
    return ""


def _corrupt(ref: CheckpointRef, why: str) -> Verdict:
    return Verdict(ref, Evidence.CORRUPT, f"{ref.name}: {why}")


def _unreadable(ref: CheckpointRef, e: OSError, name: str) -> Verdict:
    """What an OSError met on ``name`` proves: a whole checkpoint gone meanwhile is ``gone``, a
    missing file corrupt, anything else (EIO, ESTALE...) unknown."""
    e.filename = e.filename or os.path.join(ref.path, name)  # a failed read() names no file
    if e.errno == errno.ENOENT and _vanished(ref):
        return Verdict(ref, Evidence.UNKNOWN, f"{ref.name}: vanished while it was read", gone=True)
    if e.errno == errno.ENOENT:
        return _corrupt(ref, f"{name} is missing")
    return Verdict(ref, evidence_of(e), f"{ref.name}: {name} is unreadable ({describe(e)})", error=e)


def _rel(ref: CheckpointRef, filename: str | bytes | os.PathLike[str] | None, default: str) -> str:
    """The file an OSError names, relative to the checkpoint (``default`` when it names none)."""
    rel = os.path.relpath(os.fsdecode(filename), ref.path) if filename else "."
    return default if rel == "." else rel


def _vanished(ref: CheckpointRef) -> bool:
    """The whole checkpoint directory is gone (a concurrent prune or quarantine moved it)."""
    try:
        os.stat(ref.path)
    except FileNotFoundError:
        return True
    except OSError:
        return False
    return False


def identity(ref: CheckpointRef) -> tuple[int, ...] | None:
    """Which directory and manifest file a verdict was made on; None when the directory is gone.
    Raises a transient OSError (the caller retries)."""
    try:
        d = os.stat(ref.path)
    except FileNotFoundError:
        return None
    try:
        m = os.stat(ref.path / MANIFEST)
    except FileNotFoundError:
        return (d.st_dev, d.st_ino, d.st_mtime_ns)
    return (d.st_dev, d.st_ino, d.st_mtime_ns, m.st_ino, m.st_size, m.st_mtime_ns)


def check_compatible(v: Verdict, expect: Expectation) -> None:
    """Raise MismatchError when the checkpoint was made for another model config or data."""
    m = v.manifest
    if m is None:
        return
    checks = (
        (
            "model config hash",
            m.model_config_hash,
            expect.model_config_hash,
            expect.allow_config_change,
            "config",
        ),
        ("data fingerprint", m.data_fingerprint, expect.data_fingerprint, expect.allow_data_change, "data"),
    )
    for what, saved, wanted, allowed, kind in checks:
        if wanted is not None and saved != wanted and not allowed:
            raise MismatchError(
                f"{v.ref.name}: {what} {saved} differs from this run's {wanted}; "
                f"restore the {kind} or pass --allow-{kind}-change"
            )


# ---------------------------------------------------------------- quarantine


def quarantine(root: str | Path, ref: CheckpointRef, reason: str) -> Path:
    """Move a checkpoint to ``quarantine/`` with ``reason.txt``; never deletes anything."""
    with root_lock(root):
        return quarantine_locked(Path(root), ref, reason)


def quarantine_locked(root: Path, ref: CheckpointRef, reason: str) -> Path:
    """``quarantine`` for a caller that holds the root's lock. Through no link (confined.py): a
    ``quarantine/`` or a ``step_N`` that is a symbolic link is refused (confined.Escape, one line
    naming it), so nothing is moved out of the run directory nor written through a link."""
    qdir = RunDir.of(root).quarantine
    confined.make_dirs(root, qdir)
    stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
    n = 1
    while os.path.lexists(dest := qdir / quarantined_dirname(ref.name, stamp, n)):
        n += 1
    confined.rename(root, ref.path, dest)
    fsync_dir(root)
    atomic_write_text(dest / REASON, reason.rstrip("\n") + "\n", root)
    fsync_dir(qdir)
    return dest


def backfill_reasons(root: Path) -> None:
    """A crash between the move and ``reason.txt`` leaves a quarantined checkpoint without a
    reason; give it one so every quarantined checkpoint explains itself. A repair: a quarantine
    that cannot be listed (a planted link, confined.Escape) is left as it is."""
    try:
        found = list_quarantined(root)
    except OSError:
        return
    for q in found:
        if q.path.is_dir() and not q.path.is_symlink() and not os.path.lexists(q.path / REASON):
            atomic_write_text(q.path / REASON, REASON_LOST + "\n", root)


@dataclass(frozen=True)
class QuarantinedRef:
    """A checkpoint in quarantine/, with the reason recorded when it was moved there."""

    name: str
    path: Path
    reason: str


def list_quarantined(root: str | Path) -> list[QuarantinedRef]:
    """Quarantined checkpoints, newest name first. A quarantine directory that cannot be listed
    raises its OSError: "nothing quarantined" is what lets a resume start from step 0; one that is
    a symbolic link, confined.Escape (what it points to is not this run's)."""
    qdir = RunDir.of(root).quarantine
    try:
        names = sorted(confined.listdir(root, qdir), reverse=True)
    except FileNotFoundError:
        return []
    out = []
    for name in names:
        if name.startswith(QUARANTINE_DELETING_PREFIX):  # being removed by retention
            continue
        try:
            reason = read_capped(qdir / name / REASON, RECORD_MAX).decode(errors="replace").strip()
        except FileNotFoundError:
            reason = f"(no {REASON})"
        except TooLarge:
            reason = f"({REASON} larger than {RECORD_MAX} bytes)"
        except OSError as e:
            reason = f"({REASON} unreadable: {describe(e)})"
        out.append(QuarantinedRef(name, qdir / name, reason))
    return out
