"""Process tests of ``python -m supervisor watch`` with the fake trainer (real processes, real
signals, real heartbeat files and checkpoints; no torch). Short timeouts keep each test ~1-4 s."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from supervisor.events import events_path, read_state, state_path
from supervisor.exitcodes import Exit
from supervisor.heartbeat import read_heartbeats

REPO = Path(__file__).resolve().parent.parent
FAKE = str(REPO / "tests" / "fake_trainer.py")
FAST = ["--hang-timeout", "2", "--poll-interval", "0.1", "--kill-grace", "1", "--dump-wait", "1"]
FAST += ["--backoff-initial", "0.05", "--backoff-jitter", "0"]
LIMIT_S = 60


def watch_cmd(root: Path, watch_args: list[str], trainer_args: list[str]) -> list[str]:
    return [
        sys.executable,
        "-m",
        "supervisor",
        "watch",
        "--ckpt-root",
        str(root),
        *FAST,
        *watch_args,
        "--",
        sys.executable,
        FAKE,
        "--root",
        str(root),
        *trainer_args,
    ]


def start(root: Path, watch_args: list[str], trainer_args: list[str]) -> subprocess.Popen:
    return subprocess.Popen(
        watch_cmd(root, watch_args, trainer_args), cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT
    )


def finish(p: subprocess.Popen) -> tuple[int, str]:
    try:
        out, _ = p.communicate(timeout=LIMIT_S)
    except subprocess.TimeoutExpired:
        p.kill()
        out, _ = p.communicate()
        pytest.fail(f"watchdog did not finish in {LIMIT_S}s:\n{out.decode(errors='replace')}")
    return p.returncode, out.decode(errors="replace")


def run(root: Path, watch_args: list[str], trainer_args: list[str]) -> tuple[int, list[dict]]:
    rc, out = finish(start(root, watch_args, trainer_args))
    assert not leftovers(root), out
    return rc, events(root)


def events(root: Path) -> list[dict]:
    return [json.loads(line) for line in events_path(root).read_text().splitlines()]


def of(evs: list[dict], kind: str) -> list[dict]:
    return [e for e in evs if e["event"] == kind]


def leftovers(root: Path) -> list[int]:
    """Live processes whose command line mentions the run root: must be none after the watchdog."""
    needle = str(root).encode()
    out = []
    for name in os.listdir("/proc"):
        if not name.isdigit() or int(name) == os.getpid():
            continue
        try:
            cmd = Path(f"/proc/{name}/cmdline").read_bytes()
            state = Path(f"/proc/{name}/stat").read_text().rsplit(")", 1)[1].split()[0]
        except OSError:
            continue
        if needle in cmd and state != "Z":
            out.append(int(name))
    return out


def wait_for(cond, what: str, timeout: float = 20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.05)
    pytest.fail(f"timed out waiting for {what}")


def rank_pid_at(root: Path, rank: int, min_step: int) -> int | None:
    for s in read_heartbeats(root):
        if (
            s.rank == rank
            and s.heartbeat
            and s.heartbeat.step >= min_step
            and s.heartbeat.phase.value == "train"
        ):
            return s.heartbeat.pid
    return None


def test_crash_relaunches_from_checkpoint(tmp_path):
    root = tmp_path / "run"
    rc, evs = run(root, [], ["--steps", "12", "--fault", "crash", "--fault-step", "7"])
    assert rc == Exit.OK
    ends = of(evs, "launch_end")
    assert [e["outcome"] for e in ends] == ["crash", "done"]
    assert of(evs, "launch")[1]["resumed_from"] == 5
    assert of(evs, "pick")[0]["checkpoint"] == "step_00000005"
    st = read_state(state_path(root))
    assert st.status == "done" and st.exit_code == 0 and len(st.restart_times) == 1


def test_sigstop_hang_dumps_stacks_kills_and_relaunches(tmp_path):
    root = tmp_path / "run"
    p = start(root, [], ["--steps", "30", "--ckpt-every", "5"])
    pid = wait_for(lambda: rank_pid_at(root, 1, 3), "rank 1 at step 3")
    os.kill(pid, signal.SIGSTOP)
    rc, out = finish(p)
    assert rc == Exit.OK, out
    assert not leftovers(root)
    evs = events(root)
    hang = of(evs, "hang")
    assert len(hang) == 1 and hang[0]["stopped_ranks"] == [1], hang
    dumps = {e["rank"]: e for e in of(evs, "stack_dump")}
    assert dumps[1]["pid"] == pid and "most recent call first" in (dumps[1]["stacks"] or ""), dumps[1]
    assert "fake_trainer.py" in dumps[1]["stacks"]
    assert [e["outcome"] for e in of(evs, "launch_end")] == ["hang", "done"]
    assert of(evs, "kill")


def test_long_save_is_no_false_alarm(tmp_path):
    """A save 3x the train timeout: phase save has its own timeout."""
    root = tmp_path / "run"
    watch_args = ["--hang-timeout", "1", "--save-timeout", "20"]
    rc, evs = run(root, watch_args, ["--steps", "10", "--ckpt-every", "10", "--save-s", "3"])
    assert rc == Exit.OK
    assert not of(evs, "hang")
    assert len(of(evs, "launch")) == 1


def test_startup_hang_caught_by_startup_timeout(tmp_path):
    root = tmp_path / "run"
    rc, evs = run(
        root, ["--startup-timeout", "3", "--hang-timeout", "5"], ["--steps", "5", "--fault", "startup-hang"]
    )
    assert rc == Exit.OK
    hang = of(evs, "hang")
    assert len(hang) == 1 and "phase startup" in hang[0]["msg"]
    assert [e["outcome"] for e in of(evs, "launch_end")] == ["hang", "done"]


def test_non_retryable_code_stops_with_reason(tmp_path):
    root = tmp_path / "run"
    rc, evs = run(root, [], ["--fault", "exit", "--fault-code", "78", "--fault-step", "2"])
    assert rc == Exit.CHILD_NONRETRYABLE
    assert len(of(evs, "launch")) == 1
    last = of(evs, "exit")[-1]
    assert "78" in last["msg"] and "BAD_CONFIG" in last["msg"]
    st = read_state(state_path(root))
    assert st.status == "failed" and "BAD_CONFIG" in st.reason


def test_crash_loop_at_same_step_gives_no_progress_verdict(tmp_path):
    root = tmp_path / "run"
    trainer = ["--fault", "crash", "--fault-step", "7", "--fault-launches", "0"]
    rc, evs = run(root, ["--no-progress", "3"], trainer)
    assert rc == Exit.NO_PROGRESS
    assert len(of(evs, "launch")) == 3
    assert "step 7" in of(evs, "exit")[-1]["msg"]


def test_budget_survives_watchdog_restart(tmp_path):
    root = tmp_path / "run"
    trainer = ["--fault", "crash", "--fault-step", "1", "--fault-launches", "0"]
    rc, evs = run(root, ["--no-progress", "0", "--max-restarts", "2"], trainer)
    assert rc == Exit.BUDGET_EXHAUSTED and len(of(evs, "launch")) == 3
    rc, evs = run(root, ["--no-progress", "0", "--max-restarts", "2"], trainer)
    assert rc == Exit.BUDGET_EXHAUSTED and len(of(evs, "launch")) == 4  # one more launch, no restart
    assert "2 restarts done" in of(evs, "exit")[-1]["msg"]
    rc, evs = run(root, ["--no-progress", "0", "--max-restarts", "2", "--reset-budget"], ["--steps", "3"])
    assert rc == Exit.OK


def test_preemption_checkpoints_and_requests_requeue(tmp_path):
    root = tmp_path / "run"
    p = start(root, ["--requeue-exit"], ["--steps", "500", "--ckpt-every", "1000"])
    wait_for(lambda: rank_pid_at(root, 1, 3), "rank 1 at step 3")
    p.send_signal(signal.SIGUSR1)
    rc, out = finish(p)
    assert rc == Exit.REQUEUE_REQUESTED, out
    assert not leftovers(root)
    evs = events(root)
    assert "ranks [0, 1]" in of(evs, "preempt")[0]["msg"]
    assert of(evs, "launch_end")[0]["rank_exit_codes"] == {"0": 75, "1": 75}
    assert sorted(p.name for p in root.glob("step_*")), "the preempted rank 0 committed a checkpoint"


def test_sigterm_leaves_no_orphans(tmp_path):
    """Workers ignore SIGTERM and the fake agent dies at once, orphaning them (as a SIGKILLed
    torchrun would): the watchdog must still kill every one of them."""
    root = tmp_path / "run"
    p = start(root, [], ["--steps", "100000", "--ignore-sigterm", "--ranks", "3"])
    wait_for(lambda: rank_pid_at(root, 2, 2), "rank 2 at step 2")
    assert len(leftovers(root)) >= 4  # agent + 3 workers
    p.send_signal(signal.SIGTERM)
    rc, out = finish(p)
    assert rc == 128 + signal.SIGTERM, out
    assert leftovers(root) == []
    ev = events(root)
    assert "SIGKILL" in of(ev, "kill")[0]["msg"]
    assert read_state(state_path(root)).status == "stopped"


def test_descendants_walks_the_tree_and_skips_zombies():
    from supervisor.launcher import ProcInfo, descendants

    table = {
        p.pid: p
        for p in [
            ProcInfo(1, 0, 1, "S"),
            ProcInfo(10, 1, 10, "S"),  # the watchdog
            ProcInfo(11, 10, 11, "S"),  # torchrun
            ProcInfo(12, 11, 12, "T"),  # a worker in its own session, stopped
            ProcInfo(13, 11, 13, "Z"),  # a dead worker
            ProcInfo(14, 13, 14, "R"),  # ... whose child lives on
            ProcInfo(20, 1, 20, "S"),  # unrelated
        ]
    }
    assert sorted(descendants(10, table)) == [11, 12, 14]


def test_state_round_trip_and_garbage(tmp_path):
    from supervisor.events import RunState, parse_state, write_state
    from supervisor.policy import LaunchRecord, Outcome

    rec = LaunchRecord(1, "id", 1.0, 2.0, Outcome.HANG, "hang: rank 1", 5, 10, 12)
    st = RunState(status="running", restart_times=(1.5,), launches=(rec,), command=("a", "b"))
    write_state(tmp_path, st)
    back = read_state(state_path(tmp_path))
    assert back.launches == (rec,) and back.restart_times == (1.5,) and back.command == ("a", "b")
    for bad in ([], {"launches": [{"outcome": "nope"}]}, {"restart_times": ["x"]}):
        with pytest.raises(ValueError):
            parse_state(bad)


def test_preemption_during_backoff_requests_requeue(tmp_path):
    root = tmp_path / "run"
    watch = ["--requeue-exit", "--backoff-initial", "30", "--no-progress", "0"]
    p = start(root, watch, ["--fault", "crash", "--fault-step", "1", "--fault-launches", "0"])

    def backing_off() -> bool:
        try:
            return any(e["event"] == "relaunch" and e["wait_s"] > 0 for e in events(root))
        except (OSError, ValueError):
            return False

    wait_for(backing_off, "a relaunch with a backoff wait")
    p.send_signal(signal.SIGUSR1)
    rc, out = finish(p)
    assert rc == Exit.REQUEUE_REQUESTED, out
    assert "between launches" in of(events(root), "exit")[-1]["msg"]
    assert not leftovers(root)
