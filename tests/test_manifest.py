"""manifest.json: round trip, schema checks with actionable reasons, checksums."""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import pytest
import xxhash
from hypothesis import given, settings
from hypothesis import strategies as st

from supervisor.format.manifest import (
    FORMAT_VERSION,
    CheckpointInfo,
    FileEntry,
    Manifest,
    ManifestError,
    build_manifest,
    checksum_file,
    checksum_files,
    list_files,
    parse_manifest,
    read_manifest,
)


def _fill(d: Path) -> None:
    (d / "sub").mkdir()
    (d / "a.bin").write_bytes(b"a" * 1000)
    (d / "sub" / "b.bin").write_bytes(b"")
    (d / ".metadata").write_bytes(b"meta")


def test_build_parse_round_trip(tmp_path: Path) -> None:
    _fill(tmp_path)
    info = CheckpointInfo(
        7, 4, "cfg", "data", {"mode": "fsdp"}, "2.13.0", meta={"note": "x"}, metrics={"loss": 1.5, "acc": 1}
    )
    m = build_manifest(tmp_path, info)
    assert sorted(m.files) == [".metadata", "a.bin", "sub/b.bin"]
    assert m.files["a.bin"] == FileEntry(1000, xxhash.xxh3_128(b"a" * 1000).hexdigest())
    assert m.total_bytes == 1004
    again = parse_manifest(m.to_json())
    assert again == m
    assert again.info == info  # what a download commits again


def test_manifest_file_itself_is_not_listed(tmp_path: Path) -> None:
    _fill(tmp_path)
    (tmp_path / "manifest.json").write_text("{}")
    assert "manifest.json" not in build_manifest(tmp_path, CheckpointInfo(1, 1)).files


def test_known_entries_are_reused_and_recomputed_on_size_change(tmp_path: Path) -> None:
    _fill(tmp_path)
    known = {"a.bin": FileEntry(1000, "precomputed"), ".metadata": FileEntry(999, "stale")}
    m = build_manifest(tmp_path, CheckpointInfo(1, 1), known=known)
    assert m.files["a.bin"].checksum == "precomputed"
    assert m.files[".metadata"] == FileEntry(4, xxhash.xxh3_128(b"meta").hexdigest())


@settings(derandomize=True, max_examples=30, deadline=None)
@given(st.binary(max_size=3 * 1024 * 1024))
def test_checksum_file_matches_one_shot_hash_across_chunks(tmp_path_factory, data: bytes) -> None:
    p = tmp_path_factory.mktemp("ck") / "f"
    p.write_bytes(data)
    seen = []
    assert checksum_file(p, seen.append) == xxhash.xxh3_128(data).hexdigest()
    assert sum(seen) == len(data)


def test_manifest_without_metrics_reads_as_empty() -> None:
    d = _valid()
    del d["metrics"]  # written before the field existed
    assert parse_manifest(json.dumps(d)).metrics == {}


def _valid() -> dict:
    return json.loads(Manifest(step=3, world_size=2, files={"a": FileEntry(1, "x")}).to_json())


@pytest.mark.parametrize(
    ("mutate", "needle"),
    [
        (lambda d: d.pop("step"), "lacks field 'step'"),
        (lambda d: d.update(step="3"), "field 'step' has the wrong type"),
        (lambda d: d.update(step=True), "field 'step' has the wrong type"),
        (lambda d: d.update(files=[]), "field 'files' has the wrong type"),
        (lambda d: d.update(metrics=[1.0]), "field 'metrics' is not an object of numbers"),
        (lambda d: d.update(metrics={"loss": "2.3"}), "field 'metrics' is not an object of numbers"),
        (lambda d: d.update(metrics={"loss": True}), "field 'metrics' is not an object of numbers"),
        (lambda d: d.update(format_version=FORMAT_VERSION + 1), "is unknown"),
        (lambda d: d.update(checksum_algo="md5"), "checksum 'md5' is unknown"),
        (lambda d: d["files"].update(a={"size": -1, "checksum": "x"}), "entry 'a' is malformed"),
        (lambda d: d["files"].update(a={"size": True, "checksum": "x"}), "entry 'a' is malformed"),
        (lambda d: d["files"].update(a={"size": 1}), "entry 'a' is malformed"),
        (lambda d: d["files"].update({"../x": {"size": 1, "checksum": "x"}}), "entry '../x' is malformed"),
        (lambda d: d["files"].update({"/etc/x": {"size": 1, "checksum": "x"}}), "is malformed"),
        (lambda d: d["files"].update({"manifest.json": {"size": 1, "checksum": "x"}}), "is malformed"),
    ],
)
def test_schema_errors_say_what_is_wrong(mutate, needle: str) -> None:
    d = _valid()
    mutate(d)
    with pytest.raises(ManifestError, match=needle.replace("(", r"\(").replace(")", r"\)")):
        parse_manifest(json.dumps(d))


@pytest.mark.parametrize(
    "text", [b"", b"{", b"[]", b"null", b"\xff\xfe garbage", b"[" * 100_000, b'{"step": 1e999}']
)
def test_garbage_raises_manifest_error_only(text: bytes) -> None:
    with pytest.raises(ManifestError):
        parse_manifest(text)


@settings(derandomize=True, max_examples=300)
@given(st.binary(max_size=200) | st.text(max_size=200).map(str.encode))
def test_arbitrary_bytes_never_escape_as_other_errors(text: bytes) -> None:
    with contextlib.suppress(ManifestError):
        parse_manifest(text)


def test_read_manifest_missing_and_directory(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="missing"):
        read_manifest(tmp_path)
    (tmp_path / "manifest.json").mkdir()
    with pytest.raises(ManifestError, match="unreadable"):
        read_manifest(tmp_path)


def test_list_files_is_sorted_relative_posix(tmp_path: Path) -> None:
    _fill(tmp_path)
    assert list_files(tmp_path) == [".metadata", "a.bin", "sub/b.bin"]


def test_checksum_files_in_threads_matches_one_by_one(tmp_path: Path) -> None:
    paths = []
    for i in range(7):
        p = tmp_path / f"f{i}"
        p.write_bytes(bytes([i]) * (i * 100_003))
        paths.append(p)
    seen: list[int] = []
    assert checksum_files(paths, seen.append, threads=3) == [checksum_file(p) for p in paths]
    assert sum(seen) == sum(p.stat().st_size for p in paths)


def test_checksum_files_raises_the_first_unreadable_in_order(tmp_path: Path) -> None:
    (tmp_path / "ok").write_bytes(b"x")
    (tmp_path / "dir1").mkdir()
    (tmp_path / "dir2").mkdir()
    paths = [tmp_path / "ok", tmp_path / "dir2", tmp_path / "dir1"]
    with pytest.raises(OSError) as e:
        checksum_files(paths, threads=3)
    assert e.value.filename == str(tmp_path / "dir2")
