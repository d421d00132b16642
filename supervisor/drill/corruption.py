"""The ways a committed checkpoint gets damaged: one vocabulary for the drill (corrupt-latest) and
the tests. Each is what failing storage or a person does to a checkpoint's files, and validation
must catch each one (the quick check too, except a bit flip: only the deep check reads the bytes).
Torch-free: it damages DCP's files by name and size, without reading them."""

from __future__ import annotations

import json
import os
from enum import Enum
from pathlib import Path

from supervisor.format.layout import DCP_METADATA, MANIFEST, dcp_index_filename


class Corruption(str, Enum):
    TRUNCATE = "truncate"  # the largest shard cut to half its size
    BITFLIP = "bitflip"  # one bit flipped in the middle of the largest shard: same size
    DELETE_METADATA = "delete-metadata"  # DCP's index gone (rank 0's, where each rank has one)
    DELETE_SHARD = "delete-shard"  # the largest shard gone
    GARBAGE_MANIFEST = "garbage-manifest"  # manifest.json not JSON
    OTHER_STEP_MANIFEST = "other-step-manifest"  # manifest.json of another step
    DELETE_MANIFEST = "delete-manifest"
    STRAY_FILE = "stray-file"  # a file the manifest does not list


# What the drill's corrupt-latest does to a real run, in this order (it seeds chaos's plans).
DRILL = (Corruption.TRUNCATE, Corruption.BITFLIP, Corruption.DELETE_METADATA)
# Damage only the deep check (checksums) catches.
DEEP_ONLY = frozenset({Corruption.BITFLIP})


def corrupt(ckpt: Path, how: Corruption | str) -> str:
    """Damage the checkpoint directory ``ckpt`` in place; returns what was done, for a report."""
    how = Corruption(how)
    name = ckpt.name
    if how == Corruption.DELETE_METADATA:  # the one index, or rank 0's where each rank has its own
        index = DCP_METADATA if (ckpt / DCP_METADATA).exists() else dcp_index_filename(0)
        (ckpt / index).unlink()
        return f"deleted {name}/{index}"
    if how in (Corruption.GARBAGE_MANIFEST, Corruption.OTHER_STEP_MANIFEST, Corruption.DELETE_MANIFEST):
        return _manifest(ckpt, how)
    if how == Corruption.STRAY_FILE:
        (ckpt / "stray.bin").write_bytes(b"not in the manifest")
        return f"added {name}/stray.bin"
    shard = largest_shard(ckpt)
    size = shard.stat().st_size
    if how == Corruption.TRUNCATE:
        os.truncate(shard, size // 2)
        return f"truncated {name}/{shard.name} from {size} to {size // 2} bytes"
    if how == Corruption.DELETE_SHARD:
        shard.unlink()
        return f"deleted {name}/{shard.name}"
    with open(shard, "r+b") as f:  # BITFLIP
        f.seek(size // 2)
        b = f.read(1)
        f.seek(size // 2)
        f.write(bytes([b[0] ^ 0x10]))
    return f"flipped one bit at byte {size // 2} of {name}/{shard.name}"


def largest_shard(ckpt: Path) -> Path:
    shards = sorted(ckpt.glob("*.distcp"), key=lambda p: p.stat().st_size, reverse=True)
    if not shards:
        raise RuntimeError(f"{ckpt}: no .distcp shard to damage")
    return shards[0]


def _manifest(ckpt: Path, how: Corruption) -> str:
    path = ckpt / MANIFEST
    if how == Corruption.DELETE_MANIFEST:
        path.unlink()
        return f"deleted {ckpt.name}/{MANIFEST}"
    if how == Corruption.GARBAGE_MANIFEST:
        path.write_bytes(b'{"format_version": 1, "step": \x00\xff garbage')
        return f"overwrote {ckpt.name}/{MANIFEST} with garbage"
    d = json.loads(path.read_text())
    d["step"] += 1
    path.write_text(json.dumps(d))
    return f"rewrote {ckpt.name}/{MANIFEST} for step {d['step']}"
