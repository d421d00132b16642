"""The memory tier, rank side and watchdog side, without torchrun: a plain loop on one rank
(tests/memory_worker.py) under the environment a watchdog gives its ranks, the test playing the
watchdog (``supervisor.watch.memory.Memory``: its pick before the relaunch, its events). A kill -9
right after a step that no disk checkpoint holds resumes from that very step, and the run ends
bit-identical to an uninterrupted one; a corrupt snapshot is caught (by the watchdog's check, or by
the ranks' own when the watchdog's was bypassed) and the run falls back to the disk, with the
reason."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from commands import REPO
from trainer_helpers import digest
from waiting import PATIENCE_S

from supervisor import memroom, store
from supervisor.format import memsnap
from supervisor.format.events import EventLog, events_path, read_events
from supervisor.format.heartbeat import ENV_LAUNCH_ID, ENV_RESTART_COUNT
from supervisor.format.layout import MEMORY_DIR_ENV
from supervisor.format.metrics import read_metrics
from supervisor.resumable._memory import MemoryTier
from supervisor.watch.memory import Memory

pytestmark = pytest.mark.slow

WORKER = str(REPO / "tests" / "memory_worker.py")
STEPS, SAVE_EVERY, DIE_AFTER = 24, 10, 13  # the kill lands after step 13: the disk has step 10


def command(root: Path, mem: Path | None, number: int, *args: str) -> tuple[list[str], dict[str, str]]:
    """Launch ``number`` of the worker: its argv and environment; with ``mem``, under the memory
    tier's folder."""
    env = {k: v for k, v in os.environ.items() if k not in (MEMORY_DIR_ENV, ENV_LAUNCH_ID)}
    env.update(
        {ENV_RESTART_COUNT: str(number - 1), ENV_LAUNCH_ID: f"launch-{number}", "PYTHONPATH": str(REPO)}
    )
    if mem is not None:
        env[MEMORY_DIR_ENV] = str(mem)
    argv = [
        sys.executable,
        WORKER,
        "--root",
        str(root),
        "--steps",
        str(STEPS),
        "--save-every",
        str(SAVE_EVERY),
    ]
    return [*argv, *args], env


def launch(root: Path, mem: Path | None, number: int, *args: str) -> subprocess.CompletedProcess[str]:
    """Launch ``number`` of the worker, one rank; with ``mem``, under the memory tier's folder."""
    argv, env = command(root, mem, number, *args)
    return subprocess.run(argv, env=env, capture_output=True, text=True, timeout=PATIENCE_S, cwd=REPO)


def launch_nodes(root: Path, mems: list[Path | None], number: int, *args: str) -> list[tuple[int, str]]:
    """Launch ``number`` of the worker as one rank per node (DDP over a file store), rank r under
    memory folder ``mems[r]``: each rank's exit code and stderr."""
    store, procs, logs = root.parent / f"store-{number}", [], []
    try:
        for r, mem in enumerate(mems):
            extra = ("--store", str(store), "--rank", str(r), "--world-size", str(len(mems)))
            argv, env = command(root, mem, number, *args, *extra)
            logs.append(root.parent / f"launch-{number}-rank-{r}.log")
            with open(logs[-1], "w") as err:
                procs.append(subprocess.Popen(argv, env=env, stdout=subprocess.DEVNULL, stderr=err, cwd=REPO))
        codes = [p.wait(timeout=PATIENCE_S) for p in procs]
    finally:
        for p in procs:
            p.kill()
    return [(code, log.read_text()) for code, log in zip(codes, logs, strict=True)]


def losses(root: Path) -> dict[int, float]:
    """The loss of each step, the last launch's where a step was done twice."""
    return {m.step: m.loss for m in read_metrics(root / "metrics.jsonl") if m.loss is not None}


def first_step_of(root: Path, launch: str) -> int:
    return next(m.step for m in read_metrics(root / "metrics.jsonl") if m.launch == launch)


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The same run, uninterrupted and without the memory tier."""
    root = tmp_path_factory.mktemp("golden") / "run"
    done = launch(root, None, 1)
    assert done.returncode == 0, done.stderr[-3000:]
    return root


def killed_after_unsaved_step(tmp_path: Path) -> tuple[Path, Path, Memory, int]:
    """Launch 1, killed (SIGKILL) right after a step past the last save whose snapshot is in
    memory: the run dir, the memory folder, the watchdog's side of it, the step of that snapshot
    (its metrics line may have died with the launch, held until the next exchange: _steplog.py)."""
    root, mem = tmp_path / "run", tmp_path / "memory"
    mem.mkdir()
    memory = Memory(EventLog(root, 0))
    memory.folder = mem
    died = launch(root, mem, 1, "--die-after", str(DIE_AFTER))
    assert died.returncode == -9, died.stderr[-3000:]
    last = max(ix.step for _, ix in memsnap.read_slots(mem)[0])
    assert DIE_AFTER <= last < 2 * SAVE_EVERY
    assert max(losses(root)) in (last - 1, last)
    return root, mem, memory, last


def test_a_kill_after_an_unsaved_step_resumes_from_memory_redoing_nothing_bit_identical(
    tmp_path: Path, golden: Path
) -> None:
    root, mem, memory, last = killed_after_unsaved_step(tmp_path)
    assert memory.pick(2, disk_step=SAVE_EVERY) == last
    (picked,) = [e for e in read_events(events_path(root)) if e["event"] == "memory_pick"]
    assert (picked["step"], picked["disk_step"], picked["ranks"]) == (last, SAVE_EVERY, 1)
    done = launch(root, mem, 2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from the memory snapshot of step {last}, next step {last + 1}" in done.stderr
    assert first_step_of(root, "launch-2") == last + 1  # nothing redone
    assert [m.step for m in read_metrics(root / "metrics.jsonl")] == list(range(1, STEPS + 1))
    assert losses(root) == losses(golden)  # every step's loss: the RNG streams and the data order too
    assert digest(root) == digest(golden)
    assert not (mem / memsnap.PICK).exists()  # consumed by the launch that used it


def test_a_resume_from_a_snapshot_with_nothing_left_to_train_saves_it_to_the_disk(
    tmp_path: Path, golden: Path
) -> None:
    """A relaunch that resumes from memory at its last step (killed right after it, say) trains
    nothing, and that state is on no disk: its finish saves it all the same (the memory goes with
    the watchdog; the run's last state must not). Here launch 2 ends at the snapshot's step; a
    launch from the disk alone then carries on from that save to the end, bit-identical."""
    root, mem, memory, last = killed_after_unsaved_step(tmp_path)
    assert memory.pick(2, disk_step=SAVE_EVERY) == last
    done = launch(root, mem, 2, "--steps", str(last))
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"resumed from the memory snapshot of step {last}" in done.stderr
    assert store.list_checkpoints(root)[0].step == last
    done = launch(root, None, 3)
    assert done.returncode == 0, done.stderr[-3000:]
    assert first_step_of(root, "launch-3") == last + 1
    assert digest(root) == digest(golden)


def test_a_corrupt_snapshot_is_caught_by_the_watchdog_and_the_run_falls_back_to_the_disk(
    tmp_path: Path, golden: Path
) -> None:
    """The newest snapshot damaged: the one before it (the other slot) is picked instead, the
    reason logged; both damaged: the disk."""
    root, mem, memory, last = killed_after_unsaved_step(tmp_path)
    newest, older = sorted(mem.glob("slot*/rank_00000.data"), key=_index_step, reverse=True)
    _flip(newest, newest.stat().st_size // 2)
    assert memory.pick(2, disk_step=SAVE_EVERY) == _index_step(older) < last
    _flip(older, 0)
    assert memory.pick(2, disk_step=SAVE_EVERY) is None
    (fell,) = [e for e in read_events(events_path(root)) if e["event"] == "memory_fallback"]
    assert fell["by"] == "watchdog" and fell["reason"].count("checksum") == 2, fell
    assert not list(mem.glob("slot*/*"))  # forgotten: never picked later
    done = launch(root, mem, 2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert first_step_of(root, "launch-2") == SAVE_EVERY + 1
    assert digest(root) == digest(golden)


def test_the_ranks_refuse_a_corrupt_snapshot_the_watchdog_did_not_check(tmp_path: Path, golden: Path) -> None:
    """A snapshot damaged after the watchdog's check (a pick written by hand here): every rank
    checks its own part before copying a byte; the refusal is agreed, the run resumes from the
    disk, and the watchdog logs the ranks' reason."""
    root, mem, memory, last = killed_after_unsaved_step(tmp_path)
    assert memory.pick(2, disk_step=SAVE_EVERY) == last
    (victim,) = [p for p in mem.glob("slot*/rank_00000.data") if _index_step(p) == last]
    _flip(victim, 0)
    done = launch(root, mem, 2)
    assert done.returncode == 0, done.stderr[-3000:]
    assert f"memory snapshot of step {last} not used: rank 0:" in done.stderr and "checksum" in done.stderr
    assert first_step_of(root, "launch-2") == SAVE_EVERY + 1
    assert digest(root) == digest(golden)
    memory.note_rejected()
    (fell,) = [e for e in read_events(events_path(root)) if e["event"] == "memory_fallback"]
    assert fell["by"] == "ranks" and fell["step"] == last and "checksum" in fell["reason"], fell


@pytest.fixture(scope="module")
def golden_nodes(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Two ranks (a node each), uninterrupted, without the memory tier."""
    root = tmp_path_factory.mktemp("golden_nodes") / "run"
    done = launch_nodes(root, [None, None], 1, "--save-every", "100")
    assert [code for code, _ in done] == [0, 0], done
    return root


def test_nodes_resume_from_the_newest_step_every_node_holds_when_one_holds_an_older_newest(
    tmp_path: Path, golden_nodes: Path
) -> None:
    """Two nodes of a rank each, a snapshot every 4 steps, both killed after step 15: each holds
    two committed snapshots (13 and 9). Node 1's newest removed, as a stand-in's replica one push
    behind: node 0 picks the newest, node 1 the older. The ranks agree on the older, which both
    hold (not the disk, which has nothing), node 0 forgets its newest (a future the run
    abandons), and the run ends bit-identical."""
    root, mems = tmp_path / "run", [tmp_path / "node0", tmp_path / "node1"]
    for mem in mems:
        mem.mkdir()
    died = launch_nodes(root, [*mems], 1, "--save-every", "100", "--memory-every", "4", "--die-at", "15")
    assert [code for code, _ in died] == [-9, -9], died
    held = [sorted(ix.step for _, ix in memsnap.read_slots(mem)[0]) for mem in mems]
    commit = memsnap.read_commit(mems[0])
    assert held[0] == held[1] and commit is not None and commit.step == held[0][-1], (held, commit)
    older, newest = held[0]
    (ahead,) = [p for p in mems[1].glob(f"slot*/rank_00001{memsnap.INDEX_SUFFIX}") if _step_of(p) == newest]
    ahead.unlink()
    nodes = [Memory(EventLog(root, node)) for node in range(2)]
    for node, mem in zip(nodes, mems, strict=True):
        node.folder = mem
    assert [node.pick(2, None, committed_only=True) for node in nodes] == [newest, older]
    pick = memsnap.read_pick(mems[0])
    assert pick is not None and pick.steps() == (newest, older), pick
    done = launch_nodes(root, [*mems], 2, "--save-every", "100", "--memory-every", "4")
    assert [code for code, _ in done] == [0, 0], done
    said = f"memory snapshot of step {newest}: not held by every node; resuming from step {older}"
    assert said in done[0][1], done[0][1][-3000:]
    assert f"resumed from the memory snapshot of step {older}, next step {older + 1}" in done[0][1]
    assert first_step_of(root, "launch-2") == older + 1
    assert losses(root) == losses(golden_nodes)
    assert digest(root) == digest(golden_nodes)


def _kill_and_relaunch_nodes(tmp_path: Path, committed_only: bool, *died_args: str) -> tuple[Path, list[int]]:
    """Two ranks with a memory folder each, a snapshot every step, the loss reduced each step (the
    control flags ride on it): launch 1 with ``died_args`` (every rank SIGKILLed at step 13), each
    folder's pick as its watchdog's (``committed_only``: as one of several nodes, else as the node
    of every rank), launch 2 to the end. The run dir, and the step of every metrics record."""
    root, mems = tmp_path / "run", [tmp_path / "node0", tmp_path / "node1"]
    for mem in mems:
        mem.mkdir()
    args = ("--save-every", "100", "--reduce")
    died = launch_nodes(root, [*mems], 1, *args, *died_args)
    assert [code for code, _ in died] == [-9, -9], died
    for node, mem in enumerate(mems):
        watchdog = Memory(EventLog(root, node))
        watchdog.folder = mem
        watchdog.pick(2, None, committed_only=committed_only)
    done = launch_nodes(root, [*mems], 2, *args)
    assert [code for code, _ in done] == [0, 0], done
    return root, [m.step for m in read_metrics(root / "metrics.jsonl")]


def test_a_rank_killed_mid_snapshot_leaves_no_line_of_the_step_it_lost_nothing_logged_twice(
    tmp_path: Path, golden_nodes: Path
) -> None:
    """Rank 1 is killed in the middle of its snapshot of step 13, rank 0 right after it finished
    its own: step 13 is in no snapshot every rank holds, so the run resumes from 12 and trains 13
    again. Rank 0's line of step 13 waited for the ranks' next exchange, which never came: every
    step is logged once (a line written at rank 0's own snapshot made step 13 a step logged, and
    so trained, twice)."""
    root, steps = _kill_and_relaunch_nodes(tmp_path, True, "--die-in-snapshot", "13")
    assert first_step_of(root, "launch-2") == 13
    assert steps == list(range(1, STEPS + 1))
    assert losses(root) == losses(golden_nodes)
    assert digest(root) == digest(golden_nodes)


def test_a_step_every_rank_snapshotted_whose_line_was_never_written_is_logged_by_the_relaunch(
    tmp_path: Path, golden_nodes: Path
) -> None:
    """Both ranks killed right after step 13, each copy whole, before any exchange told rank 0 so:
    its line of step 13 was held, and died with it. The relaunch resumes from step 13's snapshot,
    which every rank holds, and writes that line from the snapshot (launch 1's record, with its
    loss): every step logged once, the losses the uninterrupted run's."""
    root, steps = _kill_and_relaunch_nodes(tmp_path, False, "--die-at", "13")
    assert first_step_of(root, "launch-2") == 14
    assert steps == list(range(1, STEPS + 1))
    (relogged,) = [m for m in read_metrics(root / "metrics.jsonl") if m.step == 13]
    assert relogged.launch == "launch-1"
    assert losses(root) == losses(golden_nodes)
    assert digest(root) == digest(golden_nodes)


def test_a_resume_from_an_older_step_forgets_the_nodes_newer_snapshots(tmp_path: Path) -> None:
    """What the nodes did not all hold is a future the run abandons: never to be picked later
    (``MemoryTier.load`` forgets it on each node once the ranks resumed)."""
    tier = MemoryTier(tmp_path, rank=0, world_size=1, every=1)
    try:
        for step in (8, 12):
            tier.snapshot(step, _Small(), None, {}, {})
    finally:
        tier.close()
    held = lambda: sorted(ix.step for _, ix in memsnap.read_slots(tmp_path)[0])  # noqa: E731
    assert held() == [8, 12]
    memsnap.forget_newer(tmp_path, 8)
    assert held() == [8]


def test_a_snapshot_of_another_config_is_refused(tmp_path: Path) -> None:
    root, mem, memory, last = killed_after_unsaved_step(tmp_path)
    assert memory.pick(2, disk_step=SAVE_EVERY) == last
    done = launch(root, mem, 2, "--lr", "0.5")  # the disk refuses it too: a mismatch, exit 65
    assert "config_hash differ from this run's" in done.stderr, done.stderr[-3000:]


def _flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        byte = f.read(1)
        f.seek(offset)
        f.write(bytes([byte[0] ^ 0xFF]))


def _index_step(data: Path) -> int:
    return _step_of(data.with_suffix(memsnap.INDEX_SUFFIX))


def _step_of(index: Path) -> int:
    return memsnap.read_index(index).step


class _Small:
    """A Saveable of a model and its optimizer, as the tier takes it."""

    def __init__(self) -> None:
        self.model = torch.nn.Linear(64, 64)
        self.optimizer = torch.optim.SGD(self.model.parameters(), lr=0.1)

    def state_dict(self) -> dict[str, object]:
        return {"model": self.model.state_dict()}


def test_a_copy_off_the_loop_costs_its_start_and_how_much_the_next_steps_slowed(tmp_path: Path) -> None:
    """The interval rule sees what a snapshot takes from the loop. Off the loop that is its start
    (the capture) and how much longer than the steps with no copy near the next two took: not
    the copy's CPU time on its thread, which missed its contention with the loop (a tiny model's
    steps 7-11% slower where the rule allowed 3%), nor its wall."""
    tier = MemoryTier(tmp_path, rank=0, world_size=1)
    tier.sync = False  # as the rule decides for a copy larger than the budget
    try:
        for _ in range(3):
            tier.observe(0.010)  # steps with no copy near: 10 ms
        tier.snapshot(1, _Small(), None, {}, {})
        started_s = tier.blocked_s
        tier.observe(0.010)  # the step it snapshots ran before it
        tier.wait()
        tier.observe(0.016)  # the step beside the copy: 6 ms slower
        assert tier.copy_s == 0.0  # not settled yet: the next step may still be slower
        tier.observe(0.012)  # and the next: 2 ms
    finally:
        tier.close()
    assert not tier.broken, tier.broken
    assert memsnap.read_index(memsnap.index_path(tmp_path, 0, 0)).step == 1
    assert 0.008 < tier.copy_s <= started_s + 0.008, (tier.copy_s, started_s)  # its start: within blocked_s
    assert tier.step_s == pytest.approx(0.010)  # the slow steps are not steps with no copy near
    assert (tier.sync, tier.interval >= 27) == (False, True)  # 8 ms of 3% of 10 ms: every 27 or more
    tier.observe(0.020)  # a slow step far from any copy is the step time's, not the copy's
    assert tier.copy_s <= started_s + 0.008
    assert tier.step_s > 0.010


def test_a_rank_whose_slots_would_leave_training_short_takes_no_snapshot(tmp_path: Path, monkeypatch) -> None:
    """On by default, the tier must never take what training needs: two slots of every local rank
    must leave a quarter of the node's memory (or its cgroup's). A node with 4 MiB left of 8 (a
    stand-in for a large model on a full node; the bound is read in memroom, tested there) gets no
    data file, the tier off with the reason, and training goes on."""
    monkeypatch.setenv("LOCAL_WORLD_SIZE", "2")
    monkeypatch.setattr(memroom, "room", lambda: memroom.Room(4 << 20, 8 << 20, "the node"))
    tier = MemoryTier(tmp_path, rank=0, world_size=2, every=1)
    try:
        tier.snapshot(1, _Small(), None, {}, {})  # 2 slots x 16.9 KB x 2 ranks: fits
        assert not tier.broken, tier.broken
        big = _Small()
        big.model = torch.nn.Linear(512, 512)  # 2 slots x 1 MiB x 2 ranks, of 4 MiB with 2 to keep
        tier.snapshot(2, big, None, {}, {})
    finally:
        tier.close()
    assert tier.broken.startswith("2 slots of "), tier.broken
    assert (
        "for each of this node's 2 ranks" in tier.broken
        and "less than the 25% kept for training" in tier.broken
    )
    assert [ix.step for _, ix in memsnap.read_slots(tmp_path)[0]] == [1]
