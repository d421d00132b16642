"""``<checkpoint>.seal.json``: the checksums `ckpt seal` records for another trainer's checkpoint.

torchtitan's DCP folders and Lightning's ``.ckpt`` files carry no checksum of their own (DCP has
none; a zip's CRC32 covers one record at a time and not a missing file). Sealed, each file's
size, mtime and xxh3-128 checksum are kept beside the checkpoint, so `ckpt verify --deep` proves
every byte from then on. A file whose size or mtime differs from its seal was rewritten after the
seal (Lightning rewrites ``last.ckpt`` in place): the seal no longer speaks for it, and the
checkpoint reads as unsealed again, not as corrupt; same size and mtime with another checksum is
corruption.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from supervisor.format.manifest import CHECKSUM_ALGO, ManifestError

SEAL_SCHEMA = 1


@dataclass(frozen=True)
class SealedFile:
    size: int
    mtime_ns: int
    checksum: str


@dataclass(frozen=True)
class Seal:
    """One checkpoint's record: its kind and step as listed when sealed, each file (relative to
    the checkpoint folder; a file checkpoint's one entry is its own name)."""

    kind: str
    step: int
    sealed_at: float
    files: Mapping[str, SealedFile]

    def to_json(self) -> str:
        return json.dumps(
            {
                "schema": SEAL_SCHEMA,
                "kind": self.kind,
                "step": self.step,
                "sealed_at": self.sealed_at,
                "checksum_algo": CHECKSUM_ALGO,
                "files": {
                    n: {"size": f.size, "mtime_ns": f.mtime_ns, "checksum": f.checksum}
                    for n, f in sorted(self.files.items())
                },
            },
            indent=1,
        )


def parse_seal(raw: bytes | str, label: str) -> Seal:
    """The record, or ManifestError naming ``label`` and what is wrong (an integrity error: a
    seal that cannot be read proves nothing about the checkpoint either way)."""
    try:
        d = json.loads(raw)
        if d.get("schema") != SEAL_SCHEMA or d.get("checksum_algo") != CHECKSUM_ALGO:
            raise ValueError(f"schema {d.get('schema')!r}, checksums {d.get('checksum_algo')!r}")
        files: dict[str, Any] = d["files"]
        return Seal(
            kind=str(d["kind"]),
            step=int(d["step"]),
            sealed_at=float(d["sealed_at"]),
            files={
                str(n): SealedFile(int(f["size"]), int(f["mtime_ns"]), str(f["checksum"]))
                for n, f in files.items()
            },
        )
    except (ValueError, KeyError, TypeError, AttributeError) as e:
        raise ManifestError(
            f"{label}: not a seal this toolkit can read ({e}); `ckpt seal` writes it anew"
        ) from None
