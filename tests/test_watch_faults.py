"""The watchdog on a hostile filesystem and a hostile process tree (issue 10), with the fake trainer
and real faults: a full disk (a small tmpfs), reads that fail or never return (faultfs), a state
directory that turns into a file, a state file with wrong-typed fields, ranks that exit 0 without
their last heartbeat, DataLoader-like children, an exception inside the watchdog's own loop.

Every wait is on an event (a heartbeat, an event in the log, a line of output, a blocked read);
timeouts here are the ones under test, short so that each test takes seconds."""

from __future__ import annotations

import json
import queue
import shutil
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from commands import REPO
from test_watch import hold_file, start, watch_cmd
from waiting import wait_for, wait_held
from watch_helpers import events, finish, leftovers, of

from supervisor import store
from supervisor.format.events import read_state, state_path
from supervisor.format.exitcodes import Exit
from supervisor.format.nodesummary import read_run_heartbeats
from train_ref import hold

# The fake trainer beats every step (0.05 s): tests that are not about a hang must never see one,
# however busy the machine; tests that are set the timeout they detect.
NO_HANG = ["--hang-timeout", "60", "--startup-timeout", "120"]


def at_step(root: Path, step: int, rank: int = 0) -> bool:
    return any(
        s.heartbeat is not None and s.rank == rank and s.heartbeat.step >= step
        for s in read_run_heartbeats(root)
    )


def logged(root: Path, kind: str) -> list[dict]:
    try:
        return of(events(root), kind)
    except (OSError, ValueError):
        return []


class Output:
    """The watchdog's output, read as it comes, so a test can wait for a line."""

    def __init__(self, p: subprocess.Popen) -> None:
        self.p, self.lines, self.q = p, [], queue.Queue()
        self.t = threading.Thread(target=self._read, daemon=True)
        self.t.start()

    def _read(self) -> None:
        for raw in self.p.stdout:
            self.q.put(raw.decode(errors="replace"))

    def wait_line(self, needle: str) -> str:
        def seen() -> str:
            while not self.q.empty():
                self.lines.append(self.q.get())
            return next((x for x in self.lines if needle in x), "")

        try:
            return wait_for(seen, f"a line with {needle!r}", timeout=120)
        except BaseException:
            print("".join(self.lines))
            raise

    def finish(self, timeout: float = 120) -> tuple[int, str]:
        rc = self.p.wait(timeout)
        self.t.join(10)
        while not self.q.empty():
            self.lines.append(self.q.get())
        return rc, "".join(self.lines)


# ---------------------------------------------------------------- never orphans, never blocks

INJECT = """import sys
from supervisor.watch.hangs import Hangs
from supervisor.cli.main import main
def boom(self, child, launch_id, snaps, beats):
    if any(b.step >= 3 for b in beats):
        raise RuntimeError("injected: a bug in the watchdog's loop")
    return [], 0.5
Hangs.check = boom
sys.exit(main(sys.argv[1:]))
"""


def test_an_exception_in_the_loop_kills_the_tree(tmp_path: Path):
    """A bug in the monitor loop (injected into the watchdog process) must not orphan the ranks:
    the launch's try/finally kills the whole tree before the traceback."""
    root = tmp_path / "run"
    cmd = [sys.executable, "-c", INJECT, *watch_cmd(root, NO_HANG, ["--steps", "100000", "--ranks", "3"])[3:]]
    p = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    rc, out = finish(p)
    assert rc == 1 and "RuntimeError: injected" in out, out
    assert leftovers(root) == [], out
    assert "killed what was left" in of(events(root), "kill")[-1]["msg"]


def test_state_and_event_writes_failing_mid_run_are_survived(tmp_path: Path):
    """The run's supervisor/ directory becomes a file mid-run: every event and state write fails
    for real (ENOTDIR). The watchdog says so on stderr, relaunches after the crash and finishes."""
    root = tmp_path / "run"
    p = start(root, NO_HANG, ["--steps", "12", "--fault", "crash", "--fault-step", "7"])
    wait_for(lambda: at_step(root, 3), "rank 0 at step 3")
    sup = root / "supervisor"
    shutil.rmtree(sup)
    sup.write_text("not a directory any more")
    rc, out = finish(p)
    assert rc == Exit.OK, out
    assert "event log" in out and "not written (Not a directory)" in out
    assert "state.json not written (" in out
    assert "launch 2" in out and "ended after" in out  # the story went to stderr instead
    assert not leftovers(root)


def test_full_disk_mid_run_watchdog_survives_and_relaunches(small_tmpfs):
    """The run dir on a 64 MiB tmpfs filled to ENOSPC during a save: rank 0 crashes on it, the
    watchdog's own writes fail (stderr, kept in memory), and it relaunches while the disk is
    still full; once space returns the run finishes and the event log is complete, in order."""
    root = small_tmpfs.path / "run"
    p = start(root, NO_HANG, ["--steps", "15", "--ckpt-every", "5", "--hold-in-save"], hold_at=10)
    out = Output(p)
    wait_held(hold_file(root), 2, 10, proc=p)  # every rank held inside the save of step 10
    small_tmpfs.fill()
    hold.release(hold_file(root))  # now rank 0 writes, to a full disk
    out.wait_line("not written (ENOSPC")  # the watchdog's own (state) write failed, and it said so
    out.wait_line("launch 2 (id")  # and it relaunched anyway
    small_tmpfs.free()
    rc, text = out.finish()
    assert rc == Exit.OK, text
    assert not leftovers(root)
    evs = events(root)
    outcomes = [e["outcome"] for e in of(evs, "launch_end")]
    assert outcomes[0] == "crash" and outcomes[-1] == "done", (outcomes, text)
    assert [e["t"] for e in evs] == sorted(e["t"] for e in evs)  # kept lines appended in order
    assert of(evs, "exit")[-1]["exit_code"] == 0
    assert read_state(state_path(root)).status == "done"


def test_blocked_read_is_named_and_the_unreapable_rank_left_behind(faultfs):
    """Rank 1 reads a file whose read never returns (faultfs block): it sits in the kernel, beats
    no more, writes no stack dump, and SIGKILL cannot end it (state D). The watchdog names rank,
    phase and path (from the heartbeat and from /proc), kills what it can, names what it could not
    reap after --reap-timeout, and goes on: the relaunch finishes the run."""
    root = faultfs.mountpoint / "run"
    root.mkdir()
    (root / "probe.bin").write_bytes(b"x" * 4096)
    rule = faultfs.block("/run/probe.bin", ops=["read"])
    watch = ["--verify-timeout", "2", "--reap-timeout", "1", *NO_HANG[:2]]
    trainer = ["--steps", "12", "--fault", "read", "--fault-rank", "1", "--fault-step", "3"]
    p = start(root, watch, trainer)
    try:
        (blocked,) = faultfs.wait_blocked(rule)
        kill = wait_for(
            lambda: [e for e in logged(root, "kill") if e.get("unreaped")], "a kill leaving one behind"
        )
    finally:
        faultfs.clear(rule)  # the held read returns; the pending SIGKILL ends the process
    rc, out = finish(p)
    assert rc == Exit.OK, out
    evs = events(root)
    (hang,) = of(evs, "hang")
    assert "rank 1" in hang["msg"] and "phase verify" in hang["msg"] and "at probe.bin" in hang["msg"]
    (io,) = of(evs, "blocked_io")
    assert io["rank"] == 1 and io["pid"] == blocked.pid and io["io_path"] == "probe.bin"
    assert io["blocked"].startswith(f"read({root / 'probe.bin'}) (state ")
    (unreaped,) = kill[0]["unreaped"]
    assert (
        unreaped.startswith(f"pid {blocked.pid} (state D, wchan ")
        and f"read({root / 'probe.bin'})" in unreaped
    )
    assert "left behind" in kill[0]["msg"]
    end = of(evs, "launch_end")[0]
    assert end["outcome"] == "hang" and "blocked in read(" in end["msg"]
    assert f"SIGKILL could not end: pid {blocked.pid} (state D" in end["msg"]
    assert [e["outcome"] for e in of(evs, "launch_end")] == ["hang", "done"]
    print(
        f"\nblocked read -> blocked_io event {io['t'] - blocked.since:.2f}s, -> hang event (after the "
        f"stack dumps) {hang['t'] - blocked.since:.2f}s (verify timeout 2s, poll 0.1s, dump wait 1s)"
    )
    assert not leftovers(root)


def test_clean_exit_without_final_heartbeat_is_done(tmp_path: Path):
    """Every rank exits 0 but its last heartbeat never landed (a full disk): not a death. The
    launched command's exit 0 decides."""
    root = tmp_path / "run"
    rc, out = finish(start(root, NO_HANG, ["--steps", "6", "--no-final-beat"]))
    assert rc == Exit.OK, out
    evs = events(root)
    assert not of(evs, "rank_died") and [e["outcome"] for e in of(evs, "launch_end")] == ["done"]


@pytest.mark.parametrize("plain", [False, True], ids=["launcher", "plain-script"])
def test_preemption_fallback_signals_ranks_not_their_children(tmp_path: Path, plain: bool):
    """A command that writes no heartbeat gets the notice on its ranks only: the session leaders
    right under the launched process (torchrun's workers), or the launched process itself; a
    rank's DataLoader-like child, which SIGUSR1's default action would kill, is left alone."""
    root = tmp_path / "run"
    trainer = ["--steps", "100000", "--silent", "--spawn-child", *(["--plain"] if plain else [])]
    p = start(root, [*NO_HANG, "--preempt-fallback", "0.5", "--requeue-exit"], trainer)
    children = root / "children"
    want = 1 if plain else 2
    wait_for(lambda: len(list(children.glob("*.txt"))) >= want, "the ranks' children started")
    p.send_signal(signal.SIGUSR1)
    preempt = wait_for(lambda: logged(root, "preempt"), "the notice forwarded")[0]
    ends = wait_for(lambda: logged(root, "launch_end"), "the preempted launch's end")
    if not plain:  # torchrun-like: the launcher exits 1 when its ranks exit 75, and it is relaunched
        p.send_signal(signal.SIGTERM)
    rc, out = finish(p)
    assert rc == (Exit.REQUEUE_REQUESTED if plain else 128 + signal.SIGTERM), out
    assert "no heartbeat" in preempt["msg"]
    if plain:
        assert preempt["pids"] == [of(events(root), "launch")[0]["pid"]]
        assert ends[0]["returncode"] == Exit.REQUEUE
    else:
        assert len(preempt["pids"]) == 2 and of(events(root), "launch")[0]["pid"] not in preempt["pids"]
    notes = {f.name: f.read_text() for f in children.glob("*.txt")}
    assert notes and all(t == "started\nsigterm\n" for t in notes.values()), notes  # none died of SIGUSR1
    assert not leftovers(root), out


def test_wrong_typed_state_file_takes_the_unreadable_path(tmp_path: Path):
    root = tmp_path / "run"
    sup = root / "supervisor"
    sup.mkdir(parents=True)
    bad = {"launch_count": "x", "launches": 5, "restart_times": [1.0] * 50}
    (sup / "state.json").write_text(json.dumps(bad))
    rc, out = finish(start(root, NO_HANG, ["--steps", "3"]))
    assert rc == Exit.OK, out
    assert "Traceback" not in out
    (ev,) = of(events(root), "state_unreadable")
    assert "'launch_count' is 'x'" in ev["msg"] and "fresh budget" in ev["msg"]
    assert json.loads((sup / "state.json.bad").read_text()) == bad
    st = read_state(state_path(root))
    assert st.status == "done" and st.launch_count == 1 and st.restart_times == ()


def test_unreadable_state_file_is_retried_then_exit_14_and_kept(faultfs):
    """A state file that cannot be read (EIO) is not garbage: retried for --io-retry, then exit 14
    with the verdict; it is neither moved aside nor overwritten (its restart budget stands)."""
    root = faultfs.mountpoint / "run"
    (root / "supervisor").mkdir(parents=True)
    state = root / "supervisor" / "state.json"
    state.write_text(json.dumps({"launch_count": 4, "restart_times": [1.0, 2.0]}))
    rule = faultfs.fail("/run/supervisor/state.json", "EIO", ops=["read"])
    rc, out = finish(start(root, ["--io-retry", "1"], ["--steps", "3"]))
    assert rc == Exit.STORAGE_UNAVAILABLE, out
    assert faultfs.hits(rule) >= 2 and "Traceback" not in out
    evs = events(root)
    assert of(evs, "io_retry") and not of(evs, "launch") and not of(evs, "state_unreadable")
    assert "EIO" in of(evs, "exit")[-1]["msg"]
    faultfs.clear(rule)
    assert json.loads(state.read_text()) == {"launch_count": 4, "restart_times": [1.0, 2.0]}


def test_run_dir_that_cannot_be_made_is_exit_14_never_2(faultfs):
    """An error of the environment (here: mkdir of the run dir fails with EIO) is a storage
    verdict the job requeues (14), in one line: never the usage code 2, never a traceback."""
    root = faultfs.mountpoint / "run"
    rule = faultfs.fail("/run", "EIO", ops=["mkdir"])
    p = subprocess.run(
        watch_cmd(root, [], ["--steps", "3"]), cwd=REPO, capture_output=True, text=True, timeout=120
    )
    assert p.returncode == Exit.STORAGE_UNAVAILABLE, p.stderr
    assert faultfs.hits(rule) >= 1 and "Traceback" not in p.stderr
    assert (
        "watchdog exits 14" in p.stderr and "EIO" in p.stderr and "cannot use the run directory" in p.stderr
    )


def test_command_that_cannot_start_is_one_line_exit_12(tmp_path: Path):
    root = tmp_path / "run"
    cmd = [
        sys.executable,
        "-m",
        "supervisor",
        "watch",
        "--ckpt-root",
        str(root),
        "--",
        str(tmp_path / "nope"),
    ]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert p.returncode == Exit.CHILD_NONRETRYABLE, p.stderr
    assert "Traceback" not in p.stderr and f"cannot start {tmp_path / 'nope'}: ENOENT" in p.stderr


# ---------------------------------------------------------------- storage verdicts


def test_rank_exit_74_relaunches_with_backoff_then_exit_14(tmp_path: Path):
    """A trainer that gives up on its storage (74) is relaunched, backing off; when it keeps
    failing so without a newer checkpoint, the watchdog exits 14 (requeue), not 11."""
    root = tmp_path / "run"
    trainer = ["--fault", "exit", "--fault-code", "74", "--fault-step", "1", "--fault-launches", "0"]
    rc, out = finish(start(root, [*NO_HANG, "--no-progress", "3"], trainer))
    assert rc == Exit.STORAGE_UNAVAILABLE, out
    evs = events(root)
    assert [e["outcome"] for e in of(evs, "launch_end")] == ["storage"] * 3
    waits = [e["wait_s"] for e in of(evs, "relaunch")]
    assert waits[0] == 0 and waits[1] > 0  # the second failure in a row backs off
    assert "storage unavailable" in of(evs, "exit")[-1]["msg"]
    assert not leftovers(root)


def test_unreadable_checkpoint_at_pick_is_retried_then_exit_14(faultfs):
    """Every read of the manifest fails with EIO before the relaunch: not proof of corruption.
    The pick retries for --io-retry (io_retry events, the state's reason), then the watchdog
    exits 14 with the verdict; nothing is quarantined, the checkpoint is still there."""
    root = faultfs.mountpoint / "run"
    p = start(root, [*NO_HANG, "--io-retry", "2"], ["--steps", "20", "--fault", "crash", "--fault-step", "7"])
    wait_for(lambda: at_step(root, 6), "step 5 committed, step 6 reached")
    rule = faultfs.fail("/run/step_*/manifest.json", "EIO", ops=["read"])
    rc, out = finish(p)
    assert faultfs.hits(rule) > 0
    assert rc == Exit.STORAGE_UNAVAILABLE, out
    evs = events(root)
    assert of(evs, "io_retry") and "EIO" in of(evs, "io_retry")[0]["msg"]
    last = of(evs, "exit")[-1]["msg"]
    assert "watchdog exits 14" in last and "EIO" in last and "--io-retry" in last
    faultfs.clear(rule)
    assert [r.name for r in store.list_checkpoints(root)] == ["step_00000005"]
    assert not store.list_quarantined(root) and not of(evs, "quarantine")
    assert read_state(state_path(root)).exit_code == Exit.STORAGE_UNAVAILABLE
    assert not leftovers(root)


def test_short_eio_burst_at_pick_is_ridden_out(faultfs):
    root = faultfs.mountpoint / "run"
    p = start(root, NO_HANG, ["--steps", "12", "--fault", "crash", "--fault-step", "7"])
    wait_for(lambda: at_step(root, 6), "step 5 committed, step 6 reached")
    rule = faultfs.fail("/run/step_*/manifest.json", "EIO", ops=["read"], count=2)
    rc, out = finish(p)
    assert rc == Exit.OK, out
    evs = events(root)
    assert faultfs.hits(rule) == 2 and of(evs, "io_retry")
    assert of(evs, "pick")[-1]["checkpoint"] == "step_00000005" and not of(evs, "quarantine")
    assert of(evs, "launch")[1]["resumed_from"] == 5


def test_no_usable_checkpoint_stops_unless_allowed_to_start_fresh(tmp_path: Path):
    """The only checkpoint turns out corrupt at the pick before a relaunch: quarantined, and then
    the run has history but nothing usable; the watchdog stops (12) instead of silently starting
    from step 0. With --allow-fresh-start it starts over."""
    root = tmp_path / "run"
    trainer = ["--steps", "9", "--fault", "crash", "--fault-step", "7"]
    p = start(root, NO_HANG, trainer)
    wait_for(lambda: at_step(root, 6), "step 5 committed, step 6 reached")
    (root / "step_00000005" / "manifest.json").write_text("{garbage")
    rc, out = finish(p)
    assert rc == Exit.CHILD_NONRETRYABLE, out
    evs = events(root)
    assert of(evs, "quarantine")[0]["checkpoint"] == "step_00000005"
    assert "--allow-fresh-start" in of(evs, "exit")[-1]["msg"] and len(of(evs, "launch")) == 1
    rc, out = finish(start(root, [*NO_HANG, "--allow-fresh-start"], trainer))
    assert rc == Exit.OK, out
    assert of(events(root), "launch")[-1]["resumed_from"] is None
    assert not leftovers(root)


def test_save_failures_are_reported_and_recovery_too(faultfs):
    """Rank 0's saves of steps 5 and 10 fail with ENOSPC (faultfs on their file's writes); the trainer
    reports them in its heartbeat and trains on. The watchdog logs save_failed twice, then
    save_recovered, and the run is never relaunched for it."""
    root = faultfs.mountpoint / "run"
    rules = [faultfs.fail(f"/run/step_{s:08d}.tmp*/state.txt", "ENOSPC", ops=["write"]) for s in (5, 10)]
    rc, out = finish(start(root, NO_HANG, ["--steps", "16", "--survive-save-errors"]))
    assert rc == Exit.OK, out
    assert all(faultfs.hits(r) for r in rules)
    evs = events(root)
    failed = of(evs, "save_failed")
    assert [(e["rank"], e["save_failures"]) for e in failed] == [(0, 1), (0, 2)]
    for e, step in zip(failed, (5, 10), strict=True):
        assert step <= e["step"] < step + 5  # seen in a heartbeat after that save, before the next
        assert "No space left on device" in e["last_error"] and f"step_{step:08d}" in e["last_error"]
    (ok,) = of(evs, "save_recovered")
    assert ok["rank"] == 0 and 15 <= ok["step"] <= 16
    assert len(of(evs, "launch")) == 1
