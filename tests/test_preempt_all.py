"""Preemption as SLURM sends it, to the reference trainer and every example, with 0, 1 and 2
DataLoader workers per rank: SIGTERM (a preemption, a time limit, scancel) or the notice
(``--signal`` without ``B:``) to every process of the job at once (the watchdog, torchrun's agent,
the ranks, their DataLoader workers), in a random order, at a random step, while batches are being
fetched. Each run must end with the checkpoint of the last step it finished committed, every rank
exiting 75 and the watchdog 13: nothing to redo.

One short launch each, held to nothing: the signal goes once the run has logged its step (an event,
metrics.jsonl), so the moment lands wherever the ranks and their workers are then."""

from __future__ import annotations

import os
import random
import signal
import subprocess
import sys
from pathlib import Path

import pytest
from commands import REPO, supervisor_cmd
from waiting import wait_for, watchdog_events

from supervisor.format.exitcodes import Exit
from supervisor.format.layout import RunDir
from supervisor.format.metrics import parse_line
from supervisor.store import list_checkpoints
from supervisor.watch.process import descendants, kill_tree, process_table, send

pytestmark = pytest.mark.slow

TRAINERS = {
    "train_ref": ["-m", "train_ref.train", "--config", "tiny", "--parallel", "ddp"],
    "plain_loop": ["examples/plain_loop.py"],
    "stream": ["examples/stream.py"],
    "accumulate": ["examples/accumulate.py"],
}


def _steps(root: Path) -> list[int]:
    try:
        lines = RunDir.of(root).metrics.read_bytes().splitlines()
    except FileNotFoundError:
        return []
    return [r.step for line in lines if (r := parse_line(line)) is not None]


def _job(root: Path, trainer: str, workers: int) -> subprocess.Popen[bytes]:
    """The watchdog (--requeue-exit, as sbatch/job.sh runs it) over torchrun's 2 ranks; saves only
    on the preemption (--save-every far away), so the newest checkpoint is the one it wrote."""
    cmd = supervisor_cmd("watch", "--ckpt-root", str(root), "--requeue-exit", "--hang-timeout", "120", "--")
    cmd += [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    cmd += [*TRAINERS[trainer], "--ckpt-root", str(root), "--steps", "100000", "--save-every", "100000"]
    cmd += ["--seed", "0", "--num-workers", str(workers)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    out = open(root.parent / "job.log", "wb")  # noqa: SIM115 - the process holds it; closed at exit
    return subprocess.Popen(
        cmd, cwd=REPO, env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True
    )


def _preempt_all(trainer: str, workers: int, sig: signal.Signals, tmp_path: Path) -> None:
    rng = random.Random(f"{trainer}-{workers}-{sig.name}")
    root = tmp_path / "run"
    root.mkdir()
    job = _job(root, trainer, workers)
    try:
        at = rng.randint(3, 8)
        wait_for(lambda: max(_steps(root), default=0) >= at, f"step {at}", proc=job)
        table = process_table()
        pids = [job.pid, *descendants(job.pid, table)]
        rng.shuffle(pids)
        hit = set(send(pids, sig))
        log = (tmp_path / "job.log").read_text
        rc = job.wait(timeout=300)
    finally:
        if job.poll() is None:
            kill_tree(job.pid)
            job.wait()
    # the agent (the watchdog's child), the ranks (torchrun's, each a session of its own) and their
    # DataLoader workers were all signalled
    agent = {p for p in hit if table[p].ppid == job.pid}
    ranks = {p for p in hit if table[p].ppid in agent and table[p].sid == p}
    loader_workers = {p for p in hit if table[p].ppid in ranks}
    assert len(agent) == 1 and len(ranks) == 2 and len(loader_workers) == 2 * workers, (
        agent,
        ranks,
        loader_workers,
    )
    assert rc == Exit.REQUEUE_REQUESTED, log()[-4000:]
    last = max(_steps(root))
    committed = [c.step for c in list_checkpoints(root)]
    assert committed == [last], f"the last finished step {last}; committed {committed}\n{log()[-3000:]}"
    (end,) = watchdog_events(root, "launch_end")
    assert set(end["rank_exit_codes"].values()) == {Exit.REQUEUE} and len(end["rank_exit_codes"]) == 2, end
    assert end["newest_checkpoint"] == last == end["last_step"], end
    assert "killed by signal" not in log(), "a DataLoader worker died of the signal"


@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_sigterm_to_every_process_commits_the_last_finished_step(
    trainer: str, workers: int, tmp_path: Path
) -> None:
    _preempt_all(trainer, workers, signal.SIGTERM, tmp_path)


@pytest.mark.parametrize("trainer", list(TRAINERS))
def test_the_notice_to_every_process_commits_the_last_finished_step(trainer: str, tmp_path: Path) -> None:
    """SIGUSR1 reaches torchrun's agent too, which has no handler: it must not die of it."""
    _preempt_all(trainer, 2, signal.SIGUSR1, tmp_path)
