"""The remote tier on a shared directory and on a real S3-compatible server (moto over HTTP on
loopback): the commit marker, killed uploads, node loss, corrupt remote checkpoints."""

from __future__ import annotations

import os
import random
import select
import shutil
import signal
import subprocess
import sys
import textwrap

import pytest
import remote_support as rs
from commands import REPO, free_port

from supervisor import store
from supervisor.format.layout import MANIFEST, RunDir, step_dirname
from supervisor.tiers.backends import DirBackend
from supervisor.tiers.plan import RemoteState
from supervisor.tiers.remote import LocalSourceError, RemoteUnavailable, open_remote
from supervisor.tiers.resume import prepare_resume


def test_upload_sets_the_commit_marker_and_is_idempotent(tier, local):
    ref = rs.fake_checkpoint(local, 10)
    t = tier.upload(ref)
    assert t.bytes == store.validate(ref).manifest.total_bytes and not t.already_there
    v = tier.check(10)
    assert v is not None and v.state is RemoteState.COMPLETE
    assert tier.backend.read(f"{ref.name}/{MANIFEST}") == (ref.path / MANIFEST).read_bytes()
    assert tier.upload(ref).already_there
    assert [x.step for x in tier.scan()] == [10]


def test_manifest_lands_last(tier, local):
    ref = rs.fake_checkpoint(local, 20)
    states = []
    tier.upload(ref, on_file=lambda rel, n: states.append(tier.check(20)))
    assert len(states) == 4
    # until the manifest is written the remote never shows the checkpoint as complete
    assert all(s is None or s.state is RemoteState.INCOMPLETE for s in states)
    assert tier.check(20).ok


def test_a_corrupt_local_checkpoint_is_never_uploaded(tier, local):
    ref = rs.fake_checkpoint(local, 30)
    shard = ref.path / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[100] ^= 0x01  # same size: only the checksum can tell
    shard.write_bytes(bytes(data))
    with pytest.raises(LocalSourceError, match=r"__1_0\.distcp"):
        tier.upload(ref)
    assert tier.check(30) is None
    assert tier.scan() == []


def test_a_same_step_with_other_content_replaces_and_quarantines_the_old(tier, local, tmp_path):
    tier.upload(rs.fake_checkpoint(local, 40))
    other = rs.fake_checkpoint(tmp_path / "other", 40)
    tier.upload(other)
    q = tier.list_quarantined()
    assert len(q) == 1 and "replaced by a new upload" in q[0].reason
    fresh = tmp_path / "fresh"
    prepare_resume(fresh, tier)
    assert rs.payload(fresh / step_dirname(40)) == rs.payload(other.path)


def _start_stalling_upload(tier, ref) -> subprocess.Popen:
    """A real process uploading ``ref`` that stalls after its first object, to be killed there."""
    script = textwrap.dedent(
        """
        import sys, time
        from pathlib import Path
        from supervisor.format.layout import parse_committed
        from supervisor.store import CheckpointRef
        from supervisor.tiers.remote import open_remote

        url, endpoint, ckpt = sys.argv[1:4]
        path = Path(ckpt)

        def stall(rel, size):
            print("uploaded", rel, flush=True)
            time.sleep(600)

        open_remote(url, endpoint or None).upload(CheckpointRef(parse_committed(path.name), path), stall)
        """
    )
    endpoint = getattr(tier.backend, "fs", None) and tier.backend.fs.endpoint_url
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    return subprocess.Popen(
        [sys.executable, "-c", script, tier.url, endpoint or "", str(ref.path)],
        stdout=subprocess.PIPE,
        env=env,
        text=True,
    )


def _kill_after_first_object(proc: subprocess.Popen) -> None:
    ready, _, _ = select.select([proc.stdout], [], [], 60)
    assert ready, "the uploader subprocess never reported its first object"
    assert proc.stdout.readline().startswith("uploaded")
    os.kill(proc.pid, signal.SIGKILL)
    assert proc.wait(timeout=30) == -signal.SIGKILL


def test_kill_9_during_an_upload_never_shows_a_complete_checkpoint(tier, local, tmp_path):
    tier.upload(rs.fake_checkpoint(local, 10))
    ref20 = rs.fake_checkpoint(local, 20)
    _kill_after_first_object(_start_stalling_upload(tier, ref20))

    v = tier.check(20)
    assert v is None or v.state is RemoteState.INCOMPLETE
    assert [x.step for x in tier.scan() if x.ok] == [10]
    resumed = prepare_resume(tmp_path / "elsewhere", tier)
    assert resumed.source == "remote" and resumed.chosen.step == 10

    # the next upload of the same checkpoint completes it
    assert not tier.upload(ref20).already_there
    assert tier.check(20).ok

    # killed again on step 30, then superseded by step 40: retention cleans the leftovers
    ref30 = rs.fake_checkpoint(local, 30)
    _kill_after_first_object(_start_stalling_upload(tier, ref30))
    tier.upload(rs.fake_checkpoint(local, 40))
    tier.prune(keep=3, stale_after_s=0.0)  # the store's rule: silent long enough and its pid dead
    assert tier.check(30) is None
    assert [x.step for x in tier.scan()] == [40, 20, 10]
    if isinstance(tier.backend, DirBackend):
        assert store.list_tmp(tier.backend.root) == []


def test_node_loss_resumes_from_the_remote(tier, local):
    for step in (10, 20):
        tier.upload(rs.fake_checkpoint(local, step))
    before = rs.payload(local / step_dirname(20))
    shutil.rmtree(local)  # the node and its disk are gone

    res = prepare_resume(local, tier)

    assert res.source == "remote" and res.chosen.step == 20
    assert res.downloaded_bytes > 0
    v = store.validate(res.chosen, deep=True)
    assert v.ok, v.reason
    assert rs.payload(res.chosen.path) == before
    assert store.read_latest(local) == step_dirname(20)
    assert store.list_tmp(local) == []


def test_a_truncated_newest_remote_is_quarantined_and_resume_walks_back(tier, local):
    for step in (10, 20):
        tier.upload(rs.fake_checkpoint(local, step))
    key = f"{step_dirname(20)}/__2_0.distcp"
    tier.backend.write(key, tier.backend.read(key)[:1000])  # truncate the object
    shutil.rmtree(local)

    res = prepare_resume(local, tier)

    assert res.source == "remote" and res.chosen.step == 10
    assert [n for n, _ in res.remote_quarantined] == [step_dirname(20)]
    assert "__2_0.distcp is 1000 bytes" in res.remote_quarantined[0][1]
    q = tier.list_quarantined()
    assert len(q) == 1 and q[0].name.startswith(step_dirname(20)) and "1000 bytes" in q[0].reason
    assert [v.step for v in tier.scan()] == [10]
    assert store.validate(res.chosen, deep=True).ok
    events = (RunDir.of(local).supervisor / "events.remote.jsonl").read_text()
    assert "remote_quarantined" in events


def test_a_bit_flip_on_the_remote_is_caught_by_the_download_checksum(tier, local):
    for step in (10, 20):
        tier.upload(rs.fake_checkpoint(local, step))
    key = f"{step_dirname(20)}/__0_0.distcp"
    data = bytearray(tier.backend.read(key))
    data[5] ^= 0xFF
    tier.backend.write(key, bytes(data))  # same size: the marker still holds
    assert tier.check(20).ok
    shutil.rmtree(local)

    res = prepare_resume(local, tier)

    assert res.chosen.step == 10
    assert "__0_0.distcp" in res.remote_quarantined[0][1] and "checksum" in res.remote_quarantined[0][1]
    assert not (local / step_dirname(20)).exists()
    assert store.list_tmp(local) == []


def test_local_wins_when_newest_and_the_remote_fills_gaps(tier, local, tmp_path):
    tier.upload(rs.fake_checkpoint(local, 10))
    rs.fake_checkpoint(local, 20)  # not uploaded yet
    res = prepare_resume(local, tier)
    assert (res.source, res.chosen.step, res.downloaded_bytes) == ("local", 20, 0)

    behind = tmp_path / "behind"
    rs.fake_checkpoint(behind, 5)
    res = prepare_resume(behind, tier)
    assert (res.source, res.chosen.step) == ("remote", 10)
    assert store.read_latest(behind) == step_dirname(10)


def test_remote_retention_keeps_the_newest_and_milestones(tier, local):
    for step in range(10, 110, 10):
        tier.upload(rs.fake_checkpoint(local, step))
    plan = tier.prune(keep=3, milestone_every=50)
    assert [v.step for v in tier.scan()] == [100, 90, 80, 50]
    assert len(plan.delete) == 6


def test_an_unreachable_remote(tmp_path, moto, local):
    dead = open_remote("s3://nobucket/run", endpoint=f"http://127.0.0.1:{free_port()}")
    with pytest.raises(RemoteUnavailable, match="not starting from scratch"):
        prepare_resume(local, dead)
    rs.fake_checkpoint(local, 10)
    res = prepare_resume(local, dead)
    assert (res.source, res.chosen.step) == ("local", 10)
    assert "127.0.0.1" in res.remote_error


def test_a_failing_remote_call_draws_nothing_from_the_global_random(moto, tmp_path):
    """The uploader thread shares `random` with the training loop: a draw there (botocore's retry
    jitter did) changes the trainer's next random numbers, and the run is no longer exact."""
    tier = open_remote(rs.new_bucket(moto), endpoint=f"http://127.0.0.1:{free_port()}")  # nobody there
    before = random.getstate()
    with pytest.raises(RemoteUnavailable):
        tier.scan()
    assert random.getstate() == before
