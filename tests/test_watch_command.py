"""The watchdog over any command (issue 11.2): a command that writes no heartbeat is judged on its
exit code (``--require-heartbeat`` makes silence a startup hang); torchelastic's root cause of a
failed launch (real torchrun, a worker that raises under ``@record``); a relaunch's recovery
breakdown (fake trainer). Real processes; no torch in the watchdog."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from commands import supervisor_cmd
from watch_helpers import events, finish, leftovers, of, start_watchdog

from supervisor.format.events import read_state, state_path
from supervisor.format.exitcodes import Exit

REPO = Path(__file__).resolve().parent.parent
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
WORKER = REPO / "tests" / "elastic_worker.py"
FAKE = str(REPO / "tests" / "fake_trainer.py")
# Short startup timeout and fast polls: the no-heartbeat command outlives the timeout many times.
QUICK = ["--startup-timeout", "0.2", "--poll-interval", "0.05", "--kill-grace", "1", "--dump-wait", "0.2"]
QUICK += ["--max-restarts", "0"]


def status(root: Path) -> str:
    return subprocess.run(
        supervisor_cmd("status", "--ckpt-root", str(root)), capture_output=True, text=True, check=True
    ).stdout


def test_command_without_heartbeat_is_judged_on_its_exit_code(tmp_path):
    """A plain script silent for 10x the startup timeout: no hang verdict, exit 0 is done."""
    root = tmp_path / "run"
    script = [sys.executable, "-c", "import time; time.sleep(2)"]
    rc, out = finish(start_watchdog(root, QUICK, script))
    assert rc == Exit.OK, out
    evs = events(root)
    assert not of(evs, "hang")
    assert [e["outcome"] for e in of(evs, "launch_end")] == ["done"]


def test_require_heartbeat_makes_silence_a_startup_hang(tmp_path):
    """--require-heartbeat: a command that never beats is hung after the startup timeout."""
    root = tmp_path / "run"
    script = [sys.executable, "-c", "import threading; threading.Event().wait()"]
    rc, out = finish(start_watchdog(root, [*QUICK, "--require-heartbeat"], script))
    assert rc == Exit.BUDGET_EXHAUSTED, out
    (hang,) = of(events(root), "hang")
    assert "no rank made no progress" in hang["msg"] and "phase startup" in hang["msg"]
    assert [e["outcome"] for e in of(events(root), "launch_end")] == ["hang"]
    assert not leftovers(root)


def test_root_cause_of_a_raising_torchrun_worker(tmp_path):
    """Rank 1 raises ValueError under @record: the root_cause event names it (local rank, type,
    message, the raising line), the launch's reason and `status` carry it."""
    root = tmp_path / "run"
    cmd = [TORCHRUN, "--standalone", "--nproc-per-node=2", str(WORKER), "--raise-rank", "1"]
    rc, out = finish(start_watchdog(root, ["--max-restarts", "0"], cmd))
    assert rc == Exit.BUDGET_EXHAUSTED, out[-3000:]
    (cause,) = of(events(root), "root_cause")
    raise_line = next(i for i, t in enumerate(WORKER.read_text().splitlines(), 1) if "raise ValueError" in t)
    assert (cause["local_rank"], cause["type"], cause["message"]) == (1, "ValueError", "boom on rank 1")
    assert (Path(cause["file"]), cause["line"]) == (WORKER, raise_line)
    assert "/attempt_0/1/error.json" in cause["error_file"]
    want = f"root cause local rank 1: ValueError: boom on rank 1 ({WORKER}:{raise_line})"
    (end,) = of(events(root), "launch_end")
    assert end["outcome"] == "crash" and want in end["msg"]
    assert want in read_state(state_path(root)).launches[-1].reason
    assert want in status(root)


def test_relaunch_records_its_recovery_breakdown(tmp_path):
    """A crash, then a relaunch that trains: one recovery event with the watchdog's phases and the
    ranks' first step, in order, its total their sum; `status` shows it."""
    root = tmp_path / "run"
    fake = [
        sys.executable,
        FAKE,
        "--root",
        str(root),
        "--steps",
        "8",
        "--fault",
        "crash",
        "--fault-step",
        "4",
    ]
    rc, out = finish(start_watchdog(root, ["--poll-interval", "0.05", "--backoff-initial", "0"], fake))
    assert rc == Exit.OK, out
    (rec,) = of(events(root), "recovery")
    phases = rec["phases"]
    assert list(phases) == [
        "detected",  # since the dead rank's last heartbeat
        "tree_killed",
        "backed_off",
        "checkpoint_picked",
        "process_started",
        "first_step",
        "total",
    ]
    assert all(v >= 0 for v in phases.values())
    assert abs(sum(v for k, v in phases.items() if k != "total") - phases["total"]) < 0.01
    assert rec["launch"] == 2
    st = read_state(state_path(root))
    assert st.recovery == phases
    assert f"last recovery: {phases['total']:.2f}s to the first step: detected" in status(root)
