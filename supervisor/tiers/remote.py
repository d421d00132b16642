"""The remote tier's protocol, the same on every backend.

Upload (the last stage of a save): every file of ``step_N`` first, each checked against the local
manifest just before it goes (a corrupt local checkpoint is never uploaded), then ``manifest.json``
last, then ``publish`` (a rename on a shared filesystem, nothing on an object store), then the
commit marker is read back. Until the manifest lands the prefix is INCOMPLETE and nothing uses it.

Download (resume after node loss): the commit marker is checked, every object is downloaded into a
local tmp dir and what landed is hashed against the manifest, and the tmp dir is committed into
the run directory through ``supervisor.store.commit`` (the local commit protocol).

A remote checkpoint whose objects do not match its manifest is moved under ``quarantine/`` with a
``reason.txt``; nothing is deleted except by retention (``prune``) and leftovers of killed uploads.
"""

from __future__ import annotations

import shutil
import time
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn

from supervisor.errors import IntegrityError, StorageError
from supervisor.format.capped import MANIFEST_MAX, RECORD_MAX, read_capped
from supervisor.format.layout import (
    MANIFEST,
    QUARANTINE,
    REASON,
    SIGNATURE,
    parse_committed,
    quarantined_dirname,
    step_dirname,
)
from supervisor.format.manifest import (
    CHECKSUM_ALGO,
    FileEntry,
    ManifestError,
    checksum_file,
    hash_file,
    parse_manifest,
)
from supervisor.redact import redact
from supervisor.signing import BAD, DIGEST_ALGO
from supervisor.store import STALE_TMP_AFTER_S, CheckpointRef, begin, commit
from supervisor.store.ioerrors import describe, is_transient
from supervisor.tiers.backends import Backend, open_backend
from supervisor.tiers.plan import (
    RemotePrunePlan,
    RemoteState,
    RemoteVerdict,
    judge_listing,
    plan_remote_prune,
    same_content,
)

OnFile = Callable[[str, int], None]  # (relative path, bytes) after each object is transferred


class RemoteUnavailable(StorageError):
    """The remote did not answer or answered with an error: retry later, it is not corruption."""


class RemoteCorrupt(IntegrityError):
    """Bytes that do not match their manifest: quarantined, the resume walks back; the message
    names the checkpoint and the file."""


class RemoteUntrusted(IntegrityError):
    """With a signing key: a remote checkpoint not signed with it (unsigned, a bad signature, or
    bytes that differ from the signed digests). Skipped by a resume; never quarantined."""


class LocalSourceError(IntegrityError):
    """The local checkpoint to upload is gone (pruned) or does not match its own manifest."""


class LocalUnreadable(StorageError):
    """A local file could not be read for a transient I/O error (EIO, ESTALE...): not uploaded
    now, tried again later; not a verdict on the checkpoint."""


@dataclass(frozen=True)
class Transfer:
    name: str
    step: int
    bytes: int
    seconds: float
    already_there: bool = False


@dataclass(frozen=True)
class RemoteQuarantined:
    name: str
    reason: str


@contextmanager
def _remote_errors(url: str, what: str) -> Iterator[None]:
    """Anything a backend raises, other than our own verdicts, means: the remote is unavailable."""
    try:
        yield
    except (RemoteCorrupt, RemoteUntrusted, LocalSourceError, LocalUnreadable, RemoteUnavailable):
        raise
    except Exception as e:  # a backend's text may quote the URL, credentials included: redacted
        raise RemoteUnavailable(redact(f"{url}: {what} failed ({e.__class__.__name__}: {e})")) from e


class RemoteTier:
    """One remote tier. Methods raise RemoteUnavailable when the remote cannot be reached.

    With a signing ``key`` (a resume's tier; docs/security.md), checkpoints not signed with it are
    UNTRUSTED, a download checks every file's SHA-256 against the signed one and signs the local
    copy it commits. Without one (the uploader's tier) signatures are only carried along."""

    def __init__(self, backend: Backend, key: bytes | None = None) -> None:
        self.backend = backend
        self.key = key

    @property
    def url(self) -> str:
        """The URL as every message and status file shows it: credentials redacted."""
        return redact(self.backend.url)

    # ------------------------------------------------------------ discovery

    def check(self, step: int) -> RemoteVerdict | None:
        """The commit marker applied to ``step_N``; None when nothing of it is there."""
        name = step_dirname(step)
        with _remote_errors(self.url, f"checking {name}"):
            sizes = self.backend.sizes(name)
            if not sizes:
                return None
            # never read past what a manifest or signature can be (capped.py): a larger one reads as
            # empty, and is judged as a manifest that does not parse, a signature that is not one
            raw = self._small(name, MANIFEST, sizes) if MANIFEST in sizes else None
            signed = self.key is not None and raw is not None and SIGNATURE in sizes
            sig = self._small(name, SIGNATURE, sizes) if signed else None
        return judge_listing(name, step, sizes, raw, self.key, sig)

    def _small(self, name: str, file: str, sizes: dict[str, int]) -> bytes:
        """``name/file``, when its listed size is at most a manifest's cap; else nothing."""
        return self.backend.read(f"{name}/{file}") if sizes[file] <= MANIFEST_MAX else b""

    def scan(self) -> list[RemoteVerdict]:
        """Every checkpoint prefix on the remote (complete, incomplete or corrupt), newest first."""
        with _remote_errors(self.url, "listing"):
            names = self.backend.names()
        out = []
        for name in names:
            step = parse_committed(name)
            v = self.check(step) if step is not None else None
            if v is not None:
                out.append(v)
        return sorted(out, key=lambda v: v.step, reverse=True)

    def list_quarantined(self) -> list[RemoteQuarantined]:
        with _remote_errors(self.url, "listing the quarantine"):
            sizes = self.backend.sizes(QUARANTINE)
            out = []
            for entry in sorted({rel.split("/", 1)[0] for rel in sizes}, reverse=True):
                key = f"{QUARANTINE}/{entry}/{REASON}"
                has_reason = f"{entry}/{REASON}" in sizes
                small = has_reason and sizes[f"{entry}/{REASON}"] <= RECORD_MAX
                reason = self.backend.read(key).decode(errors="replace").strip() if small else ""
                out.append(RemoteQuarantined(entry, reason or f"(no {REASON})"))
        return out

    # ------------------------------------------------------------ upload

    def upload(self, ref: CheckpointRef, on_file: OnFile | None = None) -> Transfer:
        """Copy a committed local checkpoint; the manifest last. Idempotent: a complete remote copy
        with the same files is left as it is; leftovers of a killed upload are replaced; a complete
        copy with other content is quarantined first (as the local store does on a re-commit)."""
        t0 = time.monotonic()
        name = ref.name
        try:
            raw = read_capped(ref.path / MANIFEST, MANIFEST_MAX)
            manifest = parse_manifest(raw)
        except OSError as e:
            _local_read_failed(f"{name}/{MANIFEST}", e)
        except ManifestError as e:
            raise LocalSourceError(f"{name}: local {MANIFEST} unusable ({e}); not uploaded") from None
        there = self.check(ref.step)
        if there is not None and there.ok and there.manifest and same_content(there.manifest, manifest):
            return Transfer(name, ref.step, 0, time.monotonic() - t0, already_there=True)
        with _remote_errors(self.url, f"uploading {name}"):
            if there is not None and there.state is RemoteState.INCOMPLETE:
                self.backend.remove(name)
            elif there is not None:
                why = there.reason or "complete copy with other content"
                self.quarantine(name, f"replaced by a new upload of the same step ({why})")
            staging = self.backend.staging(name)

            def put(rel: str, entry: FileEntry) -> int:
                n = self._put_checked(ref.path / rel, f"{staging}/{rel}", f"{name}/{rel}", entry)
                if on_file:
                    on_file(rel, n)
                return n

            try:
                total = self._each(put, manifest.files)
                signature = _read_local(ref.path / SIGNATURE, f"{name}/{SIGNATURE}")
            except (LocalSourceError, LocalUnreadable):
                self.backend.remove(staging)
                raise
            if signature is not None:  # carried along: a keyed resume from the remote checks it
                self.backend.write(f"{staging}/{SIGNATURE}", signature)
            self.backend.write(f"{staging}/{MANIFEST}", raw)
            self.backend.publish(staging, name)
        landed = self.check(ref.step)  # one LIST + GET: what a resume will see
        if landed is None or not landed.ok:
            why = landed.reason if landed else "nothing there"
            raise RemoteUnavailable(f"{self.url}: {name} not complete after its upload ({why})")
        return Transfer(name, ref.step, total, time.monotonic() - t0)

    def _each(self, fn: Callable[[str, FileEntry], int], files: Mapping[str, FileEntry]) -> int:
        """``fn`` over every file, ``backend.parallel`` at a time; the sum of what it returns. The
        first error propagates once the transfers already running have ended."""
        items = sorted(files.items())
        if self.backend.parallel <= 1:
            return sum(fn(rel, entry) for rel, entry in items)
        with ThreadPoolExecutor(self.backend.parallel, thread_name_prefix="ckpt-transfer") as pool:
            futures = [pool.submit(fn, rel, entry) for rel, entry in items]
            try:
                return sum(f.result() for f in futures)
            except BaseException:
                for f in futures:
                    f.cancel()
                raise

    def _put_checked(self, src: Path, key: str, label: str, entry: FileEntry) -> int:
        """Verify the local file against its manifest entry (a committed checkpoint does not
        change, and it is usually still in the page cache), then upload it."""
        try:
            size, actual = src.stat().st_size, checksum_file(src)
        except OSError as e:
            _local_read_failed(label, e)
        if size != entry.size or actual != entry.checksum:
            raise LocalSourceError(
                f"{label}: local bytes ({size} B, {actual[:12]}..) differ from the manifest "
                f"({entry.size} B, {entry.checksum[:12]}..); not uploaded"
            )
        self.backend.put_file(src, key)
        return size

    # ------------------------------------------------------------ download

    def download(self, step: int, local_root: str | Path, on_file: OnFile | None = None) -> CheckpointRef:
        """Fetch a complete remote checkpoint into ``local_root`` and commit it there.

        Raises RemoteCorrupt (quarantine it and walk back), RemoteUntrusted (with a key: not
        signed with it; skip it, never quarantine) or RemoteUnavailable (try later).
        """
        name = step_dirname(step)
        v = self.check(step)
        if v is None or v.state is RemoteState.INCOMPLETE:
            raise RemoteCorrupt(f"{name}: not a complete checkpoint on {self.url}")
        if v.state is RemoteState.UNTRUSTED:
            raise RemoteUntrusted(v.reason)
        if not v.ok or v.manifest is None:
            raise RemoteCorrupt(v.reason)
        m = v.manifest
        signed = v.signature.files if v.signature is not None else None
        digests: dict[str, str] = {}
        tmp = begin(local_root, step)

        def get(rel: str, entry: FileEntry) -> int:
            digest = self._get_checked(f"{name}/{rel}", tmp / rel, entry, signed)
            if digest:
                digests[rel] = digest
            if on_file:
                on_file(rel, entry.size)
            return entry.size

        try:
            self._each(get, m.files)
            return commit(
                local_root,
                tmp,
                m.info,
                known=m.files,
                writers=m.writers or None,  # a format-1 remote manifest records none
                sign_key=self.key if signed is not None else None,  # verified: signed again here
                digests=digests,
            )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise

    def _get_checked(self, key: str, dest: Path, entry: FileEntry, signed: Mapping[str, str] | None) -> str:
        """Download, then hash what landed (from the page cache) against the manifest and, when
        ``signed`` (name -> signed SHA-256), against its signature; returns that SHA-256 ('' unsigned)."""
        dest.parent.mkdir(parents=True, exist_ok=True)
        with _remote_errors(self.url, f"downloading {key}"):
            try:
                self.backend.get_file(key, dest)
            except FileNotFoundError:
                raise RemoteCorrupt(f"{key} vanished from {self.url} while downloading") from None
        algos = (CHECKSUM_ALGO,) if signed is None else (CHECKSUM_ALGO, DIGEST_ALGO)
        size, (actual, *digest) = dest.stat().st_size, hash_file(dest, algos)
        if size != entry.size or actual != entry.checksum:
            raise RemoteCorrupt(
                f"{key}: downloaded {size} B with checksum {actual[:12]}.., manifest says "
                f"{entry.size} B, {entry.checksum[:12]}.."
            )
        if signed is None:
            return ""
        if signed.get(key.split("/", 1)[1]) != digest[0]:
            raise RemoteUntrusted(
                f"{key}: {BAD}: its {DIGEST_ALGO} differs from the signed one (bytes replaced)"
            )
        return digest[0]

    # ------------------------------------------------------------ quarantine and retention

    def quarantine(self, name: str, reason: str) -> str:
        """Move a remote checkpoint under ``quarantine/`` with ``reason.txt``; returns the new prefix."""
        stamp = time.strftime("%Y%m%dT%H%M%SZ", time.gmtime())
        with _remote_errors(self.url, f"quarantining {name}"):
            n = 1
            while self.backend.sizes(dest := f"{QUARANTINE}/{quarantined_dirname(name, stamp, n)}"):
                n += 1
            self.backend.move(name, dest)
            self.backend.write(f"{dest}/{REASON}", reason.rstrip("\n").encode() + b"\n")
        return dest

    def prune(
        self, keep: int, milestone_every: int = 0, stale_after_s: float = STALE_TMP_AFTER_S
    ) -> RemotePrunePlan:
        """Apply the remote retention; also clean leftovers of killed uploads."""
        plan = plan_remote_prune(self.scan(), keep, milestone_every)
        with _remote_errors(self.url, "pruning"):
            for prefix in (*plan.delete, *plan.clean, *self.backend.stale_staging(stale_after_s)):
                self.backend.remove(prefix)
        return plan


def _local_read_failed(label: str, e: OSError) -> NoReturn:
    """A transient error (supervisor/store/ioerrors.py) is tried again later; any other says the local
    checkpoint is not what its manifest says (or is gone): it is never uploaded."""
    if is_transient(e):
        raise LocalUnreadable(
            f"{label} is unreadable locally ({describe(e)}); not uploaded now, retried later"
        )
    raise LocalSourceError(f"{label} is unreadable locally ({describe(e)}); not uploaded")


def _read_local(path: Path, label: str) -> bytes | None:
    """A small local file of a checkpoint (its signature), None when it has none."""
    try:
        return read_capped(path, MANIFEST_MAX)
    except FileNotFoundError:
        return None
    except OSError as e:  # capped.TooLarge too: structural, never retried
        _local_read_failed(label, e)


def open_remote(url: str, endpoint: str | None = None, key: bytes | None = None) -> RemoteTier:
    """The remote tier named by ``url`` (directory, file://, s3://...); s3fs only loaded for s3.
    ``key``: judge and download with a signing key (docs/security.md)."""
    return RemoteTier(open_backend(url, endpoint), key)
