"""``sbatch sbatch/job.sh`` on a real one-node SLURM cluster (tests/slurm/cluster.sh), with the
real watchdog, torchrun and reference trainer: completion, preemption twice, the time limit, a
kill -9 inside the allocation, and a non-retryable failure.

The cluster is started once for the session and stopped at the end, also on failure. The tests
skip only where SLURM cannot be installed (not root, no apt-get, apt-get failing); a cluster that
is installed but does not start is a failure.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import statistics
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from supervisor import events, slurm
from supervisor.exitcodes import Exit
from supervisor.heartbeat import read_heartbeats

pytestmark = pytest.mark.slurm

REPO = Path(__file__).resolve().parent.parent
CLUSTER_SH = REPO / "tests" / "slurm" / "cluster.sh"
JOB_SH = REPO / "sbatch" / "job.sh"
EXIT_UNAVAILABLE = 3  # cluster.sh: SLURM cannot be installed here
NPROC = 2
STEPS = 60
SAVE_EVERY = 10
TRAIN = ("-m", "train_ref.train", "--save-every", str(SAVE_EVERY))
JOB_TIMEOUT_S = 300.0
POLL_S = 0.25
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}
# Time-limit test: --time=1 with the notice when 30+7 s are left, i.e. at slurmctld's first 30 s
# check at least 23 s into the run. Restarting slurmctld just before the submit puts that check
# ~25 s into the first run, while a requeued run (which starts >= 5 s, cred_expire, after the
# check that requeued it) reaches its next check before 23 s and its second one at ~50 s.
TIME_LIMIT_SIGNAL = "--signal=B:USR1@7"
TIME_LIMIT_TRAIN_S = 25.0
TIME_LIMIT_SPEEDUP = 2.0


@dataclass(frozen=True)
class Cluster:
    conf: Path

    @property
    def dir(self) -> Path:
        return self.conf.parent

    def env(self, **extra: str) -> dict[str, str]:
        base = {k: v for k, v in os.environ.items() if not k.startswith(("SLURM_", "SBATCH_", "SRUN_"))}
        return {**base, "SLURM_CONF": str(self.conf), **extra}

    def run(self, *cmd: str) -> str:
        r = subprocess.run(cmd, env=self.env(), capture_output=True, text=True, timeout=60, check=False)
        assert r.returncode == 0, f"{' '.join(cmd)} failed ({r.returncode}): {r.stderr.strip()}"
        return r.stdout

    def job(self, job_id: str) -> dict[str, str]:
        return dict(re.findall(r"(\w+)=(\S*)", self.run("scontrol", "show", "job", "-o", job_id)))

    def log_tail(self, name: str = "slurmctld.log", lines: int = 30) -> str:
        path = self.dir / name
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""

    def restart_ctld(self) -> None:
        r = subprocess.run(
            [str(CLUSTER_SH), "restart-ctld", str(self.dir)], capture_output=True, text=True, timeout=120
        )
        assert r.returncode == 0, f"cluster.sh restart-ctld failed:\n{r.stderr}"


@pytest.fixture(scope="session")
def cluster(pytestconfig: pytest.Config) -> Iterator[Cluster]:
    env = {**os.environ, "PYTHON": sys.executable}
    r = subprocess.run([str(CLUSTER_SH), "start"], capture_output=True, text=True, timeout=600, env=env)
    if r.returncode == EXIT_UNAVAILABLE:
        reason = r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "cluster.sh: unavailable"
        terminal = pytestconfig.pluginmanager.get_plugin("terminalreporter")
        if terminal is not None:  # visible without -rs
            terminal.write_line(f"SLURM tests skipped: {reason}", yellow=True)
        pytest.skip(f"no SLURM cluster on this machine: {reason}")
    assert r.returncode == 0, f"tests/slurm/cluster.sh start failed (exit {r.returncode}):\n{r.stderr}"
    conf = Path(r.stdout.strip().splitlines()[-1])
    try:
        yield Cluster(conf)
    finally:
        subprocess.run([str(CLUSTER_SH), "stop", str(conf.parent)], capture_output=True, timeout=120)
        shutil.rmtree(conf.parent, ignore_errors=True)


# ---------------------------------------------------------------- a job and what it left


@dataclass(frozen=True)
class Job:
    cluster: Cluster
    job_id: str
    run_dir: Path
    out: Path

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def info(self) -> dict[str, str]:
        return self.cluster.job(self.job_id)

    def explain(self) -> str:
        return (
            f"job {self.job_id}: {self.info()}\n--- job output (tail)\n{self.output()[-6000:]}"
            f"\n--- slurmctld.log (tail)\n{self.cluster.log_tail()}"
        )

    def wait_until(self, what: str, pred: Callable[[], bool], timeout: float = JOB_TIMEOUT_S) -> None:
        deadline = time.monotonic() + timeout
        while not pred():
            if time.monotonic() > deadline:
                raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}\n{self.explain()}")
            if self.info().get("JobState") in DONE_STATES and not pred():
                raise AssertionError(f"job ended while waiting for {what}\n{self.explain()}")
            time.sleep(POLL_S)

    def wait_done(self) -> dict[str, str]:
        deadline = time.monotonic() + JOB_TIMEOUT_S
        while (info := self.info()).get("JobState") not in DONE_STATES:
            if time.monotonic() > deadline:
                raise AssertionError(f"job not done after {JOB_TIMEOUT_S:.0f}s\n{self.explain()}")
            time.sleep(POLL_S)
        return info

    def notify(self) -> None:
        """A preemption notice as SLURM would deliver it: SIGUSR1 to the batch shell."""
        self.cluster.run("scancel", "--signal=USR1", "--batch", self.job_id)

    def metrics(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        rows = []
        for line in path.read_text().splitlines():
            try:
                rows.append(json.loads(line))
            except ValueError:
                continue  # a line being written
        return rows

    def last_step(self) -> int:
        rows = self.metrics()
        return rows[-1]["step"] if rows else 0

    def digest(self) -> str:
        return json.loads((self.run_dir / "final.json").read_text())["params_sha256"]

    def requeue_state(self) -> dict:
        return json.loads(slurm.requeue_path(self.run_dir).read_text())


def submit(
    cluster: Cluster, tmp: Path, *train: str, run_dir: Path | None = None, sbatch_opts: tuple[str, ...] = ()
) -> Job:
    run_dir = run_dir or tmp / "run"
    out = tmp / "job.out"
    env = cluster.env(
        PYTHON=sys.executable,
        RUN_DIR=str(run_dir),
        NPROC_PER_NODE=str(NPROC),
        MAX_REQUEUES="5",
        NOTICE_REPEAT_S="5",
    )
    cmd = ["sbatch", "--parsable", f"--chdir={tmp}", f"--output={out}", *sbatch_opts, str(JOB_SH), *train]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, f"sbatch failed: {r.stderr}"
    return Job(cluster, r.stdout.strip().split(";")[0], run_dir, out)


def assert_no_step_lost(rows: list[dict], steps: int) -> list[str]:
    """Every step 1..steps logged exactly once, each launch starting right after the previous one
    stopped: a preemption checkpoint at the step boundary loses nothing. Returns the launch ids."""
    assert [r["step"] for r in rows] == list(range(1, steps + 1)), [r["step"] for r in rows]
    return list(dict.fromkeys(r["launch"] for r in rows))


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
    return json.loads((root / "final.json").read_text())["params_sha256"]


@pytest.fixture(scope="module")
def golden(tmp_path_factory: pytest.TempPathFactory) -> str:
    return golden_digest(tmp_path_factory.mktemp("golden") / "run", STEPS)


@pytest.fixture(scope="module")
def finished(cluster: Cluster, tmp_path_factory: pytest.TempPathFactory) -> tuple[Job, dict[str, str]]:
    """One plain sbatch run to completion, shared by the tests that need a finished run."""
    job = submit(cluster, tmp_path_factory.mktemp("finished"), *TRAIN, "--steps", str(STEPS))
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
    job = submit(cluster, tmp_path, *TRAIN, "--steps", str(STEPS))
    job.wait_until("training (step >= 8)", lambda: job.last_step() >= 8)
    job.notify()
    job.wait_until("the requeued run", lambda: job.info().get("Restarts") == "1")
    first_stop = job.last_step()
    job.wait_until(
        f"training past the resume point (step >= {first_stop + 8})",
        lambda: job.last_step() >= first_stop + 8,
    )
    job.notify()
    info = job.wait_done()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "2"), job.explain()
    out = job.output()
    for n in (0, 1, 2):
        assert f"SLURM_RESTART_COUNT={n}," in out
    assert out.count(f"scontrol requeue {job.job_id}") == 2
    assert job.requeue_state()["requeues"] == 2
    assert len(assert_no_step_lost(job.metrics(), STEPS)) == 3, job.explain()
    assert job.digest() == golden


def test_time_limit_notice_checkpoints_and_requeues(
    cluster: Cluster, tmp_path: Path, finished: tuple[Job, dict[str, str]]
) -> None:
    # Size the run from the step time measured in the finished run (x1.3 for saves), with room for
    # a machine that got faster since: the run must still be training at the first check.
    step_s = statistics.median(r["step_time"] for r in finished[0].metrics()) * 1.3
    steps = max(STEPS, round(TIME_LIMIT_SPEEDUP * TIME_LIMIT_TRAIN_S / step_s))
    cluster.restart_ctld()
    job = submit(
        cluster, tmp_path, *TRAIN, "--steps", str(steps), sbatch_opts=("--time=1", TIME_LIMIT_SIGNAL)
    )
    info = job.wait_done()
    assert info["JobState"] == "COMPLETED", job.explain()
    assert int(info["Restarts"]) >= 1, job.explain()
    out = job.output()
    assert "SIGUSR1 (preemption or time limit)" in out
    assert job.requeue_state()["requeues"] == int(info["Restarts"])
    # A notice that lands in a run's startup is acted on at its first step, so count launches loosely.
    assert len(assert_no_step_lost(job.metrics(), steps)) >= 2, job.explain()
    assert json.loads((job.run_dir / "final.json").read_text())["step"] == steps


def test_kill_9_of_a_rank_is_relaunched_inside_the_allocation(
    cluster: Cluster, tmp_path: Path, golden: str
) -> None:
    job = submit(cluster, tmp_path, *TRAIN, "--steps", str(STEPS))
    job.wait_until("a step past the first checkpoint", lambda: job.last_step() > SAVE_EVERY + 1)
    victim = next(s.heartbeat for s in read_heartbeats(job.run_dir) if s.rank == 1 and s.heartbeat)
    os.kill(victim.pid, signal.SIGKILL)
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
    job = submit(cluster, tmp_path, *TRAIN, "--steps", str(STEPS), "--config", "bench", run_dir=run_dir)
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
