"""A real SLURM cluster (tests/slurm/cluster.sh) and ``sbatch sbatch/job.sh`` jobs on it, for
tests/test_slurm.py (one node) and tests/test_slurm_two_nodes.py (two slurmd in namespaces)."""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import pytest
from commands import REPO, free_port, supervisor_cmd
from trainer_helpers import digest
from waiting import wait_for

from supervisor import slurm
from supervisor.format import events
from supervisor.format.layout import RunDir
from supervisor.format.metrics import MetricsRecord, read_metrics
from train_ref import hold

CLUSTER_SH = REPO / "tests" / "slurm" / "cluster.sh"
JOB_SH = REPO / "sbatch" / "job.sh"
EXIT_UNAVAILABLE = 3  # cluster.sh: SLURM (or, for two nodes, namespaces) cannot be had here
SAVE_EVERY = 10
TRAIN = ("-m", "train_ref.train", "--save-every", str(SAVE_EVERY))
JOB_TIMEOUT_S = 300.0
POLL_S = 0.25
DONE_STATES = {"COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY", "BOOT_FAIL"}


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

    def node_link(self, node: int) -> str:
        """The root namespace's end of node ``node``'s veth pair (n1 is 1): setting it down cuts the
        node off the bridge (cluster.sh lists each link it made, one "link NAME" line per node, in order)."""
        links = [
            ln.split()[1] for ln in (self.dir / "net").read_text().splitlines() if ln.startswith("link ")
        ]
        return links[node - 1]

    def kill_node(self, name: str) -> None:
        """The node lost: every process of its namespace SIGKILLed, its slurmd included."""
        subprocess.run([str(CLUSTER_SH), "kill-node", str(self.dir), name], check=True, timeout=60)

    def start_node(self, name: str) -> None:
        """Its slurmd again, the node resumed and every node idle (after the job)."""
        subprocess.run([str(CLUSTER_SH), "start-node", str(self.dir), name], check=True, timeout=120)

    def log_tail(self, name: str = "slurmctld.log", lines: int = 30) -> str:
        path = self.dir / name
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:]) if path.exists() else ""


class ClusterUnavailable(Exception):
    """cluster.sh says this machine cannot run it (exit 3): the reason is the message."""


@contextmanager
def cluster(nodes: int = 1, **settings: str) -> Iterator[Cluster]:
    """tests/slurm/cluster.sh start [--nodes N], stopped (and its files removed) on the way out.
    ``settings``: cluster.sh's variables (SLURM_CI_SLURMD_TIMEOUT_S=...)."""
    env = {**os.environ, "PYTHON": sys.executable, **settings}
    cmd = [str(CLUSTER_SH), "start", "--nodes", str(nodes)]
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=600, env=env, check=False)
    if r.returncode == EXIT_UNAVAILABLE:
        raise ClusterUnavailable(
            r.stderr.strip().splitlines()[-1] if r.stderr.strip() else "cluster.sh: unavailable"
        )
    assert r.returncode == 0, f"{' '.join(cmd)} failed (exit {r.returncode}):\n{r.stderr}"
    conf = Path(r.stdout.strip().splitlines()[-1])
    try:
        yield Cluster(conf)
    finally:
        subprocess.run(
            [str(CLUSTER_SH), "stop", str(conf.parent)], capture_output=True, timeout=120, check=False
        )
        shutil.rmtree(conf.parent, ignore_errors=True)


@contextmanager
def running_cluster(pytestconfig: pytest.Config, nodes: int = 1, **settings: str) -> Iterator[Cluster]:
    """``cluster`` for a test: a skip, with the reason printed, where the machine cannot run it."""
    try:
        with cluster(nodes, **settings) as c:
            yield c
    except ClusterUnavailable as e:
        terminal = pytestconfig.pluginmanager.get_plugin("terminalreporter")
        if terminal is not None:  # visible without -rs
            terminal.write_line(f"SLURM tests ({nodes} node(s)) skipped: {e}", yellow=True)
        pytest.skip(f"no {nodes}-node SLURM cluster on this machine: {e}")


# ---------------------------------------------------------------- a job and what it left


@dataclass(frozen=True)
class Job:
    cluster: Cluster
    job_id: str
    run_dir: Path
    out: Path
    ranks: int = 2  # the world size: ranks per node times nodes

    def output(self) -> str:
        return self.out.read_text(errors="replace") if self.out.exists() else ""

    def info(self) -> dict[str, str]:
        return self.cluster.job(self.job_id)

    def explain(self) -> str:
        return (
            f"job {self.job_id}: {self.info()}\n--- job output (tail)\n{self.output()[-6000:]}"
            f"\n--- slurmctld.log (tail)\n{self.cluster.log_tail()}"
        )

    def wait_until(self, what: str, pred: Callable[[], object]) -> object:
        """``pred``'s first truthy value; fails at once if the job ends first."""

        def check() -> object:
            if got := pred():
                return got
            if self.info().get("JobState") in DONE_STATES and not (got := pred()):
                raise AssertionError(f"job ended while waiting for {what}\n{self.explain()}")
            return got

        return wait_for(check, what, timeout=JOB_TIMEOUT_S, explain=self.explain, poll=POLL_S)

    def wait_done(self) -> dict[str, str]:
        def done() -> dict[str, str] | None:
            info = self.info()
            return info if info.get("JobState") in DONE_STATES else None

        return wait_for(done, "the job to end", timeout=JOB_TIMEOUT_S, explain=self.explain, poll=POLL_S)

    def wait_held(self, gate: Path, step: int) -> dict[int, dict]:
        """Every rank of the current run held after ``step``; their acks by rank."""
        return self.wait_until(
            f"{self.ranks} ranks held after step {step}", lambda: hold.held(gate, self.ranks, step)
        )

    def wait_notice_forwarded(self) -> None:
        """The current run's watchdog forwarded a notice to its ranks (its ``preempt`` event)."""
        self.wait_until("the watchdog to forward the notice to the ranks", self.notice_forwarded)

    def notice_forwarded(self) -> bool:
        evs = events.read_events(events.events_path(self.run_dir))
        starts = [i for i, e in enumerate(evs) if e.get("event") == "watchdog_start"]
        return bool(starts) and any(e.get("event") == "preempt" for e in evs[starts[-1] :])

    def notify(self, sig: str = "USR1") -> None:
        """A preemption notice as SLURM would deliver it: the signal to the batch shell."""
        self.cluster.run("scancel", f"--signal={sig}", "--batch", self.job_id)

    def metrics(self) -> list[MetricsRecord]:
        return read_metrics(RunDir.of(self.run_dir).metrics)

    def digest(self) -> str:
        return digest(self.run_dir)

    def requeue_state(self) -> dict:
        return json.loads(slurm.requeue_path(self.run_dir).read_text())


def submit(
    cluster: Cluster,
    tmp: Path,
    *train: str,
    run_dir: Path | None = None,
    sbatch_opts: tuple[str, ...] = (),
    hold_at: int | None = None,
    nodes: int = 1,
    nproc_per_node: int = 2,
    spares: int = 0,
    **env: str,
) -> tuple[Job, Path]:
    """Submit the job on ``nodes`` nodes (``spares`` of them SPARE_NODES, with --no-kill); with
    ``hold_at``, its ranks hold after that step until the returned hold file is released or moved
    on (train_ref/hold.py)."""
    if spares:
        env = {"SPARE_NODES": str(spares), **env}
        sbatch_opts = ("--no-kill", *sbatch_opts)
    run_dir = run_dir or tmp / "run"
    out = tmp / "job.out"
    gate = tmp / "hold"
    extra = {}
    if hold_at is not None:
        hold.hold_at(gate, hold_at)
        extra[hold.ENV_HOLD_FILE] = str(gate)
    env = cluster.env(
        **env,
        PYTHON=sys.executable,
        RUN_DIR=str(run_dir),
        NPROC_PER_NODE=str(nproc_per_node),
        MAX_PREEMPT_REQUEUES="5",
        MAX_REQUEUES="1",
        NOTICE_REPEAT_S="5",
        **extra,
    )
    cmd = ["sbatch", "--parsable", f"--chdir={tmp}", f"--output={out}", f"--nodes={nodes}", *sbatch_opts]
    cmd += [str(JOB_SH), *train]
    r = subprocess.run(cmd, env=env, cwd=tmp, capture_output=True, text=True, timeout=60, check=False)
    assert r.returncode == 0, f"sbatch failed: {r.stderr}"
    ranks = (nodes - spares) * nproc_per_node
    return Job(cluster, r.stdout.strip().split(";")[0], run_dir, out, ranks), gate


def assert_no_step_lost(rows: list[MetricsRecord], steps: int) -> list[str]:
    """Every step 1..steps logged exactly once, each launch starting right after the previous one
    stopped: a preemption checkpoint at the step boundary loses nothing. Returns the launch ids."""
    assert [r.step for r in rows] == list(range(1, steps + 1)), [r.step for r in rows]
    return list(dict.fromkeys(r.launch for r in rows))


def launch_ends(rows: list[MetricsRecord]) -> list[int]:
    """The last step each launch logged, in launch order."""
    launches = dict.fromkeys(r.launch for r in rows)
    return [max(r.step for r in rows if r.launch == x) for x in launches]


# ---------------------------------------------------------------- `slurm finish` with a stand-in scontrol

JOB = {"SLURM_JOB_ID": "4242", "SLURM_JOB_NODELIST": "gpu[07-08]", "SLURM_JOB_NUM_NODES": "2"}


def knob_env(root: Path, **extra: str) -> dict[str, str]:
    return {
        "RUN_DIR": str(root),
        "MAX_PREEMPT_REQUEUES": "3",
        "MAX_REQUEUES": "2",
        "TRAIN_ARGS": "-m train_ref.train",
        **extra,
    }


FAKE_SCONTROL = """#!/bin/sh
if [ "$1" = show ]; then
  echo "JobId=4242 JobState=${FAKE_STATE:-RUNNING} Requeue=1 Restarts=${FAKE_RESTARTS:-0} Partition=ci"
  exit 0
fi
echo "$@" >> "$FAKE_SCONTROL_LOG"
[ "$1" = update ] && exit "${FAKE_SCONTROL_UPDATE_EXIT:-0}"
exit "${FAKE_SCONTROL_EXIT:-0}"
"""


def run_finish(
    tmp_path: Path, code: int, *, with_scontrol: bool = True, **env: str
) -> subprocess.CompletedProcess:
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir(exist_ok=True)
    if with_scontrol:
        (bin_dir / "scontrol").write_text(FAKE_SCONTROL)
        (bin_dir / "scontrol").chmod(0o755)
    full = {
        "PATH": f"{bin_dir}:/usr/bin:/bin" if with_scontrol else str(bin_dir),
        "FAKE_SCONTROL_LOG": str(tmp_path / "scontrol.log"),
        **JOB,
        **knob_env(tmp_path / "run"),
        **env,
    }
    return subprocess.run(
        supervisor_cmd("slurm", "finish", "--exit-code", str(code)),
        env=full,
        capture_output=True,
        text=True,
        timeout=60,
        cwd=Path(__file__).resolve().parent.parent,
    )


def scontrol_calls(tmp_path: Path) -> list[str]:
    log = tmp_path / "scontrol.log"
    return log.read_text().splitlines() if log.exists() else []


def requeues(tmp_path: Path) -> tuple[int, int]:
    d = json.loads(slurm.requeue_path(tmp_path / "run").read_text())
    return d["preempt_requeues"], d["failure_requeues"]


def golden_digest(root: Path, nodes: int, train: tuple[str, ...], timeout: float = JOB_TIMEOUT_S) -> str:
    """``nodes`` torchruns of one rank each on one c10d endpoint on this machine, never interrupted:
    the digest of an uninterrupted run of that topology (bit-exactness holds per topology)."""
    cmd = [sys.executable, "-m", "torch.distributed.run", f"--nnodes={nodes}", "--nproc-per-node=1"]
    cmd += ["--rdzv-backend=c10d", f"--rdzv-endpoint=127.0.0.1:{free_port()}", f"--rdzv-id=golden{nodes}"]
    cmd += [*train, "--ckpt-root", str(root)]
    procs = [
        subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        for _ in range(nodes)
    ]
    outs = [p.communicate(timeout=timeout)[0] for p in procs]
    assert [p.returncode for p in procs] == [0] * nodes, "\n".join(o[-3000:] for o in outs)
    return digest(root)


def node_of(pid: int) -> str:
    """The SLURM node a job process runs on (slurmd puts SLURMD_NODENAME in its tasks' environment)."""
    env = Path(f"/proc/{pid}/environ").read_bytes().split(b"\0")
    return next(e.split(b"=", 1)[1].decode() for e in env if e.startswith(b"SLURMD_NODENAME="))
