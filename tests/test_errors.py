"""One error hierarchy (supervisor/errors.py): every kind an exit code per program, the toolkit's
exceptions placed in it, and the commands turning them into their codes."""

from __future__ import annotations

import importlib

import pytest

from supervisor import store
from supervisor.errors import IntegrityError, Program, StorageError, ToolkitError, UserError, exit_code
from supervisor.format.exitcodes import Exit
from supervisor.format.manifest import ManifestError
from supervisor.resumable._checkpointer import StorageGaveUp
from supervisor.resumable._devices import DeviceError
from supervisor.safepickle import UnsafePickle
from supervisor.signing import SigningKeyError
from supervisor.slurm import SlurmError
from supervisor.tiers.remote import RemoteUnavailable, RemoteUntrusted


@pytest.mark.parametrize(
    ("cls", "kind"),
    [
        (store.StoreError, UserError),
        (SlurmError, UserError),
        (SigningKeyError, UserError),
        (DeviceError, UserError),
        (store.StorageUnavailable, StorageError),
        (store.IncompleteCommit, StorageError),
        (RemoteUnavailable, StorageError),
        (StorageGaveUp, StorageError),
        (UnsafePickle, IntegrityError),
        (ManifestError, IntegrityError),
        (RemoteUntrusted, IntegrityError),
    ],
)
def test_each_error_is_of_one_kind(cls: type[ToolkitError], kind: type[ToolkitError]) -> None:
    assert issubclass(cls, kind)
    assert sum(issubclass(cls, k) for k in (UserError, StorageError, IntegrityError)) == 1


def test_the_trainer_and_the_commands_take_their_codes_from_the_table() -> None:
    assert exit_code(UnsafePickle("x"), Program.TRAINER) == Exit.UNTRUSTED == 77
    assert exit_code(StorageGaveUp("x"), Program.TRAINER) == Exit.STORAGE == 74
    assert exit_code(DeviceError("x"), Program.TRAINER) == Exit.BAD_CONFIG == 78
    assert exit_code(store.MismatchError("x"), Program.TRAINER) == Exit.MISMATCH == 65
    assert exit_code(store.MismatchError("x"), Program.COMMAND) == Exit.USAGE  # refined for the trainer only
    assert exit_code(store.StorageUnavailable("x"), Program.COMMAND) == Exit.UNREADABLE == 3
    assert exit_code(store.StorageUnavailable("x"), Program.WATCHDOG) == Exit.STORAGE_UNAVAILABLE == 14
    assert exit_code(ManifestError("x"), Program.COMMAND) == Exit.FOUND_PROBLEM == 1


def test_the_cli_prints_one_line_and_exits_with_the_kinds_code(
    monkeypatch: pytest.MonkeyPatch, capsys
) -> None:
    cli = importlib.import_module(
        "supervisor.cli.main"
    )  # the module (supervisor.cli.main is also its function)
    status = importlib.import_module("supervisor.cli.status")

    def unreadable(_args: object) -> int:
        raise store.StorageUnavailable(
            "runs/r1/step_00000010/manifest.json: EIO for 30s of retries; retry later"
        )

    monkeypatch.setattr(status, "run", unreadable)  # registered by name when the parser is built
    rc = cli.main(["status", "--ckpt-root", "nowhere"])
    assert rc == Exit.UNREADABLE
    assert capsys.readouterr().err.splitlines() == [
        "error: runs/r1/step_00000010/manifest.json: EIO for 30s of retries; retry later"
    ]
