"""The remote tier with the real trainer: torchrun, 2 ranks, real DCP files, a real S3 endpoint (moto
in server mode on loopback) and a second directory as the shared tier.

Node loss (the whole run directory gone), a truncated newest remote checkpoint with no local copy,
and the endpoint down mid-run: each run ends with the same parameters as an uninterrupted one.
"""

from __future__ import annotations

import os
import shutil
import signal
import time
from pathlib import Path

import pytest
import remote_support as rs
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
    wait_for,
    worker_pid,
)

from supervisor.exitcodes import Exit
from supervisor.tiers.remote import open_remote
from supervisor.tiers.uploader import read_remote_status

pytestmark = pytest.mark.slow

moto = pytest.fixture(scope="module")(rs.serve_moto)
PARALLEL = "ddp"
# Each checkpoint's write sleeps this long (async, so training goes on): about one save in flight
# per 0.3 s keeps a 30-step run alive long enough to signal it or to take its endpoint away.
PACE = {"TRAIN_REF_SAVE_DELAY_S": "0.3"}


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> Path:
    return shared_goldens(lambda: tmp_path_factory.mktemp("goldens")).get(PARALLEL, 2)


def remote_args(url: str, server: rs.MotoServer | None, *extra: str) -> list[str]:
    endpoint = ["--remote-endpoint", server.endpoint] if server and url.startswith("s3://") else []
    return train_args(PARALLEL, "--remote", url, *endpoint, *extra, save_every=3)


def env(**extra: str) -> dict[str, str]:
    return trainer_env(**rs.FAKE_CREDENTIALS, **extra)


def preempt_after(root: Path, args: list[str], step: int) -> int:
    """Launch, send SIGUSR1 once ``step`` is done; returns the step it checkpointed and stopped at."""
    t0 = time.time()
    proc = launch(root, 2, *args, env=env(**PACE))
    try:
        wait_for(lambda: last_step(root) >= step, 180, f"step {step}", proc)
        os.kill(worker_pid(root, 1, t0), signal.SIGUSR1)
        r = finish(proc)
    finally:
        kill_group(proc)
    assert set(heartbeat_exit_codes(root).values()) == {Exit.REQUEUE}, r.output[-3000:]
    stopped = last_step(root)
    assert stopped < STEPS
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
    assert [m["step"] for m in metrics(root)] == list(range(stopped + 1, STEPS + 1))
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
    url = rs.new_bucket(moto)
    root = tmp_path / "run"
    args = remote_args(url, moto, "--remote-attempts", "2")
    proc = launch(root, 2, *args, env=env(TRAIN_REF_SAVE_DELAY_S="0.5"))
    down_seen = None
    try:
        wait_for(
            lambda: (s := read_remote_status(root)) is not None and s.newest_remote is not None,
            180,
            "a first upload",
            proc,
        )
        moto.stop()
        try:
            wait_for(
                lambda: (s := read_remote_status(root)) is not None and s.state == "down" and s.lag_steps > 0,
                120,
                "remote.json to show the remote down with a lag",
                proc,
            )
            down_seen = read_remote_status(root)
            at = last_step(root)
            wait_for(lambda: last_step(root) > at, 60, "a training step while the remote is down", proc)
        finally:
            moto.start()
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
    dead = f"http://127.0.0.1:{rs.free_port()}"  # nobody listens there
    r = run(
        root, 2, *train_args(PARALLEL, "--remote", "s3://bucket/run", "--remote-endpoint", dead), env=env()
    )
    assert r.rc != 0
    assert set(heartbeat_exit_codes(root).values()) == {1}
    line = next(x for x in r.output.splitlines() if "cannot resume" in x)
    assert "not starting from scratch" in line and "127.0.0.1" in line, line
    assert "train_ref/" not in r.output, "a worker traceback"
    assert not metrics(root), "it trained"
