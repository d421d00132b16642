"""The store on storage that fails for real (the FUSE fault filesystem, docs/storage-faults.md):
an I/O error is never taken for corruption, a pick waits out a burst and gives up with a one-line
verdict on a lasting fault, a commit refuses a file the committing process cannot see, nodes
that share a run dir download a remote checkpoint once, and an upload that cannot read a local
file is deferred, never refused.

Every fault is injected by the filesystem; no os function is replaced. Tests skip (saying why)
only where FUSE cannot be used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
import threading
from pathlib import Path

import pytest
import remote_support as rs
from commands import REPO
from store_helpers import SHARD, committed_names, latest_text, make_ckpt, quarantine_dirs, write_tmp

from supervisor import store
from supervisor.cli.main import main
from supervisor.cli.status import render
from supervisor.format.eventnames import EventName
from supervisor.format.events import read_events
from supervisor.format.eventtypes import Event
from supervisor.format.exitcodes import Exit
from supervisor.format.layout import REMOTE_EVENTS, RunDir, step_dirname
from supervisor.format.manifest import CheckpointInfo
from supervisor.report import build_report
from supervisor.store.ioerrors import Evidence
from supervisor.tiers.remote import LocalUnreadable, open_remote
from supervisor.tiers.resume import prepare_resume
from supervisor.tiers.uploader import Uploader, UploadPolicy


@pytest.fixture
def run(faultfs) -> Path:
    """Checkpoints 10 and 20 on the fault filesystem, no fault yet."""
    root = faultfs.mountpoint / "run"
    make_ckpt(root, 10)
    make_ckpt(root, 20)
    return root


def ref20(root: Path) -> store.CheckpointRef:
    return store.CheckpointRef(20, root / step_dirname(20))


@pytest.mark.parametrize(
    ("pattern", "ops", "err", "deep", "names"),
    [
        ("/run/step_00000020/manifest.json", ["read"], "EIO", False, "manifest.json is unreadable (EIO"),
        (
            "/run/step_00000020/manifest.json",
            ["open"],
            "ESTALE",
            False,
            "manifest.json is unreadable (ESTALE",
        ),
        ("/run/step_00000020/manifest.json", ["open"], "EACCES", False, "(EACCES"),
        ("/run/step_00000020", ["readdir"], "EIO", False, ": the directory is unreadable (EIO"),
        (f"/run/step_00000020/{SHARD}", ["getattr"], "ETIMEDOUT", False, f"{SHARD} is unreadable (ETIMEDOUT"),
        (f"/run/step_00000020/{SHARD}", ["read"], "EIO", True, f"{SHARD} is unreadable (EIO"),
    ],
)
def test_an_io_error_makes_a_checkpoint_unknown_never_corrupt(faultfs, run, pattern, ops, err, deep, names):
    rid = faultfs.fail(pattern, err, ops=ops)
    v = store.validate(ref20(run), deep=deep)
    assert faultfs.hits(rid) >= 1  # the fault really fired
    assert v.evidence is Evidence.UNKNOWN and v.unknown and not v.ok and not v.gone
    assert v.reason.startswith("step_00000020: ") and names in v.reason
    faultfs.clear(rid)
    assert store.validate(ref20(run), deep=deep).ok


def test_pick_during_a_lasting_eio_quarantines_nothing_and_names_the_file(faultfs, run):
    rid = faultfs.fail("/run/step_00000020/manifest.json", "EIO", ops=["read"])
    said: list[str] = []
    with pytest.raises(store.StorageUnavailable) as e:
        store.pick(run, io_retry_s=0.6, on_retry=said.append)  # a deadline is what is tested
    msg = str(e.value)
    assert "\n" not in msg and "step_00000020/manifest.json: EIO (Input/output error) for " in msg
    assert f"ckpt quarantine --ckpt-root {run} 20" in msg
    assert said and all("step_00000020/manifest.json: EIO" in m and "retrying" in m for m in said)
    assert faultfs.hits(rid) == len(said) + 1  # one read per attempt
    assert committed_names(run) == {"step_00000010", "step_00000020"} and not quarantine_dirs(run)
    assert latest_text(run) == "step_00000020\n"


def test_pick_succeeds_once_an_eio_burst_ends_within_the_retry_time(faultfs, run):
    rid = faultfs.fail(f"/run/step_00000020/{SHARD}", "EIO", ops=["read"], count=2)
    said: list[str] = []
    res = store.pick(run, deep=True, on_retry=said.append)
    assert faultfs.hits(rid) == 2 and len(said) == 2
    assert res.chosen.ref.step == 20 and not res.quarantined and not quarantine_dirs(run)


def test_pick_goes_on_when_the_fault_clears_during_its_retries(faultfs, run):
    """The fault ends while pick backs off (the callback is the event that ends it)."""
    rid = faultfs.fail("/run/step_00000020", "ESTALE", ops=["readdir"])
    said: list[str] = []

    def on_retry(msg: str) -> None:
        said.append(msg)
        faultfs.clear(rid)

    assert store.pick(run, on_retry=on_retry).chosen.ref.step == 20
    assert len(said) == 1 and "ESTALE" in said[0]


def test_an_unreadable_root_is_never_an_empty_one(faultfs, run, capsys):
    """A listing that fails must not read as 'no checkpoints' (that would start from step 0)."""
    rid = faultfs.fail("/run", "EIO", ops=["readdir"])
    with pytest.raises(OSError, match="Input/output error"):
        store.list_checkpoints(run)
    with pytest.raises(store.StorageUnavailable, match=r"/run: EIO"):
        store.pick(run, io_retry_s=0, allow_fresh_start=True)
    assert main(["ckpt", "list", "--ckpt-root", str(run)]) == Exit.UNREADABLE
    out, err = capsys.readouterr()
    assert out == "" and err.count("\n") == 1 and f"error: {run}: EIO (Input/output error); check" in err
    report = build_report(run)  # status never stops: it says what it could not list
    assert report.checkpoints == () and "cannot be listed: EIO" in report.storage_problem
    assert "STORAGE: checkpoints of" in render(report)
    faultfs.clear(rid)
    assert store.pick(run).chosen.ref.step == 20


def test_a_corrupt_checkpoint_is_still_quarantined_around_a_flaky_one(faultfs, run):
    """Content evidence still counts: step 30 is truncated (quarantined), step 20 needs a retry."""
    make_ckpt(run, 30)
    os.truncate(run / step_dirname(30) / SHARD, 10)
    rid = faultfs.fail("/run/step_00000020/manifest.json", "EIO", ops=["read"], count=1)
    res = store.pick(run, on_retry=lambda _m: None)
    assert faultfs.hits(rid) == 1
    assert res.chosen.ref.step == 20 and [n for n, _ in res.quarantined] == ["step_00000030"]


def test_prune_leaves_an_unreadable_checkpoint_alone(faultfs, run):
    make_ckpt(run, 30)
    make_ckpt(run, 40)
    faultfs.fail("/run/step_00000010/manifest.json", "EIO", ops=["read"])
    res = store.prune(run, keep=2)
    assert [n for n, _ in res.unknown] == ["step_00000010"] and "EIO" in res.unknown[0][1]
    assert res.deleted == ("step_00000020",) and not res.quarantined
    assert committed_names(run) == {"step_00000040", "step_00000030", "step_00000010"}


def test_verify_list_and_status_show_unknown_apart_from_invalid(faultfs, run, capsys):
    faultfs.fail("/run/step_00000020/manifest.json", "EIO", ops=["read"])
    rc = main(["ckpt", "verify", "--ckpt-root", str(run)])
    out = capsys.readouterr().out
    assert rc == Exit.UNREADABLE
    assert "UNKNOWN" in out and "INVALID" not in out and "1 could not be read" in out
    assert main(["ckpt", "list", "--ckpt-root", str(run), "--json"]) == Exit.OK
    rows = {c["name"]: c for c in json.loads(capsys.readouterr().out)["checkpoints"]}
    assert rows["step_00000020"]["evidence"] == "unknown" and rows["step_00000010"]["evidence"] == "ok"
    rc = main(["ckpt", "pick", "--ckpt-root", str(run), "--io-retry", "0"])
    out, err = capsys.readouterr()
    assert rc == Exit.UNREADABLE and out == "" and err.count("\n") == 1
    assert err.startswith("error: ") and "step_00000020/manifest.json: EIO" in err
    report = build_report(run)
    c20 = next(c for c in report.checkpoints if c.name == "step_00000020")
    assert (c20.valid, c20.evidence) == (False, "unknown")
    assert "UNKNOWN: manifest.json is unreadable (EIO" in render(report)
    # a corrupt one besides: verify found a problem (1), whatever else it could not read
    os.truncate(run / step_dirname(10) / SHARD, 1)
    assert main(["ckpt", "verify", "--ckpt-root", str(run)]) == Exit.FOUND_PROBLEM


def test_a_commit_refuses_a_rank_file_the_committing_process_cannot_see(faultfs, tmp_path):
    """Rank 1's shard is there for everyone but this process (stale cache, not really shared)."""
    root = faultfs.mountpoint / "run"
    make_ckpt(root, 10)
    tmp = write_tmp(root, 20)
    faultfs.hide("/run/step_00000020.tmp.*/__1_0.distcp", pids=[os.getpid()])
    writers = {0: [".metadata", SHARD, "rank_00000.pt"], 1: ["__1_0.distcp"]}
    with pytest.raises(store.IncompleteCommit) as e:
        store.commit(root, tmp, CheckpointInfo(20, 2), writers=writers)
    assert "__1_0.distcp written by rank 1 is missing" in str(e.value) and str(tmp) in str(e.value)
    assert committed_names(root) == {"step_00000010"} and latest_text(root) == "step_00000010\n"
    assert tmp.is_dir()  # left for the caller (or a person) to look at
    assert (faultfs.backing / "run" / tmp.name / "__1_0.distcp").is_file()  # it was written


# ---------------------------------------------------------------- one download per run dir

_RESUME = textwrap.dedent(
    """
    import json, sys
    from supervisor.tiers.remote import open_remote
    from supervisor.tiers.resume import prepare_resume
    res = prepare_resume(sys.argv[1], open_remote(sys.argv[2]))
    print(json.dumps({"source": res.source, "step": res.chosen.step}), flush=True)
    """
)


def test_two_processes_resuming_from_the_remote_download_once(faultfs, tmp_path):
    """Node A downloads (held mid-read by the filesystem); node B, sharing the run dir, waits for
    A's download instead of making its own, then resumes from A's copy."""
    remote = open_remote(str(faultfs.mountpoint / "remote"))
    for step in (10, 20):
        remote.upload(rs.fake_checkpoint(tmp_path / "writer", step))
    root = tmp_path / "node-local" / "run"  # nothing local yet: the run starts on new nodes
    rid = faultfs.block("/remote/step_00000020/*.distcp", ops=["read"])
    a = subprocess.Popen(
        [sys.executable, "-c", _RESUME, str(root), remote.url],
        cwd=REPO,
        env={**os.environ, "PYTHONPATH": str(REPO)},
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        (held,) = faultfs.wait_blocked(rid)
        assert held.pid == a.pid  # A holds the download lock, stuck in its download
        waiting = threading.Event()
        results: list[object] = []

        def on_event(event: Event, msg: str) -> None:
            if event.NAME == EventName.DOWNLOAD_WAIT:
                waiting.set()

        def node_b() -> None:
            try:
                results.append(prepare_resume(root, remote, on_event=on_event))
            except BaseException as e:  # reported by the main thread
                results.append(e)

        b = threading.Thread(target=node_b)
        b.start()
        assert waiting.wait(60), f"node B never waited for the download lock: {results}"
        faultfs.clear(rid)  # A's download goes on
        out, err = a.communicate(timeout=120)
        b.join(120)
    finally:
        faultfs.clear()
        if a.poll() is None:
            a.kill()
            a.wait()
    assert a.returncode == 0, err
    assert json.loads(out) == {"source": "remote", "step": 20}
    (res,) = results
    assert not isinstance(res, BaseException), res
    assert (res.source, res.chosen.step, res.downloaded_bytes) == ("local", 20, 0)
    events = read_events(RunDir.of(root).supervisor / REMOTE_EVENTS)
    assert [e["event"] for e in events].count("downloaded") == 1
    assert not quarantine_dirs(root)  # no second commit replaced the first
    assert store.validate(res.chosen, deep=True).ok and not store.list_tmp(root)


def test_a_local_read_error_defers_an_upload_and_never_refuses_it(faultfs, tmp_path):
    """The uploader reads the local checkpoint: an EIO there is retried, not "does not match its
    manifest" (which would never upload that checkpoint)."""
    local = faultfs.mountpoint / "run"
    remote = open_remote(str(tmp_path / "remote"))
    ref = rs.fake_checkpoint(local, 10)
    rid = faultfs.fail("/run/step_00000010/__1_0.distcp", "EIO", ops=["read"])
    with pytest.raises(LocalUnreadable, match=r"step_00000010/__1_0\.distcp is unreadable locally \(EIO"):
        remote.upload(ref)
    assert remote.scan() == [] and not store.list_tmp(remote.backend.root)  # staging removed
    faultfs.clear(rid)
    rid = faultfs.fail("/run/step_00000010/__1_0.distcp", "EIO", ops=["read"], count=1)
    policy = UploadPolicy(attempts=3, backoff_initial_s=0.01, backoff_max_s=0.01, local_keep=None)
    up = Uploader(local, remote, policy).start()
    try:
        assert up.flush(60)
    finally:
        up.close()
    assert faultfs.hits(rid) == 1 and [v.step for v in remote.scan()] == [10]
    names = [e["event"] for e in read_events(RunDir.of(local).supervisor / REMOTE_EVENTS)]
    assert "upload_refused" not in names and "upload_ok" in names
