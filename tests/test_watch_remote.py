"""The watchdog with a remote tier: node loss (the local run dir gone) resumes from the remote; an
unreachable remote with nothing valid locally is waited for, then a clear stop, never a silent
start from scratch."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

from commands import REPO, supervisor_cmd
from store_helpers import make_ckpt

from supervisor.format.events import events_path, read_events
from supervisor.format.exitcodes import Exit

# Stands in for the trainer: succeeds only when the checkpoint it must resume from is in place.
NEEDS_STEP_20 = (
    "import pathlib, sys; "
    "sys.exit(0 if (pathlib.Path(sys.argv[1]) / 'step_00000020' / 'manifest.json').exists() else 3)"
)


def watch(
    root: Path, remote: str, *extra: str, env: dict | None = None, timeout: float = 120
) -> subprocess.CompletedProcess:
    cmd = supervisor_cmd("watch", "--ckpt-root", str(root), "--remote", remote)
    cmd += [
        "--verify",
        "deep",
        "--max-restarts",
        "0",
        *extra,
        "--",
        sys.executable,
        "-c",
        NEEDS_STEP_20,
        str(root),
    ]
    return subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=timeout, env=env)


def test_node_loss_resumes_from_the_remote_tier(tmp_path):
    remote = tmp_path / "shared"
    make_ckpt(remote, 10)
    make_ckpt(remote, 20)
    root = tmp_path / "node-local" / "run"  # the node's disk is gone: nothing local at all
    p = watch(root, str(remote))
    assert p.returncode == Exit.OK, p.stderr[-2000:]
    picks = [e for e in read_events(events_path(root)) if e["event"] == "pick"]
    assert picks and picks[0]["checkpoint"] == "step_00000020" and picks[0]["source"] == "remote"
    manifest = json.loads((root / "step_00000020" / "manifest.json").read_text())
    assert manifest["step"] == 20


def test_unreachable_remote_is_waited_for_then_a_clear_stop(tmp_path):
    root = tmp_path / "run"
    # Credentials present, so what fails is the connection (port 9 refuses), not the sign-in.
    env = {**os.environ, "AWS_ACCESS_KEY_ID": "test", "AWS_SECRET_ACCESS_KEY": "test"}
    args = ("--remote-endpoint", "http://127.0.0.1:9", "--remote-wait", "1")
    p = watch(root, "s3://bucket/run", *args, env=env)
    assert p.returncode == Exit.STORAGE_UNAVAILABLE, p.stderr[-2000:]  # storage verdict: requeue
    log = read_events(events_path(root))
    unavailable = [e["msg"] for e in log if e["event"] == "remote_unavailable"]
    assert unavailable and "EndpointConnectionError" in unavailable[0], unavailable
    assert "launch" not in [e["event"] for e in log]  # never started from scratch
    assert "unreachable" in log[-1]["msg"]


def run_cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(supervisor_cmd(*args), cwd=REPO, capture_output=True, text=True)


def test_ckpt_list_and_status_show_both_tiers(tmp_path):
    root, remote = tmp_path / "run", tmp_path / "shared"
    for step in (10, 20):
        make_ckpt(root, step)
    make_ckpt(remote, 10)
    p = run_cli("ckpt", "list", "--ckpt-root", str(root), "--remote", str(remote), "--json")
    assert p.returncode == 0, p.stderr
    tiers = json.loads(p.stdout)["tiers"]
    assert tiers["lag_steps"] == 10
    assert [(r["name"], r["where"]) for r in tiers["rows"]] == [
        ("step_00000020", "local"),
        ("step_00000010", "local+remote"),
    ]
    # status reads the uploader's status file only (no network): a remote that is down shows so.
    (root / "supervisor").mkdir()
    status = {"url": str(remote), "state": "down", "newest_remote": 10, "lag_steps": 10, "lag_s": 42.0}
    (root / "supervisor" / "remote.json").write_text(json.dumps(dict(status, last_error="refused")))
    human = run_cli("status", "--ckpt-root", str(root))
    assert human.returncode == 0, human.stderr
    assert f"remote {remote}: down, newest remote step 10, lag 10 steps" in human.stdout
    assert "last error: refused" in human.stdout
    doc = json.loads(run_cli("status", "--ckpt-root", str(root), "--json").stdout)
    assert doc["remote"]["state"] == "down" and doc["remote"]["lag_steps"] == 10
