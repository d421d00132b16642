"""A run directory written by an attacker (or by bad luck): no escape from it, no unbounded read,
no crash on a hostile file, no silent state change (issue 39). No torch: the trainer's side is
tests/test_hostile_load.py.

Each numbered finding of the issue has its tests here (``test_fN_...``); then the fuzz: every
parser of a run-directory record against hypothesis' hostile variants of a valid one, and the
login-node commands (``status``, ``ckpt list/verify/pick/prune/quarantine``) on run directories
hypothesis plants hostile shapes in. For every case: no traceback, a peak RSS within
``RSS_SLACK_KIB`` of the worker's baseline (measured per command, tests/hostile_worker.py),
nothing written, moved or deleted in the sentinel folder beside the run directory
(``Outside``), no raw terminal escape in what is printed.
"""

from __future__ import annotations

import errno
import json
import os
import pickle
from collections.abc import Iterator
from pathlib import Path

import pytest
from hostile_helpers import ESC, Worker, assert_calm, hostile_json, make_run, remove_runs, rewrite_manifest
from hostile_helpers import outside as outside_of
from hypothesis import given, settings
from hypothesis import strategies as st
from security_helpers import KEY, tamper
from store_helpers import make_ckpt

from supervisor import safepickle, signing, store
from supervisor.drill.hostile import GIB, Outside, plant_fifo, plant_link, plant_nest, plant_sparse
from supervisor.format import eventtypes as ev
from supervisor.format.appender import LineAppender
from supervisor.format.events import EventLog, RunState, parse_state, read_events, read_state, write_state
from supervisor.format.exitcodes import Exit
from supervisor.format.heartbeat import heartbeat_from_dict, load_object
from supervisor.format.layout import REASON, SIGNATURE, RunDir
from supervisor.format.manifest import Manifest, ManifestError, parse_manifest
from supervisor.format.metrics import parse_line
from supervisor.format.nodesummary import parse_header, parse_records, read_summary
from supervisor.slurm.requeue import parse_requeue_state
from supervisor.tiers.uploader import read_remote_status
from supervisor.watch import rootcause


@pytest.fixture(autouse=True)
def _cleanup() -> Iterator[None]:
    yield
    remove_runs()  # nests 1,200 deep: pytest's own cleanup would recurse


@pytest.fixture(scope="module")
def worker() -> Iterator[Worker]:
    w = Worker()
    yield w
    w.close()


@pytest.fixture
def run(tmp_path: Path) -> Path:
    return make_run(tmp_path / "run")


@pytest.fixture
def outside(run: Path) -> Iterator[Outside]:
    o = outside_of(run)
    yield o
    assert o.changes() == [], "something outside the run directory was written, moved or deleted"


def ckpt(root: Path, step: int) -> Path:
    return root / f"step_{step:08d}"


# ---------------------------------------------------------------- 1. the restricted unpickler

# BUILD onto the class pathlib.PosixPath itself: state (None, {"__truediv__": 42}) set as attributes
# of the real class by pickle.load: every later `path / name` in the process raised TypeError.
BUILD_ON_A_CLASS = b"\x80\x04cpathlib\nPosixPath\n(N}X\x0b\x00\x00\x00__truediv__K*stb."
# ... and onto what an allowed callable returns when that is an object the process shares: the
# member of DCP's memory-format Enum (a REDUCE of it), its value replaced for every user of it.
BUILD_ON_A_MEMBER = b"\x80\x04ctorch.distributed.checkpoint.metadata\n_MEM_FORMAT_ENCODING\n(K\x01tR(N}X\x07\x00\x00\x00_value_K*stb."


def test_f1_a_metadata_cannot_reassign_attributes_of_an_allowlisted_class() -> None:
    before = Path.__truediv__, os.fspath(Path("/a") / "b")
    with pytest.raises(
        safepickle.UnsafePickle, match=r"^x/.metadata: sets attributes of pathlib.PosixPath, which"
    ):
        safepickle.load_restricted(BUILD_ON_A_CLASS, "x/.metadata")
    assert (Path.__truediv__, os.fspath(Path("/a") / "b")) == before
    with pytest.raises(
        safepickle.UnsafePickle, match=r"_MEM_FORMAT_ENCODING\(\) returns, which the whole process"
    ):
        safepickle.check(BUILD_ON_A_MEMBER, "x/.metadata")
    # and the trainer's loader checks the bytes it then loads: the same refusal, nothing built
    with pytest.raises(safepickle.UnsafePickle):
        safepickle.load_restricted(BUILD_ON_A_MEMBER, "x/.metadata")


def test_f1_state_set_on_an_instance_the_pickle_built_is_still_allowed() -> None:
    """What real DCP metadata does: BUILD on the objects its own REDUCEs made."""
    data = pickle.dumps(Path("/ckpt/step_00000010"), protocol=4)
    assert safepickle.load_restricted(data, "x") == Path("/ckpt/step_00000010")


# ---------------------------------------------------------------- 2. no escape from the run dir


def test_f2_event_log_and_metrics_are_never_appended_through_a_link(
    run: Path, outside: Outside, capfd
) -> None:
    plant_link(RunDir.of(run).events(0), outside.bashrc)
    plant_link(RunDir.of(run).metrics, outside.key)
    log = EventLog(run, echo=None)
    log.emit(ev.Pick(checkpoint="step_00000020", verify="quick"), "resume from step_00000020")
    assert log.pending  # kept in memory, not appended through the link
    assert "a symbolic link in the run directory" in capfd.readouterr().err
    metrics = LineAppender(RunDir.of(run).metrics, run)
    assert not metrics.append('{"step": 21}')
    metrics.close()


def test_f2_no_write_through_a_linked_directory_of_the_run(run: Path, outside: Outside) -> None:
    """supervisor/ made a link to another directory: state, retention and the status cache are
    not written there; the refusal names the link."""
    import shutil

    shutil.rmtree(RunDir.of(run).supervisor)
    plant_link(RunDir.of(run).supervisor, outside.victim)
    with pytest.raises(OSError, match=r"/supervisor: a symbolic link in the run directory; refused"):
        write_state(run, RunState(node=0, host="vm"))
    with pytest.raises(OSError, match="a symbolic link"):
        store.record_policy(run, store.RetentionPolicy(keep=3))


def test_f2_quarantine_as_a_link_moves_nothing_out_and_prune_deletes_nothing_there(
    run: Path, outside: Outside, worker: Worker
) -> None:
    plant_link(RunDir.of(run).quarantine, outside.victim / "quarantine")
    r = worker.run(argv=["ckpt", "quarantine", "--ckpt-root", str(run), "20"])
    assert_calm(r, "ckpt quarantine", worker, codes=(Exit.USAGE,))
    assert (
        "quarantine: a symbolic link in the run directory; refused" in r.err and len(r.err.splitlines()) == 1
    )
    assert ckpt(run, 20).is_dir()
    plant_link(RunDir.of(run).quarantine, outside.victim)  # the victim's step_... dirs look quarantined
    r = worker.run(argv=["ckpt", "prune", "--ckpt-root", str(run), "--quarantine-keep", "0", "--keep", "2"])
    assert_calm(r, "ckpt prune", worker, codes=(Exit.USAGE,))
    assert "quarantine: a symbolic link" in r.err


def test_f2_a_linked_checkpoint_is_never_quarantined_through(
    run: Path, outside: Outside, worker: Worker
) -> None:
    import shutil

    shutil.rmtree(ckpt(run, 20))
    plant_link(ckpt(run, 20), outside.victim / "step_00000020")
    r = worker.run(argv=["ckpt", "quarantine", "--ckpt-root", str(run), "20"])
    assert_calm(r, "ckpt quarantine", worker, codes=(Exit.USAGE,))
    assert "step_00000020: a symbolic link in the run directory; refused" in r.err
    assert not (outside.victim / "step_00000020" / REASON).exists()
    # nor listed, picked or loaded: what it points to is not this run's
    assert [c.name for c in store.list_checkpoints(run)] == ["step_00000010"]


def test_f2_confined_writes_refuse_every_link_on_the_way(tmp_path: Path) -> None:
    from supervisor.format import confined

    root = tmp_path / "run"
    (root / "a").mkdir(parents=True)
    (tmp_path / "elsewhere").mkdir()
    (root / "a" / "b").symlink_to(tmp_path / "elsewhere")
    for op in (
        lambda: confined.write_atomic(root, root / "a" / "b" / "x", b"x"),
        lambda: confined.open_append(root, root / "a" / "b" / "x"),
        lambda: confined.make_dirs(root, root / "a" / "b" / "c"),
        lambda: confined.rename(root, root / "a", root / "a" / "b" / "a"),
        lambda: confined.remove_tree(root, root / "a" / "b"),
    ):
        with pytest.raises(confined.Escape) as e:
            op()
        assert e.value.errno == errno.ELOOP and "a/b: a symbolic link" in str(e.value)
    assert list((tmp_path / "elsewhere").iterdir()) == []
    with pytest.raises(confined.Escape, match="not inside"):
        confined.write_atomic(root, tmp_path / "elsewhere" / "x", b"x")
    # a link at the file itself is replaced by an atomic write, never followed
    (tmp_path / "victim").write_text("keep")
    (root / "latest").symlink_to(tmp_path / "victim")
    confined.write_atomic(root, root / "latest", b"step_00000010\n")
    assert (tmp_path / "victim").read_text() == "keep" and not (root / "latest").is_symlink()


# ---------------------------------------------------------------- 3. no read sized by the file


@pytest.mark.parametrize(
    ("where", "argv"),
    [
        ("heartbeats/node_00000.json", ["status"]),
        ("heartbeats/rank_00001.json", ["status"]),
        ("supervisor/state.json", ["status"]),
        ("supervisor/remote.json", ["status"]),
        ("supervisor/retention.json", ["ckpt", "list"]),
        ("step_00000020/manifest.json", ["ckpt", "verify"]),
        ("step_00000020/manifest.json", ["ckpt", "pick", "--dry-run"]),
        ("step_00000020/manifest.json", ["status"]),
        ("latest", ["ckpt", "list"]),
        ("supervisor/events.jsonl", ["status"]),
    ],
)
def test_f3_a_sparse_file_of_gibs_is_never_read_whole(
    run: Path, outside: Outside, worker: Worker, where: str, argv: list[str]
) -> None:
    plant_sparse(run / where, 2 * GIB)
    r = worker.run(argv=[*argv, "--ckpt-root", str(run)])
    assert_calm(r, f"{' '.join(argv)} with a 2 GiB {where}", worker)


def test_f3_read_capped_refuses_before_reading_and_never_reads_past_the_cap(tmp_path: Path) -> None:
    from supervisor.format.capped import NotRegular, TooLarge, read_capped

    p = tmp_path / "f"
    plant_sparse(p, 1 << 40)
    with pytest.raises(TooLarge, match="larger than 1024 bytes"):
        read_capped(p, 1024)
    plant_fifo(tmp_path / "fifo")
    with pytest.raises(NotRegular, match=r"a FIFO"):
        read_capped(tmp_path / "fifo", 1024)  # opened without blocking: no writer is needed
    plant_link(tmp_path / "zero", "/dev/zero")
    with pytest.raises(NotRegular, match="a character device"):
        read_capped(tmp_path / "zero", 1024)


# ---------------------------------------------------------------- 4. deep verify ends


@pytest.mark.parametrize("shape", ["dev_zero", "fifo", "grown"])
def test_f4_deep_verify_hashes_only_regular_files_and_stops_at_the_listed_size(
    run: Path, outside: Outside, worker: Worker, shape: str
) -> None:
    shard = ckpt(run, 20) / "__0_0.distcp"
    if shape == "dev_zero":  # listed at size 0: a plain read of it never ends
        tamper(ckpt(run, 20), "__0_0.distcp", b"")
        plant_link(shard, "/dev/zero")
    elif shape == "fifo":  # a plain open of it never returns
        tamper(ckpt(run, 20), "__0_0.distcp", b"")
        plant_fifo(shard)
    r = worker.run(argv=["ckpt", "verify", "--deep", "--ckpt-root", str(run)], timeout=60)
    if shape == "grown":  # the quick check's size compare sees it too; the hash stops at the listed size
        with open(shard, "ab") as f:
            f.write(b"\0" * 4096)
        r = worker.run(argv=["ckpt", "verify", "--deep", "--ckpt-root", str(run)], timeout=60)
    assert_calm(r, "ckpt verify --deep", worker, codes=(Exit.FOUND_PROBLEM,))
    row = next(line for line in r.out.splitlines() if "INVALID" in line)
    want = {"dev_zero": "a character device", "fifo": "a FIFO", "grown": "bytes, manifest says"}[shape]
    assert "20" in row and want in row, r.out


def test_f4_hash_file_stops_at_its_limit(tmp_path: Path) -> None:
    from supervisor.format.capped import TooLarge
    from supervisor.format.manifest import hash_file

    p = tmp_path / "f"
    p.write_bytes(b"x" * 10_000)
    with pytest.raises(TooLarge, match="longer than its listed 100 bytes"):
        hash_file(p, ("xxh3_128",), chunk=64, limit=100)


# ---------------------------------------------------------------- 6. one line or a walk-back, no crash


def test_f6_an_error_file_with_an_infinite_timestamp(tmp_path: Path) -> None:
    p = tmp_path / "error.json"
    p.write_text('{"message": "RuntimeError: boom", "timestamp": 1e400}')
    cause, problems = rootcause.find_root_cause(p, tmp_path / "no-logs", {})
    assert cause is not None and cause.timestamp == 0 and problems == []


def test_f6_nested_directories_in_a_checkpoint_walk_back_and_crash_nothing(
    run: Path, outside: Outside, worker: Worker
) -> None:
    plant_nest(ckpt(run, 20) / "deep")
    for argv in (["status"], ["ckpt", "list"], ["ckpt", "verify", "--deep"]):
        r = worker.run(argv=[*argv, "--ckpt-root", str(run)])
        assert_calm(r, " ".join(argv), worker)
    assert "more than 32 directories deep" in r.out
    r = worker.run(argv=["ckpt", "pick", "--ckpt-root", str(run)])
    assert_calm(r, "ckpt pick", worker)
    assert "picked step_00000010" in r.out and "quarantined step_00000020" in r.out
    assert "more than 32 directories deep" in (store.list_quarantined(run)[0].reason)


def test_f6_a_deep_foreign_tmp_dir_does_not_crash_prune(run: Path, outside: Outside) -> None:
    tmp = run / "step_00000030.tmp.999999.otherhost"
    plant_nest(tmp)
    os.utime(tmp, (0, 0))
    res = store.prune(run, keep=2, stale_tmp_after_s=0.0)
    assert res.stale_tmp_removed == (tmp.name,)  # as deep as MAX_DEPTH went; the rest is left for later


def test_f6_a_signature_with_a_non_ascii_hmac_is_untrusted_not_a_crash(
    tmp_path: Path, worker: Worker
) -> None:
    root = tmp_path / "run"
    ref = make_ckpt(root, 10, sign_key=KEY)
    sig = json.loads((ref.path / SIGNATURE).read_text())
    sig["hmac"] = "é" * 64
    (ref.path / SIGNATURE).write_text(json.dumps(sig))
    v = store.validate(ref, key=KEY)
    assert v.evidence is store.Evidence.UNTRUSTED and "HMAC does not verify" in v.reason
    key_file = tmp_path / "key"
    key_file.write_bytes(KEY)
    key_file.chmod(0o600)
    for argv in (["ckpt", "verify"], ["ckpt", "pick"]):
        r = worker.run(argv=[*argv, "--signing-key", str(key_file), "--ckpt-root", str(root)])
        assert_calm(r, " ".join(argv), worker)
        assert "HMAC does not verify" in r.text


def test_f6_a_nested_retention_record_is_rewritten_at_start_and_refused_by_name(run: Path) -> None:
    RunDir.of(run).retention.write_text("[" * 100_000)
    with pytest.raises(store.StoreError, match=r"retention.json: nested too deep"):
        store.read_policy(run)
    store.record_policy(run, store.RetentionPolicy(keep=3))  # the trainer's start: written anew
    assert store.read_policy(run) == store.RetentionPolicy(keep=3)


@pytest.mark.parametrize(
    ("where", "content"),
    [
        ("supervisor/state.json", None),  # watchdog_pid 2**70
        ("supervisor/state.json", b"[" * 100_000),
        ("supervisor/remote.json", b"[1, 2, 3]"),
        ("supervisor/remote.json", b'{"url": "s3://b", "failures": "many", "lag_s": 1e400}'),
        ("supervisor/slurm.json", b'{"job_id": "1", "preempt_requeues": 1e400, "failure_requeues": 0}'),
        ("heartbeats/rank_00000.json", b'{"rank": 0, "pid": 1e400}'),
        ("supervisor/status_cache.json", b'{"version": 2, "passed": {"step_00000020": ["k", 1e400, 1]}}'),
    ],
)
def test_f6_status_reads_hostile_records_without_a_traceback(
    run: Path, outside: Outside, worker: Worker, where: str, content: bytes | None
) -> None:
    if content is None:
        d = json.loads((run / where).read_text())
        d["watchdog_pid"] = 2**70
        content = json.dumps(d).encode()
    (run / where).write_bytes(content)
    for argv in (["status"], ["status", "--json"]):
        r = worker.run(argv=[*argv, "--ckpt-root", str(run)])
        assert_calm(r, " ".join(argv), worker, codes=(0,))


def test_f6_a_checkpoint_the_ranks_quarantined_is_a_walk_back_with_its_reason_in_events(
    tmp_path: Path,
) -> None:
    """The trainer's ranks move a checkpoint that fails its load aside (one line, exit 1); the
    watchdog says so in its event log, with their reason, and the relaunch walks back."""
    import sys

    from commands import REPO
    from watch_helpers import events, finish, of, start_watchdog

    root = tmp_path / "run"
    fake = [sys.executable, str(REPO / "tests" / "fake_trainer.py"), "--root", str(root)]
    fake += ["--steps", "16", "--fault", "quarantine", "--fault-step", "12"]  # checkpoints 5 and 10 then
    fast = ["--poll-interval", "0.1", "--backoff-initial", "0.05", "--backoff-jitter", "0"]
    rc, out = finish(start_watchdog(root, fast, fake, None))
    assert rc == Exit.OK, out
    evs = events(root)
    (q,) = of(evs, "quarantine")
    assert q["checkpoint"] == "step_00000010" and "a record failed at load" in q["why"]
    assert "(by the ranks)" in q["msg"]
    assert of(evs, "launch")[1]["resumed_from"] == 5  # walked back past it


# ---------------------------------------------------------------- 7. tampering is never hidden


def test_f7_a_new_commit_of_a_step_keeps_why_the_old_one_was_skipped(tmp_path: Path) -> None:
    root = tmp_path / "run"
    make_ckpt(root, 10, sign_key=KEY)
    make_ckpt(root, 20)  # unsigned: a run with the key skips it as untrusted
    make_ckpt(root, 20, sign_key=KEY)  # the trainer commits step 20 again
    (q,) = store.list_quarantined(root)
    assert q.reason.startswith(
        "replaced by a new commit of the same step; it was untrusted: step_00000020: unsigned"
    )


def test_f7_a_manifest_edited_to_another_world_size_is_corrupt(tmp_path: Path) -> None:
    """Without a key: ``world_size: 1, writers: {}`` on a 2-rank checkpoint passed even the deep
    check and made the trainer re-seed every rank's RNG (a misleading "world size 1 -> 2")."""
    root = tmp_path / "run"
    files = {
        "__0_0.distcp": b"a",
        "__1_0.distcp": b"b",
        "rank_00000.state.pt": b"r0",
        "rank_00001.state.pt": b"r1",
        ".metadata": b"m",
    }
    ref = make_ckpt(root, 10, files, world_size=2)
    assert store.validate(ref, deep=True).ok
    rewrite_manifest(ref.path, world_size=1, writers={})
    v = store.validate(ref, deep=True)
    assert v.evidence is store.Evidence.CORRUPT
    assert v.reason == "step_00000010: __1_0.distcp is rank 1's, but manifest.json says world size 1"


# ---------------------------------------------------------------- 8. no terminal escapes


def test_f8_status_and_ckpt_list_print_no_escape_sequence(run: Path, worker: Worker) -> None:
    hb = json.loads((run / "heartbeats" / "rank_00000.json").read_text())
    hb["host"] = f"vm{ESC}"
    (run / "heartbeats" / "rank_00000.json").write_text(json.dumps(hb))
    st_ = json.loads(RunDir.of(run).state(0).read_text())
    st_["reason"] = f"relaunch {ESC}"
    RunDir.of(run).state(0).write_text(json.dumps(st_))
    rewrite_manifest(ckpt(run, 20), meta={"config": ESC})
    store.quarantine(run, store.CheckpointRef(10, ckpt(run, 10)), f"corrupt {ESC}")
    for argv in (["status"], ["ckpt", "list"], ["ckpt", "verify"]):
        r = worker.run(argv=[*argv, "--ckpt-root", str(run)])
        assert_calm(r, " ".join(argv), worker)
        assert "\\x1b" in r.text or argv[-1] == "verify"  # shown, escaped


# ---------------------------------------------------------------- fuzz: every record parser

_VALID_MANIFEST = json.loads(
    Manifest(step=10, world_size=2, files={}, parallelism={"global_batch": 8}).to_json()
) | {
    "files": {"__0_0.distcp": {"size": 4, "checksum": "0" * 32}},
    "writers": {"0": ["__0_0.distcp"], "1": ["__0_0.distcp"]},
}
_VALID_STATE = {
    "node": 0, "host": "vm", "watchdog_pid": 12, "status": "running", "reason": "", "exit_code": None,
    "command": ["x"], "launch_count": 1, "launch_id": "l", "child_pid": 13, "launch_started": 1.0,
    "restart_times": [1.0], "launches": [{"number": 1, "launch_id": "l", "started": 1.0, "ended": 2.0,
    "reason": "", "resumed_from": None, "newest_after": 10, "last_step": 10, "outcome": "crash"}],
    "timeouts": {"train": 1.0}, "recovery": {}, "started": 1.0, "updated": 2.0, "version": 1,
}  # fmt: skip
_VALID_HEARTBEAT = {
    "rank": 0, "local_rank": 0, "host": "vm", "pid": 12, "step": 3, "phase": "train", "wall_time": 1.0,
    "restart_count": 0, "world_size": 2, "last_step_s": 0.5, "launch_id": "l", "exit_code": None,
    "progress": 0, "progress_total": 0, "io_path": "", "marks": {"first_step": 1.0},
}  # fmt: skip
_VALID_ERROR = {
    "message": {
        "message": "RuntimeError: boom",
        "extraInfo": {"py_callstack": 'File "x.py", line 3, in f', "timestamp": "12"},
    }
}
_VALID_REMOTE = {
    "url": "s3://b/r",
    "state": "in_sync",
    "lag_steps": 0,
    "lag_s": 0.0,
    "failures": 0,
    "skipped": [10],
    "updated": 1.0,
}
_VALID_REQUEUE = {"job_id": "7", "preempt_requeues": 1, "failure_requeues": 0, "history": [], "version": 2}
_VALID_SIG = json.loads(signing.sign(b"{}", {"__0_0.distcp": "0" * 64}, KEY))
_VALID_METRICS = {"step": 3, "loss": 1.5, "lr": 0.1, "grad_norm": 1.0}
_VALID_SUMMARY_HEADER = {"format": 1, "node": 0, "host": "vm", "written": 1.0, "ranks": 2}


def _parses_or_refuses(fn, data: bytes, allowed: tuple[type[BaseException], ...]) -> None:
    """``fn(data)`` returns, or raises one of ``allowed`` with a one-line message."""
    try:
        fn(data)
    except allowed as e:
        assert "\n" not in str(e).strip(), f"{type(e).__name__} of many lines: {e}"


_PARSERS = {
    "manifest": (_VALID_MANIFEST, parse_manifest, (ManifestError,)),
    "state": (_VALID_STATE, lambda b: parse_state(json.loads(b)), (ValueError, RecursionError)),
    "heartbeat": (_VALID_HEARTBEAT, lambda b: heartbeat_from_dict(load_object(b)), (ValueError,)),
    "error file": (_VALID_ERROR, rootcause.parse_error_file, (ValueError,)),
    "requeue record": (
        _VALID_REQUEUE,
        lambda b: parse_requeue_state(json.loads(b)),
        (ValueError, RecursionError),
    ),
    "signature": (
        _VALID_SIG,
        lambda b: signing.verify(b"{}", b, ["__0_0.distcp"], KEY),
        (signing.Untrusted,),
    ),
    "metrics line": (_VALID_METRICS, parse_line, ()),
    "summary header": (_VALID_SUMMARY_HEADER, parse_header, (ValueError,)),
    "summary records": (
        {"heartbeats": [_VALID_HEARTBEAT], "problems": []},
        lambda b: parse_records("x", b),
        (ValueError,),
    ),
}


@pytest.mark.parametrize("kind", sorted(_PARSERS))
@settings(max_examples=300)
@given(data=st.data())
def test_fuzz_every_record_parser_returns_or_refuses_in_one_line(kind: str, data: st.DataObject) -> None:
    valid, fn, allowed = _PARSERS[kind]
    _parses_or_refuses(fn, data.draw(hostile_json(valid)), allowed)


_FILE_READERS = {
    "supervisor/remote.json": (_VALID_REMOTE, lambda root: read_remote_status(root)),
    "supervisor/state.json": (_VALID_STATE, lambda root: _or_value_error(lambda: read_state(RunDir.of(root).state(0)))),
    "supervisor/retention.json": ({"schema": 1, "policy": {"keep": 2}}, lambda root: _or_store_error(lambda: store.read_policy(root))),
    "supervisor/events.jsonl": ({"t": 1.0, "event": "pick", "msg": "m"}, lambda root: read_events(RunDir.of(root).events(0))),
    "heartbeats/node_00000.json": (_VALID_SUMMARY_HEADER, lambda root: _or_value_error(lambda: read_summary(RunDir.of(root).node_summary(0)).snapshots())),
    "latest": ("step_00000010", lambda root: store.read_latest(root)),
}  # fmt: skip


def _or_value_error(fn):  # type: ignore[no-untyped-def]
    try:
        return fn()
    except ValueError as e:
        assert "\n" not in str(e).strip()
        return None


def _or_store_error(fn):  # type: ignore[no-untyped-def]
    try:
        return fn()
    except store.StoreError as e:
        assert "\n" not in str(e)
        return None


@pytest.mark.parametrize("where", sorted(_FILE_READERS))
@settings(max_examples=60)
@given(data=st.data())
def test_fuzz_every_record_reader_of_the_run_dir_returns_or_refuses(
    tmp_path_factory, where: str, data: st.DataObject
) -> None:
    root = tmp_path_factory.mktemp("reader")
    valid, read = _FILE_READERS[where]
    (root / where).parent.mkdir(parents=True, exist_ok=True)
    (root / where).write_bytes(data.draw(hostile_json(valid)))
    read(root)


# ---------------------------------------------------------------- fuzz: the commands on planted shapes

_TARGETS = (
    "supervisor/events.jsonl",
    "supervisor/state.json",
    "supervisor/remote.json",
    "supervisor/retention.json",
    "supervisor/status_cache.json",
    "supervisor",
    "heartbeats/rank_00001.json",
    "heartbeats/node_00000.json",
    "heartbeats",
    "quarantine",
    "latest",
    "metrics.jsonl",
    "step_00000020",
    "step_00000020/manifest.json",
    "step_00000020/__0_0.distcp",
    "step_00000020/.metadata",
    "step_00000010/manifest.json",
    "step_00000030.tmp.1.otherhost",
)
_SHAPES = ("link_out_file", "link_out_dir", "dev_zero", "fifo", "sparse", "nest", "hostile_json", "escape")


def _plant(root: Path, out: Outside, target: str, shape: str, doc: bytes) -> None:
    path = root / target
    if shape == "link_out_file":
        plant_link(path, out.bashrc)
    elif shape == "link_out_dir":
        plant_link(path, out.victim)
    elif shape == "dev_zero":
        plant_link(path, "/dev/zero")
    elif shape == "fifo":
        plant_fifo(path)
    elif shape == "sparse":
        plant_sparse(path, 2 * GIB)
    elif shape == "nest":
        if path.is_file() or path.is_symlink():
            path.unlink()
        plant_nest(path)
    elif shape == "hostile_json":
        if path.is_dir() and not path.is_symlink():
            return
        path.parent.mkdir(parents=True, exist_ok=True)
        if path.is_symlink() or path.is_fifo():
            path.unlink()
        path.write_bytes(doc)
    else:  # escape: in a name of the run directory
        (root / f"step_00000040.tmp.1.{ESC[:4]}").mkdir(exist_ok=True)


_COMMANDS = (
    ["status"],
    ["status", "--json"],
    ["ckpt", "list"],
    ["ckpt", "verify", "--deep"],
    ["ckpt", "pick", "--deep", "--io-retry", "0"],
    ["ckpt", "prune", "--keep", "2", "--quarantine-keep", "0"],
    ["ckpt", "quarantine", "10"],
)


@settings(max_examples=20)
@given(
    plants=st.lists(
        st.tuples(st.sampled_from(_TARGETS), st.sampled_from(_SHAPES), hostile_json(_VALID_STATE)),
        min_size=1,
        max_size=3,
    )
)
def test_fuzz_commands_on_hostile_run_dirs_stay_inside_bounded_and_calm(
    tmp_path_factory, worker: Worker, plants
) -> None:
    root = make_run(tmp_path_factory.mktemp("hostile") / "run")
    out = outside_of(root)
    for target, shape, doc in plants:
        _plant(root, out, target, shape, doc)
    for argv in _COMMANDS:
        r = worker.run(argv=[*argv, "--ckpt-root", str(root)], timeout=60)
        assert_calm(r, f"{' '.join(argv)} after {[(t, s) for t, s, _ in plants]}", worker)
        assert len(r.err.strip().splitlines()) <= 3, r.err  # a line or so, not a report of its own
        assert out.changes() == [], f"{' '.join(argv)} changed what is outside: {out.changes()}"


# ---------------------------------------------------------------- the drill's hostile scenario


def test_the_drills_hostile_plants_come_and_go_and_its_checks_judge_them(
    tmp_path: Path, worker: Worker
) -> None:
    """What the drill plants (supervisor/drill/storage.py) is removed again, leaving the run dir as it
    was; a command that is not calm, or a change outside, fails the scenario's checks."""
    from supervisor.drill.judge import StorageFacts, _hostile_checks
    from supervisor.drill.storage import plant_hostile, unplant_hostile

    root = make_run(tmp_path / "run")
    out = outside_of(root)
    before = sorted(p.name for p in root.iterdir())
    planted = plant_hostile(root, out)
    assert {"quarantine", "step_99999990", "step_99999980.tmp.1.elsewhere"} <= set(planted)
    for argv in (["status"], ["ckpt", "list"], ["ckpt", "verify", "--deep"]):
        assert_calm(worker.run(argv=[*argv, "--ckpt-root", str(root)]), " ".join(argv), worker)
    unplant_hostile(root, planted)
    assert sorted(p.name for p in root.iterdir()) == before and out.changes() == []
    calm = StorageFacts(planted=tuple(planted), commands=("status: calm",))
    assert all(c.ok for c in _hostile_checks(calm, [], [], None))
    for bad in (
        StorageFacts(planted=tuple(planted), commands=("status: exit 99, Traceback",)),
        StorageFacts(
            planted=tuple(planted), commands=("status: calm",), outside_changed=(".bashrc: changed",)
        ),
    ):
        assert not all(c.ok for c in _hostile_checks(bad, [], [], None))
