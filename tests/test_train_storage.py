"""End to end: the reference trainer (torchrun, 2 ranks) on storage that fails for real (the fault
filesystem, docs/storage-faults.md). A failed save commits nothing, leaves ``latest`` alone and
training goes on; too many in a row end the launch with exit 74 and nothing lost; a commit that
misses a rank's file is refused; a resume waits out an EIO burst and never quarantines for it;
the deep verify spread over the ranks quarantines on content evidence only.

Every case ends digest-equal to an uninterrupted run (a golden, shared by the session): a failed
save must not change training. Faults are sequenced by the filesystem's own events (a blocked
operation names its process), never by time."""

from __future__ import annotations

import os
import signal
from pathlib import Path

import pytest
from trainer_helpers import (
    BeatLog,
    beats,
    committed,
    digest,
    finish,
    heartbeat_exit_codes,
    kill_group,
    largest_share,
    launch,
    metrics,
    rewind,
    run,
    run_ok,
    train_args,
)
from waiting import wait_for, wait_fs_blocked

from supervisor import store
from supervisor.format.exitcodes import Exit
from supervisor.format.heartbeat import Phase
from supervisor.format.layout import MANIFEST
from supervisor.format.manifest import read_manifest
from supervisor.format.nodesummary import read_run_heartbeats

pytestmark = pytest.mark.slow


def leftovers(root: Path) -> list[str]:
    """Tmp and half-deleted dirs: a failed save must leave none behind."""
    return sorted(n for n in os.listdir(root) if ".tmp." in n or ".deleting." in n)


def quarantined(root: Path) -> list[str]:
    q = root / "quarantine"
    return sorted(p.name.split("-")[0] for p in q.iterdir()) if q.exists() else []


def test_a_save_that_hits_enospc_commits_nothing_and_training_goes_on(goldens, faultfs):
    golden = goldens.get("ddp", 2)
    root = faultfs.mountpoint / "run"
    rid = faultfs.fail("/run/step_00000020.tmp.*/*", "ENOSPC", ops=["write"])  # the save of step 20
    r = run_ok(root, 2, *train_args("ddp"))
    assert faultfs.hits(rid) >= 2  # both ranks' writes failed
    line = next(x for x in r.output.splitlines() if "SAVE FAILED at step 20" in x)
    assert "rank 0: step_00000020.tmp." in line and "ENOSPC (No space left on device)" in line, line
    assert "latest is still step_00000010" in line
    assert (
        committed(root) == ["step_00000010", "step_00000030"] and store.read_latest(root) == "step_00000030"
    )
    assert leftovers(root) == []
    assert [m.step for m in metrics(root)] == list(range(1, 31))
    assert {s.heartbeat.save_failures for s in read_run_heartbeats(root)} == {0}  # reset by step 30
    assert digest(root) == digest(golden)


def test_a_final_save_that_fails_is_retried_and_commits(goldens, faultfs):
    golden = goldens.get("ddp", 2)
    root = faultfs.mountpoint / "run"
    # The first two writes into step 30's tmp dir: the two per-rank state files of the first try
    # (DCP writes only after a collective that both ranks reach once their state file is written).
    rid = faultfs.fail("/run/step_00000030.tmp.*/*", "ENOSPC", ops=["write"], count=2)
    r = run_ok(root, 2, *train_args("ddp"))
    assert faultfs.hits(rid) == 2
    failed = [x for x in r.output.splitlines() if "SAVE FAILED" in x]
    assert len(failed) == 1 and "SAVE FAILED at step 30: rank 0: " in failed[0] and "ENOSPC" in failed[0]
    assert "save recovered: step_00000030 committed after 1 failed save(s)" in r.output
    assert committed(root) == ["step_00000010", "step_00000020", "step_00000030"] and leftovers(root) == []
    assert digest(root) == digest(golden)


def test_failed_saves_in_a_row_exit_74_and_lose_nothing(goldens, faultfs):
    golden = goldens.get("ddp", 2)
    root = rewind(golden, faultfs.mountpoint / "run", 10)
    rid = faultfs.fail("/run/step_*.tmp.*/*", "ENOSPC", ops=["write"])
    args = train_args("ddp", "--save-every", "5", "--max-failed-saves", "2")
    r = run(root, 2, *args)
    assert r.rc != 0 and faultfs.hits(rid) > 0
    assert set(heartbeat_exit_codes(root).values()) == {Exit.STORAGE}
    assert "SAVE FAILED at step 15" in r.output
    line = next(x for x in r.output.splitlines() if "giving up" in x)
    assert "giving up at step 20: 2 saves failed in a row (--max-failed-saves 2)" in line, line
    assert "newest: step_00000010" in line
    assert {
        (s.heartbeat.save_failures, "ENOSPC" in s.heartbeat.last_error) for s in read_run_heartbeats(root)
    } == {(2, True)}
    assert committed(root) == ["step_00000010"] and store.read_latest(root) == "step_00000010"
    assert (
        leftovers(root) == []
        and store.validate(store.CheckpointRef(10, root / "step_00000010"), deep=True).ok
    )
    faultfs.clear(rid)  # space again: the relaunch resumes from what was kept and finishes
    r2 = run_ok(root, 2, *args)
    assert "resumed from step_00000010, next step 11" in r2.output
    assert digest(root) == digest(golden)


def test_a_rank_file_missing_from_rank_0s_view_is_refused_like_a_failed_save(goldens, faultfs):
    golden = goldens.get("ddp", 2)
    root = faultfs.mountpoint / "run"
    hold = faultfs.block("/run", ops=["readdir"])  # rank 0's pick lists the run dir: held there
    proc = launch(root, 2, *train_args("ddp"))
    try:
        (held,) = wait_fs_blocked(faultfs, hold, proc)
        rank0 = held.pid  # rank 1's shard of step 20 is there for everyone but rank 0
        hide = faultfs.hide("/run/step_00000020.tmp.*/__1_0.distcp", pids=[rank0])
        faultfs.clear(hold)
        r = finish(proc)
    finally:
        kill_group(proc)
    assert r.rc == 0, r.output[-3000:]
    assert faultfs.hits(hide) > 0
    line = next(x for x in r.output.splitlines() if "SAVE FAILED at step 20" in x)
    assert "__1_0.distcp written by rank 1 is missing" in line and f"pid {rank0}" in line, line
    assert committed(root) == ["step_00000010", "step_00000030"] and leftovers(root) == []
    assert read_manifest(root / "step_00000030").writers[1] == ("__1_0.distcp", "rank_00001.state.pt")
    assert digest(root) == digest(golden)


def test_an_eio_burst_during_the_resume_pick_quarantines_nothing(goldens, faultfs):
    golden = goldens.get("ddp", 2)
    root = rewind(golden, faultfs.mountpoint / "run", 20)
    rid = faultfs.fail("/run/step_00000020/manifest.json", "EIO", ops=["read"], count=3)
    r = run_ok(root, 2, *train_args("ddp"))
    assert faultfs.hits(rid) == 3
    retries = [x for x in r.output.splitlines() if "step_00000020/manifest.json: EIO" in x]
    assert len(retries) == 3 and all("not proof of corruption; retrying" in x for x in retries)
    assert "resumed from step_00000020, next step 21" in r.output
    assert quarantined(root) == []
    assert digest(root) == digest(golden)


def test_a_bit_flip_found_by_rank_1_is_confirmed_by_rank_0_then_quarantined(goldens, tmp_path):
    golden = goldens.get("ddp", 2)
    root = rewind(golden, tmp_path / "run", 20)
    name = largest_share(root, 20, rank=1)
    path = root / "step_00000020" / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x01  # same size: only a checksum sees it
    path.write_bytes(bytes(data))
    r = run_ok(root, 2, *train_args("ddp"))
    line = next(x for x in r.output.splitlines() if "deep verify: step_00000020 quarantined" in x)
    assert f"{name} checksum" in line, line
    assert "resumed from step_00000010, next step 11" in r.output
    assert quarantined(root) == ["step_00000020"]
    assert digest(root) == digest(golden)


def test_an_eio_in_a_share_of_the_deep_verify_is_retried_never_quarantined(goldens, faultfs):
    golden = goldens.get("ddp", 2)
    root = rewind(golden, faultfs.mountpoint / "run", 20)
    name = largest_share(root, 20, rank=1)
    rid = faultfs.fail(f"/run/step_00000020/{name}", "EIO", ops=["read"], count=1)  # rank 1's read
    r = run_ok(root, 2, *train_args("ddp"))
    assert faultfs.hits(rid) == 1
    line = next(x for x in r.output.splitlines() if "retrying the choice" in x)
    assert f"rank 1: step_00000020: {name} is unreadable (EIO" in line, line
    assert "resumed from step_00000020, next step 21" in r.output and quarantined(root) == []
    assert digest(root) == digest(golden)


def test_a_lasting_eio_in_the_deep_verify_exits_74_and_moves_nothing(goldens, faultfs):
    root = rewind(goldens.get("ddp", 2), faultfs.mountpoint / "run", 20)
    name = largest_share(root, 20, rank=1)
    faultfs.fail(f"/run/step_00000020/{name}", "EIO", ops=["read"])
    r = run(root, 2, *train_args("ddp", "--io-retry", "1"))
    assert set(heartbeat_exit_codes(root).values()) == {Exit.STORAGE}
    line = next(x for x in r.output.splitlines() if "cannot resume" in x)
    assert f"rank 1: step_00000020: {name} is unreadable (EIO" in line and "of retries (deep verify)" in line
    assert "ckpt quarantine" in line, line
    assert quarantined(root) == [] and committed(root) == ["step_00000010", "step_00000020"]
    assert (root / "step_00000020" / MANIFEST).exists()


def test_a_preemption_checkpoint_that_fails_exits_74_not_75(goldens, faultfs):
    root = rewind(goldens.get("ddp", 2), faultfs.mountpoint / "run", 10)
    faultfs.fail("/run/step_*.tmp.*/*", "ENOSPC", ops=["write"])
    hold = faultfs.block("/run", ops=["readdir"])  # rank 0's pick: the notice lands before step 11
    # --verify quick: a notice during the deep verify stops the resume there (exit 75, nothing
    # trained yet: test_hostile_load.py f4); this one must reach the first step's preemption save
    proc = launch(root, 2, *train_args("ddp", "--verify", "quick", save_every=1000))
    try:
        (held,) = wait_fs_blocked(faultfs, hold, proc)
        os.kill(held.pid, signal.SIGUSR1)
        faultfs.clear(hold)
        r = finish(proc)
    finally:
        kill_group(proc)
    assert r.rc != 0
    assert set(heartbeat_exit_codes(root).values()) == {Exit.STORAGE}  # not 75: nothing was saved
    line = next(x for x in r.output.splitlines() if "preemption checkpoint of step 11 failed" in x)
    assert "ENOSPC" in line and "the relaunch resumes from step_00000010" in line, line
    assert committed(root) == ["step_00000010"] and leftovers(root) == []


def test_a_read_blocked_in_the_spread_verify_names_its_file_while_the_waiting_rank_beats(goldens, faultfs):
    """In-process side of the watchdog's blocked-read verdict: the blocked rank's heartbeat stops
    with the file in io_path; its peer, done with its share, keeps beating (it is not the one
    stuck). Released, the launch goes on and ends digest-equal."""
    golden = goldens.get("ddp", 2)
    root = rewind(golden, faultfs.mountpoint / "run", 20)
    name = largest_share(root, 20, rank=1)
    rid = faultfs.block(f"/run/step_00000020/{name}", ops=["read"])
    proc = launch(root, 2, *train_args("ddp"))
    try:
        (held,) = wait_fs_blocked(faultfs, rid, proc)
        in_read = lambda: (b := beats(root).get(1)) is not None and b.pid == held.pid and bool(b.io_path)  # noqa: E731
        wait_for(in_read, "rank 1's heartbeat in its read", proc=proc)
        stuck = beats(root)[1]
        assert (stuck.phase, stuck.io_path) == (Phase.VERIFY, f"step_00000020/{name}")
        first = beats(root)[0].mono_time
        wait_for(lambda: beats(root)[0].mono_time > first, "rank 0 beating while it waits", proc=proc)
        assert beats(root)[1].mono_time == stuck.mono_time  # silent: no progress in a blocked read
        faultfs.clear(rid)
        r = finish(proc)
    finally:
        faultfs.clear()
        kill_group(proc)
    assert r.rc == 0, r.output[-3000:]
    assert "resumed from step_00000020, next step 21" in r.output and quarantined(root) == []
    assert digest(root) == digest(golden)


# A throttle that makes verify + load of the tiny checkpoint take over a minute (measured: 55 s at
# 60 kB/s; the bytes are fixed, so the time is a floor, by construction), while one 64 KiB chunk
# per reader (two share it) takes about 3 s.
THROTTLE_BYTES_PER_S = 45_000
# Two saves of the tiny checkpoint (~0.6 MB each) through this take ~15 s, while one smallest
# write per rank (two share the throttle) takes 0.4 s.
SAVE_THROTTLE_BYTES_PER_S = 80_000


def test_on_a_throttled_file_system_verify_load_and_saves_beat_all_along(goldens, faultfs):
    """In-process side of "a long phase with progress is never a hang": however long verify and
    load take, and the saves after them (an async save at step 25 that the loop must wait for at
    step 30, then the sync final save), no rank is silent for more than a fraction of it. The
    numbers are printed."""
    golden = goldens.get("ddp", 2)
    root = rewind(golden, faultfs.mountpoint / "run", 20)
    faultfs.throttle("/run/step_00000020/*", THROTTLE_BYTES_PER_S)
    faultfs.throttle("/run/step_*.tmp.*/*", SAVE_THROTTLE_BYTES_PER_S, ops=["write"])
    log = BeatLog(root)
    after = (Phase.DIGEST, Phase.DONE)  # the tiny model's digest may come and go between two polls
    proc = launch(root, 2, *train_args("ddp", save_every=5))
    try:
        saved = lambda: log.poll() or log.first(*after) is not None  # noqa: E731
        wait_for(saved, "the end of the saves after a throttled resume", timeout=600, proc=proc)
        r = finish(proc)
    finally:
        faultfs.clear()
        kill_group(proc)
    assert r.rc == 0, r.output[-3000:]
    phases = {p for w in log.seen.values() for _t, p in w}
    assert {Phase.VERIFY, Phase.LOAD, Phase.SAVE} <= phases, phases
    for what, first, last in (("verify+load", Phase.VERIFY, (Phase.TRAIN,)), ("saves", Phase.SAVE, after)):
        start, end = log.first(first), log.first(*last)
        assert start is not None and end is not None
        silence = log.longest_silence(end, since=start)
        print(f"\n{what} {end - start:.1f}s, longest silence of a rank {silence:.1f}s")
        assert end - start >= 5 * silence, (what, end - start, silence)
    assert store.read_latest(root) == "step_00000030" and digest(root) == digest(golden)
