"""cli.main reports every UserError the same way: one line on stderr, the class's exit code."""

from __future__ import annotations

from pathlib import Path

import pytest
from store_helpers import make_ckpt

from supervisor.cli.main import main
from supervisor.errors import Program, UserError, exit_code
from supervisor.format.exitcodes import Exit
from supervisor.signing import SigningKeyError
from supervisor.slurm import SlurmError
from supervisor.store import StoreError


def test_the_user_facing_errors_are_user_errors() -> None:
    for cls in (StoreError, SigningKeyError, SlurmError):
        assert issubclass(cls, UserError) and exit_code(cls("x"), Program.COMMAND) == Exit.USAGE


def _one_error_line(capsys: pytest.CaptureFixture[str], *argv: str) -> str:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    assert rc == Exit.USAGE and out == ""
    assert err.startswith("error: ") and err.count("\n") == 1, err  # one line, no traceback
    return err


def test_drill_refuses_a_used_workdir_and_a_plan_that_does_not_fit(tmp_path: Path, capsys) -> None:
    (tmp_path / "used").mkdir()
    (tmp_path / "used" / "drill.log").write_text("a previous run\n")
    err = _one_error_line(capsys, "drill", "--workdir", str(tmp_path / "used"))
    assert str(tmp_path / "used") in err and "pass a new --workdir" in err
    new = tmp_path / "new"
    err = _one_error_line(capsys, "drill", "--workdir", str(new), "--scenario", "chaos", "--steps", "12")
    assert "12 steps are too few" in err and "raise --steps" in err and not new.exists()


def test_a_missing_signing_key_names_the_variable(tmp_path: Path, capsys, monkeypatch) -> None:
    make_ckpt(tmp_path / "run", 10)
    monkeypatch.delenv("NO_SUCH_KEY_VAR", raising=False)
    err = _one_error_line(
        capsys, "ckpt", "verify", "--ckpt-root", str(tmp_path / "run"), "--signing-key", "env:NO_SUCH_KEY_VAR"
    )
    assert "NO_SUCH_KEY_VAR is not set" in err
