"""``sbatch sbatch/job.sh`` on a real one-node SLURM cluster (tests/slurm/cluster.sh), with the
real watchdog, torchrun and reference trainer: completion, preemption twice, the time limit, a
kill -9 inside the allocation, and a non-retryable failure.

Every fault lands while the ranks are held at a step (train_ref/hold.py; the hold file's variable
reaches the trainer through sbatch's environment), and a notice counts as delivered once the
watchdog logged its ``preempt`` event: no test hopes that a run is still training.

The cluster is started once for the session and stopped at the end, also on failure. The tests
skip only where SLURM cannot be installed (not root, no apt-get, apt-get failing); a cluster that
is installed but does not start is a failure.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurm_helpers import (
    JOB_SH,
    JOB_TIMEOUT_S,
    REPO,
    SAVE_EVERY,
    TRAIN,
    Cluster,
    Job,
    assert_no_step_lost,
    running_cluster,
    submit,
)
from trainer_helpers import digest

from supervisor.format import events
from supervisor.format.exitcodes import Exit
from train_ref import hold

pytestmark = pytest.mark.slurm

NPROC = 2
STEPS = 60
# Time-limit test: slurmctld checks time limits every 30 s and signals at the first check where at
# most 60 + 30 s are left: with --time=2 that is a check 30-60 s into each run, leaving >= 60 s
# to checkpoint. The first run is held at TIME_LIMIT_HOLD until its notice came, so the runs after
# it have at most STEPS - TIME_LIMIT_HOLD - 1 steps to do; each run does at least one (a notice
# in startup is acted on at the first step), so at most that many more requeues, within
# MAX_REQUEUES.
TIME_LIMIT_OPTS = ("--time=2", "--signal=B:USR1@60")
TIME_LIMIT_HOLD = 55


@pytest.fixture(scope="session")
def cluster(pytestconfig: pytest.Config) -> Iterator[Cluster]:
    with running_cluster(pytestconfig) as c:
        yield c


def golden_digest(root: Path, steps: int) -> str:
    """The same training as the jobs run, in one uninterrupted torchrun outside SLURM."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={NPROC}",
        *TRAIN, "--steps", str(steps), "--ckpt-root", str(root),
    ]  # fmt: skip
    r = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=JOB_TIMEOUT_S, check=False)
    assert r.returncode == 0, (
        f"golden torchrun failed ({r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}"
    )
    return digest(root)


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> str:
    return golden_digest(tmp_path_factory.mktemp("golden") / "run", STEPS)


@pytest.fixture(scope="module")
def finished(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, dict[str, str]]:
    """One plain sbatch run to completion, shared by the tests that need a finished run."""
    job, _ = submit(cluster, tmp_path_factory.mktemp("finished"), *TRAIN, "--steps", str(STEPS))
    return job, job.wait_done()


# ---------------------------------------------------------------- the tests


def test_sbatch_runs_to_completion_digest_equal(finished: tuple[Job, dict[str, str]], golden: str) -> None:
    job, info = finished
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), job.explain()
    assert job.digest() == golden
    out = job.output()
    assert "SLURM_RESTART_COUNT=0" in out
    assert f"job {job.job_id} ends: run finished" in out
    assert job.requeue_state()["requeues"] == 0
    assert len(assert_no_step_lost(job.metrics(), STEPS)) == 1


def test_preemption_twice_requeues_and_loses_no_step(cluster: Cluster, tmp_path: Path, golden: str) -> None:
    """Held after step 8, notified, released: the run stops at step 9; the requeued run is held
    after step 20, notified, released: it stops at step 21; the third run finishes."""
    job, gate = submit(cluster, tmp_path, *TRAIN, "--steps", str(STEPS), hold_at=8)
    for step, then in ((8, lambda: hold.hold_at(gate, 20)), (20, lambda: hold.release(gate))):
        job.wait_held(gate, step)
        job.notify()
        job.wait_notice_forwarded()
        then()
    info = job.wait_done()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "2"), job.explain()
    out = job.output()
    for n in (0, 1, 2):
        assert f"SLURM_RESTART_COUNT={n}," in out
    assert out.count(f"scontrol requeue {job.job_id}") == 2
    assert "preemption requeue 2 of 5" in out
    assert "requeues used: preemption 2 of 5, failure 0 of 1" in out  # the third start's line
    assert (job.requeue_state()["preempt_requeues"], job.requeue_state()["failure_requeues"]) == (2, 0)
    rows = job.metrics()
    launches = assert_no_step_lost(rows, STEPS)
    assert [max(r.step for r in rows if r.launch == x) for x in launches] == [9, 21, STEPS], job.explain()
    assert job.digest() == golden


def test_requeue_signal_urg_is_trapped_forwarded_and_acted_on(
    cluster: Cluster, tmp_path: Path, golden: str
) -> None:
    """REQUEUE_SIGNAL=URG end to end: the batch shell traps it, scancel hands it to the step (srun
    drops URG), the watchdog takes it as the notice and forwards it, the ranks checkpoint on it. SBATCH_SIGNAL
    sets the matching --signal (sbatch reads it; the job sees it), so the start-up check is quiet."""
    job, gate = submit(
        cluster,
        tmp_path,
        *TRAIN,
        "--steps",
        str(STEPS),
        hold_at=8,
        REQUEUE_SIGNAL="URG",
        SBATCH_SIGNAL="B:URG@60",
    )
    job.wait_held(gate, 8)
    job.notify("URG")
    job.wait_notice_forwarded()
    hold.release(gate)
    info = job.wait_done()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), job.explain()
    out = job.output()
    assert "SIGURG (preemption or time limit): telling the watchdogs to checkpoint" in out
    assert "preemption notice (SIGURG) forwarded" in out
    assert "--notice-signal URG" in out and "--ignore-signal URG" in out
    assert "] WARNING: job" not in out, job.explain()  # slurm start's --signal check
    rows = job.metrics()
    launches = assert_no_step_lost(rows, STEPS)
    assert [max(r.step for r in rows if r.launch == x) for x in launches] == [9, STEPS], job.explain()
    assert job.digest() == golden


def test_preemption_by_a_higher_tier_job_sigterm_checkpoints_and_requeues_once(
    cluster: Cluster, tmp_path: Path, golden: str
) -> None:
    """Real preemption (tests/slurm/cluster.sh: PreemptType=preempt/partition_prio,
    PreemptMode=REQUEUE, GraceTime on ci): a job in ci-urgent needs the node, so SLURM sends
    SIGTERM to every process of the step (not the batch shell) and would requeue the job at the end
    of the grace. The ranks, held after step 8, acknowledge the SIGTERM while held, are released,
    checkpoint step 9 and exit 75; the watchdog exits 13 within its --stop-grace; the script, still
    inside the grace, requeues the job itself (SLURM does not requeue a job that ended), exactly once."""
    job, gate = submit(cluster, tmp_path, *TRAIN, "--steps", str(STEPS), hold_at=8)
    job.wait_held(gate, 8)
    urgent = cluster.run(
        "sbatch", "--parsable", "--partition=ci-urgent", "--exclusive", f"--output={tmp_path / 'urgent.out'}",
        "--wrap", "true",
    ).strip()  # fmt: skip
    job.wait_until("the ranks to get SIGTERM while held", lambda: hold.noticed(gate, NPROC, 8))
    hold.release(gate)
    info = job.wait_done()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), job.explain()
    assert cluster.job(urgent)["JobState"] == "COMPLETED"
    out = job.output()
    assert "received SIGTERM: stopping the child (grace 30s)" in out
    assert "stopped by signal; child checkpointed: requeue" in out
    assert out.count(f"scontrol requeue {job.job_id}") == 1
    assert "not requeueing it again" not in out
    assert (job.requeue_state()["preempt_requeues"], job.requeue_state()["failure_requeues"]) == (1, 0)
    rows = job.metrics()
    launches = assert_no_step_lost(rows, STEPS)
    assert [max(r.step for r in rows if r.launch == x) for x in launches] == [9, STEPS], job.explain()
    assert job.digest() == golden


def test_array_tasks_keep_their_own_run_dirs_and_a_preempted_task_requeues_only_itself(
    cluster: Cluster, tmp_path: Path, golden: str
) -> None:
    """`sbatch --array=0-1`: each task trains in runs/ARRAYID_TASKID (job.sh's default, RUN_DIR
    unset); the tasks run one after the other (--exclusive on one node). The first to run is held
    after step 8, notified and released: it requeues ARRAYID_TASKID, the other task runs, and both
    finish bit-identical to the uninterrupted run."""
    gate = tmp_path / "hold"
    hold.hold_at(gate, 8)
    env = {k: v for k, v in cluster.env().items() if k != "RUN_DIR"}
    env.update(PYTHON=sys.executable, NPROC_PER_NODE=str(NPROC), NOTICE_REPEAT_S="5")
    env[hold.ENV_HOLD_FILE] = str(gate)
    cmd = [
        "sbatch", "--parsable", "--array=0-1", f"--chdir={tmp_path}", f"--output={tmp_path}/job_%a.out",
        str(JOB_SH), *TRAIN, "--steps", str(STEPS),
    ]  # fmt: skip
    r = subprocess.run(cmd, env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, r.stderr
    array = r.stdout.strip().split(";")[0]
    tasks = [
        Job(cluster, f"{array}_{t}", tmp_path / "runs" / f"{array}_{t}", tmp_path / f"job_{t}.out")
        for t in (0, 1)
    ]
    tasks[0].wait_until("a task held after step 8", lambda: hold.held(gate, NPROC, 8))
    running = [t for t in tasks if t.info().get("JobState") == "RUNNING"]
    assert len(running) == 1, [t.info().get("JobState") for t in tasks]
    preempted = running[0]
    preempted.notify()
    preempted.wait_notice_forwarded()
    hold.release(gate)
    for task in tasks:
        info = task.wait_done()
        restarts = "1" if task is preempted else "0"
        assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", restarts), (
            task.explain()
        )
        assert task.digest() == golden
        assert task.requeue_state()["preempt_requeues"] == int(restarts)
        assert f"run dir {task.run_dir};" in task.output()
    assert preempted.output().count(f"scontrol requeue {preempted.job_id}") == 1
    rows = preempted.metrics()
    launches = assert_no_step_lost(rows, STEPS)
    assert [max(r.step for r in rows if r.launch == x) for x in launches] == [9, STEPS]


def test_torchrun_restarts_are_refused_before_anything_runs(cluster: Cluster, tmp_path: Path) -> None:
    job, _ = submit(cluster, tmp_path, *TRAIN, "--steps", str(STEPS), TORCHRUN_OPTS="--max-restarts=3")
    info = job.wait_done()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("FAILED", f"{int(Exit.USAGE)}:0", "0")
    assert "error: TORCHRUN_OPTS has --max-restarts 3: torchrun would restart ranks" in job.output()
    assert not (job.run_dir / "metrics.jsonl").exists()


def test_time_limit_notice_checkpoints_and_requeues(cluster: Cluster, tmp_path: Path, golden: str) -> None:
    """SLURM's own --signal ahead of the time limit. The run holds after TIME_LIMIT_HOLD until the
    notice reached its ranks (a run that got it earlier, still starting, stops after a step and
    the next run holds there instead), so it is still training when the notice comes."""
    job, gate = submit(
        cluster, tmp_path, *TRAIN, "--steps", str(STEPS), sbatch_opts=TIME_LIMIT_OPTS, hold_at=TIME_LIMIT_HOLD
    )
    job.wait_held(gate, TIME_LIMIT_HOLD)
    job.wait_notice_forwarded()
    hold.release(gate)
    info = job.wait_done()
    assert info["JobState"] == "COMPLETED", job.explain()
    assert int(info["Restarts"]) >= 1, job.explain()
    out = job.output()
    assert "SIGUSR1 (preemption or time limit)" in out
    assert job.requeue_state()["preempt_requeues"] == int(info["Restarts"])
    # A notice that lands in a run's startup is acted on at its first step, so count launches loosely.
    assert len(assert_no_step_lost(job.metrics(), STEPS)) >= 2, job.explain()
    assert job.digest() == golden


def test_kill_9_of_a_rank_is_relaunched_inside_the_allocation(
    cluster: Cluster, tmp_path: Path, golden: str
) -> None:
    job, gate = submit(cluster, tmp_path, *TRAIN, "--steps", str(STEPS), hold_at=SAVE_EVERY + 2)
    os.kill(job.wait_held(gate, SAVE_EVERY + 2)[1]["pid"], signal.SIGKILL)
    hold.release(gate)  # before or after the relaunch reaches the hold: either way it goes on
    info = job.wait_done()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), job.explain()
    state = events.read_state(events.state_path(job.run_dir))
    assert state is not None
    assert state.launch_count == 2, job.explain()
    assert job.digest() == golden


def test_non_retryable_failure_ends_the_job_without_requeue(
    cluster: Cluster, tmp_path: Path, finished: tuple[Job, dict[str, str]]
) -> None:
    run_dir = tmp_path / "run"
    shutil.copytree(finished[0].run_dir, run_dir)
    job, _ = submit(cluster, tmp_path, *TRAIN, "--steps", str(STEPS), "--config", "bench", run_dir=run_dir)
    info = job.wait_done()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == (
        "FAILED",
        f"{int(Exit.CHILD_NONRETRYABLE)}:0",
        "0",
    ), job.explain()
    out = job.output()
    assert f"job {job.job_id} ends: non-retryable failure" in out
    assert "not requeueing" in out
    assert f"exited {int(Exit.MISMATCH)} (MISMATCH)" in out
    assert "scontrol requeue" not in out
    history = [h for h in job.requeue_state()["history"] if h["job_id"] == job.job_id]
    assert [h["event"] for h in history] == ["start", "end"]
    assert history[-1]["exit_code"] == Exit.CHILD_NONRETRYABLE
