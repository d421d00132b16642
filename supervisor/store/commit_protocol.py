"""The commit protocol: how a checkpoint becomes visible, all at once or not at all.

The writer fills ``step_N.tmp.<pid>.<host>/`` (``begin``); ``commit`` fsyncs every file, checks that
every rank's reported files are there, writes ``manifest.json`` last, fsyncs, renames the directory
to ``step_N/``, fsyncs the root, and only then points ``latest`` at it (tmp file, fsync,
``os.replace``, fsync dir) under the root's lock. A crash at any point leaves the old state or the
new one: a tmp dir is never listed, and a directory without a valid manifest is never picked.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Mapping
from pathlib import Path

from supervisor.errors import StorageError
from supervisor.format import confined
from supervisor.format.atomic import fsync_dir, fsync_tree, hostname
from supervisor.format.commitstep import CommitStep
from supervisor.format.layout import MANIFEST, step_dirname, tmp_dirname
from supervisor.format.manifest import CheckpointInfo, FileEntry, build_manifest, file_sizes, writers_problem
from supervisor.store.checkpoints import (
    CheckpointRef,
    Verdict,
    list_checkpoints,
    quarantine_locked,
    root_lock,
    validate,
    write_latest,
)


class IncompleteCommit(StorageError):
    """A rank's reported file is not in the committing process's view (or not at its size):
    nothing was committed; the message names the rank and the file."""


def begin(root: str | Path, step: int) -> Path:
    """Create and return the tmp dir the writer fills for ``step``.

    Nothing is synced here: a tmp dir lost in a crash loses only a save that was not committed,
    and ``commit`` syncs the tmp dir before renaming it and the root after. A sync here sat in
    the training loop's path (an async save's call) and, on ext4, waits for the journal to commit
    the data of every file written since the last one, any file: 31 ms median with 64 MB left
    unsynced beside it, 0.3 ms without."""
    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)  # the root itself: the user's to choose
    tmp = root / tmp_dirname(step, os.getpid(), hostname())
    if os.path.lexists(tmp):  # this pid's own leftover (through no link: a planted one is refused)
        confined.remove_tree(root, tmp)
    confined.make_dirs(root, tmp)
    return tmp


def commit(  # noqa: PLR0913  keyword-only options, each for one kind of caller
    root: str | Path,
    tmp_dir: str | Path,
    info: CheckpointInfo,
    *,
    known: Mapping[str, FileEntry] | None = None,
    writers: Mapping[int, Collection[str]] | None = None,
    on_phase: Callable[[CommitStep], None] | None = None,
    sign_key: bytes | None = None,
    digests: Mapping[str, str] | None = None,
    files_synced: bool = False,
) -> CheckpointRef:
    """Make ``tmp_dir`` the committed checkpoint ``step_N`` (N = ``info.step``) and point ``latest``
    at it; ``info`` is what its manifest records besides the files.

    ``writers`` (rank -> the files it wrote, relative to the tmp dir) is recorded in the manifest;
    every rank of ``world_size`` must have reported a file and every reported file must be in this
    process's view of the tmp dir, at the size in ``known`` when it is there, else
    IncompleteCommit and nothing is committed (the tmp dir is left as it is, for the caller to
    remove or a person to inspect). ``on_phase`` is called with each ``CommitStep`` as it
    starts: crash-injection tests use it to die at every point of the protocol.

    ``sign_key``: also write ``manifest.sig`` after the manifest (supervisor/signing.py), with the
    SHA-256 of every file (``digests`` holds those already computed, e.g. by a download).

    ``files_synced``: every file's writer fsynced it before reporting (the trainer's ranks do, in
    parallel), so only the directory entries are synced here. One process fsyncing every rank's
    files in turn cost ~4 ms a file even when clean (a cache flush each): 30 s at 4,096 ranks
    (bench/commit_scale.py).
    """
    root, tmp, step = Path(root), Path(tmp_dir), info.step
    phase = on_phase or (lambda _p: None)
    phase(CommitStep.FSYNC)
    fsync_tree(tmp, files=not files_synced)
    phase(CommitStep.MANIFEST)
    sizes = file_sizes(tmp)
    problem = writers_problem(writers, info.world_size, sizes, known) if writers is not None else ""
    if problem:
        raise IncompleteCommit(
            f"{tmp}: {problem} as this process (pid {os.getpid()} on {hostname()}) sees it; "
            f"step {step} not committed: check that every rank writes to the same shared file system"
        )
    manifest = build_manifest(tmp, info, known=known, writers=writers, sizes=sizes)
    manifest_bytes = manifest.to_json().encode()
    confined.write_new(root, tmp / MANIFEST, manifest_bytes)  # through no link
    if sign_key is not None:
        from supervisor.signing import write_signature

        write_signature(root, tmp, manifest_bytes, manifest.files, sign_key, digests)
    fsync_dir(tmp)
    final = root / step_dirname(step)
    with root_lock(root):
        if os.path.lexists(final):
            old = validate(CheckpointRef(step, final), key=sign_key)  # kept, and what it was said
            quarantine_locked(root, CheckpointRef(step, final), replaced_reason(old))
        phase(CommitStep.RENAME)
        confined.rename(root, tmp, final)
        fsync_dir(root)
        phase(CommitStep.LATEST)
        newest = next(iter(list_checkpoints(root)), None)
        if newest is None or newest.step <= step:
            write_latest(root, final.name)
    return CheckpointRef(step, final)


def replaced_reason(old: Verdict) -> str:
    """Why a committed checkpoint is moved aside by a new commit of its step, with what it was:
    a checkpoint skipped as untrusted or found corrupt keeps that evidence in its reason.txt."""
    why = "replaced by a new commit of the same step"
    if old.ok:
        return f"{why} (it passed its quick check{', signed' if old.signature else ''})"
    return f"{why}; it was {old.evidence.value}: {old.reason}"
