"""The checkpoint store: what other packages use of it is this package's ``__all__`` (``store.<name>``).

- ``commit_protocol.py``: the commit protocol (below), ``begin`` and ``commit``;
- ``walkback.py``: the walk-back before a resume (``pick``), a rollback, a quarantine by hand;
- ``checkpoints.py``: discovery, validation, quarantine, the ``latest`` pointer and the root's lock;
- ``retention.py`` (on disk) and ``retention_policy.py`` (pure: what to keep);
- ``foreign.py``: other trainers' checkpoints (torchtitan's ``step-N/``, Lightning's ``.ckpt``):
  their structural check, `ckpt seal`'s checksums, their walk-back;
- ``ioerrors.py``: which I/O errors prove corruption and which are retried; ``quickcache.py``:
  the quick checks `status` remembers.

Commit: the writer fills ``step_N.tmp.<pid>.<host>/``, then ``commit`` fsyncs every file, checks
that every rank's reported files are there, writes ``manifest.json`` last, fsyncs, renames the
directory to ``step_N/``, fsyncs the root, and only then points ``latest`` at it (tmp file, fsync,
``os.replace``, fsync dir) under the root's lock. A crash at any point leaves the old state or the
new one: a tmp dir is never listed, and a directory without a valid manifest is never picked.

Mutations (pointer update, quarantine, prune) hold the root's file lock; readers take no lock, so
every mutation a reader can see is one rename: commit renames tmp -> final, quarantine moves the
whole directory, prune renames a checkpoint to ``step_N.deleting.*`` before removing its files.
Nothing is hashed under the lock (deep checksums in ``pick`` run before it is taken), and files
are removed after it is released, so a trainer's commit never waits behind a login-node command.

An error that is not proof of corruption (supervisor/store/ioerrors.py) makes a checkpoint unknown:
``pick`` retries the whole walk for ``io_retry_s``, then raises StorageUnavailable; it never
quarantines for it and never gives up the run's progress without being told to.
"""

from __future__ import annotations

from supervisor.format.confined import remove_tree  # the store's removals: through no link
from supervisor.store.checkpoints import (
    LOCK_TIMEOUT_S,
    REASON_LOST,
    CheckpointRef,
    Expectation,
    MismatchError,
    QuarantinedRef,
    StoreError,
    Verdict,
    check_compatible,
    check_files,
    file_lock,
    list_checkpoints,
    list_quarantined,
    quarantine,
    read_latest,
    require_root,
    root_lock,
    validate,
    write_latest,
)
from supervisor.store.commit_protocol import (
    IncompleteCommit,
    begin,
    commit,
)
from supervisor.store.foreign import (
    FOREIGN_LABEL,
    ForeignKind,
    ForeignRef,
    ForeignVerdict,
    foreign_may_be_writing,
    list_foreign,
    newest_foreign_step,
    quarantine_foreign,
    seal_foreign,
    validate_foreign,
)
from supervisor.store.ioerrors import (
    IO_RETRY_S,
    Evidence,
    StorageUnavailable,
)
from supervisor.store.retention import (
    DEFAULT_KEEP,
    MIN_KEEP,
    QUARANTINE_KEEP,
    STALE_TMP_AFTER_S,
    Candidate,
    KeepReason,
    PruneResult,
    QuarantineEntry,
    RetentionPolicy,
    TmpRef,
    disk_usage,
    list_deleting,
    list_tmp,
    plan_quarantine,
    plan_retention,
    prune,
    read_policy,
    record_policy,
    tmp_is_stale,
)
from supervisor.store.walkback import (
    NoUsableCheckpoint,
    PickResult,
    RollbackResult,
    no_usable_message,
    pick,
    quarantine_step,
    rollback,
    unreadable_fix,
)

__all__ = [
    "DEFAULT_KEEP",
    "FOREIGN_LABEL",
    "IO_RETRY_S",
    "LOCK_TIMEOUT_S",
    "MIN_KEEP",
    "QUARANTINE_KEEP",
    "REASON_LOST",
    "STALE_TMP_AFTER_S",
    "Candidate",
    "CheckpointRef",
    "Evidence",
    "Expectation",
    "ForeignKind",
    "ForeignRef",
    "ForeignVerdict",
    "IncompleteCommit",
    "KeepReason",
    "MismatchError",
    "NoUsableCheckpoint",
    "PickResult",
    "PruneResult",
    "QuarantineEntry",
    "QuarantinedRef",
    "RetentionPolicy",
    "RollbackResult",
    "StorageUnavailable",
    "StoreError",
    "TmpRef",
    "Verdict",
    "begin",
    "check_compatible",
    "check_files",
    "commit",
    "disk_usage",
    "file_lock",
    "foreign_may_be_writing",
    "list_checkpoints",
    "list_deleting",
    "list_foreign",
    "list_quarantined",
    "list_tmp",
    "newest_foreign_step",
    "no_usable_message",
    "pick",
    "plan_quarantine",
    "plan_retention",
    "prune",
    "quarantine",
    "quarantine_foreign",
    "quarantine_step",
    "read_latest",
    "read_policy",
    "record_policy",
    "remove_tree",
    "require_root",
    "rollback",
    "root_lock",
    "seal_foreign",
    "tmp_is_stale",
    "unreadable_fix",
    "validate",
    "validate_foreign",
    "write_latest",
]
