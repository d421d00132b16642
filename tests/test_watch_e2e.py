"""End to end: the real reference trainer under torchrun (tiny config, 2 ranks, gloo on CPU),
supervised by ``python -m supervisor watch``; real kill -9, SIGSTOP, a corrupted checkpoint and a
killed "node". Each interrupted run must end with final.json's params_sha256 equal to an
uninterrupted run's. Every fault lands while the ranks are held after step 25 (train_ref/hold.py),
so the run is still running by construction."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from commands import free_port
from trainer_helpers import digest
from waiting import wait_for, wait_held, watchdog_events
from watch_helpers import events, finish, leftovers, start_watchdog

from supervisor import store
from supervisor.drill.corruption import Corruption, corrupt
from supervisor.format.exitcodes import Exit
from supervisor.format.layout import RunDir
from supervisor.format.metrics import read_metrics
from train_ref import hold

pytestmark = pytest.mark.slow

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
STEPS, SAVE_EVERY = 60, 10
HOLD_AT = 25
TRAIN = ["-m", "train_ref.train", "--steps", str(STEPS), "--save-every", str(SAVE_EVERY), "--seed", "3"]
# A train-phase silence of a minute is a hang, never load (steps take ~0.1 s); the hang test sets
# its own, shorter one.
WATCH = ["--hang-timeout", "60", "--poll-interval", "0.2", "--kill-grace", "20", "--dump-wait", "2"]
WATCH += ["--backoff-initial", "0.5", "--backoff-jitter", "0"]


def standalone(root: Path) -> list[str]:
    return [TORCHRUN, "--standalone", "--nproc-per-node=2", *TRAIN, "--ckpt-root", str(root)]


def start_watch(root: Path, command: list[str], *extra: str, gate: Path | None = None) -> subprocess.Popen:
    return start_watchdog(root, [*WATCH, *extra], command, gate)


def held_at(tmp_path: Path) -> Path:
    """A hold file asking every rank to hold after step HOLD_AT."""
    gate = tmp_path / "hold"
    hold.hold_at(gate, HOLD_AT)
    return gate


@pytest.fixture(scope="module")
def reference(tmp_path_factory) -> str:
    root = tmp_path_factory.mktemp("reference") / "run"
    rc, out = finish(start_watch(root, standalone(root)))
    assert rc == Exit.OK, out[-3000:]
    return digest(root)


def test_kill9_worker_resumes_digest_equal(tmp_path, reference):
    root, gate = tmp_path / "run", held_at(tmp_path)
    p = start_watch(root, standalone(root), gate=gate)
    os.kill(wait_held(gate, 2, HOLD_AT, proc=p)[1]["pid"], signal.SIGKILL)
    hold.release(gate)  # before or after the relaunch reaches the hold: either way it goes on
    rc, out = finish(p)
    assert rc == Exit.OK, out[-3000:]
    ends = [e for e in events(root) if e["event"] == "launch_end"]
    assert [e["outcome"] for e in ends] == ["crash", "done"], out[-3000:]
    assert digest(root) == reference
    assert not leftovers(root)


def test_kill9_after_an_unsaved_step_resumes_from_the_memory_tier_redoing_nothing(tmp_path, reference):
    """The memory tier, on by default (no flag): a kill -9 of a rank held after step 25 (the disk's
    newest: step 20) relaunches from the memory snapshot the watchdog picked and verified, newer
    than the disk's; the relaunch's first step is the one after it (nothing redone), the run ends
    bit-identical, and the memory folder is gone at the end."""
    root, gate = tmp_path / "run", held_at(tmp_path)
    # A snapshot every step: the 3% rule's interval grows with the load (a busy loop on each core
    # made it 16 steps, the newest snapshot at the kill step 17, older than the disk's 20).
    p = start_watch(root, [*standalone(root), "--memory-every", "1"], gate=gate)
    acks = wait_held(gate, 2, HOLD_AT, proc=p)
    assert [a["memory_every"] for a in acks.values()] == [1, 1], acks  # Resumable.memory_every
    os.kill(acks[1]["pid"], signal.SIGKILL)
    hold.release(gate)
    rc, out = finish(p)
    assert rc == Exit.OK, out[-3000:]
    evs = events(root)
    (folder,) = [e["path"] for e in evs if e["event"] == "memory_dir"]
    (pick,) = [e for e in evs if e["event"] == "memory_pick"]
    assert pick["disk_step"] is not None and pick["disk_step"] < pick["step"] <= HOLD_AT, pick
    relaunch = [e["launch_id"] for e in evs if e["event"] == "launch"][1]
    first = next(m.step for m in read_metrics(RunDir.of(root).metrics) if m.launch == relaunch)
    assert first == pick["step"] + 1
    assert digest(root) == reference
    assert folder and not Path(folder).exists()
    assert not leftovers(root)


def test_kill9_of_rank0_is_the_root_cause_the_peers_error_its_consequence(tmp_path):
    """kill -9 of rank 0 (held after step 25, so by construction while the run runs): it records
    nothing; rank 1, released, dies of the lost peer with an exception (its heartbeat and @record).
    The root cause is rank 0, killed by a signal; rank 1's error a consequence; `status` says so.
    (--dead-rank-grace 60: the watchdog waits for rank 1's own end rather than killing it.)"""
    root, gate = tmp_path / "run", held_at(tmp_path)
    extra = ("--max-restarts", "0", "--dead-rank-grace", "60")
    p = start_watch(root, standalone(root), *extra, gate=gate)
    victim = wait_held(gate, 2, HOLD_AT, proc=p)[0]["pid"]
    os.kill(victim, signal.SIGKILL)
    hold.release(gate)
    rc, out = finish(p)
    assert rc == Exit.BUDGET_EXHAUSTED, out[-3000:]
    (cause,) = [e for e in events(root) if e["event"] == "root_cause"]
    assert (cause["rank"], cause["pid"], cause["signal"]) == (0, victim, True)
    at = cause["step"]  # its last heartbeat's (written at most once a second)
    assert cause["how"].startswith("killed by"), cause["how"]
    (then,) = cause["consequences"]
    assert then.startswith("rank 1 (pid ") and "Error" in then, then
    text = subprocess.run(
        [sys.executable, "-m", "supervisor", "status", "--ckpt-root", str(root)],
        capture_output=True,
        text=True,
        timeout=60,
    ).stdout
    assert f"root cause rank 0 (pid {victim}) at step {at}: killed by" in text, text
    assert "then, as a consequence: rank 1" in text and not leftovers(root)


def test_kill9_relaunch_taken_from_the_standby_digest_equal(tmp_path, reference):
    """--standby: once launch 1 trains, launch 2 is started ahead and its ranks wait, imports
    done; after a kill -9 the relaunch is that process (no new torchrun), its recovery shows the
    process start and the imports as already done (0 s), and the run ends bit-identical."""
    root, gate = tmp_path / "run", held_at(tmp_path)
    p = start_watch(root, standalone(root), "--standby", gate=gate)
    victim = wait_held(gate, 2, HOLD_AT, proc=p)[1]["pid"]
    spare = wait_for(lambda: watchdog_events(root, "standby"), "a standby launch", proc=p)[0]
    ready = RunDir.of(root).launch_dir(spare["launch_id"])
    wait_for(lambda: len(list(ready.glob("ready_*"))) == 2, "the standby's 2 ranks ready", proc=p)
    os.kill(victim, signal.SIGKILL)
    hold.release(gate)
    rc, out = finish(p)
    assert rc == Exit.OK, out[-3000:]
    evs = events(root)
    second = [e for e in evs if e["event"] == "launch"][1]
    assert (second["launch_id"], second["pid"]) == (spare["launch_id"], spare["pid"])
    (rec,) = [e for e in evs if e["event"] == "recovery"]
    assert rec["phases"]["worker_started"] == 0 and rec["phases"]["torch_imported"] == 0, rec
    assert "first_step" in rec["phases"]
    assert digest(root) == reference
    assert not leftovers(root)  # nor the standby made for a launch 3 that was never needed


def test_sigstop_worker_detected_dumped_resumed(tmp_path, reference):
    """Rank 1 is stopped while held and stays held until its launch ended (the stack dump's SIGCONT
    lets it run, but not past the hold), so the stopped rank is the only silent one."""
    root, gate = tmp_path / "run", held_at(tmp_path)
    # Held ranks act on the watchdog's SIGTERM only once released: no grace to wait for here.
    p = start_watch(root, standalone(root), "--hang-timeout", "10", "--kill-grace", "1", gate=gate)
    pid = wait_held(gate, 2, HOLD_AT, proc=p)[1]["pid"]
    os.kill(pid, signal.SIGSTOP)
    wait_for(lambda: watchdog_events(root, "launch_end"), "the hung launch to end", proc=p)
    hold.release(gate)
    rc, out = finish(p)
    assert rc == Exit.OK, out[-3000:]
    evs = events(root)
    hang = [e for e in evs if e["event"] == "hang"]
    assert len(hang) == 1 and 1 in hang[0]["stopped_ranks"], hang
    dumps = [e for e in evs if e["event"] == "stack_dump" and e["rank"] == 1]
    assert dumps and "train_ref" in (dumps[0]["stacks"] or ""), dumps
    assert digest(root) == reference
    assert not leftovers(root)


def test_corrupt_newest_while_down_then_resume(tmp_path, reference):
    """Stop the run (SIGTERM: the trainer checkpoints and exits), flip a byte in the newest
    checkpoint, start the watchdog again: --verify deep quarantines it and the run resumes from
    the one before."""
    root, gate = tmp_path / "run", held_at(tmp_path)
    p = start_watch(root, standalone(root), gate=gate)
    wait_held(gate, 2, HOLD_AT, proc=p)
    p.send_signal(signal.SIGTERM)
    # The watchdog logs "stop", then signals the tree; the trainer checkpoints at its next step.
    wait_for(lambda: watchdog_events(root, "stop"), "the watchdog to stop the launch", proc=p)
    hold.release(gate)
    rc, out = finish(p)
    assert rc == 128 + signal.SIGTERM, out[-3000:]
    newest = store.list_checkpoints(root)[0]
    corrupt(newest.path, Corruption.BITFLIP)
    rc, out = finish(start_watch(root, standalone(root), "--verify", "deep"))
    assert rc == Exit.OK, out[-3000:]
    quarantined = [e for e in events(root) if e["event"] == "quarantine"]
    assert [e["checkpoint"] for e in quarantined] == [newest.name]
    assert "checksum" in quarantined[0]["why"]
    assert digest(root) == reference


def two_nodes(root: Path, gate: Path | None = None) -> list[subprocess.Popen]:
    """Two watchdogs, each with a torchrun --nnodes=2 --nproc-per-node=1 on one c10d endpoint."""
    port = free_port()
    cmd = [TORCHRUN, "--nnodes=2", "--nproc-per-node=1", "--rdzv-backend=c10d"]
    cmd += [f"--rdzv-endpoint=127.0.0.1:{port}", "--rdzv-id=e2e", "--max-restarts=0"]
    cmd += [*TRAIN, "--ckpt-root", str(root)]
    return [start_watch(root, cmd, "--node-rank", str(n), gate=gate) for n in (0, 1)]


@pytest.fixture(scope="module")
def reference_two_nodes(tmp_path_factory) -> str:
    """The same job as two 1-rank nodes: its digest differs from one 2-rank node's (seen here:
    the topology changes the result), so an interrupted two-node run is compared with this."""
    root = tmp_path_factory.mktemp("reference2") / "run"
    for rc, out in [finish(p) for p in two_nodes(root)]:
        assert rc == Exit.OK, out[-3000:]
    return digest(root)


def test_two_nodes_kill_one_node_tree(tmp_path, reference_two_nodes):
    """Node 1's torchrun and its worker are SIGKILLed; both watchdogs relaunch and the job ends
    digest-equal."""
    root, gate = tmp_path / "run", held_at(tmp_path)
    nodes = two_nodes(root, gate)
    try:
        victim = wait_held(gate, 2, HOLD_AT, proc=nodes[1])[1]["pid"]
        agent = int(Path(f"/proc/{victim}/stat").read_text().rsplit(")", 1)[1].split()[1])
        os.kill(agent, signal.SIGKILL)
        os.kill(victim, signal.SIGKILL)
        hold.release(gate)
        results = [finish(p) for p in nodes]
    finally:
        for p in nodes:
            if p.poll() is None:
                p.send_signal(signal.SIGTERM)
    for rc, out in results:
        assert rc == Exit.OK, out[-3000:]
    assert any(e["event"] == "relaunch" for e in events(root, 1))
    assert digest(root) == reference_two_nodes
    assert not leftovers(root)
