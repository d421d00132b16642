"""Shared test helpers for the checkpoint store: fake checkpoints (a few small files, the way DCP
lays them out) and the corruptions the store must catch. No torch."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

from supervisor import store
from supervisor.format.layout import REASON, RunDir
from supervisor.format.manifest import CheckpointInfo

SHARD = "__0_0.distcp"


def default_files(step: int) -> dict[str, bytes]:
    """A DCP-like checkpoint: metadata, two shards, one per-rank file; contents depend on step."""
    seed = step.to_bytes(4, "little")
    return {
        ".metadata": b"meta" + seed,
        SHARD: seed * 64,
        "__1_0.distcp": seed * 32 + b"\x01",
        "rank_00000.pt": b"rng" + seed,
    }


def write_tmp(root: Path, step: int, files: dict[str, bytes] | None = None) -> Path:
    tmp = store.begin(root, step)
    for name, data in (files or default_files(step)).items():
        (tmp / name).parent.mkdir(parents=True, exist_ok=True)
        (tmp / name).write_bytes(data)
    return tmp


def make_ckpt(
    root: Path,
    step: int,
    files: dict[str, bytes] | None = None,
    *,
    world_size: int = 2,
    sign_key: bytes | None = None,
    **info: Any,
) -> store.CheckpointRef:
    """Write and commit one checkpoint through the real protocol (``info``: CheckpointInfo's fields)."""
    tmp = write_tmp(root, step, files)
    return store.commit(root, tmp, CheckpointInfo(step, world_size, **info), sign_key=sign_key)


def quarantine_dirs(root: Path) -> list[Path]:
    q = RunDir.of(root).quarantine
    return sorted(p for p in q.iterdir() if p.is_dir()) if q.is_dir() else []


def assert_quarantine_explained(root: Path) -> None:
    for q in quarantine_dirs(root):
        assert (q / REASON).is_file(), f"{q} has no {REASON}"
        assert (q / REASON).read_text().strip(), f"{q}/{REASON} is empty"


def committed_names(root: Path) -> set[str]:
    return {r.name for r in store.list_checkpoints(root)}


def latest_text(root: Path) -> str | None:
    p = RunDir.of(root).latest
    return p.read_text() if os.path.lexists(p) else None
