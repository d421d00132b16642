"""Process tests of ``python -m supervisor watch`` with the fake trainer (real processes, real
signals, real heartbeat files and checkpoints; no torch).

Nothing here waits on time: a run that must still be running when a signal arrives is held at a
step (train_ref/hold.py), and the hang timeouts are short only in the tests about hangs, where
every launch that may be judged by them hangs by construction.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from commands import REPO
from waiting import wait_for, wait_held, watchdog_events
from watch_helpers import events, finish, leftovers, of, start_watchdog, watch_argv

from supervisor.format.events import read_state, state_path
from supervisor.format.exitcodes import Exit
from supervisor.format.layout import LAUNCHES, RunDir, launch_id
from supervisor.format.nodesummary import read_run_heartbeats
from train_ref import hold

FAKE = str(REPO / "tests" / "fake_trainer.py")
# The fake trainer beats every step (0.05 s): a minute of silence is a real hang, never load.
FAST = ["--hang-timeout", "60", "--poll-interval", "0.1", "--kill-grace", "1", "--dump-wait", "1"]
FAST += ["--backoff-initial", "0.05", "--backoff-jitter", "0"]
# Tests about hangs: the timeout they detect (later options win over FAST's).
HANG_S = "2"


def start(
    root: Path, watch_args: list[str], trainer_args: list[str], hold_at: int | None = None
) -> subprocess.Popen:
    """The watchdog over the fake trainer; with ``hold_at``, every rank holds after that step until
    released (the hold file is written before the launch, as the fake trainer needs)."""
    gate = None
    if hold_at is not None:
        gate = hold_file(root)
        gate.parent.mkdir(parents=True, exist_ok=True)
        hold.hold_at(gate, hold_at)
    return start_watchdog(root, [*FAST, *watch_args], fake_cmd(root, trainer_args), gate)


def fake_cmd(root: Path, trainer_args: list[str]) -> list[str]:
    return [sys.executable, FAKE, "--root", str(root), *trainer_args]


def watch_cmd(root: Path, watch_args: list[str], trainer_args: list[str]) -> list[str]:
    """The watchdog command line over the fake trainer (FAST options first)."""
    return watch_argv(root, [*FAST, *watch_args], fake_cmd(root, trainer_args))


def hold_file(root: Path) -> Path:
    return root.parent / "hold"


def run(root: Path, watch_args: list[str], trainer_args: list[str]) -> tuple[int, list[dict]]:
    rc, out = finish(start(root, watch_args, trainer_args))
    assert not leftovers(root), out
    return rc, events(root)


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


def test_a_rank_killed_just_before_its_launcher_exits_is_the_dead_rank_with_its_root_cause(tmp_path):
    """One rank per node (as the two-node tests run): its launcher exits 1 the moment the rank is
    SIGKILLed, between two of the watchdog's looks at the heartbeats (30 s apart here, so always).
    The rank is still named dead with a dated root cause, a kill at its last beat: without it a
    multi-node launch's first failure is pinned on the peer whose rank died of this one after."""
    root = tmp_path / "run"
    rc, evs = run(
        root,
        ["--poll-interval", "30"],
        ["--ranks", "1", "--steps", "12", "--fault", "kill", "--fault-step", "7"],
    )
    assert rc == Exit.OK
    first = of(evs, "launch_end")[0]
    assert (
        first["outcome"] == "crash" and "rank 0" in first["msg"] and "without an exit code" in first["msg"]
    ), first
    (cause,) = of(evs, "root_cause")
    assert (cause["rank"], cause["step"], cause["signal"]) == (0, 7, True), cause
    assert 0 < cause["failed_at"] <= first["t"], cause


@pytest.mark.parametrize(("flags", "on"), [([], True), (["--no-memory-tier"], False)])
def test_the_memory_tier_is_on_by_default_and_one_flag_turns_it_off(tmp_path, flags, on):
    """On by default: the watchdog makes its node's memory folder at start, hands it to every
    launch, looks in it before each relaunch (the fake trainer takes no snapshot: the disk; said
    once, not at every relaunch) and removes it at the end. ``--no-memory-tier``: no folder, no look."""
    root = tmp_path / "run"
    rc, evs = run(
        root, flags, ["--steps", "12", "--fault", "crash", "--fault-step", "7", "--fault-launches", "2"]
    )
    assert rc == Exit.OK
    folders = [e["path"] for e in of(evs, "memory_dir")]
    fallbacks = [e["reason"] for e in of(evs, "memory_fallback")]
    if on:
        assert len(folders) == 1 and folders[0] and not Path(folders[0]).exists(), folders
        assert fallbacks == ["no snapshot in memory"], fallbacks
    else:
        assert folders == [] and fallbacks == [], (folders, fallbacks)
    assert [e["resumed_from"] for e in of(evs, "launch")[1:]] == [5, 5]


def test_launch_dirs_beyond_the_state_files_record_are_removed_for_this_node_only(tmp_path):
    """Launch dirs (error files, worker logs) pile up over weeks of relaunches: after each launch
    the watchdog removes its node's that its state file no longer records, and no other node's."""
    root = tmp_path / "run"
    base = RunDir.of(root).supervisor / LAUNCHES
    gone, other = launch_id("old", 0, 1, 1, "aaaaaa"), launch_id("old", 1, 1, 1, "bbbbbb")
    for name in (gone, other, "notes"):
        (base / name).mkdir(parents=True)
    rc, evs = run(root, [], ["--steps", "12", "--fault", "crash", "--fault-step", "7"])
    assert rc == Exit.OK
    recorded = {e["launch_id"] for e in of(evs, "launch_end")}
    assert len(recorded) == 2
    assert sorted(p.name for p in base.iterdir()) == sorted({other, "notes", *recorded})


def test_sigstop_hang_dumps_stacks_kills_and_relaunches(tmp_path):
    """Rank 1 is stopped while held at step 4 and stays held until the launch is over (the stack
    dump's SIGCONT lets it run again, but not past the hold). The relaunch resumes from step 3 with
    3 steps to go, so the short hang timeout judges little besides the hang itself."""
    root = tmp_path / "run"
    p = start(root, ["--hang-timeout", HANG_S], ["--steps", "6", "--ckpt-every", "3"], hold_at=4)
    pid = wait_held(hold_file(root), 2, 4, proc=p)[1]["pid"]
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: watchdog_events(root, "launch_end"), "the hung launch to end", proc=p)
    hold.release(hold_file(root))
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
    assert of(evs, "launch")[1]["resumed_from"] == 3
    assert of(evs, "kill")


def test_long_save_is_no_false_alarm(tmp_path):
    """A silent save 2x the train timeout: phase save has its own timeout. The run resumes at step
    9, so the short train timeout judges one step; rank 0's save of step 10 is held (silent) until
    its heartbeat is 2 train timeouts old."""
    root = tmp_path / "run"
    rc, _ = run(root, [], ["--steps", "9", "--ckpt-every", "9"])
    assert rc == Exit.OK
    watch_args = ["--hang-timeout", HANG_S, "--save-timeout", "300"]
    p = start(root, watch_args, ["--steps", "10", "--ckpt-every", "10", "--hold-in-save"], hold_at=10)
    wait_held(hold_file(root), 1, 10, proc=p)

    def save_silent_for() -> float:
        hb = read_run_heartbeats(root)[0].heartbeat
        assert hb is not None and hb.phase.value == "save", hb
        return time.time() - hb.wall_time

    wait_for(lambda: save_silent_for() > 2 * float(HANG_S), "a save silent for 2 train timeouts", proc=p)
    hold.release(hold_file(root))
    rc, out = finish(p)
    assert rc == Exit.OK, out
    assert not leftovers(root)
    evs = events(root)
    assert not of(evs, "hang")
    assert len(of(evs, "launch")) == 2  # the first run's and this one's


def test_beats_without_progress_in_a_save_are_a_hang_within_the_save_timeout(tmp_path):
    """Issue 44 end to end: every rank holds inside its save and keeps rewriting its heartbeat as a
    wait for its peers, advancing nothing, as two ranks left in different collectives by a failed
    save did for ten minutes with no verdict. The beats stay fresh; the verdict comes within the
    save timeout + 1 s of the last progress (entering the save, just before the hold), names both
    ranks and what they wait for, with their stacks; released and relaunched, the run finishes."""
    root = tmp_path / "run"
    watch_args = ["--hang-timeout", "60", "--save-timeout", HANG_S]
    p = start(root, watch_args, ["--steps", "6", "--ckpt-every", "3", "--wait-in-save"], hold_at=3)
    wait_held(hold_file(root), 2, 3, proc=p)
    held_since = max(hold.ack_path(hold_file(root), r).stat().st_mtime for r in (0, 1))
    wait_for(lambda: watchdog_events(root, "hang"), "the hang verdict", proc=p)
    hold.release(hold_file(root))
    rc, out = finish(p)
    assert rc == Exit.OK, out
    assert not leftovers(root)
    evs = events(root)
    (hang,) = of(evs, "hang")
    assert hang["ranks"] == [0, 1], hang["msg"]
    assert (
        "in phase save" in hang["msg"]
        and "its peers in the save's exchange, beating without progress" in hang["msg"]
    )
    assert hang["detected"] - held_since <= float(HANG_S) + 1.0, (hang["detected"] - held_since, hang["msg"])
    assert {e["rank"] for e in of(evs, "stack_dump")} == {0, 1}
    assert [e["outcome"] for e in of(evs, "launch_end")] == ["hang", "done"]


def test_startup_hang_caught_by_startup_timeout(tmp_path):
    """Every launch hangs in startup (rank 0), so the short startup timeout judges only hangs: both
    launches are caught, and the budget of one restart stops the watchdog."""
    root = tmp_path / "run"
    watch_args = [
        "--startup-timeout",
        "3",
        "--hang-timeout",
        "5",
        "--max-restarts",
        "1",
        "--no-progress",
        "0",
    ]
    rc, evs = run(root, watch_args, ["--steps", "5", "--fault", "startup-hang", "--fault-launches", "0"])
    assert rc == Exit.BUDGET_EXHAUSTED
    hang = of(evs, "hang")
    assert len(hang) == 2 and all("phase startup" in h["msg"] for h in hang), hang
    assert [e["outcome"] for e in of(evs, "launch_end")] == ["hang", "hang"]


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


# torchrun kills the other workers when one exits non-zero, so whether rank 1 records its 75 first
# is a race in real life; the fake trainer makes each outcome deterministic, and both must requeue.
@pytest.mark.parametrize(("launcher", "codes"), [("torchrun", {"0": 75}), ("wait-all", {"0": 75, "1": 75})])
def test_preemption_checkpoints_and_requests_requeue(tmp_path, launcher, codes):
    root = tmp_path / "run"
    trainer = ["--steps", "20", "--ckpt-every", "1000", "--launcher", launcher]
    p = start(root, ["--requeue-exit"], trainer, hold_at=3)
    wait_held(hold_file(root), 2, 3, proc=p)
    p.send_signal(signal.SIGUSR1)
    wait_for(lambda: watchdog_events(root, "preempt"), "the watchdog to forward the notice", proc=p)
    hold.release(hold_file(root))
    rc, out = finish(p)
    assert rc == Exit.REQUEUE_REQUESTED, out
    assert not leftovers(root)
    evs = events(root)
    assert "ranks [0, 1]" in of(evs, "preempt")[0]["msg"]
    (end,) = of(evs, "launch_end")
    assert (end["outcome"], end["rank_exit_codes"]) == ("requeue", codes), end
    assert [c.name for c in root.glob("step_*")] == ["step_00000004"], "rank 0 checkpointed the next step"
    assert read_state(state_path(root)).status == "requeued"


def test_sigterm_leaves_no_orphans(tmp_path):
    """Workers ignore SIGTERM and the fake agent dies at once, orphaning them (as a SIGKILLed
    torchrun would): the watchdog must still kill every one of them."""
    root = tmp_path / "run"
    p = start(root, [], ["--ignore-sigterm", "--ranks", "3"], hold_at=2)
    wait_held(hold_file(root), 3, 2, proc=p)
    assert len(leftovers(root)) >= 4  # agent + 3 workers
    p.send_signal(signal.SIGTERM)
    rc, out = finish(p)
    assert rc == 128 + signal.SIGTERM, out
    assert leftovers(root) == []
    ev = events(root)
    assert "SIGKILL" in of(ev, "kill")[0]["msg"]
    assert read_state(state_path(root)).status == "stopped"


def test_descendants_walks_the_tree_and_skips_zombies():
    from supervisor.watch.process import ProcInfo, descendants

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


def test_libc_function_calls_libc_and_says_none_for_a_missing_one():
    import ctypes

    from supervisor.libc import libc_function

    getpid = libc_function("getpid", [])
    assert getpid is not None and getpid() == os.getpid()
    assert libc_function("no_such_libc_function_xyz", [ctypes.c_int]) is None


def test_state_round_trip_and_garbage(tmp_path):
    from supervisor.format.events import RunState, parse_state, write_state
    from supervisor.format.launches import LaunchRecord, Outcome

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
    # The notice must land in the backoff: one so long that only the notice can end it.
    watch = ["--requeue-exit", "--backoff-initial", "3600", "--backoff-max", "3600", "--no-progress", "0"]
    p = start(root, watch, ["--fault", "crash", "--fault-step", "1", "--fault-launches", "0"])

    def backing_off() -> bool:
        try:
            return any(e["event"] == "relaunch" and e["wait_s"] > 0 for e in events(root))
        except (OSError, ValueError):
            return False

    wait_for(backing_off, "a relaunch with a backoff wait", proc=p)
    p.send_signal(signal.SIGUSR1)
    rc, out = finish(p)
    assert rc == Exit.REQUEUE_REQUESTED, out
    assert "between launches" in of(events(root), "exit")[-1]["msg"]
    assert not leftovers(root)
