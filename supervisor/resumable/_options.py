"""What a loop tells ``Resumable``: when to save (``Saves``), how to choose the checkpoint to resume
from (``ResumeOptions``), and what makes two launches the same run (``Identity``). Each option
field is also the reference trainer's flag (``supervisor.options``): the docs' tables come from
these declarations.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor import shared_options as shared
from supervisor import store
from supervisor.options import NOT_NEGATIVE, nested, option
from supervisor.resumable._resume import Request
from supervisor.resumable._save_policy import DEFAULT_MAX_FAILED_SAVES, SavePolicy
from supervisor.resumable._tiering import RemoteOptions

__all__ = ["VERIFY", "Identity", "ResumeOptions", "Saves", "remote_problem", "resume_args"]

VERIFY = ("quick", "deep")


@dataclass(frozen=True)
class Saves:
    """When and how to checkpoint. Each option field is also the trainer's flag (``supervisor.options``)."""

    every_steps: int = option("save every N steps (0: only by --save-every-s)", 50, flag="--save-every")
    every_s: float = option(
        "also save when this long has passed since the last save (rank 0's clock decides for all)",
        0.0,
        flag="--save-every-s",
        metavar="SECONDS",
    )
    async_save: bool = option(
        "save in the background while training goes on (default)", True, off="--sync-save"
    )
    # The newest ``keep`` and the retention beyond it: the retention flags (--keep, --keep-every-s,
    # --keep-best, --keep-all) of supervisor.store.retention_policy, shared with `ckpt prune`.
    keep: int = store.DEFAULT_KEEP
    max_failed_saves: int = option(
        "exit 74 after N failed saves in a row (a full disk, EIO...); until then training goes on",
        DEFAULT_MAX_FAILED_SAVES,
        metavar="N",
    )
    max_unsaved_s: float = option(
        "also exit 74 when a save fails and nothing was committed for this long (0: no limit)",
        0.0,
        metavar="SECONDS",
    )
    memory_every: int = option(
        "under the watchdog, snapshot the whole state into node-local memory every N steps (0: the "
        "interval that keeps the copy within 3 percent of the step time; none without the watchdog, or under its --no-memory-tier)",
        0,
        metavar="N",
        check=NOT_NEGATIVE,
    )
    # What prune keeps locally beyond the newest ``keep`` (one per period, best by a metric of
    # ``step_end``, all); None: the newest ``keep``. Recorded for `status` and `ckpt list`.
    retention: store.RetentionPolicy | None = None

    def retention_policy(self) -> store.RetentionPolicy:
        return self.retention if self.retention is not None else store.RetentionPolicy(keep=self.keep)

    def policy(self) -> SavePolicy:
        return SavePolicy(max_failed_saves=self.max_failed_saves, max_unsaved_s=self.max_unsaved_s)

    def problem(self) -> str:
        """What is wrong with these values (one line naming the flag), or ''."""
        if self.every_steps < 0 or self.every_s < 0 or not (self.every_steps or self.every_s):
            return "--save-every must be >= 1 (or 0 with --save-every-s > 0)"
        if self.keep < store.MIN_KEEP:
            return f"--keep {self.keep}: keep at least {store.MIN_KEEP} so a corrupt newest has a fallback"
        return self.policy().problem()


@dataclass(frozen=True)
class Identity:
    """What makes two launches the same run: every field that changes the trajectory (model shape,
    optimizer, schedule length, precision, seed...), the data, and the global batch the data
    position counts. ``fields`` are hashed into the manifest's ``model_config_hash`` and recorded
    in its ``meta.identity``, so a refusal names the fields that differ. ``changeable``: fields
    ``allow_config_change`` may change, applied by ``Resumable.apply_config_change``; any other
    field that differs is refused even then."""

    fields: Mapping[str, Any] = field(default_factory=dict)
    data: str = ""  # the data fingerprint
    seed: int | None = None  # per-rank RNGs are seeded from (seed, rank, step) when not restored
    name: str = ""
    global_batch: int = 0
    mode: str = ""  # the parallel mode, recorded (a resume may change it: DCP reshards)
    changeable: frozenset[str] = frozenset()

    @property
    def all_fields(self) -> dict[str, Any]:
        return {**self.fields, **({} if self.seed is None else {"seed": self.seed})}

    @property
    def config_hash(self) -> str:
        blob = json.dumps(self.all_fields, sort_keys=True, separators=(",", ":")).encode()
        return "sha256:" + hashlib.sha256(blob).hexdigest()[:32]


@dataclass(frozen=True)
class ResumeOptions:
    """How to choose the checkpoint to resume from. Each option field is also the trainer's flag."""

    verify: str = option(
        "checkpoint check before loading: deep = every file's checksum (DCP has none), quick = sizes",
        "deep",  # deep: spread over the ranks
        choices=VERIFY,
    )
    io_retry_s: float = shared.io_retry("exit 74 (at resume)")
    allow_fresh_start: bool = shared.allow_fresh_start("start from step 0")
    allow_config_change: bool = option(
        "resume with a changed LR, weight decay, schedule or augmentation (applied); "
        "other changes are still refused",
        False,
    )
    allow_data_change: bool = option("resume on data with another fingerprint", False)
    load_step: int | None = option(
        "resume from committed step N instead of the newest (newer ones are moved to quarantine/)",
        None,
        metavar="N",
    )
    # A new run's starting point: another run's weights, DIR or DIR:STEP (default its newest valid
    # checkpoint), and with init_optimizer its optimizer state too; recorded in every manifest.
    init_from: str | None = option(
        "a NEW run starts from another run's weights (its newest valid checkpoint, or STEP); "
        "recorded in every manifest; ignored once this run has checkpoints of its own",
        None,
        metavar="DIR[:STEP]",
    )
    init_optimizer: bool = option("with --init-from: its optimizer state too", False)
    sign_key: bytes | None = field(default=None, repr=False)  # --signing-key's key (supervisor.signing)
    remote: RemoteOptions = nested(RemoteOptions, "remote tier (docs/tiers.md)")


def resume_args(root: Path, options: ResumeOptions, identity: Identity | None = None) -> Request:
    """The options as resume.py reads them."""
    return Request(
        ckpt_root=root,
        verify=options.verify,
        io_retry=options.io_retry_s,
        allow_fresh_start=options.allow_fresh_start,
        sign_key=options.sign_key,
        load_step=options.load_step,
        identity=(identity or Identity()).all_fields,
        remote=options.remote if options.remote.url else None,
    )


def remote_problem(remote: RemoteOptions, local_keep: int) -> str:
    """What is wrong with the remote tier's options (one line naming the flag), or ''."""
    if not remote.url:
        return ""
    try:
        remote.policy(local_keep)
    except store.StoreError as e:
        return str(e)
    return ""
