"""The hot-spare scenario, once, for its test (tests/test_slurm_spares.py) and its benchmark
(tests/spare_bench.py): a job of 2 training nodes and 1 spare on the 4-node test cluster loses a
training node, and the spare takes its place inside the allocation."""

from __future__ import annotations

import time
from dataclasses import dataclass
from pathlib import Path

from slurm_helpers import DONE_STATES, TRAIN, Cluster, Job, node_of, submit

from supervisor.format import events
from supervisor.format import eventtypes as ev
from supervisor.format.badnodes import read_bad_nodes
from supervisor.format.eventtypes import Logged
from supervisor.format.heartbeat import Mark
from supervisor.format.layout import RunDir
from supervisor.format.metrics import read_metrics
from supervisor.format.nodesummary import read_run_heartbeats
from supervisor.format.roster import read_roster
from train_ref import hold

NODES = 4  # the test cluster: 3 for the spare job, a fourth for the bad-node job's requeue
STEPS = 30
HOLD_AT = 12  # the ranks hold after this step until the node is lost
DDP = (*TRAIN, "--parallel", "ddp", "--num-workers", "0", "--steps", str(STEPS))
SLURMD_TIMEOUT_S = "20"  # cluster.sh: a lost node's job can end


def job_events(job: Job) -> list[Logged[ev.Event]]:
    """The coordinator's events (the job's log), typed."""
    return events.read_logged(RunDir.of(job.run_dir).job_events)


def generations(job: Job) -> list[Logged[ev.Event]]:
    """The roster generations the coordinator wrote (not its stop)."""
    return [e for e in job_events(job) if isinstance(e.event, ev.Generation) and not e.event.stop]


def first_step_after(job: Job, t: float) -> float | None:
    """When the first rank of the launch that followed ``t`` made its first step (its heartbeat's
    mark), from the node summaries; None when none did."""
    marks = [
        s.heartbeat.marks.get(Mark.FIRST_STEP.value, 0.0)
        for s in read_run_heartbeats(job.run_dir)
        if s.heartbeat is not None
    ]
    after = [m for m in marks if m > t]
    return min(after) if after else None


@dataclass(frozen=True)
class NodeLoss:
    """What one node loss cost: seconds from the loss to the next launch's first step, and the steps
    trained twice (rank 0's metrics records beyond the run's steps: each step logs once per launch
    that makes it); ``memory_every``: the memory tier's snapshot interval the ranks had agreed when
    the node was lost (their hold acks; 0: the tier off), the budget's unit."""

    recovery_s: float
    redone: int
    memory_every: int

    @property
    def resumed_from(self) -> int:
        return HOLD_AT - self.redone

    @property
    def within_interval(self) -> bool:
        """The issue's budget: at most one snapshot interval redone (the tier on)."""
        return self.memory_every > 0 and self.redone <= self.memory_every


def lose_a_node_to_the_spare(cluster: Cluster, tmp: Path, golden: str) -> NodeLoss:
    """n2 of a job on n1, n2 (n3 its spare) is lost while the ranks hold after step 12: every
    process of its namespace SIGKILLed, its slurmd too, at once (the memory tier on, by default:
    its buddy may not keep its newest snapshot yet). Asserts that n3 took n2's node rank with no
    requeue, the job completed, its digest is ``golden`` and n2 has its incident; returns what the
    loss cost. n2 is started again on the way out."""
    job, gate = submit(
        cluster, tmp, *DDP, hold_at=HOLD_AT, nodes=3, nproc_per_node=1, spares=1, NODE_TIMEOUT_S="5"
    )
    try:
        acks = job.wait_held(gate, HOLD_AT)
        where = {node_of(a["pid"]) for a in acks.values()}
        assert where == {"n1", "n2"}, job.explain()  # trains on the first two, n3 waits
        lost_at = time.time()
        cluster.kill_node("n2")
        hold.release(gate)
        info = job.wait_done()
        assert (info["JobState"], info["ExitCode"], info["Restarts"]) == ("COMPLETED", "0:0", "0"), (
            job.explain()
        )
        roster = read_roster(job.run_dir)
        assert roster is not None and roster.stop and roster.exit_code == 0, job.explain()
        gens = [g.event for g in generations(job)]
        assert [(g.generation, g.nodes, g.replaced) for g in gens] == [
            (1, ["n1", "n2"], {}),
            (2, ["n1", "n3"], {"n2": "n3"}),
        ], job.explain()
        lost = [e.event.host for e in job_events(job) if isinstance(e.event, ev.NodeLost)]
        assert lost == ["n2"], job.explain()
        assert "scontrol requeue" not in job.output()
        assert job.digest() == golden
        bad = read_bad_nodes(job.run_dir)
        assert bad is not None and [(i.host, i.why) for i in bad.incidents] == [("n2", ("lost",))]
        first = first_step_after(job, lost_at)
        assert first is not None, job.explain()
        redone = len(read_metrics(RunDir.of(job.run_dir).metrics)) - STEPS
        return NodeLoss(first - lost_at, redone, max(int(a.get("memory_every", 0)) for a in acks.values()))
    finally:
        if job.info().get("JobState") not in DONE_STATES:
            cluster.run("scancel", job.job_id)
        job.wait_done()
        cluster.start_node("n2")
