"""Hot spares and bad nodes without a cluster: the roster's decisions (supervisor/slurm/spares.py),
which host a failure is pinned on (incidents.py), the records (roster.json, bad_nodes.json) and
the group's facts the ranks join with, the knobs and launch command, `status`'s lines, and
``slurm finish`` excluding (and draining) bad nodes against a stand-in ``scontrol``."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from slurm_helpers import JOB, knob_env, run_finish, scontrol_calls

from supervisor import slurm
from supervisor.format import eventtypes as ev
from supervisor.format.badnodes import (
    BadNodes,
    Incident,
    parse_bad_nodes,
    read_bad_nodes,
    write_bad_nodes,
)
from supervisor.format.eventnames import EventName
from supervisor.format.events import EventLog, read_events
from supervisor.format.eventtypes import Logged
from supervisor.format.exitcodes import Exit
from supervisor.format.roster import (
    GroupFacts,
    Roster,
    parse_roster,
    read_roster,
    write_roster,
)
from supervisor.report import build_report
from supervisor.slurm import JobEnv, Knobs, SlurmError
from supervisor.slurm.exclude import exclusion_list
from supervisor.slurm.incidents import Failure, attribute, failure_of, slurm_down, straggler_incident
from supervisor.slurm.spares import NodeView, first_roster, job_exit, lost_now, next_roster

HOSTS = ("n1", "n2", "n3", "n4")


def roster(gen: int = 1, nodes: tuple[int, ...] = (0, 1), spares: tuple[int, ...] = (2,)) -> Roster:
    return Roster("7.0", gen, HOSTS[:3], nodes, spares, 20007)


def view(n: int, **kw: object) -> NodeView:
    return NodeView(n, HOSTS[n], seen=True, **kw)  # type: ignore[arg-type]


def waiting(r: Roster, spare: tuple[int, ...] = (2,)) -> dict[int, NodeView]:
    """Every training node waits for the next generation, the spares wait as spares."""
    views = {n: view(n, status="restarting", role="train", roster_wait=r.generation + 1) for n in r.nodes}
    views.update({n: view(n, status="restarting", role="spare", roster_wait=1) for n in spare})
    return views


# ---------------------------------------------------------------- the roster's decisions


def test_first_roster_trains_on_the_first_good_hosts_and_keeps_the_rest_as_spares() -> None:
    r = first_roster("7.0", HOSTS, 2, set(), 20007)
    assert (r.generation, r.nodes, r.spares, r.master_addr) == (1, (0, 1), (2, 3), "n1")
    r = first_roster("7.0", HOSTS, 2, {"n1"}, 20007)
    assert (r.nodes, r.spares, r.master_addr) == ((1, 2), (3,), "n2")
    assert "bad nodes left out: n1" in r.reason
    r = first_roster("7.0", HOSTS, 4, {"n1"}, 20007)  # too few good hosts: the bad one trains
    assert r.nodes == (0, 1, 2, 3) and r.spares == ()


def test_nothing_is_written_while_a_training_node_still_runs_its_launch() -> None:
    r = roster()
    views = waiting(r)
    views[1] = view(1, status="running", role="train", roster_gen=1)
    assert next_roster(r, views, {}, set()) is None


def test_every_training_node_waiting_gives_the_next_generation_with_the_same_places() -> None:
    r = roster()
    nxt = next_roster(r, waiting(r), {}, set())
    assert nxt is not None and (nxt.generation, nxt.nodes, nxt.spares, nxt.stop) == (2, (0, 1), (2,), False)


def test_a_lost_node_is_replaced_by_a_spare_at_its_node_rank() -> None:
    r = roster()
    views = waiting(r)
    del views[1]
    views[1] = view(1, status="running", silent_s=40.0)
    nxt = next_roster(r, views, {1: "silent"}, set())
    assert nxt is not None and nxt.nodes == (0, 2) and nxt.spares == ()
    assert nxt.replaced == {"n2": "n3"} and "n2 lost (silent): n3 takes its place" in nxt.reason
    facts = nxt.facts(2)
    assert facts == GroupFacts(2, 1, 2, "n1", 20007)


def test_a_lost_node_without_a_spare_stops_the_job_with_node_lost() -> None:
    r = roster(spares=())
    nxt = next_roster(r, waiting(r, spare=()), {1: "silent"}, set())
    assert nxt is not None and nxt.stop and nxt.exit_code == Exit.NODE_LOST
    assert "no spare left: requeue" in nxt.reason


@pytest.mark.parametrize(
    "spare",
    [
        {"role": "spare", "status": "failed", "exit_code": 12},  # its watchdog ended
        {"role": "", "status": "restarting"},  # has not read the roster yet
    ],
)
def test_only_a_live_waiting_spare_takes_a_place(spare: dict[str, object]) -> None:
    r = roster()
    views = waiting(r)
    views[2] = view(2, **spare)
    nxt = next_roster(r, views, {1: "silent"}, set())
    assert nxt is not None and nxt.stop and nxt.exit_code == Exit.NODE_LOST


def test_a_bad_training_node_is_swapped_out_while_a_spare_is_left_and_kept_without_one() -> None:
    r = roster()
    nxt = next_roster(r, waiting(r), {}, {"n2"})
    assert nxt is not None and nxt.nodes == (0, 2) and nxt.spares == () and nxt.replaced == {"n2": "n3"}
    assert 1 not in (*nxt.nodes, *nxt.spares)  # left out: neither trains nor waits as a spare
    r = roster(spares=())
    nxt = next_roster(r, waiting(r, spare=()), {}, {"n2"})
    assert nxt is not None and nxt.nodes == (0, 1) and "kept: no spare left" in nxt.reason


def test_a_bad_spare_is_no_spare() -> None:
    r = roster()
    nxt = next_roster(r, waiting(r), {1: "silent"}, {"n3"})
    assert nxt is not None and nxt.stop and nxt.exit_code == Exit.NODE_LOST


def test_a_training_nodes_watchdog_that_ended_stops_the_others_with_its_code() -> None:
    r = roster()
    views = waiting(r)
    views[0] = view(0, status="done", exit_code=0, reason="training finished")
    views[1] = view(1, status="running", role="train")
    assert next_roster(r, views, {}, set()) is None  # node 1 still runs: it ends too
    views[1] = view(1, status="done", exit_code=0, reason="training finished")
    nxt = next_roster(r, views, {}, set())
    assert nxt is not None and nxt.stop and nxt.exit_code == 0 and "n1's watchdog ended (exit 0" in nxt.reason
    views[1] = view(1, status="failed", exit_code=Exit.BUDGET_EXHAUSTED)
    nxt = next_roster(r, views, {}, set())
    assert nxt is not None and nxt.exit_code == Exit.BUDGET_EXHAUSTED


def test_a_stopped_roster_writes_nothing_more() -> None:
    stopped = Roster("7.0", 2, HOSTS[:3], (0, 1), (2,), 20007, stop=True, exit_code=0)
    assert next_roster(stopped, waiting(stopped), {}, set()) is None


def test_lost_now_by_slurm_by_silence_and_after_a_longer_grace_for_a_node_never_seen() -> None:
    views = {
        0: view(0, silent_s=3.0),
        1: view(1, silent_s=31.0),
        2: NodeView(2, "n3", seen=False, silent_s=31.0),  # its watchdog is still starting
        3: view(3, silent_s=1.0, slurm_down="DOWN*"),
    }
    assert set(lost_now(views, {}, 30.0)) == {1, 3}
    assert "SLURM says n4 is DOWN*" in lost_now(views, {}, 30.0)[3]
    views[2] = NodeView(2, "n3", seen=False, silent_s=200.0)
    assert set(lost_now(views, {1: "x", 3: "y"}, 30.0)) == {2}
    views[1] = view(1, silent_s=99.0, status="done", exit_code=0)  # ended: its summary's last word
    assert 1 not in lost_now(views, {}, 30.0)


def test_job_exit_once_every_live_node_ended() -> None:
    views = {
        0: view(0, status="done", exit_code=0),
        1: view(1, status="running"),
        2: view(2, status="stopped", exit_code=0),
    }
    assert job_exit(views, {}) is None
    assert job_exit(views, {1: "lost"}) == 0
    views[1] = view(1, status="failed", exit_code=Exit.NODE_LOST)
    assert job_exit(views, {}) == Exit.NODE_LOST


# ---------------------------------------------------------------- which host a failure is pinned on


def cause(host: str, at: float, signal: bool = False) -> Failure:
    return Failure(host, at, EventName.ROOT_CAUSE, f"{host} rank failed", signal=signal)


def test_the_host_whose_rank_failed_first_gets_the_incident() -> None:
    [inc] = attribute(
        [cause("n1", 10.5), cause("n2", 10.0, signal=True), cause("n3", 10.6)], set(), "7.0", 1.0
    )
    assert (inc.host, inc.why, inc.job) == ("n2", ("died_first",), "7.0")
    assert "n1 failed 0.50s later" in inc.evidence[0]


def test_a_tie_pins_nothing_unless_the_first_was_a_kill() -> None:
    assert attribute([cause("n1", 10.00), cause("n2", 10.01)], set(), "7.0") == []
    [inc] = attribute([cause("n1", 10.00, signal=True), cause("n2", 10.01)], set(), "7.0")
    assert inc.host == "n1"


def test_a_lost_node_carries_the_blame_and_a_hang_culprit_beats_the_root_causes() -> None:
    assert attribute([cause("n1", 10.0, signal=True)], {"n2"}, "7.0") == []
    hang = Failure("n3", 12.0, EventName.HANG, "culprit rank 2", culprit=True)
    [inc] = attribute(
        [cause("n1", 10.0, signal=True), hang, Failure("n1", 12.0, EventName.HANG, "waits")], set(), "7.0"
    )
    assert (inc.host, inc.why, inc.evidence) == ("n3", ("hang",), ("culprit rank 2",))


def logged(tmp_path: Path, *emits: tuple[ev.Event, str]) -> list[Logged[ev.Event]]:
    """Events as a watchdog writes them to its log and the coordinator reads them back."""
    log = EventLog(tmp_path, echo=None)
    for e, msg in emits:
        log.emit(e, msg)
    return [x for x in map(ev.parse, read_events(log.path)) if x is not None]


def test_failure_of_reads_root_causes_with_a_time_and_hangs(tmp_path: Path) -> None:
    timed, untimed, hang, launch = logged(
        tmp_path,
        (ev.RootCause(launch=1, rank=0, signal=True, failed_at=5.0), "m"),
        (ev.RootCause(launch=1, rank=0), "m"),
        (ev.Hang(ranks=[1], detected=7.0, culprits=[{"rank": 1}]), "h"),
        (ev.Launch(launch=1, launch_id="a", pid=1, resumed_from=None), "x"),
    )
    assert failure_of("n1", timed) == Failure("n1", 5.0, EventName.ROOT_CAUSE, "m", signal=True)
    assert failure_of("n1", untimed) is None  # no time: no comparison
    f = failure_of("n2", hang)
    assert f is not None and f.culprit and f.at == 7.0
    assert failure_of("n2", launch) is None


def test_a_straggler_event_is_an_incident_of_its_host(tmp_path: Path) -> None:
    flagged, cleared = logged(
        tmp_path,
        (ev.Straggler(3, "n4", "compute", 1.5, 10, 30), "rank 3 on n4 computes 1.5x"),
        (ev.StragglerCleared(3, "n4", "compute", 1.1, 10, 60), "cleared"),
    )
    inc = straggler_incident(flagged, "7.0", 3.0)
    assert inc is not None and (inc.host, inc.why, inc.evidence) == (
        "n4",
        ("straggler",),
        ("rank 3 on n4 computes 1.5x",),
    )
    assert straggler_incident(cleared, "7.0", 3.0) is None


@pytest.mark.parametrize(
    ("state", "down"),
    [
        ("IDLE", False),
        ("MIXED", False),
        ("DOWN*", True),
        ("IDLE*", True),
        ("DOWN+DRAIN", True),
        ("ALLOCATED+DRAIN", False),
    ],
)
def test_slurm_down(state: str, down: bool) -> None:
    assert slurm_down(state) is down


# ---------------------------------------------------------------- the records


def test_a_loss_found_twice_is_one_incident_and_two_failures_make_a_bad_node(tmp_path: Path) -> None:
    bad = BadNodes(threshold=2)
    bad, new = bad.add(Incident("n2", ("lost",), 100.0, "7.0", ("silent",)))
    assert new and bad.bad == {}
    bad, new = bad.add(Incident("n2", ("slurmd",), 400.0, "7.0", ("DOWN*",)))  # SlurmdTimeout later
    assert not new and len(bad.of("n2")) == 1 and bad.of("n2")[0].why == ("lost", "slurmd")
    bad, new = bad.add(Incident("n2", ("lost",), 500.0, "7.1", ("silent",)))  # lost again, the next job
    assert new and list(bad.bad) == ["n2"]
    bad, new = bad.add(Incident("n3", ("died_first",), 600.0, "7.1", ("rank 1 killed",)))
    bad, new = bad.add(Incident("n3", ("died_first",), 614.0, "7.1", ("rank 1 killed again",)))
    assert new and list(bad.bad) == ["n2", "n3"]  # two failures 14 s apart: two incidents
    write_bad_nodes(tmp_path, bad)
    assert read_bad_nodes(tmp_path) == bad
    assert json.loads((tmp_path / "supervisor" / "bad_nodes.json").read_text())["bad"] == ["n2", "n3"]


@pytest.mark.parametrize(
    "d",
    [
        [],
        {"threshold": 0},
        {"incidents": [{"host": 3}]},
        {"incidents": "x"},
        {"actions": [{"what": "x", "hosts": "n1"}]},
    ],
)
def test_a_bad_node_list_that_is_garbage_is_a_value_error(d: object) -> None:
    with pytest.raises(ValueError):
        parse_bad_nodes(d)


def test_the_roster_round_trips_and_garbage_is_refused(tmp_path: Path) -> None:
    r = Roster("7.0", 3, HOSTS, (0, 2), (3,), 20007, reason="n2 lost", replaced={"n2": "n3"}, written=1.5)
    write_roster(tmp_path, r)
    assert read_roster(tmp_path) == r
    for bad in (
        {**r.to_dict(), "nodes": [0, 9]},  # a node the hosts do not have
        {**r.to_dict(), "spares": [0]},  # trains and waits at once
        {**r.to_dict(), "stop": True, "exit_code": None},
        {**r.to_dict(), "key": 7},
    ):
        with pytest.raises(ValueError):
            parse_roster(bad)


def test_group_facts_give_each_rank_its_global_place_and_a_store_of_its_own() -> None:
    facts = GroupFacts.parse(GroupFacts(4, 2, 3, "n1", 20007).to_json())
    env = facts.environ(local_rank=1, local_world_size=2)
    assert (env["RANK"], env["WORLD_SIZE"], env["GROUP_RANK"], env["MASTER_ADDR"], env["MASTER_PORT"]) == (
        "5",
        "6",
        "2",
        "n1",
        "20007",
    )
    assert env["TORCHELASTIC_USE_AGENT_STORE"] == "False"
    for text in (
        "{}",
        '{"group": {"generation": 1, "node_rank": 3, "nnodes": 3, "master_addr": "a", "master_port": 1}}',
        "x",
    ):
        with pytest.raises(ValueError):
            GroupFacts.parse(text)


# ---------------------------------------------------------------- knobs, launch command, status


def test_spares_need_a_fixed_world_and_room_in_the_allocation(tmp_path: Path) -> None:
    with pytest.raises(SlurmError, match="hot spares keep the world size fixed"):
        Knobs.from_environ(knob_env(tmp_path, SPARE_NODES="1", NNODES="2:4"))
    job = JobEnv.from_environ({**JOB, "SLURM_JOB_NUM_NODES": "3"})
    knobs = Knobs.from_environ(knob_env(tmp_path, SPARE_NODES="1"))
    assert knobs.train_nodes(job) == 2
    slurm.check_allocation(job, knobs)
    with pytest.raises(SlurmError, match="submit with --nodes=N\\+1"):
        slurm.check_allocation(job, Knobs.from_environ(knob_env(tmp_path, SPARE_NODES="1", NNODES="3")))
    with pytest.raises(SlurmError, match="BAD_NODE_ACTION='kill'"):
        Knobs.from_environ(knob_env(tmp_path, BAD_NODE_ACTION="kill"))


def test_launch_command_under_a_roster_starts_each_nodes_ranks_alone(tmp_path: Path) -> None:
    job = JobEnv.from_environ({**JOB, "SLURM_JOB_NUM_NODES": "3", "SLURM_RESTART_COUNT": "2"})
    knobs = Knobs.from_environ(knob_env(tmp_path, SPARE_NODES="1", NODE_TIMEOUT_S="8", NPROC_PER_NODE="4"))
    cmd = slurm.launch_command(knobs, slurm.rendezvous(job, knobs, "n1"), slurm.roster_key(job))
    watch, child = cmd[: cmd.index("--")], cmd[cmd.index("--") + 1 :]
    assert watch[watch.index("--roster") + 1] == "4242.2" and "--standby" in watch
    assert watch[watch.index("--summary-interval") + 1] == "2"
    torchrun = child[child.index("--") + 1 :]
    assert torchrun[:2] == ["--standalone", "--nproc-per-node=4"]
    assert not any(a.startswith(("--rdzv", "--nnodes")) for a in torchrun)


def test_status_shows_the_roster_and_the_bad_nodes_with_their_evidence(tmp_path: Path) -> None:
    root = tmp_path / "run"
    write_roster(
        root, Roster("7.0", 3, HOSTS, (0, 2), (3,), 20007, reason="n2 is a bad node", replaced={"n2": "n3"})
    )
    bad = BadNodes()
    for t, why in ((100.0, "died_first"), (400.0, "died_first")):
        bad, _ = bad.add(Incident("n2", (why,), t, "7.0", (f"rank 1 killed at {t}",)))
    bad, _ = bad.add(Incident("n4", ("lost",), 500.0, "7.0", ("silent",)))
    write_bad_nodes(root, bad)
    r = build_report(root)
    assert "generation 3: training on n1, n3; spares n4; n2 replaced by n3" in r.roster
    assert r.bad_nodes[0].startswith("BAD n2: 2 incidents (threshold 2): died_first in job 7.0")
    assert "rank 1 killed at 400.0" in r.bad_nodes[0]
    assert r.bad_nodes[1] == "incidents below the threshold (2): n4 1"


# ---------------------------------------------------------------- `slurm finish` keeps bad nodes out


def test_exclusion_list_adds_the_bad_hosts_to_what_the_job_excluded() -> None:
    assert exclusion_list("(null)", ["n2"]) == ["n2"]
    assert exclusion_list("n[5-6]", ["n2", "n5"]) == ["n5", "n6", "n2"]


def bad_run(tmp_path: Path) -> None:
    bad = BadNodes()
    for t in (100.0, 400.0):
        bad, _ = bad.add(Incident("gpu08", ("died_first",), t, "4242.0", ("rank 1 killed",)))
    write_bad_nodes(tmp_path / "run", bad)


def test_finish_requeues_with_the_bad_nodes_excluded(tmp_path: Path) -> None:
    bad_run(tmp_path)
    r = run_finish(tmp_path, Exit.NODE_LOST)
    assert r.returncode == 0, r.stdout + r.stderr
    assert scontrol_calls(tmp_path) == ["requeue 4242", "update JobId=4242 ExcNodeList=gpu08"]
    assert "excluded gpu08: ExcNodeList=gpu08" in r.stdout
    bad = read_bad_nodes(tmp_path / "run")
    assert bad is not None and [(a.what, a.hosts) for a in bad.actions] == [("excluded", ("gpu08",))]
    history = json.loads(slurm.requeue_path(tmp_path / "run").read_text())["history"]
    assert [h["event"] for h in history][-2:] == ["requeue", "excluded"]
    assert history[-2]["reason"].startswith("a node was lost and no spare was left")


def test_finish_drains_the_bad_nodes_when_asked_and_says_when_it_cannot(tmp_path: Path) -> None:
    bad_run(tmp_path)
    r = run_finish(tmp_path, Exit.REQUEUE_REQUESTED, BAD_NODE_ACTION="drain")
    assert r.returncode == 0, r.stdout + r.stderr
    calls = scontrol_calls(tmp_path)
    assert calls[1] == "update JobId=4242 ExcNodeList=gpu08"
    assert calls[2].startswith(
        "update NodeName=gpu08 State=DRAIN Reason=resumable-training: bad node of job 4242"
    )
    r = run_finish(tmp_path, Exit.REQUEUE_REQUESTED, BAD_NODE_ACTION="drain", FAKE_SCONTROL_UPDATE_EXIT="1")
    assert "WARNING: BAD_NODE_ACTION=drain" in r.stdout and "operator's rights" in r.stdout


def test_finish_without_bad_nodes_excludes_nothing(tmp_path: Path) -> None:
    r = run_finish(tmp_path, Exit.REQUEUE_REQUESTED)
    assert r.returncode == 0 and scontrol_calls(tmp_path) == ["requeue 4242"]
