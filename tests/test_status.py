"""``supervisor status``: the report over a synthetic run directory, garbage included."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
from commands import REPO, supervisor_cmd
from store_helpers import make_ckpt

from supervisor import store
from supervisor.cli.status import render
from supervisor.drill.corruption import Corruption, corrupt
from supervisor.format.events import RunState, write_state
from supervisor.format.heartbeat import Heartbeat, Phase, write_heartbeat
from supervisor.format.launches import LaunchRecord, Outcome
from supervisor.format.layout import RunDir, tmp_dirname
from supervisor.report import STATUS_SCHEMA, build_report

LID = "vm-n0-1-2-abc"


def beat(root: Path, rank: int, step: int, phase: Phase, age: float, launch: str = LID, last_step_s=0.5):
    hb = Heartbeat(rank, rank, "vm", 1000 + rank, step, phase, time.time() - age, 1, 4, last_step_s, launch)
    write_heartbeat(root, hb)


@pytest.fixture
def run_dir(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    root.mkdir()
    for step in (10, 20, 30):
        make_ckpt(root, step)
    corrupt(root / "step_00000030", Corruption.TRUNCATE)
    store.quarantine(root, store.CheckpointRef(20, root / "step_00000020"), "step_00000020: test reason")
    store.begin(root, 40)  # a save in progress
    rec = LaunchRecord(
        1, "old", time.time() - 100, time.time() - 50, Outcome.CRASH, "exit 1: crash", 10, 30, 31
    )
    write_state(
        root,
        RunState(
            host="vm",
            watchdog_pid=os.getpid(),
            status="running",
            reason="launch 2 running",
            launch_count=2,
            launch_id=LID,
            restart_times=(time.time() - 50,),
            launches=(rec,),
            timeouts={"train": 10, "startup": 60, "load": 60, "save": 60},
        ),
    )
    beat(root, 0, 35, Phase.TRAIN, 1)
    beat(root, 1, 35, Phase.TRAIN, 30)  # silent past the train timeout
    beat(root, 2, 35, Phase.SAVE, 30)  # a long save: fine
    beat(root, 3, 12, Phase.TRAIN, 1, launch="old")  # from an earlier launch
    (RunDir.of(root).heartbeats / "rank_00004.json").write_text("{garbage")
    return root


def test_report(run_dir: Path):
    r = build_report(run_dir)
    assert (r.state, r.why) == ("running", "launch 2 running")
    assert r.nodes[0].restarts == 1 and r.nodes[0].launches == 2
    assert [(lr.number, lr.outcome, lr.last_step) for lr in r.launches] == [(1, "crash", 31)]
    stale = {x.rank: x for x in r.ranks}
    assert [x.rank for x in r.ranks] == [0, 1, 2, 3, 4]
    assert not stale[0].stale and not stale[2].stale
    assert stale[1].stale and "silent" in stale[1].note
    assert stale[3].stale and "earlier launch" in stale[3].note
    assert stale[4].stale and stale[4].phase == "unknown" and "JSON" in stale[4].note
    assert r.current_step == 35 and r.steps_per_s == pytest.approx(2.0)
    ck = {c.step: c for c in r.checkpoints}
    assert set(ck) == {10, 30}
    assert ck[10].valid and not ck[30].valid and "bytes" in ck[30].reason
    assert ck[30].latest and not ck[10].latest
    assert ck[10].size_bytes > 0 and 0 <= ck[10].age_s < 60
    assert [q.reason for q in r.quarantined] == ["step_00000020: test reason"]
    assert len(r.in_progress) == 1 and r.in_progress[0].startswith("step_00000040.tmp.")
    assert r.disk_bytes > 0
    text = render(r)
    for needle in (
        "RUNNING",
        "STALE",
        "INVALID",
        "<- latest",
        "test reason",
        "exit 1: crash",
        "being written",
    ):
        assert needle in text, needle


def test_dead_watchdog_and_failed_states(tmp_path: Path):
    root = tmp_path / "run"
    root.mkdir()
    dead = subprocess.run(
        [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
    )
    write_state(
        root,
        RunState(host=os.uname().nodename.split(".")[0], watchdog_pid=int(dead.stdout), status="running"),
    )
    r = build_report(root)
    assert r.state == "failed" and "is gone" in r.why
    write_state(root, RunState(node=1, status="failed", reason="no progress: step 7", exit_code=11))
    r = build_report(root)
    node1 = next(n for n in r.nodes if n.node == 1)
    assert (node1.status, node1.exit_code, node1.reason) == ("failed", 11, "no progress: step 7")
    assert r.state == "failed" and "(node 0)" in r.why
    assert "watchdogs:" in render(r)


def test_garbage_never_crashes(tmp_path: Path):
    root = tmp_path / "run"
    (root / "supervisor").mkdir(parents=True)
    (root / "supervisor" / "state.json").write_bytes(b"\xff\x00not json")
    (root / "supervisor" / "state.node1.json").write_text('{"launches": [{"outcome": "zzz"}]}')
    (root / "supervisor" / "events.jsonl").write_text("garbage\n")
    (root / "heartbeats").mkdir()
    (root / "heartbeats" / "rank_00000.json").write_text('{"rank": 0}')
    (root / "step_00000005").mkdir()
    (root / "latest").write_text("../../etc/passwd")
    r = build_report(root)
    assert r.state == "unknown"
    assert all(n.status == "unknown" and n.problem for n in r.nodes) and len(r.nodes) == 2
    assert r.ranks[0].phase == "unknown" and "missing" in r.ranks[0].note
    assert not r.checkpoints[0].valid and "manifest" in r.checkpoints[0].reason
    render(r)


def test_ranks_show_io_progress_failed_saves_and_monotonic_age(tmp_path: Path):
    """A rank deep in a verify shows how far it got and on which file; one whose saves fail shows
    how many and why; a heartbeat of this boot is aged on the monotonic clock, so a wall clock
    that jumped ahead does not make a live rank look stale."""
    from supervisor.format.heartbeat import boot_id

    root = tmp_path / "run"
    write_state(root, RunState(host="vm", watchdog_pid=os.getpid(), status="running", launch_id=LID))
    path = "step_00000120/__1_0.distcp"
    common = {"launch_id": LID, "mono_time": time.monotonic(), "boot_id": boot_id()}
    jumped = time.time() - 3600  # the wall clock stepped an hour since (or the writer's was off)
    write_heartbeat(
        root,
        Heartbeat(
            0,
            0,
            "vm",
            1000,
            120,
            Phase.VERIFY,
            jumped,
            progress=45,
            progress_total=100,
            io_path=path,
            **common,
        ),
    )
    err = "ENOSPC (No space left on device): step_00000130.tmp"
    write_heartbeat(
        root, Heartbeat(1, 1, "vm", 1001, 131, Phase.TRAIN, jumped, save_failures=2, last_error=err, **common)
    )
    r = build_report(root)
    ranks = {x.rank: x for x in r.ranks}
    assert ranks[0].progress == f"45% at {path}" and not ranks[0].stale and ranks[0].age_s < 60
    assert (ranks[1].save_failures, ranks[1].last_error) == (2, err) and "2 failed saves" in ranks[1].note
    assert not ranks[1].stale
    text = render(r)
    assert f"verify  45% at {path}" in text and f"2 failed saves: {err}" in text
    assert json.loads(json.dumps(r.to_dict()))["ranks"][0]["progress"] == f"45% at {path}"


def test_empty_run_dir(tmp_path: Path):
    r = build_report(tmp_path)
    assert r.state == "unknown" and r.checkpoints == () and r.ranks == ()
    assert "none" in render(r)


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(
        supervisor_cmd("status", *args),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )


def test_cli_json_and_table(run_dir: Path):
    p = cli("--ckpt-root", str(run_dir), "--json")
    assert p.returncode == 0, p.stderr
    d = json.loads(p.stdout)
    assert (
        d["schema"] == STATUS_SCHEMA
        and d["state"] == "running"
        and len(d["ranks"]) == 5
        and len(d["checkpoints"]) == 2
    )
    p = cli("--ckpt-root", str(run_dir))
    assert p.returncode == 0 and "checkpoints:" in p.stdout


def test_cli_missing_root_is_one_line_error(tmp_path: Path):
    p = cli("--ckpt-root", str(tmp_path / "nope"))
    assert p.returncode == 2
    assert "does not exist" in p.stderr and len(p.stderr.strip().splitlines()) == 1


def test_cli_watch_refreshes_until_interrupted(run_dir: Path):
    argv = supervisor_cmd("status", "--ckpt-root", str(run_dir), "--watch", "0.2")
    # A shell that starts jobs in the background (as CI may) leaves SIGINT ignored in its children;
    # restore it so this test sees what a person's Ctrl-C does.
    p = subprocess.Popen(
        argv,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL),
    )
    deadline = time.monotonic() + 30
    out = ""
    while out.count("checkpoints:") < 2 and time.monotonic() < deadline:
        out += p.stdout.readline()
    p.send_signal(signal.SIGINT)
    p.communicate(timeout=30)
    # Into a pipe: each refresh appended under a time line, no terminal escapes.
    assert (
        out.count("checkpoints:") >= 2
        and "\x1b" not in out
        and out.count("\n--- ") + out.startswith("--- ") >= 2
    )
    assert p.returncode == 130


def _dead_pid() -> int:
    return int(
        subprocess.run(
            [sys.executable, "-c", "import os; print(os.getpid())"], capture_output=True, text=True
        ).stdout
    )


def test_a_run_finished_under_plain_torchrun_is_done(tmp_path: Path):
    """No watchdog state; every rank's last beat says done (its exit code 0), minutes ago."""
    root = tmp_path / "run"
    for rank in (0, 1):
        hb = Heartbeat(rank, rank, "vm", 1000 + rank, 200, Phase.DONE, time.time() - 600, exit_code=0)
        write_heartbeat(root, hb)
    r = build_report(root)
    assert (r.state, r.why) == (
        "done",
        "every rank finished; no watchdog state (not started by `supervisor watch`?)",
    )
    assert render(r).startswith(f"run {root}: DONE - every rank finished")


def test_without_a_watchdog_the_first_rank_to_fail_is_named_with_how(tmp_path: Path):
    """kill -9 of rank 0 under plain torchrun: its pid is gone, it recorded no exception; rank 1
    died of the lost peer just after, its exception in its last heartbeat."""
    root, me = tmp_path / "run", os.uname().nodename.split(".")[0]
    killed = _dead_pid()
    reset = "RuntimeError: Connection reset by peer (t.py:9)"
    write_heartbeat(root, Heartbeat(0, 0, me, killed, 23, Phase.TRAIN, time.time() - 5))
    write_heartbeat(root, Heartbeat(1, 1, me, _dead_pid(), 23, Phase.TRAIN, time.time() - 4.9, died_of=reset))
    r = build_report(root)
    assert r.state == "failed"
    assert r.why.startswith(f"root cause rank 0 (pid {killed}) at step 23: killed by a signal"), r.why
    assert "; then, as a consequence: rank 1 (pid " in r.why and reset in r.why
    rows = {x.rank: x for x in r.ranks}
    assert rows[0].gone and f"pid {killed} gone without an exit code" in rows[0].note
    assert rows[1].died_of == reset and f"died of {reset}" in rows[1].note


def test_a_dead_writers_tmp_is_abandoned_not_being_written(tmp_path: Path):
    root = tmp_path / "run"
    root.mkdir()
    live = store.begin(root, 40)  # this process: a live writer
    dead = _dead_pid()
    (root / tmp_dirname(30, dead, os.uname().nodename.split(".")[0])).mkdir()
    far = root / tmp_dirname(20, 1, "other-host")
    far.mkdir()
    os.utime(far, (time.time() - 7200, time.time() - 7200))  # nothing written there for 2 h
    r = build_report(root)
    assert r.in_progress == (live.name,)
    assert r.abandoned == (
        f"{far.name} (nothing written for 2.0 h by pid 1 on other-host)",
        f"{tmp_dirname(30, dead, os.uname().nodename.split('.')[0])} (writer pid {dead} gone)",
    )
    text = render(r)
    assert f"being written: {live.name}" in text and f"(writer pid {dead} gone)" in text
    assert json.loads(json.dumps(r.to_dict()))["abandoned"] == list(r.abandoned)
