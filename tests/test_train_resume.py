"""End to end: a killed, preempted or refused launch of the reference trainer, then a relaunch.

Each case compares against an uninterrupted run of the same configuration (a golden, shared by the
session): on CPU a resumed run must end with bit-identical parameters.
"""

from __future__ import annotations

import json
import os
import random
import signal
from pathlib import Path

import pytest
from trainer_helpers import (
    EMA,
    SAVE_EVERY,
    STEPS,
    committed,
    copy_run,
    digest,
    finish,
    heartbeat_exit_codes,
    kill_group,
    last_step,
    launch,
    metrics,
    rewind,
    run,
    run_ok,
    train_args,
    trainer_env,
)
from waiting import wait_for, wait_held

from supervisor.drill.corruption import Corruption, corrupt
from supervisor.format.atomic import atomic_write_json
from supervisor.format.exitcodes import Exit
from supervisor.format.layout import MANIFEST, RunDir
from supervisor.format.manifest import META_SAVE_S, read_manifest
from supervisor.store import read_latest
from supervisor.watch.process import process_table
from train_ref import hold
from train_ref.data import build_corpus

pytestmark = pytest.mark.slow


def _tree(root: Path) -> dict[str, tuple[int, int]]:
    """Every file of the run with its size and mtime; heartbeats and the lock file excepted."""
    out = {}
    for dirpath, _dirs, names in os.walk(root):
        if "heartbeats" in Path(dirpath).relative_to(root).parts:
            continue
        for n in names:
            if n == ".lock":
                continue
            st = os.stat(os.path.join(dirpath, n))
            out[os.path.relpath(os.path.join(dirpath, n), root)] = (st.st_size, st.st_mtime_ns)
    return out


# Every value of each dimension appears, and ranks x parallel is covered fully; num_workers does
# not change the result by design, so goldens run with the default (2 workers), the faulted runs
# with 0 or 2.
# One case keeps a moving average of the parameters (EMA: its shards resumed too, digest and all).
CASES = [("ddp", 2, 0, ()), ("ddp", 4, 2, ()), ("fsdp", 2, 2, EMA), ("fsdp", 4, 0, ())]


@pytest.mark.parametrize(
    ("parallel", "nproc", "workers", "extra"),
    CASES,
    ids=[f"{p}-{n}-{w}{'-ema' * bool(e)}" for p, n, w, e in CASES],
)
def test_kill9_one_worker_then_relaunch_is_bit_exact(goldens, tmp_path, parallel, nproc, workers, extra):
    golden = goldens.get(parallel, nproc, *extra)
    rng = random.Random(f"{parallel}-{nproc}-{workers}")
    kill_at, victim = rng.randint(SAVE_EVERY + 1, STEPS - 4), rng.randrange(nproc)
    root = tmp_path / "run"
    # Sync saves: step 10's checkpoint is committed before step 11 begins. An async one commits
    # at the first step boundary after its upload, which a busy machine delayed past kill_at: the
    # relaunch then started fresh (bit-exact still, but no resume to test). The async path's kill
    # is the test below.
    args = train_args(parallel, "--num-workers", str(workers), "--sync-save", *extra)
    gate = tmp_path / "hold"
    hold.hold_at(gate, kill_at)
    proc = launch(root, nproc, *args, env=trainer_env(gate))
    try:
        acks = wait_held(gate, nproc, kill_at, proc=proc)
        assert {a["memory_every"] for a in acks.values()} == {0}, acks  # no watchdog: no memory tier
        os.kill(acks[victim]["pid"], signal.SIGKILL)
        hold.release(gate)  # the others go on into a collective with the dead rank and fail
        r = finish(proc)
    finally:
        kill_group(proc)
    assert r.rc != 0, "torchrun should report the killed worker"
    killed_at = last_step(root)
    assert killed_at == kill_at, "a step completed without the killed rank"
    r2 = run_ok(root, nproc, *args)
    resumed = int(r2.output.split("resumed from step_")[1].split(",")[0])
    assert resumed <= killed_at and resumed % SAVE_EVERY == 0
    assert digest(root) == digest(golden), f"killed rank {victim} at step {killed_at}, resumed from {resumed}"


def test_a_launch_past_its_patience_is_killed_whole_and_the_test_fails_instead_of_hanging(tmp_path):
    """torchrun starts each rank in a session of its own: a launch that never ends (two ranks held
    here, as two ranks hung in a collective once were) is killed with every rank, and ``finish``
    fails the test at once instead of waiting for ever on the pipe they hold."""
    gate = tmp_path / "hold"
    hold.hold_at(gate, 2)
    proc = launch(tmp_path / "run", 2, *train_args("ddp"), env=trainer_env(gate))
    try:
        acks = wait_held(gate, 2, 2, proc=proc)
        with pytest.raises(AssertionError, match=r"torchrun did not finish in 0\.1s"):
            finish(proc, timeout=0.1)
    finally:
        kill_group(proc)
    assert proc.returncode == -signal.SIGKILL
    ranks = {a["pid"] for a in acks.values()}

    def alive() -> set[int]:
        return {p for p, info in process_table().items() if p in ranks and info.state != "Z"}

    wait_for(lambda: not alive(), f"ranks {sorted(ranks)} to be gone")


def test_kill_during_async_save_never_uses_that_checkpoint(goldens, tmp_path):
    """Held after step 20, the async save of step 20 has begun (its tmp dir exists, step 10 was
    committed first) and cannot commit: a commit starts only at a step boundary."""
    golden = goldens.get("ddp", 2)
    root = tmp_path / "run"
    args = train_args("ddp", "--async-save")
    gate = tmp_path / "hold"
    hold.hold_at(gate, 20)
    proc = launch(root, 2, *args, env=trainer_env(gate))
    try:
        pid = wait_held(gate, 2, 20, proc=proc)[1]["pid"]
        assert committed(root) == ["step_00000010"]
        assert any(n.startswith("step_00000020.tmp.") for n in os.listdir(root)), os.listdir(root)
        os.kill(pid, signal.SIGKILL)
        hold.release(gate)
        r = finish(proc)
    finally:
        kill_group(proc)
    assert r.rc != 0
    assert committed(root) == ["step_00000010"]
    assert read_latest(root) == "step_00000010"
    r2 = run_ok(root, 2, *args)
    assert "resumed from step_00000010, next step 11" in r2.output
    assert digest(root) == digest(golden)
    # step 20 was written again by the relaunch; the dead writer's tmp dir is left to the store's
    # stale-tmp retention and is never read.
    meta = read_manifest(root / "step_00000020").meta
    assert meta["launch"] == metrics(root)[-1].launch
    # The save's duration, for `slurm start`'s --signal lead check: an async save of a tiny model
    # commits at a step boundary within seconds.
    assert 0 < meta[META_SAVE_S] < 60, meta


def test_sigusr2_dumps_stacks_and_sigusr1_checkpoints_then_exits_requeue(goldens, tmp_path):
    golden = goldens.get("ddp", 2)
    root = tmp_path / "run"
    args = train_args("ddp", save_every=1000)  # no periodic save: only the preemption one
    gate = tmp_path / "hold"
    hold.hold_at(gate, 5)
    proc = launch(root, 2, *args, env=trainer_env(gate))
    try:
        pids = {r: a["pid"] for r, a in wait_held(gate, 2, 5, proc=proc).items()}
        stacks = RunDir.of(root).stack_dump(0)
        os.kill(pids[0], signal.SIGUSR2)  # a stack dump, and training goes on
        wait_for(lambda: stacks.exists() and "train_ref/train.py" in stacks.read_text(), "a stack dump")
        hold.hold_at(gate, 8)
        wait_held(gate, 2, 8, proc=proc)
        os.kill(pids[1], signal.SIGUSR1)  # one rank told, while held: all must agree at step 9
        hold.release(gate)
        r = finish(proc)
    finally:
        kill_group(proc)
    assert r.rc != 0  # torchrun reports any non-zero worker as 1; the real code is in heartbeats
    assert set(heartbeat_exit_codes(root).values()) == {Exit.REQUEUE}
    stopped = last_step(root)
    assert stopped == 9
    assert committed(root) == [f"step_{stopped:08d}"], "checkpoint is not at the last completed step"
    r2 = run_ok(root, 2, *args)
    assert f"resumed from step_{stopped:08d}, next step {stopped + 1}" in r2.output
    assert [m.step for m in metrics(root)] == list(range(1, STEPS + 1)), "steps lost or repeated"
    assert digest(root) == digest(golden)


@pytest.mark.parametrize("change", ["config", "data"])
def test_mismatch_is_refused_and_nothing_moves(goldens, tmp_path, change):
    root = copy_run(goldens.get("ddp", 2), tmp_path / "run")
    if change == "config":
        extra, words = ["--config", "bench"], "model config hash"
    else:
        text = root.parent / "corpus.txt"  # the same characters in another order
        text.write_text("\n".join(reversed(build_corpus().splitlines())) + "\n")
        extra, words = ["--corpus", str(text)], "data fingerprint"
    before = _tree(root)
    r = run(root, 2, *train_args("ddp", *extra, steps=STEPS + 10))
    assert r.rc != 0
    assert set(heartbeat_exit_codes(root).values()) == {Exit.MISMATCH}
    line = next(x for x in r.output.splitlines() if "refused" in x)
    assert words in line and line.count("sha256:") == 2, line
    assert _tree(root) == before, "a refused launch changed the run directory"
    assert not (root / "quarantine").exists()


def test_global_batch_that_does_not_split_is_a_bad_config(tmp_path):
    root = tmp_path / "run"
    r = run(root, 3, *train_args("ddp"))  # tiny's global batch of 8 over 3 ranks
    assert r.rc != 0
    assert set(heartbeat_exit_codes(root).values()) == {Exit.BAD_CONFIG}
    assert "does not split over 3 ranks" in r.output
    assert not any(n.startswith("step_") for n in os.listdir(root))


def test_a_same_size_bit_flip_is_caught_by_the_deep_check_and_resume_walks_back(goldens, tmp_path):
    """DCP has no checksums: without --verify deep (the default) this checkpoint loads silently."""
    golden = goldens.get("ddp", 2)
    root = rewind(golden, tmp_path / "run", 20)
    corrupt(root / "step_00000020", Corruption.BITFLIP)
    r = run_ok(root, 2, *train_args("ddp"))
    assert "resumed from step_00000010, next step 11" in r.output
    assert [p.name.split("-")[0] for p in (root / "quarantine").iterdir()] == ["step_00000020"]
    assert digest(root) == digest(golden)


def test_another_global_batch_is_a_one_line_refusal_even_with_allow_config_change(goldens, tmp_path):
    root = rewind(goldens.get("ddp", 2), tmp_path / "run", 20)
    path = root / "step_00000020" / MANIFEST
    m = json.loads(path.read_text())
    m["parallelism"]["global_batch"] = 16  # as if saved by a config with another global batch
    atomic_write_json(path, m)
    r = run(root, 2, *train_args("ddp", "--allow-config-change"))
    assert set(heartbeat_exit_codes(root).values()) == {Exit.BAD_CONFIG}
    assert "train_ref/" not in r.output, "a worker traceback (torchrun's own one names no file of ours)"
    line = next(x for x in r.output.splitlines() if "refused" in x)
    assert "global batch 16" in line and "global batch 8" in line, line


def test_a_preemption_notice_at_the_last_step_finishes_normally(goldens, tmp_path):
    root = rewind(goldens.get("ddp", 2), tmp_path / "run", 10)
    gate = tmp_path / "hold"
    hold.hold_at(gate, 20)  # the notice arrives while held after step 20: step 21 is the last
    proc = launch(root, 2, *train_args("ddp", steps=21), env=trainer_env(gate))
    try:
        os.kill(wait_held(gate, 2, 20, proc=proc)[0]["pid"], signal.SIGUSR1)
        hold.release(gate)
        r = finish(proc)
    finally:
        kill_group(proc)
    assert r.rc == 0, r.output[-3000:]
    assert "preemption signal at the last step 21: finishing normally" in r.output
    assert set(heartbeat_exit_codes(root).values()) == {Exit.OK}
    assert json.loads((root / "final.json").read_text())["step"] == 21
    assert committed(root)[-1] == "step_00000021"
