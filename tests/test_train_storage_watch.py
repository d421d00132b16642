"""End to end under the watchdog: the reference trainer (torchrun, 2 ranks, tiny) supervised by
``python -m supervisor watch``, its run dir on the fault filesystem (docs/storage-faults.md).

- One rank's shard throttled, so that verify + load take many times the phase timeouts: the
  slow rank beats all along, the other beats while it waits for it; no hang verdict, one launch,
  digest-equal to an uninterrupted run.
- A read that never returns in the spread deep verify: the hang verdict comes within the verify
  timeout + 2 s and names the rank, the phase and the file; the rank waiting for it is not named.
- The same for a shard write that never returns in a save.
- Waits on storage that are no hang: a final save retried for long on a full disk, and a save
  that waits for a slow prune of old checkpoints.

The measured numbers are printed (pytest -s)."""

from __future__ import annotations

import json
import re
import subprocess
from collections.abc import Callable
from pathlib import Path

import pytest
from commands import supervisor_cmd
from trainer_helpers import (
    REPO,
    BeatLog,
    beats,
    committed,
    digest,
    kill_group,
    largest_share,
    rewind,
    torchrun_cmd,
    train_args,
    trainer_env,
)
from waiting import wait_for, wait_fs_blocked

from supervisor import store
from supervisor.drill.faultctl import FaultFS
from supervisor.format.events import events_path
from supervisor.format.exitcodes import Exit
from supervisor.format.heartbeat import Phase

pytestmark = pytest.mark.slow

WATCH = ["--poll-interval", "0.2", "--kill-grace", "1", "--reap-timeout", "1", "--dump-wait", "1"]
WATCH += ["--backoff-initial", "0.5", "--backoff-jitter", "0", "--startup-timeout", "120"]


def watch(
    root: Path, *watch_args: str, train: tuple[str, ...] = (), parallel: str = "ddp"
) -> subprocess.Popen[str]:
    """The watchdog over torchrun over the trainer, in its own session (cleanup kills the group)."""
    trainer = torchrun_cmd(root, 2, *train_args(parallel, *train))
    argv = supervisor_cmd("watch", "--ckpt-root", str(root), *WATCH, *watch_args)
    return subprocess.Popen(
        [*argv, "--", *trainer],
        cwd=REPO,
        env=trainer_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def events(root: Path, kind: str | None = None) -> list[dict]:
    try:
        lines = events_path(root).read_text().splitlines()
    except FileNotFoundError:
        return []
    evs = [json.loads(x) for x in lines if x.strip()]
    return [e for e in evs if kind is None or e["event"] == kind]


def done(p: subprocess.Popen[str]) -> tuple[int, str]:
    out, _ = p.communicate(timeout=600)
    return p.returncode, out


def one_clean_launch(
    root: Path,
    p: subprocess.Popen[str],
    faultfs: FaultFS,
    until: Callable[[], bool],
    what: str,
    then: Callable[[], None] = lambda: None,
) -> str:
    """Wait for ``until`` (then do ``then``) and for the watchdog's end, the faults cleared and
    the group killed whatever happens: exit 0, one launch, no hang verdict. Its output."""
    try:
        wait_for(until, what, timeout=600, proc=p)
        then()
        rc, out = done(p)
    finally:
        faultfs.clear()
        kill_group(p)
    assert rc == Exit.OK, out[-4000:]
    assert events(root, "hang") == [] and len(events(root, "launch")) == 1, out[-4000:]
    return out


# Rank 1's FSDP shard file (0.39 MB of the tiny model, which rank 1 alone loads: each rank reads
# its own index's shard) read at this rate: rank 1's verify and its load take at least 13 s each
# (nothing of the file comes faster), over 5 phase timeouts in all. A 64 KiB read takes 2.2 s,
# with the 1 s between heartbeat writes under the timeout.
SLOW_SHARD_BYTES_PER_S = 30_000
IO_TIMEOUT_S = 5.0


def test_a_throttled_verify_and_load_far_longer_than_their_timeouts_is_no_hang(goldens, faultfs):
    """FSDP, each rank verifying the files it wrote and loading its own shard; rank 1's shard file
    alone is slow. Rank 1 beats per chunk through both phases, however long they take; rank 0,
    done with its part at once, waits for rank 1 in the verify's exchange and the load's agreement
    (each time many timeouts long) and beats meanwhile (progress_io.kept_alive), or it is the one
    judged hung. No hang verdict, one launch, digest equal to an uninterrupted run."""
    golden = goldens.get("fsdp", 2)
    root = rewind(golden, faultfs.mountpoint / "run", 20)
    faultfs.throttle("/run/step_00000020/__1_0.distcp", SLOW_SHARD_BYTES_PER_S, ops=["read"])
    t = str(IO_TIMEOUT_S)
    log = BeatLog(root)
    p = watch(root, "--hang-timeout", "60", "--verify-timeout", t, "--load-timeout", t, parallel="fsdp")
    trained = lambda: log.poll() or log.first(Phase.TRAIN) is not None  # noqa: E731
    one_clean_launch(root, p, faultfs, trained, "the first step after the throttled resume")
    took, load = (log.first(Phase.TRAIN) - log.first(phase) for phase in (Phase.VERIFY, Phase.LOAD))
    print(
        f"\nverify+load {took:.1f}s (load {load:.1f}s) with rank 1's shard at {SLOW_SHARD_BYTES_PER_S} B/s = "
        f"{took / IO_TIMEOUT_S:.1f}x the verify/load timeout ({IO_TIMEOUT_S:g}s); no hang verdict"
    )
    # long by construction (the throttle), or the test proves nothing
    assert took >= 4 * IO_TIMEOUT_S and load >= 2 * IO_TIMEOUT_S
    assert digest(root) == digest(golden)


# The final save's tries fail until a rank reports this many in a row: the backoff before the
# next try is then 4-8 s (supervisor.store.ioerrors.backoff_s), longer than SAVE_TIMEOUT_S by construction.
FINAL_SAVE_FAILURES = 5
SAVE_TIMEOUT_S = 3.0


def test_a_final_save_retried_longer_than_the_phase_timeouts_is_no_hang(goldens, faultfs):
    """The final save fails again and again (ENOSPC) and each rank waits longer between tries; a
    rank that slept silently through a backoff was once killed as hung at the very end of a run.
    Every rank beats while it waits: no hang verdict, one launch, the checkpoint commits once
    space is back, digest equal to an uninterrupted run."""
    golden = goldens.get("ddp", 2)
    root = rewind(golden, faultfs.mountpoint / "run", 20)
    rid = faultfs.fail("/run/step_00000030.tmp.*/*", "ENOSPC", ops=["write"])
    t = str(SAVE_TIMEOUT_S)
    p = watch(root, "--hang-timeout", t, "--save-timeout", t, train=("--max-failed-saves", "20"))
    failed = lambda: max((b.save_failures for b in beats(root).values()), default=0)  # noqa: E731
    until = lambda: failed() >= FINAL_SAVE_FAILURES  # noqa: E731
    out = one_clean_launch(
        root, p, faultfs, until, "the final save's failures", then=lambda: faultfs.clear(rid)
    )
    assert out.count("SAVE FAILED at step 30") >= FINAL_SAVE_FAILURES, out[-4000:]
    assert store.read_latest(root) == "step_00000030"
    assert digest(root) == digest(golden)


# Each file of a pruned checkpoint takes this long to unlink: removing one (6 files) takes 6 s,
# twice the train timeout, and the final save waits for it.
UNLINK_DELAY_S = 1.0
TRAIN_TIMEOUT_S = 3.0


def test_a_save_waiting_for_a_slow_prune_is_no_hang(goldens, faultfs):
    """Retention keeps 2: the commit of step 25 prunes step 10 in the background, and the final
    save, 5 steps later, waits for that prune first (the room it frees is that save's), as the
    end waits for the prune after it. Each unlink takes 1 s here. Rank 0 waits in phase save,
    beating per checkpoint judged or removed (``Checkpointer.wait_pruned``); silent in phase
    train, as before, a 6 s wait was twice the timeout. No hang verdict, one launch, the pruned
    checkpoints gone, digest equal to an uninterrupted run."""
    golden = goldens.get("ddp", 2)
    root = rewind(golden, faultfs.mountpoint / "run", 20)
    rid = faultfs.delay("/run/step_*.deleting.*/*", UNLINK_DELAY_S, ops=["unlink"])
    train = ("--keep", "2", "--save-every", "5")
    p = watch(root, "--hang-timeout", str(TRAIN_TIMEOUT_S), "--save-timeout", "30", train=train)
    unlinks: list[int] = []
    final = lambda: (root / "final.json").exists()  # noqa: E731 - written after the last prune
    one_clean_launch(
        root, p, faultfs, final, "the end of the run", then=lambda: unlinks.append(faultfs.hits(rid))
    )
    print(f"\n{unlinks[0]} unlinks of pruned checkpoints at {UNLINK_DELAY_S:g}s each; no hang verdict")
    assert unlinks[0] >= 12  # steps 10 and 20, 6 files each: as slow as that by construction
    assert committed(root) == ["step_00000025", "step_00000030"]
    assert digest(root) == digest(golden)


def hang_on_block(root: Path, faultfs: FaultFS, rule: str, p: subprocess.Popen[str]) -> tuple[dict, float]:
    """Watch ``root`` (``p``) until the operation held by faultfs ``rule`` is judged a hang; the
    launch is then relaunched and finishes (exit 0, outcomes hang then done). Returns the hang
    event and its latency from the block. The rule is released once the watchdog sent SIGKILL
    (the pending kill then ends the rank): released before, the ranks would act on its SIGTERM
    as a preemption notice and checkpoint."""
    try:
        (blocked,) = wait_fs_blocked(faultfs, rule, p)
        wait_for(lambda: events(root, "kill"), "the kill of the hung launch", proc=p)
        faultfs.clear(rule)
        rc, out = done(p)
    finally:
        faultfs.clear()
        kill_group(p)
    assert rc == Exit.OK, out[-4000:]
    assert [e["outcome"] for e in events(root, "launch_end")] == ["hang", "done"]
    (hang,) = events(root, "hang")
    return hang, hang["t"] - blocked.since


def test_a_write_that_never_returns_in_a_save_is_a_hang_naming_its_rank_and_file_only(goldens, faultfs):
    """Rank 1's shard write of the final save blocks forever. Rank 1 goes silent, its heartbeat
    naming the file; rank 0, done with its own shard and waiting inside DCP's save for rank 1,
    keeps beating (progress_io.Keepalive), so the verdict names rank 1 alone."""
    golden = goldens.get("ddp", 2)
    root = rewind(golden, faultfs.mountpoint / "run", 20)
    rule = faultfs.block("/run/step_00000030.tmp.*/__1_0.distcp", ops=["write"])
    p = watch(root, "--hang-timeout", "60", "--save-timeout", str(SAVE_TIMEOUT_S))
    hang, latency = hang_on_block(root, faultfs, rule, p)
    print(f"\nwrite blocked -> hang verdict: {latency:.2f}s (save timeout {SAVE_TIMEOUT_S:g}s, poll 0.2s)")
    assert hang["ranks"] == [1], hang["msg"]
    assert "rank 1 made no progress" in hang["msg"] and "in phase save" in hang["msg"], hang["msg"]
    assert re.search(r"at step_00000030\.tmp\.[^/ ]+/__1_0\.distcp", hang["msg"]), hang["msg"]
    assert latency <= SAVE_TIMEOUT_S + 2.0
    assert digest(root) == digest(golden)  # relaunched from step 20 once the write was released


def test_a_prune_that_never_returns_is_a_hang_naming_the_directory(goldens, faultfs):
    """An unlink of the checkpoint the commit of step 25 pruned blocks forever, and the final
    save waits for that prune: rank 0 goes silent in phase save, its heartbeat naming the
    directory being removed (``store.remove_tree``). Relaunched, the run resumes from step 25
    and finishes; the dead prune's directory goes with the next prune."""
    golden = goldens.get("ddp", 2)
    root = rewind(golden, faultfs.mountpoint / "run", 20)
    rule = faultfs.block("/run/step_00000010.deleting.*/*", ops=["unlink"])
    train = ("--keep", "2", "--save-every", "5")
    p = watch(root, "--hang-timeout", "60", "--save-timeout", str(SAVE_TIMEOUT_S), train=train)
    hang, latency = hang_on_block(root, faultfs, rule, p)
    print(f"\nunlink blocked -> hang verdict: {latency:.2f}s (save timeout {SAVE_TIMEOUT_S:g}s, poll 0.2s)")
    assert hang["ranks"] == [0], hang["msg"]
    assert "rank 0 made no progress" in hang["msg"] and "in phase save" in hang["msg"], hang["msg"]
    assert re.search(r"at \S*step_00000010\.deleting\.[^/ ]+", hang["msg"]), hang["msg"]
    assert committed(root) == ["step_00000025", "step_00000030"]
    assert not list(root.glob("*.deleting.*"))
    assert digest(root) == digest(golden)


VERIFY_TIMEOUT_S = 3.0


def test_a_read_that_never_returns_in_the_verify_is_a_hang_naming_rank_phase_and_file(goldens, faultfs):
    golden = goldens.get("ddp", 2)
    root = rewind(golden, faultfs.mountpoint / "run", 20)
    name = largest_share(root, 20, rank=1)
    rule = faultfs.block(f"/run/step_00000020/{name}", ops=["read"])
    p = watch(root, "--hang-timeout", "60", "--verify-timeout", str(VERIFY_TIMEOUT_S))
    hang, latency = hang_on_block(root, faultfs, rule, p)
    print(f"\nread blocked -> hang verdict: {latency:.2f}s (verify timeout {VERIFY_TIMEOUT_S:g}s, poll 0.2s)")
    assert hang["ranks"] == [1], hang["msg"]
    assert "rank 1 made no progress" in hang["msg"] and "in phase verify" in hang["msg"]
    assert f"at step_00000020/{name}" in hang["msg"], hang["msg"]
    assert latency <= VERIFY_TIMEOUT_S + 2.0
    assert digest(root) == digest(golden)  # relaunched once the read was released
