"""`status`'s remembered quick checks (supervisor/store/quickcache.py): a checkpoint whose files changed
after it passed is checked again, never listed from the cache."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from store_helpers import make_ckpt

from supervisor import store
from supervisor.drill.corruption import DEEP_ONLY, Corruption, corrupt
from supervisor.format.layout import RunDir
from supervisor.format.nodesummary import write_summary
from supervisor.report import CheckpointRow, build_report
from supervisor.store.quickcache import QuickChecks, fingerprint
from supervisor.watch.liveness import Clock, PhaseTimeouts
from supervisor.watch.node_summary import NodeFacts, build_summary

STEPS = (10, 20, 30)


@pytest.fixture
def root(tmp_path: Path) -> Path:
    root = tmp_path / "run"
    root.mkdir()
    RunDir.of(root).supervisor.mkdir()
    for step in STEPS:
        make_ckpt(root, step)
    return root


def rows(root: Path) -> dict[str, CheckpointRow]:
    return {c.name: c for c in build_report(root, now=1e10).checkpoints}


def cached(root: Path) -> set[str]:
    return set(json.loads(RunDir.of(root).status_cache.read_bytes())["passed"])


def test_passed_checkpoints_are_remembered_and_listed_the_same(root: Path) -> None:
    first = rows(root)
    assert cached(root) == {f"step_{s:08d}" for s in STEPS}
    before = RunDir.of(root).status_cache.stat()
    assert rows(root) == first  # from the cache: the same rows
    assert RunDir.of(root).status_cache.stat().st_mtime_ns == before.st_mtime_ns  # unchanged: not rewritten
    assert all(r.valid and r.size_bytes for r in first.values())


@pytest.mark.parametrize("how", sorted(set(Corruption) - DEEP_ONLY))
def test_a_checkpoint_changed_after_it_passed_is_checked_again(root: Path, how: Corruption) -> None:
    rows(root)
    corrupt(root / "step_00000020", how)
    after = rows(root)
    assert not after["step_00000020"].valid, how
    assert after["step_00000020"].evidence == "corrupt"
    assert after["step_00000010"].valid and after["step_00000030"].valid
    assert cached(root) == {"step_00000010", "step_00000030"}  # forgotten until it passes again


def test_a_same_size_rewrite_with_the_old_mtime_changes_the_key(root: Path) -> None:
    """ctime moves on any write: a file put back at its size and mtime is not the file that passed."""
    ckpt = root / "step_00000010"
    shard = next(p for p in ckpt.iterdir() if p.name.endswith(".distcp"))
    before = fingerprint(os.fspath(ckpt))
    st = shard.stat()
    shard.write_bytes(bytes(st.st_size))
    os.utime(shard, ns=(st.st_atime_ns, st.st_mtime_ns))
    after = fingerprint(os.fspath(ckpt))
    assert before is not None and after is not None
    assert after.key != before.key
    assert after.disk_bytes == before.disk_bytes


def test_a_checkpoint_replaced_by_another_of_the_same_name_is_checked_again(root: Path) -> None:
    """New inodes: the remembered verdict was for other files."""
    rows(root)
    ckpt = root / "step_00000030"
    manifest = (ckpt / "manifest.json").read_bytes()
    for p in ckpt.iterdir():
        data = p.read_bytes()
        p.unlink()
        p.write_bytes(data[: len(data) // 2] if p.name.endswith(".distcp") else data)
    assert (ckpt / "manifest.json").read_bytes() == manifest
    assert not rows(root)["step_00000030"].valid


def test_a_forged_or_garbage_cache_never_makes_a_checkpoint_valid(root: Path) -> None:
    corrupt(root / "step_00000020", Corruption.TRUNCATE)
    cache = RunDir.of(root).status_cache
    cache.write_text(json.dumps({"version": 1, "passed": {"step_00000020": ["0" * 32, 1.0, 5]}}))
    assert not rows(root)["step_00000020"].valid
    for garbage in (b"\x00garbage", b"[]", b'{"version": 1, "passed": {"a": 3}}', b"[" * 100_000):
        cache.write_bytes(garbage)
        r = rows(root)
        assert not r["step_00000020"].valid and r["step_00000010"].valid
    assert cached(root) == {"step_00000010", "step_00000030"}  # rewritten whole


def test_without_a_writable_supervisor_folder_status_checks_every_time(root: Path) -> None:
    RunDir.of(root).supervisor.rmdir()
    first = rows(root)
    assert not RunDir.of(root).supervisor.exists()  # status creates nothing
    assert rows(root) == first


def test_a_symlink_in_a_checkpoint_is_never_cached(root: Path, tmp_path: Path) -> None:
    """A symlink's own stat does not change with its target's: one that passes is checked each time."""
    ckpt = root / "step_00000010"
    shard = next(p for p in ckpt.iterdir() if p.name.endswith(".distcp"))
    shard.rename(tmp_path / shard.name)
    shard.symlink_to(tmp_path / shard.name)
    assert fingerprint(os.fspath(ckpt)) is None
    checks = QuickChecks(root)
    assert checks.check(store.CheckpointRef(10, ckpt)).evidence.value == "ok"
    assert checks.passed == {}
    (tmp_path / shard.name).write_bytes(b"short")
    assert not rows(root)["step_00000010"].valid


def test_disk_use_counts_what_it_stat_ed_or_read_once(root: Path) -> None:
    """Checkpoints sized from their keys and node summaries from their reads: the same total."""
    for node in (0, 1):
        facts = NodeFacts(node, f"h{node}", 55, 5.0, launch_id="L")
        write_summary(root, *build_summary([], facts, Clock(1000.0), PhaseTimeouts()))
    rows(root)  # the cache file exists before both are measured
    assert build_report(root).disk_bytes == store.disk_usage(root)
