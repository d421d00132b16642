"""``sbatch --nodes=2 sbatch/job.sh`` on two real slurmd nodes (tests/slurm/cluster.sh --nodes 2:
each slurmd in its own network and UTS namespace), one rank per node: the run finishes
bit-identical to an uninterrupted run of the same topology, a node's training processes killed
mid-run are relaunched by both nodes' watchdogs inside the allocation, and a preemption notice
requeues the two-node job, which resumes.

Two ranks in all, 30 steps: CI runs this on 2 cores. The reference is two 1-rank torchruns on one
c10d endpoint outside SLURM: one 2-rank node gives another digest (docs/slurm.md, *How it is tested*).
"""

from __future__ import annotations

import os
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from slurm_helpers import (
    TRAIN,
    Cluster,
    Job,
    assert_no_step_lost,
    golden_digest,
    launch_ends,
    node_of,
    running_cluster,
    submit,
)

from supervisor.format import events
from supervisor.format.eventnames import EventName
from supervisor.format.nodesummary import read_run_heartbeats
from train_ref import hold

pytestmark = pytest.mark.slurm

NODES = 2
STEPS = 30


@pytest.fixture(scope="module")
def cluster2(pytestconfig: pytest.Config) -> Iterator[Cluster]:
    with running_cluster(pytestconfig, nodes=NODES) as c:
        yield c


@pytest.fixture(scope="module")
def golden2(tmp_path_factory: pytest.TempPathFactory) -> str:
    """Two torchruns of one rank each on one c10d endpoint on this machine, never interrupted."""
    return golden_digest(tmp_path_factory.mktemp("golden2") / "run", NODES, (*TRAIN, "--steps", str(STEPS)))


def submit2(cluster: Cluster, tmp: Path, hold_at: int | None = None, **env: str) -> tuple[Job, Path]:
    return submit(
        cluster, tmp, *TRAIN, "--steps", str(STEPS), hold_at=hold_at, nodes=NODES, nproc_per_node=1, **env
    )


def test_two_nodes_run_to_completion_digest_equal(cluster2: Cluster, tmp_path: Path, golden2: str) -> None:
    job, gate = submit2(cluster2, tmp_path, hold_at=5)
    acks = job.wait_held(gate, 5)
    # One rank on each node, each in its node's namespaces (its own host name).
    assert sorted(node_of(a["pid"]) for a in acks.values()) == ["n1", "n2"], job.explain()
    hosts = {s.heartbeat.host for s in read_run_heartbeats(job.run_dir) if s.heartbeat is not None}
    assert hosts == {"n1", "n2"}, hosts
    hold.release(gate)
    info = job.wait_done()
    assert (info["JobState"], info["ExitCode"], info["Restarts"], info["NodeList"]) == (
        "COMPLETED",
        "0:0",
        "0",
        "n[1-2]",
    ), job.explain()
    out = job.output()
    assert "2 node(s): n1,n2" in out
    assert "node n1 (SLURM_NODEID=0): starting the watchdog" in out
    assert "node n2 (SLURM_NODEID=1): starting the watchdog" in out
    for node in (0, 1):
        state = events.read_state(events.state_path(job.run_dir, node))
        assert state is not None and state.launch_count == 1, job.explain()
    assert len(assert_no_step_lost(job.metrics(), STEPS)) == 1
    assert job.digest() == golden2


def test_two_nodes_one_nodes_training_killed_both_relaunch(
    cluster2: Cluster, tmp_path: Path, golden2: str
) -> None:
    """Node n2's torchrun agent and its rank are SIGKILLed while held after step 12 (after the
    step-10 checkpoint): n2's watchdog relaunches its torchrun, n1's rank loses its peer and n1's
    watchdog relaunches too; both re-form the group at the rendezvous on n1 and resume from step 10
    inside the allocation (no requeue), digest equal."""
    job, gate = submit2(cluster2, tmp_path, hold_at=12)
    acks = job.wait_held(gate, 12)
    victim = next(a["pid"] for a in acks.values() if node_of(a["pid"]) == "n2")
    agent = int(Path(f"/proc/{victim}/stat").read_text().rsplit(")", 1)[1].split()[1])
    os.kill(agent, signal.SIGKILL)
    os.kill(victim, signal.SIGKILL)
    hold.release(gate)  # before or after the relaunch reaches the hold: either way it goes on
    info = job.wait_done()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), job.explain()
    for node in (0, 1):
        evs = events.read_events(events.events_path(job.run_dir, node))
        assert any(e.get("event") == EventName.RELAUNCH for e in evs), (node, job.explain())
    assert job.digest() == golden2


def test_two_nodes_preemption_requeues_and_resumes(cluster2: Cluster, tmp_path: Path, golden2: str) -> None:
    """Held after step 8 on both nodes, notified (USR1 to the batch shell on n1; srun hands it to
    both nodes' steps), released: both ranks stop at step 9, both watchdogs exit 13, the job
    requeues once and the requeued run on the two nodes finishes, no step lost, digest equal."""
    job, gate = submit2(cluster2, tmp_path, hold_at=8)
    job.wait_held(gate, 8)
    job.notify()
    job.wait_notice_forwarded()
    hold.release(gate)
    info = job.wait_done()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "1"), job.explain()
    out = job.output()
    assert out.count(f"scontrol requeue {job.job_id}") == 1
    assert "SLURM_RESTART_COUNT=1, 2 node(s): n1,n2" in out
    assert job.requeue_state()["preempt_requeues"] == 1
    rows = job.metrics()
    assert_no_step_lost(rows, STEPS)
    assert launch_ends(rows) == [9, STEPS], job.explain()
    assert job.digest() == golden2


def hang_events(job: Job, node: int) -> list[dict]:
    return [
        e
        for e in events.read_events(events.events_path(job.run_dir, node))
        if e.get("event") == EventName.HANG
    ]


def test_two_nodes_network_partition_named_and_resumed(
    cluster2: Cluster, tmp_path: Path, golden2: str
) -> None:
    """Held after step 12 on both nodes (step 10 committed), node n2 is cut off the bridge (its
    veth's root end set down, as a dead switch port would); released, the ranks' next collective
    never finishes. Each node's watchdog names, within its timeout, the collective its rank
    entered (and no rank missing from it) and the connection to the other node that the network
    does not deliver; n2's also names its own link as down. The link comes back, both nodes
    relaunch inside the allocation, and the run finishes digest-equal."""
    timeout_s = 8.0  # a resumed launch's first step took 4-5 s here at load 10 (FSDP's first dispatch)
    watch = f"--hang-timeout {timeout_s:g} --kill-grace 1"
    job, gate = submit2(cluster2, tmp_path, hold_at=12, WATCH_OPTS=watch)
    job.wait_held(gate, 12)
    link = cluster2.node_link(2)
    subprocess.run(["ip", "link", "set", link, "down"], check=True)
    try:
        hold.release(gate)
        job.wait_until("a hang verdict on both nodes", lambda: all(hang_events(job, n) for n in (0, 1)))
    finally:
        subprocess.run(["ip", "link", "set", link, "up"], check=True)
    info = job.wait_done()
    assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), job.explain()
    assert job.digest() == golden2
    for node, other in ((0, "n2"), (1, "n1")):
        (hang, *_) = hang_events(job, node)
        (rank,) = [int(r) for r in hang["collectives"]]  # this node's one rank (the rendezvous numbers them)
        stuck = hang["collective"]
        assert stuck is not None and stuck["waiting"] == [rank] and not stuck["culprits"], hang["msg"]
        assert "every rank here entered it and none finished it: none is missing" in hang["msg"], hang["msg"]
        assert hang["late_s"] <= 0.5 and hang["stuck_s"] <= timeout_s + 0.5, hang
        assert not hang["culprits"], hang["msg"]
        assert {n["host"] for n in hang["network"]} == {other}, hang["network"]
        assert f"the network does not deliver rank {rank}'s" in hang["msg"] and f"to {other} (" in hang["msg"]
    (cut,) = {n["device_state"] for n in hang_events(job, 1)[0]["network"]}
    assert cut not in ("up", ""), cut  # n2 sees its own link down
    assert all(n["device_state"] == "up" for n in hang_events(job, 0)[0]["network"])
