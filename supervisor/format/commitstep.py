"""The steps of the commit protocol (supervisor/store/commit_protocol.py), in order: what a commit
reports as it goes (``on_phase``), what crash-injection tests die at, and what the heartbeat's
commit phase covers."""

from __future__ import annotations

from enum import Enum


class CommitStep(str, Enum):
    FSYNC = "fsync"  # every file (or, when their writers synced them, the directory entries)
    MANIFEST = "manifest"  # the ranks' files checked, manifest.json (and manifest.sig) written
    RENAME = "rename"  # step_N.tmp.* -> step_N, the root fsynced
    LATEST = "latest"  # the latest pointer moved to it
