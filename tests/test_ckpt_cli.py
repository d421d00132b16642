"""`python -m supervisor ckpt ...`: tables, stable JSON, exit codes, one-line errors, no torch, fast."""

from __future__ import annotations

import io
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
from commands import REPO, supervisor_cmd
from store_helpers import make_ckpt, quarantine_dirs, write_tmp

from supervisor import store
from supervisor.cli.main import main
from supervisor.drill.corruption import Corruption, corrupt
from supervisor.format.exitcodes import Exit


def run(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["ckpt", *argv])
    out, err = capsys.readouterr()
    return rc, out, err


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "run"
    for s in (10, 20, 30):
        make_ckpt(r, s)
    return r


def test_list_table(root: Path, capsys) -> None:
    corrupt(root / "step_00000020", Corruption.TRUNCATE)
    write_tmp(root, 40)
    rc, out, err = run(capsys, "list", "--ckpt-root", str(root))
    assert rc == Exit.OK and err == ""
    lines = out.splitlines()
    assert lines[0].split() == ["step", "age", "size", "files", "status", "kept", "reason"]
    assert lines[1].split()[:2] == ["latest", "30"] and "ok" in lines[1]
    assert "INVALID" in lines[2] and "__0_0.distcp is 128 bytes, manifest says 256" in lines[2]
    assert "step_00000040.tmp." in out and "may be writing" in out
    assert len({line.index("ago") for line in lines[1:4]}) == 1  # aligned columns


def test_list_json_is_stable(root: Path, capsys) -> None:
    store.pick(root)
    corrupt(root / "step_00000030", Corruption.DELETE_MANIFEST)
    store.pick(root)
    rc, out, _ = run(capsys, "list", "--ckpt-root", str(root), "--json")
    doc = json.loads(out)
    assert rc == 0
    assert set(doc) == {
        "schema",
        "command",
        "root",
        "latest",
        "retention",
        "checkpoints",
        "foreign",
        "quarantined",
        "tmp",
    }
    assert (doc["schema"], doc["command"], doc["latest"]) == (1, "list", "step_00000020")
    c = doc["checkpoints"][0]
    assert set(c) == {
        "name",
        "step",
        "path",
        "ok",
        "evidence",
        "reason",
        "wall_time",
        "age_s",
        "bytes",
        "files",
        "latest",
        "kept",
    }
    assert (c["name"], c["step"], c["ok"], c["latest"], c["files"]) == ("step_00000020", 20, True, True, 4)
    assert c["evidence"] == "ok"
    (q,) = doc["quarantined"]
    assert q["name"].startswith("step_00000030-") and "manifest.json is missing" in q["reason"]


def test_verify_exit_codes_and_depth(root: Path, capsys) -> None:
    assert run(capsys, "verify", "--ckpt-root", str(root))[0] == Exit.OK
    corrupt(root / "step_00000020", Corruption.BITFLIP)
    assert run(capsys, "verify", "--ckpt-root", str(root))[0] == Exit.OK  # sizes still match
    rc, out, _ = run(capsys, "verify", "--ckpt-root", str(root), "--deep", "--json")
    doc = json.loads(out)
    assert rc == Exit.FOUND_PROBLEM and doc["ok"] is False and doc["deep"] is True
    bad = [c for c in doc["checkpoints"] if not c["ok"]]
    assert [c["name"] for c in bad] == ["step_00000020"] and "checksum" in bad[0]["reason"]


class _Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


def test_deep_verify_draws_a_bar_on_a_terminal_only(root: Path, capsys, monkeypatch) -> None:
    run(capsys, "verify", "--ckpt-root", str(root), "--deep")
    assert capsys.readouterr().err == ""
    fake = _Tty()
    monkeypatch.setattr(sys, "stderr", fake)
    assert main(["ckpt", "verify", "--ckpt-root", str(root), "--deep"]) == Exit.OK
    assert "verify [" in fake.getvalue() and "100.0%" in fake.getvalue()


def test_pick_dry_run_then_pick(root: Path, capsys) -> None:
    corrupt(root / "step_00000030", Corruption.GARBAGE_MANIFEST)
    rc, out, _ = run(capsys, "pick", "--ckpt-root", str(root), "--dry-run")
    assert rc == 0 and "would quarantine step_00000030" in out and "would pick step_00000020" in out
    assert not quarantine_dirs(root)
    rc, out, _ = run(capsys, "pick", "--ckpt-root", str(root), "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["chosen"]["name"] == "step_00000020" and doc["latest_after"] == "step_00000020"
    assert [q["name"] for q in doc["quarantined"]] == ["step_00000030"]
    assert len(quarantine_dirs(root)) == 1


def test_pick_with_none_valid_exits_1(tmp_path: Path, capsys) -> None:
    make_ckpt(tmp_path, 10)
    corrupt(tmp_path / "step_00000010", Corruption.DELETE_SHARD)
    rc, out, _ = run(capsys, "pick", "--ckpt-root", str(tmp_path), "--deep")
    assert rc == Exit.FOUND_PROBLEM and "quarantined step_00000010: __0_0.distcp is missing" in out
    assert "no usable checkpoint, but 1 checkpoint is quarantined" in out and "--allow-fresh-start" in out
    rc, out, _ = run(capsys, "pick", "--ckpt-root", str(tmp_path), "--allow-fresh-start", "--json")
    doc = json.loads(out)
    assert rc == Exit.FOUND_PROBLEM and doc["chosen"] is None and doc["no_usable"] is None


def test_prune(root: Path, capsys) -> None:
    make_ckpt(root, 40)
    rc, out, _ = run(capsys, "prune", "--ckpt-root", str(root), "--keep", "2", "--dry-run", "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["dry_run"] and doc["deleted"] == ["step_00000020", "step_00000010"]
    rc, out, _ = run(capsys, "prune", "--ckpt-root", str(root), "--keep", "2", "--milestone-every", "20")
    assert rc == 0 and "delete step_00000010" in out
    assert [r.step for r in store.list_checkpoints(root)] == [40, 30, 20]


def _one_line_error(capsys, *argv: str) -> str:
    rc, out, err = run(capsys, *argv)
    assert rc == Exit.USAGE and out == ""
    assert err.count("\n") == 1 and err.startswith("error: ") and "Traceback" not in err
    return err


def test_bad_input_is_one_line_and_exit_2(tmp_path: Path, capsys, monkeypatch) -> None:
    missing = tmp_path / "missing"
    assert str(missing) in _one_line_error(capsys, "list", "--ckpt-root", str(missing))
    afile = tmp_path / "afile"
    afile.write_text("x")
    assert "not a directory" in _one_line_error(capsys, "verify", "--ckpt-root", str(afile))
    home = tmp_path / "home"
    (home / "Documents").mkdir(parents=True)
    err = _one_line_error(capsys, "pick", "--ckpt-root", str(home))
    assert "not a run directory" in err and "--ckpt-root" in err
    assert not (home / ".lock").exists()  # refused before touching anything
    one = make_ckpt(tmp_path / "run", 10).path
    assert "pass its parent" in _one_line_error(capsys, "list", "--ckpt-root", str(one))
    assert "keep at least 2" in _one_line_error(
        capsys, "prune", "--ckpt-root", str(tmp_path / "run"), "--keep", "1"
    )

    def denied(*_a, **_k):
        raise PermissionError(13, "Permission denied", str(tmp_path / "run" / ".lock"))

    monkeypatch.setattr("supervisor.cli.ckpt.pick", denied)
    err = _one_line_error(capsys, "pick", "--ckpt-root", str(tmp_path / "run"))
    assert ".lock: Permission denied" in err


def test_json_errors_keep_stdout_empty(tmp_path: Path, capsys) -> None:
    _one_line_error(capsys, "list", "--json", "--ckpt-root", str(tmp_path / "missing"))


# ---------------------------------------------------------------- speed and no torch, in fresh processes


@pytest.fixture(scope="module")
def root200(tmp_path_factory) -> Path:
    r = tmp_path_factory.mktemp("r200") / "run"
    for s in range(1, 201):
        make_ckpt(r, s * 10, files={"__0_0.distcp": b"x" * s, ".metadata": b"m"})
    return r


def _best_of(cmds: list[list[str]], rounds: int = 5) -> list[float]:
    """Best wall time of each command, interleaved within each round so that load from other
    processes falls on all of them alike."""
    best = [float("inf")] * len(cmds)
    for _ in range(rounds):
        for i, cmd in enumerate(cmds):
            t = time.perf_counter()
            subprocess.run(cmd, cwd=REPO, check=True, capture_output=True, timeout=60)
            best[i] = min(best[i], time.perf_counter() - t)
    return best


def test_list_of_200_checkpoints_costs_about_a_python_startup(root200: Path, tmp_path: Path) -> None:
    """Measured side by side, never against a fixed number of seconds: ``ckpt list`` on 200
    checkpoints vs the same command on an empty root (the import cost) and vs bare python."""
    empty = tmp_path / "empty"
    empty.mkdir()
    cli = supervisor_cmd("ckpt", "list", "--ckpt-root")
    bare, t_empty, t_200 = _best_of(
        [[sys.executable, "-c", "pass"], [*cli, str(empty)], [*cli, str(root200)]]
    )
    print(f"\npython -c pass {bare:.3f}s; ckpt list: empty root {t_empty:.3f}s, 200 checkpoints {t_200:.3f}s")
    assert t_200 < 3 * t_empty, "listing 200 checkpoints costs more than twice the command's startup"
    assert t_200 < 25 * bare, "ckpt list is far slower than an interpreter start"


def test_cli_never_imports_torch(root200: Path) -> None:
    code = (
        "import sys\n"
        "from supervisor.cli.main import main\n"
        f"assert main(['ckpt', 'list', '--ckpt-root', {str(root200)!r}]) == 0\n"
        f"main(['ckpt', 'verify', '--deep', '--ckpt-root', {str(root200)!r}])\n"
        "assert 'torch' not in sys.modules, 'torch was imported'\n"
    )
    subprocess.run([sys.executable, "-c", code], cwd=REPO, check=True, capture_output=True, timeout=60)
    p = subprocess.run(
        [sys.executable, "-X", "importtime", "-m", "supervisor", "ckpt", "list", "--ckpt-root", str(root200)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert p.returncode == 0
    imported = {
        line.split("|")[-1].strip() for line in p.stderr.splitlines() if line.startswith("import time:")
    }
    assert "supervisor.store" in imported  # the probe sees our own imports
    assert not {m for m in imported if m == "torch" or m.startswith("torch.")}


def test_help_shows_each_default_once_and_the_program_name_typed():
    from supervisor.cli.main import build_parser, program_name

    assert program_name("/usr/bin/resumable-supervisor") == "resumable-supervisor"
    assert program_name("/x/supervisor/__main__.py") == "python -m supervisor"
    watch = build_parser("watch")._subparsers._group_actions[0].choices["watch"]
    text = " ".join(watch.format_help().split())
    assert "(default: 120.0)" in text  # --hang-timeout: no default in its own words
    assert "(default: quick)" in text and "(default: quick) (default" not in text  # said once
