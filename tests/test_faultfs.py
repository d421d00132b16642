"""The fault filesystem itself (supervisor/drill/faultfs.py, faultctl.py, faultrules.py, mounts.py):
its rules as pure decisions, then on a real FUSE mount: a faithful passthrough for what the run dir
needs, each fault on the matching path only (counters prove it fired), windows, latency and a
bandwidth cap measured against the same operation unthrottled, a blocked read, teardown while
blocked, and a real full disk on a small tmpfs.
"""

from __future__ import annotations

import errno
import fcntl
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from waiting import EVENT_TIMEOUT_S

from supervisor.drill import faultctl
from supervisor.drill.faultctl import FaultFS
from supervisor.drill.faultfs import Faults, proc_lineage
from supervisor.drill.faultrules import SIZED_OPS, RuleError, RuleState, parse_rule, throttle
from supervisor.drill.mounts import SmallTmpfs, is_mounted
from supervisor.format import atomic

# ---------------------------------------------------------------- rules, pure


@pytest.mark.parametrize(
    ("spec", "names"),
    [
        ({"action": "explode"}, "action"),
        ({"action": "error"}, "errno"),
        ({"action": "error", "errno": "ENOTANERRNO"}, "errno"),
        ({"action": "error", "errno": "EIO", "ops": ["read", "frobnicate"]}, "frobnicate"),
        ({"action": "error", "errno": "EIO", "count": 2, "seconds": 1}, "count or seconds"),
        ({"action": "error", "errno": "EIO", "count": 0}, "count"),
        ({"action": "error", "errno": "EIO", "skip": -1}, "skip"),
        ({"action": "error", "errno": "EIO", "skip": 2, "seconds": 1}, "skip counts operations"),
        ({"action": "delay", "delay_s": -1}, "delay_s"),
        ({"action": "delay", "delay_s": 1, "errno": "EIO"}, "errno"),
        ({"action": "throttle", "bytes_per_s": 10, "ops": ["getattr"]}, "read, write"),
        ({"action": "hide", "ops": ["read"]}, "hide takes no ops"),
        ({"action": "block", "pattern": "relative/path"}, "pattern"),
        ({"action": "block", "colour": "red"}, "colour"),
    ],
)
def test_bad_rules_are_refused_naming_the_field(spec: dict, names: str) -> None:
    with pytest.raises(RuleError, match=names) as e:
        parse_rule(spec)
    assert "\n" not in str(e.value)


def test_rule_defaults_and_round_trip() -> None:
    r = parse_rule({"action": "error", "errno": "estale", "pattern": "*/x", "count": 3, "pids": [7]})
    assert r.errno == errno.ESTALE and r.ops is None and r.count == 3 and r.pids == {7}
    assert parse_rule(r.to_dict()) == r
    assert parse_rule({"action": "throttle", "bytes_per_s": 1e6}).ops == SIZED_OPS
    assert parse_rule({"action": "error", "errno": 28, "ops": "write"}).ops == {"write"}


def test_rule_matching() -> None:
    r = parse_rule({"action": "error", "errno": "EIO", "pattern": "/run/step_*/*.distcp", "ops": ["read"]})
    assert r.matches("read", ("/run/step_10/__0_0.distcp",))
    assert r.matches("read", ("/run/step_10/sub/x.distcp",)), "* matches across /"
    assert not r.matches("write", ("/run/step_10/__0_0.distcp",))
    assert not r.matches("read", ("/run/step_10/.metadata",))
    rename = parse_rule({"action": "error", "errno": "EIO", "pattern": "/latest"})
    assert rename.matches("rename", ("/.latest.tmp", "/latest")), "a rename matches on either name"
    hide = parse_rule({"action": "hide", "pattern": "/a"})
    assert hide.matches("getattr", ("/a",)) and hide.matches("open", ("/a",))
    assert not hide.matches("unlink", ("/a",)) and not hide.matches("write", ("/a",))


def test_windows_count_seconds_and_pids() -> None:
    counted = RuleState("r1", parse_rule({"action": "error", "errno": "EIO", "count": 2}), set_at=100.0)
    assert counted.applies("read", ("/f",), 100.0, None)
    counted.hits = 2
    assert not counted.active(100.0) and not counted.applies("read", ("/f",), 100.0, None)
    timed = RuleState("r2", parse_rule({"action": "error", "errno": "EIO", "seconds": 5}), set_at=100.0)
    assert timed.active(104.9) and not timed.active(105.0)
    scoped = RuleState("r3", parse_rule({"action": "hide", "pattern": "/f", "pids": [42]}), set_at=0.0)
    assert scoped.applies("getattr", ("/f",), 1.0, frozenset({99, 42, 1}))  # 42's child
    assert not scoped.applies("getattr", ("/f",), 1.0, frozenset({99, 1}))
    assert not scoped.applies("getattr", ("/f",), 1.0, frozenset())  # the caller is gone


def test_skip_lets_the_first_matching_operations_through_then_the_window_opens() -> None:
    rule = parse_rule(
        {"action": "error", "errno": "ENOSPC", "pattern": "/f", "ops": ["write"], "skip": 2, "count": 1}
    )
    assert parse_rule(rule.to_dict()) == rule
    rs = RuleState("r1", rule, set_at=0.0)
    fired = [rs.fire(op, ("/f",), 1.0, None) for op in ("write", "read", "write", "write", "write")]
    assert fired == [False, False, False, True, False], "the third write, once; a read is no match"
    assert (rs.passed, rs.hits) == (2, 1) and rs.status(1.0)["passed"] == 2
    assert parse_rule({"action": "error", "errno": "EIO", "skip": 0}).skip is None


def test_throttle_queues_operations_behind_each_other() -> None:
    wait, free = throttle(0.0, 10.0, 1000, 1000.0)
    assert (wait, free) == (1.0, 11.0)
    wait, free = throttle(free, 10.0, 500, 1000.0)  # a second thread at the same moment queues
    assert (wait, free) == (1.5, 11.5)
    assert throttle(free, 20.0, 100, 1000.0) == (pytest.approx(0.1), pytest.approx(20.1)), (
        "no debt after idle"
    )


def test_proc_lineage_names_the_process_and_its_parents() -> None:
    lineage = proc_lineage(threading.get_native_id())
    assert lineage[:2] == (os.getpid(), os.getppid())
    assert proc_lineage(2**22 + 12345) == ()


def test_faults_engine_count_is_exact_under_threads_and_clear_releases_blocked() -> None:
    """The rule engine without a mount: a count window fails exactly N operations however many
    threads race, and clearing a block rule lets its operation go on."""
    faults = Faults()
    rid = faults.add({"action": "error", "errno": "EIO", "pattern": "/f", "count": 100})
    failures = []

    def worker() -> None:
        for _ in range(50):
            try:
                faults.gate("read", ("/f",), threading.get_native_id())
            except OSError as e:
                failures.append(e.errno)

    threads = [threading.Thread(target=worker) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert failures == [errno.EIO] * 100
    status = faults.status()
    assert (
        status["ops"]["read"] == 400
        and status["rules"][0]["hits"] == 100
        and not status["rules"][0]["active"]
    )

    bid = faults.add({"action": "block", "pattern": "/g", "ops": ["open"]})
    t = threading.Thread(target=faults.gate, args=("open", ("/g",), threading.get_native_id()))
    t.start()
    assert faults.wait(bid, None, 1, EVENT_TIMEOUT_S)
    assert faults.status()["blocked"][0]["path"] == "/g" and t.is_alive()
    faults.clear(bid)
    t.join(EVENT_TIMEOUT_S)
    assert not t.is_alive() and faults.status()["blocked"] == []
    assert faults.clear() == [rid]


# ---------------------------------------------------------------- passthrough fidelity


def test_passthrough_files_dirs_and_metadata(faultfs: FaultFS) -> None:
    m, b = faultfs.mountpoint, faultfs.backing
    (m / "d").mkdir()
    atomic.atomic_write_json(m / "d" / "state.json", {"a": 1})  # tmp, fsync, rename over, fsync dir
    atomic.atomic_write_json(m / "d" / "state.json", {"a": 2})
    assert (b / "d" / "state.json").read_text() == (m / "d" / "state.json").read_text()
    assert [p.name for p in (m / "d").iterdir()] == ["state.json"]

    log = m / "d" / "events.jsonl"  # two writers appending: nothing overwritten
    with open(log, "a") as f1, open(log, "a") as f2:
        for i in range(3):
            f1.write(f"one {i}\n")
            f1.flush()
            f2.write(f"two {i}\n")
            f2.flush()
    assert log.read_text().splitlines() == [f"{w} {i}" for i in range(3) for w in ("one", "two")]

    big = m / "d" / "big.bin"
    payload = os.urandom(3 << 20)
    big.write_bytes(payload)
    with open(big, "r+b") as f:
        f.seek(1 << 20)
        f.write(b"xyz")
        os.fsync(f.fileno())
        f.truncate(2 << 20)
    expect = payload[: 1 << 20] + b"xyz" + payload[(1 << 20) + 3 : 2 << 20]
    assert big.read_bytes() == expect == (b / "d" / "big.bin").read_bytes()
    atomic.fsync_tree(m / "d")

    st, bst = os.stat(big), os.stat(b / "d" / "big.bin")
    assert (st.st_ino, st.st_size, st.st_mtime_ns, st.st_mode) == (
        bst.st_ino,
        bst.st_size,
        bst.st_mtime_ns,
        bst.st_mode,
    )
    os.utime(big, ns=(1_000_000_123, 2_000_000_456))
    assert os.stat(big).st_mtime_ns == 2_000_000_456
    big.touch()
    assert os.stat(big).st_mtime_ns > 2_000_000_456
    os.chmod(big, 0o600)
    assert os.stat(b / "d" / "big.bin").st_mode & 0o777 == 0o600

    os.symlink("big.bin", m / "d" / "link")
    os.link(big, m / "d" / "hard")
    assert os.readlink(m / "d" / "link") == "big.bin" and (m / "d" / "link").read_bytes() == expect
    assert os.stat(m / "d" / "hard").st_nlink == 2

    with open(m / "d" / "hard", "rb") as f:  # unlinked while open: readable, and really gone
        os.unlink(m / "d" / "hard")
        assert f.read(3) == expect[:3]
        assert "hard" not in os.listdir(m / "d")
    assert not [n for n in os.listdir(b / "d") if n.startswith(".fuse_hidden")]

    (m / "d" / "sub" / "deeper").mkdir(parents=True)
    (m / "d" / "sub" / "deeper" / "x").write_text("x")
    walk = sorted((os.path.relpath(d, m), sorted(ds), sorted(fs)) for d, ds, fs in os.walk(m))
    assert walk == sorted((os.path.relpath(d, b), sorted(ds), sorted(fs)) for d, ds, fs in os.walk(b))
    os.unlink(m / "d" / "sub" / "deeper" / "x")
    os.rmdir(m / "d" / "sub" / "deeper")
    assert not (b / "d" / "sub" / "deeper").exists()

    sv, bsv = os.statvfs(m), os.statvfs(b)
    assert (sv.f_bsize, sv.f_frsize, sv.f_blocks, sv.f_files) == (
        bsv.f_bsize,
        bsv.f_frsize,
        bsv.f_blocks,
        bsv.f_files,
    )
    with pytest.raises(FileExistsError):
        os.open(m / "d" / "state.json", os.O_CREAT | os.O_EXCL | os.O_WRONLY)
    with pytest.raises(FileNotFoundError):
        os.stat(m / "nope")
    ops = faultfs.ops()
    assert {"create", "write", "fsync", "fsyncdir", "rename", "readdir", "statfs", "unlink", "rmdir"} <= set(
        ops
    )


@pytest.mark.filterwarnings("ignore:torch.distributed is disabled:UserWarning")
def test_dcp_and_torch_save_load_through_the_mount(faultfs: FaultFS) -> None:
    torch = pytest.importorskip("torch")
    import torch.distributed.checkpoint as dcp

    gen = torch.Generator().manual_seed(0)
    state = {"w": torch.randn(512, 1024, generator=gen), "b": torch.arange(1000), "step": torch.tensor(7)}
    ckpt = faultfs.mountpoint / "run" / "step_7"
    dcp.save(state, checkpoint_id=ckpt)  # one process, no process group
    loaded = {k: torch.zeros_like(v) for k, v in state.items()}
    dcp.load(loaded, checkpoint_id=ckpt)
    assert all(torch.equal(loaded[k], state[k]) for k in state)
    assert sorted(os.listdir(ckpt)) == sorted(os.listdir(faultfs.backing / "run" / "step_7"))

    rng = faultfs.mountpoint / "run" / "rng_0.pt"
    torch.save({"cpu": torch.get_rng_state(), "n": 3}, rng)
    back = torch.load(rng, weights_only=True)
    assert torch.equal(back["cpu"], torch.get_rng_state()) and back["n"] == 3
    assert faultfs.ops()["write"] > 0 and faultfs.ops()["read"] > 0


LOCKER = """
import sys
from filelock import FileLock, Timeout
try:
    FileLock(sys.argv[1], timeout=0).acquire()
except Timeout:
    sys.exit(3)
"""


def test_filelock_excludes_another_process(faultfs: FaultFS) -> None:
    from filelock import FileLock

    path = faultfs.mountpoint / "run.lock"

    def other() -> int:
        return subprocess.run([sys.executable, "-c", LOCKER, str(path)], timeout=60, check=False).returncode

    with FileLock(path, timeout=10):
        assert other() == 3, "a second process got the lock held by this one"
    assert other() == 0


# ---------------------------------------------------------------- each fault on its path only


def _read(p: Path) -> None:
    with open(p, "rb") as f:
        f.read()


def _write(p: Path) -> None:
    fd = os.open(p, os.O_WRONLY)
    try:
        os.write(fd, b"new")
    finally:
        os.close(fd)


def _fsync(p: Path) -> None:
    fd = os.open(p, os.O_RDWR)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _close(p: Path) -> None:
    fd = os.open(p, os.O_RDONLY)
    os.close(fd)


def _create(p: Path) -> None:
    os.close(os.open(p.with_name(p.name + ".new"), os.O_CREAT | os.O_WRONLY, 0o644))


def _mkdir(p: Path) -> None:
    os.mkdir(p.with_name(p.name + ".dir"))


FAULT_CASES: list[tuple[str, str, str, Callable[[Path], object]]] = [
    # (op, errno, pattern suffix, what triggers it on /d/<name>)
    ("read", "EIO", "", _read),
    ("write", "ENOSPC", "", _write),
    ("fsync", "EIO", "", _fsync),
    ("flush", "EIO", "", _close),
    ("open", "ESTALE", "", _read),
    ("getattr", "ESTALE", "", os.stat),
    ("create", "EDQUOT", ".new", _create),
    ("mkdir", "EACCES", ".dir", _mkdir),
    ("rename", "EIO", "", lambda p: os.replace(p, p.with_name(p.name + ".moved"))),
    ("unlink", "EROFS", "", os.unlink),
    ("statfs", "EIO", "", os.statvfs),
    ("truncate", "EFBIG", "", lambda p: os.truncate(p, 1)),
    ("readdir", "EIO", "", os.listdir),
]


@pytest.mark.parametrize(("op", "err", "suffix", "trigger"), FAULT_CASES, ids=[c[0] for c in FAULT_CASES])
def test_each_fault_fires_on_the_matching_path_only(
    faultfs: FaultFS, op: str, err: str, suffix: str, trigger: Callable[[Path], object]
) -> None:
    m = faultfs.mountpoint
    for name in ("target", "other"):
        if op == "readdir":
            (m / name).mkdir()
        else:
            (m / name).write_bytes(b"0123456789")
    rid = faultfs.fail(f"/target{suffix}", err, ops=[op])
    before = faultfs.ops().get(op, 0)
    trigger(m / "other")  # same operation, another path: untouched
    assert faultfs.ops().get(op, 0) > before, f"{op} on /other never reached the filesystem"
    assert faultfs.hits(rid) == 0
    with pytest.raises(OSError) as e:
        trigger(m / "target")
    assert e.value.errno == getattr(errno, err), e.value
    assert faultfs.hits(rid) >= 1
    faultfs.clear(rid)
    trigger(m / "target")  # cleared: works again


def test_count_window_then_until_cleared(faultfs: FaultFS) -> None:
    f = faultfs.mountpoint / "shard.distcp"
    f.write_bytes(b"x" * 1000)
    rid = faultfs.fail("*.distcp", "EIO", ops=["read"], count=2)
    for _ in range(2):
        with pytest.raises(OSError, match="Input/output error"):
            _read(f)
    _read(f)  # the burst is over
    rule = faultfs.status().rules[rid]
    assert rule["hits"] == 2 and rule["active"] is False
    forever = faultfs.fail("*.distcp", "ESTALE", ops=["open"])
    for _ in range(3):
        with pytest.raises(OSError) as e:
            _read(f)
        assert e.value.errno == errno.ESTALE
    assert faultfs.hits(forever) >= 3  # the kernel retries an ESTALE open once (LOOKUP_REVAL)
    assert faultfs.clear() == [rid, forever]
    _read(f)
    timed = faultfs.fail("*.distcp", "EIO", ops=["read"], seconds=3600)
    with pytest.raises(OSError):
        _read(f)
    assert faultfs.status().rules[timed]["active"] is True


LISTER = """
import os, sys
sys.stdin.readline()  # go: the rule is set
print(os.path.exists(sys.argv[1]), sorted(os.listdir(os.path.dirname(sys.argv[1]))), flush=True)
"""


def test_hide_from_one_process_only(faultfs: FaultFS) -> None:
    """A commit one rank does not see yet: hidden from that process, visible to this one."""
    d = faultfs.mountpoint / "step_10"
    d.mkdir()
    for name in ("manifest.json", "__0_0.distcp"):
        (d / name).write_text(name)
    rank0 = subprocess.Popen(
        [sys.executable, "-c", LISTER, str(d / "manifest.json")],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    rid = faultfs.hide("/step_10/manifest.json", pids=[rank0.pid])
    out, _ = rank0.communicate("go\n", timeout=60)
    assert out.strip() == "False ['__0_0.distcp']"
    assert faultfs.hits(rid) >= 2
    assert sorted(os.listdir(d)) == ["__0_0.distcp", "manifest.json"] and (d / "manifest.json").exists()
    everyone = faultfs.hide("/step_10/manifest.json")
    assert os.listdir(d) == ["__0_0.distcp"]
    with pytest.raises(FileNotFoundError):
        (d / "manifest.json").read_text()
    faultfs.clear(everyone)
    assert (d / "manifest.json").read_text() == "manifest.json"


# ---------------------------------------------------------------- latency and bandwidth


def _fastest(fn: Callable[[], object], rounds: int = 3) -> float:
    """The fastest of a few runs: a stall on a busy machine only ever adds time."""
    best = float("inf")
    for _ in range(rounds):
        t = time.perf_counter()
        fn()
        best = min(best, time.perf_counter() - t)
    return best


def test_delay_slows_each_matching_op(faultfs: FaultFS) -> None:
    f = faultfs.mountpoint / "slow"
    f.write_text("x")
    other = faultfs.mountpoint / "fast"
    other.write_text("x")

    def stats(p: Path) -> Callable[[], None]:
        return lambda: [os.stat(p) for _ in range(5)]

    base = _fastest(stats(f))
    delay = max(0.01, 2 * base)  # each stat then takes at least 10x the five unthrottled ones / 5
    rid = faultfs.delay("/slow", delay, ops=["getattr"])
    slowed = _fastest(stats(f), rounds=1)
    assert slowed / base >= 5, (
        f"5 stats took {slowed:.3f}s with a {delay:.3f}s delay each, {base:.4f}s without"
    )
    assert faultfs.hits(rid) >= 5
    hits = faultfs.hits(rid)
    stats(other)()
    assert faultfs.hits(rid) == hits, "the delay hit another path"


def test_throttle_caps_read_and_write_bandwidth(faultfs: FaultFS) -> None:
    f = faultfs.mountpoint / "blob"
    payload = os.urandom(4 << 20)
    f.write_bytes(payload)
    base_read = _fastest(lambda: _read(f))
    base_write = _fastest(lambda: f.write_bytes(payload))
    bps = len(payload) / (10 * max(base_read, base_write))
    rid = faultfs.throttle("/blob", bps)
    t = time.perf_counter()
    assert f.read_bytes() == payload
    slow_read = time.perf_counter() - t
    t = time.perf_counter()
    f.write_bytes(payload)
    slow_write = time.perf_counter() - t
    assert slow_read / base_read >= 5, f"read: {slow_read:.3f}s capped at {bps:.0f} B/s vs {base_read:.3f}s"
    assert slow_write / base_write >= 5, (
        f"write: {slow_write:.3f}s capped at {bps:.0f} B/s vs {base_write:.3f}s"
    )
    assert len(payload) / slow_read <= bps * 1.01 and len(payload) / slow_write <= bps * 1.01
    assert faultfs.hits(rid) >= 2


# ---------------------------------------------------------------- blocked operations


def test_blocked_read_holds_the_reader_not_the_filesystem(faultfs: FaultFS) -> None:
    m = faultfs.mountpoint
    (m / "stuck.distcp").write_bytes(b"payload")
    (m / "fine").write_bytes(b"fine")
    rid = faultfs.block("*/stuck.distcp", ops=["read"])
    got: list[bytes] = []
    tids: list[int] = []

    def reader() -> None:
        tids.append(threading.get_native_id())
        got.append((m / "stuck.distcp").read_bytes())

    t = threading.Thread(target=reader, daemon=True)
    t.start()
    (blocked,) = faultfs.wait_blocked(rid, timeout=EVENT_TIMEOUT_S)
    assert (blocked.op, blocked.path, blocked.pid, blocked.tid) == (
        "read",
        "/stuck.distcp",
        os.getpid(),
        tids[0],
    )
    assert t.is_alive() and got == []
    assert (m / "fine").read_bytes() == b"fine" and "stuck.distcp" in os.listdir(m), (
        "other ops go on meanwhile"
    )
    faultfs.release(rid)
    t.join(EVENT_TIMEOUT_S)
    assert got == [b"payload"] and faultfs.blocked() == []


def test_more_blocked_ops_than_libfuse_default_threads(faultfs: FaultFS) -> None:
    """libfuse runs at most 10 workers unless told otherwise: twelve blocked reads must still
    leave room for everything else."""
    m = faultfs.mountpoint
    for i in range(12):
        (m / f"s{i}").write_bytes(b"s")
    rid = faultfs.block("/s*", ops=["read"])
    threads = [threading.Thread(target=_read, args=(m / f"s{i}",), daemon=True) for i in range(12)]
    for t in threads:
        t.start()
    assert len(faultfs.wait_blocked(rid, n=12, timeout=EVENT_TIMEOUT_S)) == 12
    (m / "free").write_text("still served")
    assert (m / "free").read_text() == "still served"
    faultfs.release(rid)
    for t in threads:
        t.join(EVENT_TIMEOUT_S)
    assert not any(t.is_alive() for t in threads)


def test_stop_while_another_process_is_blocked(tmp_path: Path, need_fuse: None) -> None:
    fs = FaultFS.start(tmp_path / "backing", tmp_path / "mnt")
    try:
        (fs.mountpoint / "f").write_bytes(b"data")
        fs.block("/f", ops=["read"])
        cat = subprocess.Popen(["cat", str(fs.mountpoint / "f")], stdout=subprocess.PIPE)
        (blocked,) = fs.wait_blocked(timeout=EVENT_TIMEOUT_S)
        assert blocked.pid == cat.pid and cat.poll() is None
    finally:
        fs.stop()  # released first: cat reads on while the busy mount is detached, then it ends
    assert not is_mounted(fs.mountpoint) and fs.proc.poll() is not None
    assert cat.wait(timeout=EVENT_TIMEOUT_S) == 0 and cat.stdout is not None and cat.stdout.read() == b"data"


def test_stop_while_a_lookup_is_blocked(tmp_path: Path, need_fuse: None) -> None:
    """A block on lookups holds the caller before it has anything open (the mount is not busy);
    stop still ends cleanly and the caller is let go (its file is gone with the mount)."""
    fs = FaultFS.start(tmp_path / "backing", tmp_path / "mnt")
    try:
        (fs.mountpoint / "f").write_bytes(b"data")
        fs.block("/f", ops=["getattr"])
        cat = subprocess.Popen(
            ["cat", str(fs.mountpoint / "f")], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
        )
        blocked = fs.wait_blocked(timeout=EVENT_TIMEOUT_S)
        assert [(b.op, b.pid) for b in blocked] == [("getattr", cat.pid)]
    finally:
        fs.stop()
    assert not is_mounted(fs.mountpoint) and fs.proc.poll() is not None
    cat.wait(timeout=EVENT_TIMEOUT_S)


def test_stop_while_a_thread_of_this_process_is_blocked(tmp_path: Path, need_fuse: None) -> None:
    """What the fixture's teardown meets when a test ends with a read still blocked."""
    got: list[bytes] = []
    with FaultFS.start(tmp_path / "backing", tmp_path / "mnt") as fs:
        (fs.mountpoint / "f").write_bytes(b"data")
        fs.block("/f", ops=["read"])
        t = threading.Thread(target=lambda: got.append((fs.mountpoint / "f").read_bytes()), daemon=True)
        t.start()
        fs.wait_blocked(timeout=EVENT_TIMEOUT_S)
    t.join(EVENT_TIMEOUT_S)
    assert not t.is_alive() and got == [b"data"] and not is_mounted(fs.mountpoint)


def test_stop_after_the_filesystem_process_was_killed(tmp_path: Path, need_fuse: None) -> None:
    """A dead filesystem process leaves a mount that answers ENOTCONN; stop() still removes it,
    and the reader that was blocked gets an error instead of hanging for ever."""
    fs = FaultFS.start(tmp_path / "backing", tmp_path / "mnt")
    try:
        (fs.mountpoint / "f").write_bytes(b"data")
        fs.block("/f", ops=["read"])
        cat = subprocess.Popen(
            ["cat", str(fs.mountpoint / "f")], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        fs.wait_blocked(timeout=EVENT_TIMEOUT_S)
        os.kill(fs.proc.pid, signal.SIGKILL)
        assert cat.wait(timeout=EVENT_TIMEOUT_S) != 0
        assert is_mounted(fs.mountpoint)
    finally:
        fs.stop()
    assert not is_mounted(fs.mountpoint)


def test_stop_while_this_process_holds_files_open(tmp_path: Path, need_fuse: None) -> None:
    fs = FaultFS.start(tmp_path / "backing", tmp_path / "mnt")
    held = open(fs.mountpoint / "open.log", "w")  # noqa: SIM115 - held open across the unmount on purpose
    try:
        held.write("x")
        held.flush()
    finally:
        fs.stop(grace=0.5)  # busy: detached lazily and, the grace over, the filesystem ended
    assert not is_mounted(fs.mountpoint) and fs.proc.poll() is not None
    with pytest.raises(OSError) as e:
        held.close()  # the file outlived its filesystem
    assert e.value.errno == errno.ENOTCONN


# ---------------------------------------------------------------- a real full disk


def test_small_tmpfs_fills_to_enospc_and_recovers(small_tmpfs: SmallTmpfs) -> None:
    run = small_tmpfs.path / "run"
    run.mkdir()
    (run / "before").write_bytes(b"x" * 4096)
    taken = small_tmpfs.fill()
    assert 0 < taken <= small_tmpfs.size
    assert os.statvfs(small_tmpfs.path).f_bavail == 0
    with pytest.raises(OSError) as e:
        atomic.atomic_write_json(run / "state.json", {"step": 1, "pad": "y" * 8192})
    assert e.value.errno == errno.ENOSPC
    assert sorted(os.listdir(run)) == ["before"], "the failed atomic write left its tmp file"
    small_tmpfs.free()
    atomic.atomic_write_json(run / "state.json", {"step": 1})
    assert (run / "before").read_bytes() == b"x" * 4096


def test_small_tmpfs_unmounts_even_when_busy(tmp_path: Path, need_mount: None) -> None:
    fs = SmallTmpfs(tmp_path / "t", 1 << 20).mount()
    assert is_mounted(fs.path)
    held = open(fs.path / "held", "w")  # noqa: SIM115 - keeps the tmpfs busy
    fs.unmount()
    assert not is_mounted(fs.path)
    held.close()


@pytest.fixture
def uncached() -> Iterator[None]:
    """``fuse_unavailable`` asked afresh (it answers once per process), and afresh again after."""
    faultctl.fuse_unavailable.cache_clear()
    yield
    faultctl.fuse_unavailable.cache_clear()


class _FreshMachine:
    """``fuse_unavailable``'s view of a machine without fuse3, as root with apt-get: ``which``
    finds fusermount3 from the ``found_at``-th look on (another installer finished meanwhile),
    and each apt-get call is recorded with whether this project's install lock was held."""

    def __init__(self, monkeypatch: pytest.MonkeyPatch, lock: Path, found_at: int) -> None:
        self.lock, self.found_at, self.looks = lock, found_at, 0
        self.calls: list[tuple[str, bool]] = []
        monkeypatch.setattr(faultctl, "APT_INSTALL_LOCK", lock)
        monkeypatch.setattr(faultctl.os.path, "exists", lambda p: p == "/dev/fuse" or os.path.lexists(p))
        monkeypatch.setattr(faultctl.os, "access", lambda p, mode: True)
        monkeypatch.setattr(faultctl.os, "geteuid", lambda: 0)
        monkeypatch.setattr(faultctl.shutil, "which", self.which)
        monkeypatch.setattr(faultctl.subprocess, "run", self.run)

    def which(self, name: str) -> str | None:
        if name != "fusermount3":
            return f"/usr/bin/{name}"
        self.looks += 1
        return "/usr/bin/fusermount3" if self.looks >= self.found_at else None

    def run(self, cmd: list[str], **kwargs: object) -> subprocess.CompletedProcess[str]:
        self.calls.append((cmd[3], self.held()))
        if cmd[3] == "install":
            self.found_at = self.looks + 1
        return subprocess.CompletedProcess(cmd, 0, "", "")

    def held(self) -> bool:
        """Whether the lock is held (by another open file: flock locks exclude each other)."""
        with open(self.lock, "a") as f:
            try:
                fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                return True
            fcntl.flock(f, fcntl.LOCK_UN)
            return False


def test_fuse3_is_installed_under_the_projects_apt_lock(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, uncached: None
) -> None:
    """Two test workers on a fresh machine: one installs, holding the lock tests/slurm/cluster.sh
    takes too; apt-get never runs twice at once (the one refused apt's lock would have kept that
    answer for the rest of its run, and skipped every FUSE test it met)."""
    machine = _FreshMachine(monkeypatch, tmp_path / "apt.lock", found_at=99)
    assert faultctl.fuse_unavailable() is None
    assert machine.calls == [("update", True), ("install", True)]
    assert not machine.held()


def test_fuse3_installed_while_waiting_for_the_lock_is_not_installed_again(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path, uncached: None
) -> None:
    machine = _FreshMachine(monkeypatch, tmp_path / "apt.lock", found_at=2)  # found once locked
    assert faultctl.fuse_unavailable() is None
    assert machine.calls == []
