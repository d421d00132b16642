"""The remote tier with the real trainer: torchrun, 2 ranks, real DCP files, a real S3 endpoint (moto
in server mode on loopback) and a second directory as the shared tier.

Node loss (the whole run directory gone), a truncated newest remote checkpoint with no local copy,
and the endpoint down mid-run: each run ends with the same parameters as an uninterrupted one.
"""

from __future__ import annotations

import os
import shutil
import signal
from pathlib import Path

import pytest
import remote_support as rs
from commands import free_port
from trainer_helpers import (
    STEPS,
    digest,
    finish,
    heartbeat_exit_codes,
    kill_group,
    last_step,
    launch,
    metrics,
    read_jsonl,
    run,
    run_ok,
    shared_goldens,
    train_args,
    trainer_env,
)
from waiting import wait_for, wait_held

from supervisor.format.exitcodes import Exit
from supervisor.tiers.remote import open_remote
from supervisor.tiers.uploader import read_remote_status
from train_ref import hold

pytestmark = pytest.mark.slow

PARALLEL = "ddp"


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Path:
    return shared_goldens(lambda: tmp_path_factory.mktemp("goldens")).get(PARALLEL, 2)


def remote_args(url: str, server: rs.MotoServer | None, *extra: str) -> list[str]:
    endpoint = ["--remote-endpoint", server.endpoint] if server and url.startswith("s3://") else []
    return train_args(PARALLEL, "--remote", url, *endpoint, *extra, save_every=3)


def env(hold_file: Path | None = None) -> dict[str, str]:
    return trainer_env(hold_file, **rs.FAKE_CREDENTIALS)


def preempt_after(root: Path, args: list[str], step: int) -> int:
    """Launch, send SIGUSR1 while held after ``step``; returns the step it checkpointed and stopped
    at (the next one)."""
    gate = root.parent / "hold"
    hold.hold_at(gate, step)
    proc = launch(root, 2, *args, env=env(gate))
    try:
        os.kill(wait_held(gate, 2, step, proc=proc)[1]["pid"], signal.SIGUSR1)
        hold.release(gate)
        r = finish(proc)
    finally:
        kill_group(proc)
    assert set(heartbeat_exit_codes(root).values()) == {Exit.REQUEUE}, r.output[-3000:]
    stopped = last_step(root)
    assert stopped == step + 1
    return stopped


def remote_steps(url: str, server: rs.MotoServer | None) -> list[int]:
    tier = open_remote(url, server.endpoint if server else None)
    return [v.step for v in tier.scan() if v.ok]


def test_node_loss_resumes_from_the_remote_digest_equal(golden, tmp_path, moto):
    url = rs.new_bucket(moto)
    root = tmp_path / "run"
    args = remote_args(url, moto)
    stopped = preempt_after(root, args, 8)
    assert max(remote_steps(url, moto)) == stopped, "the preemption checkpoint did not reach the remote"

    shutil.rmtree(root)  # node loss: every local checkpoint, heartbeat and log is gone
    r = run_ok(root, 2, *args, env=env())
    assert f"downloaded from {url}" in r.output
    assert f"resumed from step_{stopped:08d}, next step {stopped + 1}" in r.output
    assert [m.step for m in metrics(root)] == list(range(stopped + 1, STEPS + 1))
    assert digest(root) == digest(golden)
    assert max(remote_steps(url, moto)) == STEPS, "the final checkpoint did not reach the remote"


def test_truncated_newest_remote_walks_back_quarantined_digest_equal(golden, tmp_path):
    url = str(tmp_path / "shared" / "run")  # the directory tier
    root = tmp_path / "run"
    args = remote_args(url, None)
    preempt_after(root, args, 8)
    newest, previous = remote_steps(url, None)[:2]
    victim = max((Path(url) / f"step_{newest:08d}").glob("__*.distcp"), key=lambda p: p.stat().st_size)
    with victim.open("r+b") as f:
        f.truncate(victim.stat().st_size // 2)

    shutil.rmtree(root)
    r = run_ok(root, 2, *args, env=env())
    assert f"resumed from step_{previous:08d}, next step {previous + 1}" in r.output
    assert digest(root) == digest(golden)
    (q,) = open_remote(url).list_quarantined()
    assert q.name.startswith(f"step_{newest:08d}-")
    assert victim.name in q.reason and "manifest says" in q.reason, q.reason
    events = read_jsonl(root / "supervisor" / "events.remote.jsonl")
    assert any(e["event"] == "remote_quarantined" for e in events)


def test_remote_down_mid_run_training_goes_on_and_uploads_catch_up(golden, tmp_path, moto):
    """Held after step 6 (step 3 committed, its upload under way) until step 3 is on the remote;
    then the endpoint goes down and the hold moves to step 10: the ranks train on, commit step 6,
    its upload fails, and remote.json shows the remote down with a lag, all while the run is held
    at step 10, so it is still running by construction."""
    url = rs.new_bucket(moto)
    root, gate = tmp_path / "run", tmp_path / "hold"
    args = remote_args(url, moto, "--remote-attempts", "2")
    hold.hold_at(gate, 6)
    proc = launch(root, 2, *args, env=env(gate))
    down_seen = None
    try:
        wait_held(gate, 2, 6, proc=proc)
        wait_for(
            lambda: (s := read_remote_status(root)) is not None and s.newest_remote is not None,
            "a first upload",
            proc=proc,
        )
        moto.stop()
        try:
            hold.hold_at(gate, 10)
            wait_held(gate, 2, 10, proc=proc)  # four steps trained while the remote is down
            down_seen = wait_for(
                lambda: (
                    (s := read_remote_status(root)) is not None
                    and s.state == "down"
                    and s.lag_steps > 0
                    and s
                ),
                "remote.json to show the remote down with a lag",
                proc=proc,
            )
        finally:
            moto.start()
        hold.release(gate)
        r = finish(proc)
    finally:
        kill_group(proc)
    assert r.rc == 0, r.output[-4000:]
    assert down_seen is not None and down_seen.last_error
    assert digest(root) == digest(golden)
    assert max(remote_steps(url, moto)) == STEPS, "the final checkpoint did not reach the remote"
    end = read_remote_status(root)
    assert end is not None and end.state == "in_sync" and end.lag_steps == 0
    events = [e["event"] for e in read_jsonl(root / "supervisor" / "events.remote.jsonl")]
    assert "remote_down" in events and "remote_back" in events
    back = events.index("remote_back")
    assert events.index("remote_down") < back and "upload_ok" in events[back:], events
    assert "upload_refused" not in events


def test_an_unreachable_remote_with_nothing_local_is_a_retryable_exit(tmp_path):
    """Never a silent fresh start over a remote that may hold the run's progress."""
    root = tmp_path / "run"
    dead = f"http://127.0.0.1:{free_port()}"  # nobody listens there
    r = run(
        root, 2, *train_args(PARALLEL, "--remote", "s3://bucket/run", "--remote-endpoint", dead), env=env()
    )
    assert r.rc != 0
    assert set(heartbeat_exit_codes(root).values()) == {1}
    line = next(x for x in r.output.splitlines() if "cannot resume" in x)
    assert "not starting from scratch" in line and "127.0.0.1" in line, line
    assert "train_ref/" not in r.output, "a worker traceback"
    assert not metrics(root), "it trained"
