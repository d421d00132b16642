"""supervisor/appear.py: a wait for a file that sleeps on inotify (a standby rank's wait for its
release), with a bounded check as the backstop and a poll where inotify cannot watch."""

from __future__ import annotations

import os
import threading
import time
from pathlib import Path

from supervisor.appear import Appearance

LONG_S = 120.0  # a backstop no wake in these tests may wait for


def renamed_into_place(path: Path, started: threading.Event) -> threading.Thread:
    """A thread that writes ``path`` as the watchdog does (a temporary name, then a rename), once
    ``started`` is set."""

    def write() -> None:
        started.wait()
        tmp = path.with_name(f".{path.name}.tmp")
        tmp.write_text("go\n")
        os.rename(tmp, path)

    t = threading.Thread(target=write, daemon=True)
    t.start()
    return t


def test_a_file_that_is_there_ends_the_wait_at_once(tmp_path: Path) -> None:
    (tmp_path / "release").write_text("go\n")
    with Appearance(tmp_path / "release", LONG_S, LONG_S) as a:
        assert a.wait(LONG_S)


def test_a_rename_into_place_wakes_the_wait_long_before_its_backstop(tmp_path: Path) -> None:
    path, started = tmp_path / "release", threading.Event()
    writer = renamed_into_place(path, started)
    with Appearance(path, LONG_S, LONG_S) as a:
        assert a.watching
        t0 = time.monotonic()
        started.set()
        assert a.wait(2 * LONG_S)
        assert time.monotonic() - t0 < LONG_S  # the event woke it, not the backstop
    writer.join()


def test_other_files_appearing_do_not_end_the_wait(tmp_path: Path) -> None:
    with Appearance(tmp_path / "release", 0.01, 0.01) as a:
        (tmp_path / "release.tmp").write_text("not yet\n")
        (tmp_path / "rank_0.ready").write_text("1\n")
        assert not a.wait(0.1)


def test_without_events_it_polls(tmp_path: Path) -> None:
    path, started = tmp_path / "release", threading.Event()
    writer = renamed_into_place(path, started)
    with Appearance(path, LONG_S, 0.01, events=False) as a:
        assert not a.watching
        assert not a.wait(0.05)
        started.set()
        assert a.wait(LONG_S)
    writer.join()


def test_a_folder_inotify_cannot_watch_falls_back_to_the_poll(tmp_path: Path) -> None:
    with Appearance(tmp_path / "missing" / "release", LONG_S, 0.01) as a:
        assert not a.watching
        assert not a.wait(0.05)
