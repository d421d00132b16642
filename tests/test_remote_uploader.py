"""The background uploader: one upload in flight, the busy policy, a remote that goes down and comes
back (a real moto server stopped and restarted on its port), retention on both tiers, status."""

from __future__ import annotations

import subprocess
import sys
import threading
from pathlib import Path

import pytest
import remote_support as rs
from commands import REPO
from waiting import PATIENCE_S, wait_for

from supervisor import store
from supervisor.format.events import read_events
from supervisor.format.layout import REMOTE_EVENTS, RunDir
from supervisor.tiers.backends import RemoteConfigError
from supervisor.tiers.listing import list_tiers
from supervisor.tiers.remote import RemoteTier, open_remote
from supervisor.tiers.uploader import BUSY_WAIT, Uploader, UploadPolicy, read_remote_status

FAST = UploadPolicy(attempts=2, backoff_initial_s=0.05, backoff_max_s=0.1, down_retry_s=0.3, remote_keep=3)


def events(root: Path) -> list[dict]:
    return read_events(RunDir.of(root).supervisor / REMOTE_EVENTS)


class GatedBackend:
    """A backend whose object writes wait for ``gate``: an upload that takes as long as the test says."""

    def __init__(self, inner) -> None:
        self.inner = inner
        self.gate = threading.Event()
        self.writing = threading.Event()

    def __getattr__(self, name):
        return getattr(self.inner, name)

    def put_file(self, src, key):
        self.writing.set()
        assert self.gate.wait(PATIENCE_S)
        self.inner.put_file(src, key)


def test_every_save_reaches_the_remote_and_retention_runs_on_both_tiers(tier, local):
    up = Uploader(local, tier, FAST).start()
    try:
        for step in range(10, 60, 10):
            up.submit(rs.fake_checkpoint(local, step))
            assert up.flush(PATIENCE_S)
    finally:
        up.close()
    assert [v.step for v in tier.scan()] == [50, 40, 30]
    assert [r.step for r in store.list_checkpoints(local)] == [50, 40]
    st = read_remote_status(local)
    assert (st.state, st.lag_steps, st.last_success_step, st.failures) == ("in_sync", 0, 50, 0)
    assert [e["step"] for e in events(local) if e["event"] == "upload_ok"] == [10, 20, 30, 40, 50]


def test_skip_policy_returns_at_once_and_uploads_the_newest(tier, local):
    gated = GatedBackend(tier.backend)
    up = Uploader(local, RemoteTier(gated), FAST).start()
    try:
        up.submit(rs.fake_checkpoint(local, 10))
        wait_for(gated.writing.is_set, "the first upload to start")
        up.submit(rs.fake_checkpoint(local, 20))
        up.submit(rs.fake_checkpoint(local, 30))
        # both submits returned while step 10's upload is held at the gate
        assert up.status().in_flight == 10 and not gated.gate.is_set()
        gated.gate.set()
        assert up.flush(PATIENCE_S)
    finally:
        up.close()
    assert [v.step for v in tier.scan()] == [30, 10]
    skipped = [e for e in events(local) if e["event"] == "upload_skipped"]
    assert [e["step"] for e in skipped] == [20] and "superseded" in skipped[0]["reason"]
    assert read_remote_status(local).skipped == (20,)


def test_wait_policy_waits_for_the_running_upload_but_no_longer_than_its_timeout(tier, local):
    gated = GatedBackend(tier.backend)
    policy = UploadPolicy(busy=BUSY_WAIT, wait_timeout_s=0.2, down_retry_s=0.3, remote_keep=3)
    up = Uploader(local, RemoteTier(gated), policy).start()
    try:
        up.submit(rs.fake_checkpoint(local, 10))
        wait_for(gated.writing.is_set, "the first upload to start")
        up.submit(rs.fake_checkpoint(local, 20))  # the gate stays shut: only the timeout ends this
        assert up.status().in_flight == 10
        up.policy = UploadPolicy(busy=BUSY_WAIT, wait_timeout_s=PATIENCE_S, remote_keep=3)
        threading.Timer(0.2, gated.gate.set).start()
        up.submit(rs.fake_checkpoint(local, 30))  # returns once step 10's upload has ended
        assert tier.check(10) is not None and tier.check(10).ok
        assert up.flush(PATIENCE_S)
    finally:
        up.close()
    assert tier.scan()[0].step == 30


def test_remote_down_for_a_while_training_goes_on_then_uploads_catch_up(local, monkeypatch):
    pytest.importorskip("s3fs", reason="s3fs not installed: pip install -e '.[dev]'")
    server = rs.MotoServer()  # its own server: stopping it must not disturb other tests
    for k, v in rs.FAKE_CREDENTIALS.items():
        monkeypatch.setenv(k, v)
    server.start()
    policy = UploadPolicy(
        attempts=2,
        backoff_initial_s=0.05,
        backoff_max_s=0.1,
        down_retry_s=0.3,
        milestone_every=20,
        local_keep=3,
    )
    tier = open_remote(rs.new_bucket(server), endpoint=server.endpoint)
    up = Uploader(local, tier, policy).start()
    try:
        up.submit(rs.fake_checkpoint(local, 10))
        assert up.flush(PATIENCE_S)

        server.stop()
        for step in (20, 30):
            up.submit(rs.fake_checkpoint(local, step))  # training goes on: submit never blocks

        def reported_down() -> bool:  # what an operator sees in remote.json
            st = read_remote_status(local)
            return st is not None and st.state == "down" and st.newest_local == 30

        wait_for(reported_down, "remote.json to say down")
        st = read_remote_status(local)
        assert st.lag_steps == 20 and st.lag_s >= 0 and "127.0.0.1" in st.last_error
        assert st.newest_remote == 10 and st.failures >= 1
        listing = list_tiers(local, tier)
        assert listing.remote_error and [r.remote for r in listing.rows] == ["?", "?", "?"]

        server.start()  # same port, objects kept: the endpoint is back
        wait_for(lambda: up.status().state == "in_sync", "the catch-up")
        # nothing lost: the newest and the milestone both reached the remote, in that order
        assert [v.step for v in tier.scan()] == [30, 20, 10]
    finally:
        up.close()
        server.stop()
    kinds = [e["event"] for e in events(local)]
    assert kinds.count("remote_down") == 1 and "remote_back" in kinds
    assert [e["step"] for e in events(local) if e["event"] == "upload_ok"] == [10, 30, 20]
    assert read_remote_status(local).lag_steps == 0


def test_a_new_uploader_catches_up_without_a_submit(tier, local):
    tier.upload(rs.fake_checkpoint(local, 10))
    rs.fake_checkpoint(local, 20)  # committed, then the trainer died before uploading it
    up = Uploader(local, tier, FAST).start()
    try:
        assert up.flush(PATIENCE_S)
    finally:
        up.close()
    assert [v.step for v in tier.scan()] == [20, 10]


def test_a_corrupt_local_checkpoint_is_refused_once_and_the_next_goes_up(tier, local):
    ref = rs.fake_checkpoint(local, 10)
    data = bytearray((ref.path / "__0_0.distcp").read_bytes())
    data[0] ^= 1
    (ref.path / "__0_0.distcp").write_bytes(bytes(data))
    up = Uploader(local, tier, UploadPolicy(remote_keep=3, local_keep=None)).start()
    try:
        wait_for(lambda: "__0_0.distcp" in up.status().last_error, "the refusal")
        up.submit(rs.fake_checkpoint(local, 20))
        assert up.flush(PATIENCE_S)
    finally:
        up.close()
    assert [v.step for v in tier.scan()] == [20]
    assert [e["step"] for e in events(local) if e["event"] == "upload_refused"] == [10]


def test_listing_shows_where_each_checkpoint_lives(tier, local):
    tier.upload(rs.fake_checkpoint(local, 10))
    tier.upload(rs.fake_checkpoint(local, 20))
    rs.fake_checkpoint(local, 30)
    store.prune(local, keep=2)  # step 10 now lives on the remote only
    listing = list_tiers(local, tier)
    assert [(r.step, r.where) for r in listing.rows] == [(30, "local"), (20, "local+remote"), (10, "remote")]
    assert listing.lag_steps == 10 and listing.url == tier.url
    assert all(r.bytes > 0 for r in listing.rows)


def test_bad_urls_get_one_line_errors():
    with pytest.raises(RemoteConfigError, match="bucket"):
        open_remote("s3://")
    with pytest.raises(RemoteConfigError, match="nosuchscheme"):
        open_remote("nosuchscheme://x/y")
    with pytest.raises(RemoteConfigError, match="skip or wait"):
        UploadPolicy(busy="later")
    with pytest.raises(RemoteConfigError, match="--remote-keep 1 refused"):
        UploadPolicy(remote_keep=1)


def test_a_directory_tier_imports_neither_fsspec_nor_torch(tmp_path):
    code = (
        "import sys\n"
        "from supervisor.tiers import listing, resume, uploader\n"
        "from supervisor.tiers.remote import open_remote\n"
        f"resume.prepare_resume({str(tmp_path / 'run')!r}, open_remote({str(tmp_path / 'shared')!r}))\n"
        "print(sorted(m for m in ('fsspec', 's3fs', 'torch', 'boto3', 'botocore') if m in sys.modules))\n"
    )
    out = subprocess.run(
        [sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, timeout=120, check=True
    )
    assert out.stdout.strip() == "[]"
