"""What an attacker with write access to a checkpoint does, for the security tests: replace a
file and rewrite its manifest entry to match (xxh3 checks corruption, not tampering), and a
pickle that runs a command when it is loaded. No torch."""

from __future__ import annotations

import json
import os
import pickle
from pathlib import Path

from supervisor.format.layout import MANIFEST
from supervisor.format.manifest import checksum_file

KEY = b"k" * 32 + b"-the-run-key"
OTHER_KEY = b"o" * 32 + b"-another-key"


def tamper(ckpt: Path, name: str, data: bytes) -> None:
    """Replace ``ckpt/name`` with ``data`` and make the manifest agree (size and checksum), so the
    checkpoint passes even a deep check of the store."""
    (ckpt / name).write_bytes(data)
    m = json.loads((ckpt / MANIFEST).read_text())
    m["files"][name] = {"size": len(data), "checksum": checksum_file(ckpt / name)}
    (ckpt / MANIFEST).write_text(json.dumps(m, indent=1, sort_keys=True) + "\n")


class RunsCommand:
    """Unpickling this runs ``touch marker`` through os.system (a REDUCE of posix.system)."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):  # type: ignore[no-untyped-def]
        return (os.system, (f"touch {self.marker}",))


def evil_pickle(marker: Path) -> bytes:
    """A pickle whose load creates ``marker``; checked once to work (in this process, so the test
    that uses it proves something), then the marker is removed."""
    data = pickle.dumps(RunsCommand(marker))
    pickle.loads(data)  # the payload is real: loading it unguarded runs the command
    assert marker.exists(), "the payload did not run the command: the test would prove nothing"
    marker.unlink()
    return data
