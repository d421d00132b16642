"""The standby gate (supervisor/resumable/_standby.py), which importing supervisor.resumable
passes: without the watchdog's variable it is a no-op; with it, the rank says it is ready and
waits for the release file, or exits 0 once the watchdog that started it is gone. The end-to-end
use (a relaunch taken from the standby) is in tests/test_watch_e2e.py (the reference trainer) and
tests/test_standby_user.py (a user's loop, examples/plain_loop.py)."""

from __future__ import annotations

import os
import subprocess
import sys
import threading

import pytest
from commands import REPO
from waiting import wait_for

from supervisor.format.heartbeat import ENV_STANDBY_RELEASE, ENV_WATCHDOG_PID
from supervisor.format.layout import standby_ready_filename
from supervisor.resumable import _standby
from supervisor.watch import process


@pytest.fixture(autouse=True)
def no_warm_imports(monkeypatch):
    monkeypatch.setattr(_standby, "WARM_IMPORTS", ())  # torch._dynamo takes seconds; not the point here
    monkeypatch.setenv("RANK", "3")


def test_without_the_variable_it_returns_at_once(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV_STANDBY_RELEASE, raising=False)
    _standby.wait_if_standby()
    assert list(tmp_path.iterdir()) == []


def test_waits_ready_until_released(tmp_path, monkeypatch):
    release = tmp_path / "release"
    monkeypatch.setenv(ENV_STANDBY_RELEASE, str(release))
    monkeypatch.setenv(ENV_WATCHDOG_PID, str(os.getpid()))
    done = threading.Event()
    t = threading.Thread(target=lambda: (_standby.wait_if_standby(), done.set()), daemon=True)
    t.start()
    ready = tmp_path / standby_ready_filename(3)
    wait_for(ready.exists, "the rank's ready file")
    assert not done.is_set()  # ready, still waiting: nothing released it
    release.write_text("go\n")
    t.join(timeout=60)
    assert done.is_set()


def test_exits_0_once_its_watchdog_is_gone(tmp_path, monkeypatch):
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # reaped: its pid names no process
    monkeypatch.setenv(ENV_STANDBY_RELEASE, str(tmp_path / "release"))
    monkeypatch.setenv(ENV_WATCHDOG_PID, str(gone.pid))
    with pytest.raises(SystemExit) as e:
        _standby.wait_if_standby()
    assert e.value.code == 0


def test_a_standby_is_a_tree_of_its_own(tmp_path):
    """The running launch's tree leaves the standby's out, and killing it spares the standby;
    the standby's tree is only itself and what is below it (supervisor/watch/process.py)."""
    forks = "import subprocess, sys, threading; subprocess.Popen([sys.executable, '-c', "
    forks += "'import threading; threading.Event().wait()']); threading.Event().wait()"
    argv = [sys.executable, "-c", forks]
    launch = process.Child(argv, os.environ, reap_timeout_s=10)
    spare = process.Child(argv, os.environ, reap_timeout_s=10, own_subtree=True)
    launch.excluded = {spare.pid}
    try:
        wait_for(lambda: len(spare.tree()) == 2 and len(launch.tree()) >= 2, "both with their child")
        assert spare.pid not in launch.tree() and set(launch.tree()).isdisjoint(spare.tree())
        launch.kill(0.0)
        assert spare.poll() is None and len(spare.tree()) == 2
    finally:
        launch.kill(0.0)
        spare.kill(0.0)
    assert spare.tree() == []


def test_importing_the_api_is_the_gate_and_the_ranks_children_are_not_gated(tmp_path):
    """A user's loop that only imports ``supervisor.resumable`` waits at the import until released;
    once through, the watchdog's variable is gone from its environment (its DataLoader workers,
    which import the package again, must not wait)."""
    release = tmp_path / "release"
    code = (
        f"import os, supervisor.resumable; print(os.environ.get({ENV_STANDBY_RELEASE!r}, 'gone'), flush=True)"
    )
    env = dict(
        os.environ, **{ENV_STANDBY_RELEASE: str(release), ENV_WATCHDOG_PID: str(os.getpid()), "RANK": "3"}
    )
    rank = subprocess.Popen(
        [sys.executable, "-c", code], env=env, stdout=subprocess.PIPE, text=True, cwd=REPO
    )
    try:
        wait_for((tmp_path / standby_ready_filename(3)).exists, "the rank's ready file", proc=rank)
        assert rank.poll() is None  # ready, imports done, and waiting: nothing released it
        release.write_text("go\n")
        out, _ = rank.communicate(timeout=120)
    finally:
        rank.kill()
        rank.wait()
    assert (rank.returncode, out.strip()) == (0, "gone")
