"""Shared fixtures.

Hypothesis without wall-clock checks: CI runs on 2 shared cores, where one stall of a second or
more (seen: a 1.6 s draw) fails a per-example deadline or the too-slow health check. Such a failure
says the machine was busy, not that the code is wrong; everything else Hypothesis checks stays on.

Storage faults (docs/storage-faults.md): ``faultfs`` mounts the fault-injecting filesystem over a
temp dir and yields its controller; ``small_tmpfs`` a 64 MiB tmpfs that can be filled to ENOSPC.
Both skip, with the reason printed, only where FUSE or mount cannot be used (not root, no
/dev/fuse, fuse3 not installable); anything else that fails is a test failure.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator
from pathlib import Path

import pytest
import remote_support as rs
from hypothesis import HealthCheck, settings

from supervisor.drill.faultctl import FaultFS, fuse_unavailable
from supervisor.drill.mounts import SmallTmpfs, mount_unavailable
from supervisor.format.layout import node_local_base
from supervisor.tiers.remote import RemoteTier
from supervisor.watch import memory_owner

settings.register_profile("ci", deadline=None, derandomize=True, suppress_health_check=[HealthCheck.too_slow])
settings.load_profile("ci")

SMALL_TMPFS_BYTES = 64 << 20
_told: set[str] = set()


def _skip_unless_available(config: pytest.Config, what: str, reason: str | None) -> None:
    """Skip when ``reason`` is set, saying why on the terminal once (visible without -rs)."""
    if reason is None:
        return
    line = f"{what} tests skipped: {reason}"
    terminal = config.pluginmanager.get_plugin("terminalreporter")
    capture = config.pluginmanager.get_plugin("capturemanager")
    if terminal is not None and line not in _told:
        _told.add(line)
        with capture.global_and_fixture_disabled() if capture else contextlib.nullcontext():
            terminal.write_line(line, yellow=True)  # past the capture, which holds it during setup
    pytest.skip(line)


@pytest.fixture
def need_fuse(pytestconfig: pytest.Config) -> None:
    """Skips the test where a FUSE mount cannot be made (installs fuse3 first where it can)."""
    _skip_unless_available(pytestconfig, "FUSE", fuse_unavailable())


@pytest.fixture
def need_mount(pytestconfig: pytest.Config) -> None:
    """Skips the test where mount(8) cannot be used."""
    _skip_unless_available(pytestconfig, "mount", mount_unavailable())


@pytest.fixture
def faultfs(tmp_path: Path, need_fuse: None) -> Iterator[FaultFS]:
    """The fault filesystem mounted on tmp_path/"mnt" (backing: tmp_path/"backing"); put the run
    dir under ``faultfs.mountpoint``. Unmounted in teardown, also while an operation is blocked."""
    with FaultFS.start(tmp_path / "backing", tmp_path / "mnt") as fs:
        yield fs


@pytest.fixture
def small_tmpfs(tmp_path: Path, need_mount: None) -> Iterator[SmallTmpfs]:
    """A 64 MiB tmpfs on tmp_path/"tmpfs": ``fill()`` makes it full (ENOSPC), ``free()`` frees it."""
    with SmallTmpfs(tmp_path / "tmpfs", SMALL_TMPFS_BYTES) as fs:
        yield fs


# The remote tier's fixtures (tests/remote_support.py): a moto S3 server per module, a tier of each
# kind (a directory, S3 on that server), and the local run dir a test uploads from.
moto = pytest.fixture(scope="module")(rs.serve_moto)


@pytest.fixture(params=rs.KINDS)
def tier(request: pytest.FixtureRequest, tmp_path: Path) -> RemoteTier:
    server = request.getfixturevalue("moto") if request.param == "s3" else None
    return rs.make_tier(request.param, tmp_path, server)


@pytest.fixture
def local(tmp_path: Path) -> Path:
    return tmp_path / "local" / "run"


@pytest.fixture(scope="session")
def goldens(tmp_path_factory: pytest.TempPathFactory):
    """Uninterrupted reference runs of the real trainer, made once per session and shared by every
    test that compares a faulted run against one (trainer_helpers.Goldens)."""
    from trainer_helpers import shared_goldens  # imports torch: only for the tests that need it

    return shared_goldens(lambda: tmp_path_factory.mktemp("goldens"))


class RecordingTracker:
    """A ``Tracker`` (supervisor/format/heartbeat.py) that records what it hears: the units, the
    paths it is told of, and its waits."""

    def __init__(self) -> None:
        self.units: list[int] = []
        self.paths: list[str] = []
        self.waits: list[tuple[str, float]] = []

    def __call__(self, n: int) -> None:
        self.units.append(n)

    def set_path(self, path: str) -> None:
        self.paths.append(path)

    def wait(self, what: str, until: float = 0.0) -> None:
        self.waits.append((what, until))


@pytest.fixture
def tracker() -> RecordingTracker:
    return RecordingTracker()


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    """Under pytest-xdist (``--dist loadgroup``, the Makefile's): every SLURM test on one worker,
    so one test cluster runs at a time."""
    for item in items:
        if item.get_closest_marker("slurm"):
            item.add_marker(pytest.mark.xdist_group("slurm"))


def pytest_sessionfinish(session: pytest.Session) -> None:
    """The memory folders this session's watchdogs left without their cleanup (the SLURM tests'
    lost nodes, the watchdogs killed on purpose), removed as the next watchdog would: only those
    whose owner is gone (another worker's live watchdogs keep theirs)."""
    memory_owner.sweep(node_local_base() / f"supervisor-{os.getuid()}")
