"""The checkpoint store: commit, validation reasons, pick and quarantine, latest, retention."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from filelock import Timeout
from store_helpers import (
    SHARD,
    assert_quarantine_explained,
    committed_names,
    latest_text,
    make_ckpt,
    quarantine_dirs,
    write_tmp,
)

from supervisor import store
from supervisor.drill.corruption import DEEP_ONLY, Corruption, corrupt
from supervisor.format.atomic import hostname
from supervisor.format.layout import REASON, RunDir, deleting_dirname, tmp_dirname
from supervisor.store import Expectation, MismatchError, NoUsableCheckpoint, StoreError


def test_commit_lists_validates_and_points_latest(tmp_path: Path) -> None:
    for s in (10, 20, 30):
        make_ckpt(tmp_path, s)
    assert [r.step for r in store.list_checkpoints(tmp_path)] == [30, 20, 10]
    assert latest_text(tmp_path) == "step_00000030\n"
    v = store.validate(store.list_checkpoints(tmp_path)[0], deep=True)
    assert v.ok and v.manifest is not None and v.manifest.step == 30 and v.manifest.world_size == 2


def test_tmp_dirs_are_never_checkpoints(tmp_path: Path) -> None:
    make_ckpt(tmp_path, 10)
    write_tmp(tmp_path, 20)
    assert committed_names(tmp_path) == {"step_00000010"}
    assert [t.step for t in store.list_tmp(tmp_path)] == [20]


def test_commit_of_an_older_step_leaves_latest_on_the_newest(tmp_path: Path) -> None:
    make_ckpt(tmp_path, 30)
    make_ckpt(tmp_path, 20)
    assert latest_text(tmp_path) == "step_00000030\n"


def test_commit_of_an_existing_step_quarantines_the_old_one(tmp_path: Path) -> None:
    make_ckpt(tmp_path, 10)
    make_ckpt(tmp_path, 10, files={"x": b"new"})
    assert store.validate(store.list_checkpoints(tmp_path)[0]).manifest.files.keys() == {"x"}
    (q,) = quarantine_dirs(tmp_path)
    assert "replaced" in (q / REASON).read_text()


# Every corruption, with whether the quick check catches it and what the reason says.
REASONS = {
    Corruption.TRUNCATE: f"{SHARD} is 128 bytes, manifest says 256",
    Corruption.BITFLIP: f"{SHARD} checksum",
    Corruption.DELETE_METADATA: ".metadata is missing",
    Corruption.DELETE_SHARD: f"{SHARD} is missing",
    Corruption.GARBAGE_MANIFEST: "manifest.json is not valid JSON",
    Corruption.OTHER_STEP_MANIFEST: "manifest.json is for step 11, not 10",
    Corruption.DELETE_MANIFEST: "manifest.json is missing",
    Corruption.STRAY_FILE: "stray.bin is not listed in manifest.json",
}


@pytest.mark.parametrize("kind", list(Corruption))
def test_each_corruption_has_an_actionable_reason(tmp_path: Path, kind: Corruption) -> None:
    ref = make_ckpt(tmp_path, 10)
    corrupt(ref.path, kind)
    quick, deep = store.validate(ref), store.validate(ref, deep=True)
    assert quick.ok is (kind in DEEP_ONLY)
    assert not deep.ok
    assert deep.reason.startswith("step_00000010: ") and REASONS[kind] in deep.reason
    assert not deep.gone


def test_validate_of_a_vanished_checkpoint_is_gone_not_corrupt(tmp_path: Path) -> None:
    ref = make_ckpt(tmp_path, 10)
    os.rename(ref.path, tmp_path / "elsewhere")
    v = store.validate(ref)
    assert not v.ok and v.gone


def test_pick_walks_back_quarantines_with_reasons_and_repoints(tmp_path: Path) -> None:
    for s in (10, 20, 30, 40):
        make_ckpt(tmp_path, s)
    corrupt(tmp_path / "step_00000040", Corruption.TRUNCATE)
    corrupt(tmp_path / "step_00000030", Corruption.BITFLIP)
    res = store.pick(tmp_path, deep=True)
    assert res.chosen is not None and res.chosen.ref.step == 20
    assert [n for n, _ in res.quarantined] == ["step_00000040", "step_00000030"]
    assert (res.latest_before, res.latest_after) == ("step_00000040", "step_00000020")
    assert latest_text(tmp_path) == "step_00000020\n"
    assert committed_names(tmp_path) == {"step_00000020", "step_00000010"}
    assert len(quarantine_dirs(tmp_path)) == 2
    assert_quarantine_explained(tmp_path)
    reasons = sorted((q / REASON).read_text() for q in quarantine_dirs(tmp_path))
    assert any("is 128 bytes, manifest says 256" in r for r in reasons)


def test_quick_pick_trusts_sizes_deep_pick_catches_bitflips(tmp_path: Path) -> None:
    make_ckpt(tmp_path, 10)
    make_ckpt(tmp_path, 20)
    corrupt(tmp_path / "step_00000020", Corruption.BITFLIP)
    assert store.pick(tmp_path, dry_run=True).chosen.ref.step == 20
    assert store.pick(tmp_path, deep=True).chosen.ref.step == 10


def test_pick_dry_run_changes_nothing(tmp_path: Path) -> None:
    for s in (10, 20):
        make_ckpt(tmp_path, s)
    corrupt(tmp_path / "step_00000020", Corruption.DELETE_MANIFEST)
    before = sorted(os.listdir(tmp_path)), latest_text(tmp_path)
    res = store.pick(tmp_path, dry_run=True)
    assert res.dry_run and res.chosen.ref.step == 10 and res.quarantined
    assert (sorted(os.listdir(tmp_path)), latest_text(tmp_path)) == before


def test_nothing_valid_with_history_refuses_a_fresh_start_unless_allowed(tmp_path: Path) -> None:
    make_ckpt(tmp_path, 10)
    make_ckpt(tmp_path, 20)
    corrupt(tmp_path / "step_00000020", Corruption.TRUNCATE)
    corrupt(tmp_path / "step_00000010", Corruption.GARBAGE_MANIFEST)
    with pytest.raises(NoUsableCheckpoint) as e:
        store.pick(tmp_path, dry_run=True)
    assert "2 checkpoints are quarantined (newest step_00000020: " in str(e.value)
    assert committed_names(tmp_path) == {"step_00000010", "step_00000020"}  # dry run: nothing moved
    with pytest.raises(NoUsableCheckpoint, match="pass --allow-fresh-start to start from step 0") as e:
        store.pick(tmp_path)
    assert [n for n, _ in e.value.result.quarantined] == ["step_00000020", "step_00000010"]
    assert latest_text(tmp_path) is None and not committed_names(tmp_path)
    assert_quarantine_explained(tmp_path)
    with pytest.raises(NoUsableCheckpoint, match="newest step_00000020-"):  # the quarantine is history
        store.pick(tmp_path)
    res = store.pick(tmp_path, allow_fresh_start=True)
    assert res.chosen is None and res.latest_after is None and not res.quarantined


def test_an_empty_root_starts_fresh_without_the_flag(tmp_path: Path) -> None:
    res = store.pick(tmp_path)
    assert res.chosen is None and not res.quarantined


@pytest.mark.parametrize(
    "bad_latest",
    ["garbage \x00\xff", "", "step_00000099\n", "step_00000010", "../../etc/passwd", "symlink", "dangling"],
)
def test_pick_rewrites_a_garbage_dangling_or_foreign_latest(tmp_path: Path, bad_latest: str) -> None:
    make_ckpt(tmp_path, 10)
    make_ckpt(tmp_path, 20)
    latest = RunDir.of(tmp_path).latest
    latest.unlink()
    if bad_latest == "symlink":
        latest.symlink_to("step_00000020")
    elif bad_latest == "dangling":
        latest.symlink_to("step_00000077")
    else:
        latest.write_bytes(bad_latest.encode("utf-8", "surrogateescape"))
    store.pick(tmp_path)
    assert latest_text(tmp_path) == "step_00000020\n" and not latest.is_symlink()


def test_pick_with_nothing_valid_clears_a_garbage_latest(tmp_path: Path) -> None:
    RunDir.of(tmp_path).latest.write_text("garbage")
    assert store.pick(tmp_path).chosen is None
    assert latest_text(tmp_path) is None


def test_read_latest_accepts_paths_and_symlinks_as_hints(tmp_path: Path) -> None:
    latest = RunDir.of(tmp_path).latest
    latest.write_text("ckpt/step_00000050\n")  # the way a hand-written trainer writes it
    assert store.read_latest(tmp_path) == "step_00000050"
    latest.unlink()
    latest.symlink_to("step_00000060/")
    assert store.read_latest(tmp_path) == "step_00000060"
    latest.unlink()
    latest.write_text("nonsense")
    assert store.read_latest(tmp_path) is None


def test_mismatch_is_a_hard_error_and_moves_nothing(tmp_path: Path) -> None:
    make_ckpt(tmp_path, 10, model_config_hash="cfgA", data_fingerprint="dataA")
    make_ckpt(tmp_path, 20, model_config_hash="cfgA", data_fingerprint="dataA")
    with pytest.raises(MismatchError, match="model config hash cfgA differs from this run's cfgB"):
        store.pick(tmp_path, expect=Expectation(model_config_hash="cfgB"))
    with pytest.raises(MismatchError, match="--allow-data-change"):
        store.pick(tmp_path, expect=Expectation(data_fingerprint="dataB"))
    assert committed_names(tmp_path) == {"step_00000010", "step_00000020"} and not quarantine_dirs(tmp_path)
    ok = store.pick(tmp_path, expect=Expectation(model_config_hash="cfgB", allow_config_change=True))
    assert ok.chosen.ref.step == 20


def test_pick_on_a_missing_root_is_a_store_error(tmp_path: Path) -> None:
    with pytest.raises(StoreError, match="does not exist"):
        store.pick(tmp_path / "nope")


def test_backfills_a_reason_lost_in_a_crash(tmp_path: Path) -> None:
    make_ckpt(tmp_path, 10)
    q = RunDir.of(tmp_path).quarantine / "step_00000005-20260101T000000Z"
    q.mkdir(parents=True)
    store.pick(tmp_path)
    assert "reason unknown" in (q / REASON).read_text()


def test_root_lock_is_reentrant_in_a_thread_and_exclusive_across_threads(tmp_path: Path) -> None:
    got: list[str] = []

    def other() -> None:
        try:
            with store.root_lock(tmp_path, timeout=0.2):
                got.append("acquired")
        except Timeout:
            got.append("timeout")

    relative = os.path.relpath(tmp_path)  # another spelling of the same root is the same lock
    with store.root_lock(tmp_path), store.root_lock(relative, timeout=1):
        t = threading.Thread(target=other)
        t.start()
        t.join()
    assert got == ["timeout"]
    other()
    assert got == ["timeout", "acquired"]


def test_deep_pick_does_not_hold_the_lock_while_hashing(tmp_path: Path) -> None:
    """A trainer's commit must not wait behind a login-node `ckpt pick --deep`."""
    make_ckpt(tmp_path, 10)
    outcomes: list[str] = []

    def progress(_n: int) -> None:
        if outcomes:
            return
        try:
            with store.root_lock(tmp_path, timeout=0.5):
                outcomes.append("free")
        except Timeout:
            outcomes.append("held")

    t = threading.Thread(target=lambda: store.pick(tmp_path, deep=True, progress=progress))
    t.start()
    t.join()
    assert outcomes == ["free"]


def test_a_commit_during_a_deep_pick_is_not_held_up_and_is_picked(tmp_path: Path) -> None:
    """A trainer commits while a login node's deep pick hashes: the commit takes the lock at once,
    and the pick, seeing a checkpoint it has not hashed, hashes it outside the lock and takes it."""
    make_ckpt(tmp_path, 10)
    make_ckpt(tmp_path, 20)
    done: list[str] = []

    def progress(_n: int) -> None:  # called from the hashing threads
        if done:
            return
        try:
            with store.root_lock(tmp_path, timeout=0.5):
                done.append("free")
        except Timeout:
            done.append("held")
            return
        make_ckpt(tmp_path, 30)

    res = store.pick(tmp_path, deep=True, progress=progress)
    assert done == ["free"]
    assert res.chosen.ref.step == 30 and not res.quarantined and latest_text(tmp_path) == "step_00000030\n"


def test_deep_pick_revalidates_a_checkpoint_replaced_meanwhile(tmp_path: Path) -> None:
    make_ckpt(tmp_path, 10)
    make_ckpt(tmp_path, 20)
    swapped: list[bool] = []

    def progress(_n: int) -> None:
        if not swapped:  # while the unlocked pass hashes step 20, it gets corrupted
            swapped.append(True)
            corrupt(tmp_path / "step_00000020", Corruption.OTHER_STEP_MANIFEST)

    res = store.pick(tmp_path, deep=True, progress=progress)
    assert res.chosen.ref.step == 10 and [n for n, _ in res.quarantined] == ["step_00000020"]


# ---------------------------------------------------------------- retention


def _steps(names) -> list[int]:
    return sorted(int(n.split("_")[1]) for n in names)


def test_prune_keeps_the_newest_k(tmp_path: Path) -> None:
    for s in range(10, 80, 10):
        make_ckpt(tmp_path, s)
    res = store.prune(tmp_path, keep=3)
    assert _steps(res.deleted) == [10, 20, 30, 40]
    assert _steps(committed_names(tmp_path)) == [50, 60, 70]
    assert not [n for n in os.listdir(tmp_path) if ".deleting." in n]


def test_prune_counts_a_unit_per_checkpoint_judged_and_file_removed(tmp_path: Path, tracker) -> None:
    """What a rank waiting on a prune beats by (train_ref's Checkpointer.wait_pruned); a stuck
    removal names its directory."""
    for s in range(10, 60, 10):
        make_ckpt(tmp_path, s)
    doomed_files = sum(len(files) for s in (10, 20) for _, _, files in os.walk(tmp_path / f"step_{s:08d}"))
    res = store.prune(tmp_path, keep=3, progress=tracker)
    assert _steps(res.deleted) == [10, 20]
    assert doomed_files > 2
    assert tracker.units == [1] * (5 + doomed_files)
    named = [p for p in tracker.paths if p]
    assert sorted(Path(p).name.split(".")[0] for p in named) == ["step_00000010", "step_00000020"]
    assert all(".deleting." in p for p in named) and tracker.paths[-1] == ""


def test_remove_tree_removes_links_not_what_they_point_to(tmp_path: Path, tracker) -> None:
    """A checkpoint dir is writable by whoever writes the storage: a symlink planted in it (to a
    file, to a directory, dangling) is removed, and nothing outside is touched."""
    outside = tmp_path / "outside"
    (outside / "sub").mkdir(parents=True)
    (outside / "keep.bin").write_bytes(b"x")
    top = tmp_path / "step_00000010.deleting.1.h"
    (top / "nested").mkdir(parents=True)
    (top / "nested" / "a.distcp").write_bytes(b"a")
    (top / "b.distcp").write_bytes(b"b")
    (top / "to_file").symlink_to(outside / "keep.bin")
    (top / "nested" / "to_dir").symlink_to(outside)
    (top / "dangling").symlink_to(tmp_path / "nowhere")
    store.remove_tree(tmp_path, top, tracker)
    assert not os.path.lexists(top)
    assert (outside / "keep.bin").read_bytes() == b"x" and (outside / "sub").is_dir()
    assert sum(tracker.units) == 5  # two files, three links (to a file, to a directory, to nowhere)
    assert tracker.paths == [str(top), ""]


@pytest.mark.parametrize("keep", [-1, 0, 1])
def test_prune_refuses_keep_below_two(tmp_path: Path, keep: int) -> None:
    make_ckpt(tmp_path, 10)
    with pytest.raises(StoreError, match="keep at least 2"):
        store.prune(tmp_path, keep=keep)


def test_prune_keeps_milestones(tmp_path: Path) -> None:
    for s in range(10, 110, 10):
        make_ckpt(tmp_path, s)
    res = store.prune(tmp_path, policy=store.RetentionPolicy(keep=2, milestone_every=40))
    assert _steps(committed_names(tmp_path)) == [40, 80, 90, 100]
    assert _steps(res.kept) == [40, 80, 90, 100]


def test_prune_counts_valid_ones_never_deletes_newest_valid_and_quarantines_old_invalid(
    tmp_path: Path,
) -> None:
    for s in range(10, 70, 10):
        make_ckpt(tmp_path, s)
    corrupt(tmp_path / "step_00000060", Corruption.TRUNCATE)  # newest: left for pick
    corrupt(tmp_path / "step_00000040", Corruption.DELETE_SHARD)  # between kept ones: quarantined
    corrupt(tmp_path / "step_00000010", Corruption.GARBAGE_MANIFEST)  # old: quarantined, not deleted
    res = store.prune(tmp_path, keep=2)
    assert _steps(committed_names(tmp_path)) == [30, 50, 60]
    assert _steps(res.deleted) == [20]
    assert sorted(n for n, _ in res.quarantined) == ["step_00000010", "step_00000040"]
    assert_quarantine_explained(tmp_path)


def test_prune_dry_run_changes_nothing(tmp_path: Path) -> None:
    for s in range(10, 60, 10):
        make_ckpt(tmp_path, s)
    before = sorted(os.listdir(tmp_path))
    res = store.prune(tmp_path, keep=2, dry_run=True)
    assert _steps(res.deleted) == [10, 20, 30] and sorted(os.listdir(tmp_path)) == before


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _age(path: Path, seconds: float) -> None:
    old = time.time() - seconds
    for dirpath, dirs, names in os.walk(path):
        for n in dirs + names:
            os.utime(os.path.join(dirpath, n), (old, old))
    os.utime(path, (old, old))


def test_prune_removes_tmp_dirs_of_dead_writers_at_once_and_keeps_live_ones(tmp_path: Path) -> None:
    make_ckpt(tmp_path, 10)
    me, dead = hostname(), _dead_pid()
    dirs = {
        "dead_old": tmp_path / tmp_dirname(20, dead, me),
        "dead_young": tmp_path / tmp_dirname(21, dead, me),
        "live_old": tmp_path / tmp_dirname(22, os.getpid(), me),
        "other_host_old": tmp_path / tmp_dirname(23, 1, "far-away-node"),
        "other_host_young": tmp_path / tmp_dirname(24, 1, "far-away-node"),
        "leftover_delete": tmp_path / deleting_dirname(5, dead, me),
    }
    for name, d in dirs.items():
        d.mkdir()
        (d / "shard").write_bytes(b"x")
        if "young" not in name:
            _age(d, 2 * store.STALE_TMP_AFTER_S)
    res = store.prune(tmp_path, keep=2)
    removed = set(res.stale_tmp_removed)
    # on this host a dead pid is proof at once; on another host only an hour of silence is
    assert removed == {dirs[k].name for k in ("dead_old", "dead_young", "other_host_old", "leftover_delete")}
    for k, d in dirs.items():
        assert d.exists() is (d.name not in removed), k


def test_young_old_tmp_age_counts_from_the_newest_file(tmp_path: Path) -> None:
    d = tmp_path / tmp_dirname(20, 1, "far-away-node")
    d.mkdir()
    (d / "shard").write_bytes(b"x")
    _age(d, 2 * store.STALE_TMP_AFTER_S)
    os.utime(d / "shard")  # a writer still appending to a big shard
    (t,) = store.list_tmp(tmp_path)
    assert t.age_s < 60
