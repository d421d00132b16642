"""`ckpt rollback` (store.rollback): every checkpoint newer than the target goes to quarantine
(never deleted), `latest` names the target; refused for a target that is not valid, beside a live
run (a real watchdog held at a step), for a run with a remote tier, and without confirmation."""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path

import pytest
from commands import REPO
from store_helpers import committed_names, latest_text, make_ckpt, quarantine_dirs
from waiting import wait_held
from watch_helpers import finish, start_watchdog

from supervisor import store
from supervisor.cli.main import main
from supervisor.drill.corruption import Corruption, corrupt
from supervisor.format.atomic import hostname
from supervisor.format.events import RunState, write_state
from supervisor.format.exitcodes import Exit
from supervisor.format.heartbeat import Heartbeat, Phase, write_heartbeat
from supervisor.format.layout import REASON, RunDir
from supervisor.report import build_report
from train_ref import hold

FAKE = str(REPO / "tests" / "fake_trainer.py")


@pytest.fixture
def root(tmp_path: Path) -> Path:
    r = tmp_path / "run"
    for s in (10, 20, 30, 40):
        make_ckpt(r, s)
    return r


def rollback(capsys, root: Path, *argv: str) -> tuple[int, str, str]:
    rc = main(["ckpt", "rollback", "--ckpt-root", str(root), *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def refused(capsys, root: Path, *argv: str) -> str:
    """A one-line refusal, exit 2, and nothing changed."""
    before = sorted(os.listdir(root)), latest_text(root)
    rc, out, err = rollback(capsys, root, *argv)
    assert rc == Exit.USAGE and out == "" and err.count("\n") == 1 and err.startswith("error: "), err
    assert (sorted(os.listdir(root)), latest_text(root)) == before
    return err


def test_rollback_quarantines_newer_ones_and_points_latest_at_the_target(root: Path, capsys) -> None:
    corrupt(root / "step_00000040", Corruption.TRUNCATE)  # invalid ones newer than the target go too
    shard = (root / "step_00000030" / "__0_0.distcp").read_bytes()
    rc, out, _ = rollback(capsys, root, "--to", "20", "--yes", "--json")
    doc = json.loads(out)
    assert (
        rc == Exit.OK and doc["to"] == "step_00000020" and doc["newer"] == ["step_00000040", "step_00000030"]
    )
    assert (doc["latest_before"], doc["latest_after"]) == ("step_00000040", "step_00000020")
    assert committed_names(root) == {"step_00000010", "step_00000020"}
    assert latest_text(root) == "step_00000020\n"
    moved = {Path(m["moved_to"]).name.split("-")[0]: Path(m["moved_to"]) for m in doc["moved"]}
    assert set(moved) == {"step_00000030", "step_00000040"}
    assert (moved["step_00000030"] / "__0_0.distcp").read_bytes() == shard  # moved, not deleted
    assert "rolled back to step_00000020" in (moved["step_00000040"] / REASON).read_text()
    assert store.pick(root).chosen.ref.step == 20  # what a resume uses now
    # and again: nothing newer left, only latest is (re)written
    rc, out, _ = rollback(capsys, root, "--to", "20", "--yes")
    assert rc == Exit.OK and out.strip() == "latest: step_00000020 -> step_00000020"


def test_dry_run_changes_nothing(root: Path, capsys) -> None:
    before = sorted(os.listdir(root))
    rc, out, _ = rollback(capsys, root, "--to", "20", "--dry-run")
    assert rc == Exit.OK and "would move step_00000040" in out and "would move step_00000030" in out
    assert sorted(os.listdir(root)) == before and latest_text(root) == "step_00000040\n"


def test_refuses_a_target_that_is_not_a_valid_checkpoint(root: Path, capsys) -> None:
    assert "step_00000025: cannot roll back to it: no such committed checkpoint" in refused(
        capsys, root, "--to", "25", "--yes"
    )
    corrupt(root / "step_00000020", Corruption.DELETE_SHARD)
    err = refused(capsys, root, "--to", "20", "--yes")
    assert "__0_0.distcp is missing" in err and "ckpt list" in err
    assert "out of range" in refused(capsys, root, "--to", str(10**9), "--yes")


class _Tty:
    def __init__(self, answer: str) -> None:
        self.answer = answer

    def isatty(self) -> bool:
        return True

    def readline(self) -> str:
        return self.answer


def test_asks_unless_yes(root: Path, capsys, monkeypatch) -> None:
    assert "pass --yes" in refused(capsys, root, "--to", "20")  # no terminal to ask on
    monkeypatch.setattr(sys, "stdin", _Tty("n\n"))
    rc, out, err = rollback(capsys, root, "--to", "20")
    _, line = err.split("[y/N] ")  # on a terminal, the answer ends the prompt's line
    assert rc == Exit.USAGE and out == "" and "not confirmed: nothing changed" in line
    assert committed_names(root) == {f"step_000000{s}" for s in (10, 20, 30, 40)}
    monkeypatch.setattr(sys, "stdin", _Tty("y\n"))
    rc, _, err = rollback(capsys, root, "--to", "20")
    assert rc == Exit.OK and "move 2 newer checkpoint(s) to quarantine" in err and "[y/N]" in err
    assert committed_names(root) == {"step_00000010", "step_00000020"}


def _beat(root: Path, host: str, pid: int, phase: Phase = Phase.TRAIN) -> None:
    write_heartbeat(root, Heartbeat(0, 0, host, pid, 41, phase, time.time(), 1, 1, 0.5, "L"))


def test_refuses_beside_signs_of_a_live_run(root: Path, capsys, tmp_path: Path) -> None:
    me, gone = hostname(), _dead_pid()
    # a watchdog on this host whose pid is alive: proof, --run-stopped does not override it
    write_state(root, RunState(host=me, watchdog_pid=os.getpid(), status="running"))
    err = refused(capsys, root, "--to", "20", "--yes", "--run-stopped")
    assert (
        f"the run is live (watchdog pid {os.getpid()} on {me} is running)" in err and "stop it first" in err
    )
    # its pid gone: not live
    write_state(root, RunState(host=me, watchdog_pid=gone, status="running"))
    assert store.rollback(root, 40, dry_run=True).newer == ()
    # on another host: its word only; --run-stopped says that host is gone
    write_state(root, RunState(host="far-node", watchdog_pid=1, status="restarting"))
    assert "pass --run-stopped" in refused(capsys, root, "--to", "30", "--yes")
    assert rollback(capsys, root, "--to", "30", "--yes", "--run-stopped")[0] == Exit.OK
    # a fresh heartbeat without a watchdog: a rank alive on this host, and not once it is done
    write_state(root, RunState(host=me, watchdog_pid=gone, status="failed"))
    _beat(root, me, os.getpid())
    assert f"rank 0 (pid {os.getpid()} on {me})" in refused(capsys, root, "--to", "20", "--yes")
    _beat(root, me, os.getpid(), Phase.DONE)
    assert rollback(capsys, root, "--to", "20", "--yes")[0] == Exit.OK


def _dead_pid() -> int:
    import subprocess

    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def test_refuses_a_run_with_a_remote_tier(root: Path, capsys) -> None:
    RunDir.of(root).remote_status.parent.mkdir(exist_ok=True)
    RunDir.of(root).remote_status.write_text("{}")
    assert "download the checkpoints newer than step_00000020 back" in refused(
        capsys, root, "--to", "20", "--yes"
    )


def test_real_watchdog_held_refuses_then_the_run_resumes_from_the_target(tmp_path: Path, capsys) -> None:
    """A real watchdog over the fake trainer, held after step 6: rollback is refused while it runs;
    after it finished, rollback to step 3 and a new run resumes from step 3."""
    root, gate = tmp_path / "run", tmp_path / "hold"
    hold.hold_at(gate, 6)
    cmd = [sys.executable, FAKE, "--root", str(root), "--steps", "8", "--ckpt-every", "3"]
    p = start_watchdog(root, ["--hang-timeout", "60", "--poll-interval", "0.1"], cmd, gate)
    wait_held(gate, 2, 6, proc=p)
    err = refused(capsys, root, "--to", "3", "--yes", "--run-stopped")
    assert "the run is live" in err
    hold.release(gate)
    rc, out = finish(p)
    assert rc == Exit.OK, out
    newer = sorted(n for n in committed_names(root) if n > "step_00000003")
    assert newer  # the run got past step 3
    assert rollback(capsys, root, "--to", "3", "--yes")[0] == Exit.OK
    assert sorted(q.name.split("-")[0] for q in store.list_quarantined(root)) == newer
    assert not [d for d in quarantine_dirs(root) if not (d / REASON).exists()]
    rc, out = finish(start_watchdog(root, ["--poll-interval", "0.1"], cmd))
    assert rc == Exit.OK, out
    launches = build_report(root).launches
    assert launches[-1].resumed_from == 3, launches
