"""Complete commits: every rank's reported files must be in the committing process's view, the
manifest (format 2) records who wrote what, and validation checks that every rank is covered.
Format 1 manifests stay readable."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from store_helpers import SHARD, committed_names, latest_text, make_ckpt, quarantine_dirs, write_tmp

from supervisor import store
from supervisor.format.layout import MANIFEST
from supervisor.format.manifest import (
    FORMAT_VERSION,
    CheckpointInfo,
    FileEntry,
    parse_manifest,
    writers_problem,
)

WRITERS = {0: [".metadata", SHARD, "rank_00000.pt"], 1: ["__1_0.distcp"]}


def _commit(root: Path, step: int, writers, known=None) -> store.CheckpointRef:
    return store.commit(root, write_tmp(root, step), CheckpointInfo(step, 2), writers=writers, known=known)


def test_the_manifest_records_who_wrote_what_and_validates(tmp_path: Path) -> None:
    ref = _commit(tmp_path, 10, WRITERS)
    v = store.validate(ref, deep=True)
    assert v.ok and v.manifest.format_version == FORMAT_VERSION == 2
    assert v.manifest.writers == {0: (".metadata", SHARD, "rank_00000.pt"), 1: ("__1_0.distcp",)}
    raw = json.loads((ref.path / MANIFEST).read_text())
    assert raw["writers"] == {"0": [".metadata", SHARD, "rank_00000.pt"], "1": ["__1_0.distcp"]}


@pytest.mark.parametrize(
    ("writers", "known", "needle"),
    [
        (
            {0: [SHARD], 1: ["__1_0.distcp", "__1_1.distcp"]},
            None,
            "__1_1.distcp written by rank 1 is missing",
        ),
        ({0: [SHARD]}, None, "rank 1 of world size 2 wrote no files"),
        ({0: [SHARD], 1: []}, None, "rank 1 of world size 2 wrote no files"),
        ({0: [SHARD], 1: ["__1_0.distcp"], 2: ["x"]}, None, "rank 2 is outside world size 2"),
        (
            WRITERS,
            {"__1_0.distcp": FileEntry(999, "ab")},
            "__1_0.distcp written by rank 1 is 129 bytes, rank 1 wrote 999",
        ),
    ],
)
def test_an_incomplete_commit_is_refused_and_nothing_is_committed(
    tmp_path: Path, writers, known, needle
) -> None:
    make_ckpt(tmp_path, 10)
    tmp = write_tmp(tmp_path, 20)
    with pytest.raises(store.IncompleteCommit) as e:
        store.commit(tmp_path, tmp, CheckpointInfo(20, 2), writers=writers, known=known)
    msg = str(e.value)
    assert needle in msg and str(tmp) in msg and "\n" not in msg and "not committed" in msg
    assert committed_names(tmp_path) == {"step_00000010"} and latest_text(tmp_path) == "step_00000010\n"
    assert tmp.is_dir() and not (tmp / MANIFEST).exists()  # kept for the caller; no marker written
    assert [t.step for t in store.list_tmp(tmp_path)] == [20]


def test_files_no_rank_claims_are_still_listed(tmp_path: Path) -> None:
    """Only what a rank reported must be there; everything there is in the manifest."""
    ref = _commit(tmp_path, 10, {0: [SHARD], 1: ["__1_0.distcp"]})
    m = store.validate(ref).manifest
    assert set(m.files) == {".metadata", SHARD, "__1_0.distcp", "rank_00000.pt"}


def _rewrite(ref: store.CheckpointRef, edit) -> None:
    d = json.loads((ref.path / MANIFEST).read_text())
    edit(d)
    (ref.path / MANIFEST).write_text(json.dumps(d))


@pytest.mark.parametrize(
    ("edit", "needle"),
    [
        (lambda d: d["writers"].pop("1"), "rank 1 of world size 2 wrote no files"),
        (lambda d: d["writers"]["1"].append("ghost.distcp"), "ghost.distcp written by rank 1 is missing"),
        (lambda d: d.update(world_size=3), "rank 2 of world size 3 wrote no files"),
        (lambda d: d["writers"].update({"01": ["x"]}), "writers entry '01' is malformed"),
        (lambda d: d.pop("writers"), "field 'writers' is missing"),
    ],
)
def test_validation_checks_rank_coverage(tmp_path: Path, edit, needle: str) -> None:
    ref = _commit(tmp_path, 10, WRITERS)
    _rewrite(ref, edit)
    v = store.validate(ref)
    assert v.evidence is store.Evidence.CORRUPT and needle in v.reason
    make_ckpt(tmp_path, 5)
    res = store.pick(tmp_path)
    assert res.chosen.ref.step == 5 and [n for n, _ in res.quarantined] == ["step_00000010"]


def _as_v1(d: dict) -> None:
    d["format_version"] = 1
    del d["writers"]


def test_format_1_manifests_still_validate_and_are_picked(tmp_path: Path) -> None:
    ref = make_ckpt(tmp_path, 10)
    _rewrite(ref, _as_v1)
    v = store.validate(ref, deep=True)
    assert v.ok and v.manifest.format_version == 1 and v.manifest.writers == {}
    assert store.pick(tmp_path, deep=True).chosen.ref.step == 10 and not quarantine_dirs(tmp_path)
    # written back as it was read: still format 1, no writers field
    again = json.loads(v.manifest.to_json())
    assert again["format_version"] == 1 and "writers" not in again
    assert parse_manifest(v.manifest.to_json()) == v.manifest


def test_a_commit_without_writers_records_none_and_is_not_checked(tmp_path: Path) -> None:
    ref = make_ckpt(tmp_path, 10)
    m = store.validate(ref).manifest
    assert m.format_version == 2 and m.writers == {}


def test_writers_problem_is_pure() -> None:
    present = {"a": 1, "b": 2}
    assert writers_problem({}, 4, present) == ""  # not recorded
    assert writers_problem({0: ["a"], 1: ["b"]}, 2, present) == ""
    assert writers_problem({0: ["a"], 1: ["b"]}, 2, present, {"b": FileEntry(3, "x")}) == (
        "b written by rank 1 is 2 bytes, rank 1 wrote 3"
    )
    assert writers_problem({1: ["b"]}, 2, present) == "rank 0 of world size 2 wrote no files"
    assert writers_problem({0: ["a"], -1: ["b"]}, 1, present) == "rank -1 is outside world size 1"


@pytest.mark.parametrize("files_synced", [False, True])
def test_files_their_writers_synced_are_not_fsynced_again(tmp_path: Path, monkeypatch, files_synced) -> None:
    """Rank 0 fsyncing every rank's files in turn cost ~4 ms a file here (30 s at 4,096 ranks):
    with ``files_synced`` only the directories and what the commit writes itself are synced."""
    from supervisor.format import atomic

    synced: list[str] = []
    real = atomic.fsync_file
    monkeypatch.setattr(atomic, "fsync_file", lambda p: (synced.append(Path(p).name), real(p)))
    tmp = write_tmp(tmp_path, 10)
    ref = store.commit(tmp_path, tmp, CheckpointInfo(10, 2), writers=WRITERS, files_synced=files_synced)
    assert store.validate(ref, deep=True).ok
    data_files = {n for names in WRITERS.values() for n in names}
    assert (set(synced) == data_files) is not files_synced
    assert not set(synced) - data_files


def test_opening_a_save_syncs_nothing_and_its_commit_syncs_the_tmp_dir_and_the_root(
    tmp_path: Path, monkeypatch
) -> None:
    """``begin`` runs in an async save's call, in the training loop: on ext4 a directory fsync
    there waited for the journal to take every unsynced file's data. The commit syncs what the
    rename needs durable: the tmp dir's entries before it, the root's after."""
    from supervisor.store import commit_protocol as store_module

    synced: list[Path] = []
    real = store_module.fsync_dir
    monkeypatch.setattr(store_module, "fsync_dir", lambda p: (synced.append(Path(p)), real(p)))
    monkeypatch.setattr(store_module, "fsync_tree", lambda p, files=True: synced.append(Path(p)))
    tmp = store.begin(tmp_path, 10)
    assert synced == []
    (tmp / SHARD).write_bytes(b"x" * 10)
    ref = store.commit(tmp_path, tmp, CheckpointInfo(10, 1))
    assert synced[0] == tmp and tmp_path in synced[synced.index(tmp) + 1 :], synced
    assert store.validate(ref).ok
