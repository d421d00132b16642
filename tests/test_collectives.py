"""A hang's collectives (issue 42): the flight-recorder summary a rank writes (format/collectives.py),
its reporter thread on a real torch flight recorder (resumable/_collectives.py), the watchdog's
reading of who waits where and who never came (watch/collectives.py), the culprit it names
(watch/culprit.py), and the connections the network does not deliver (watch/network.py)."""

from __future__ import annotations

import itertools
import json
import os
import socket
import stat
import subprocess
import sys
import time
from pathlib import Path

import pytest
from commands import REPO

from supervisor.format import confined
from supervisor.format.collectives import (
    ENV_FR_BUFFER,
    ENV_NCCL_TRACE_BUFFER,
    Collective,
    CollectiveDump,
    GroupState,
    from_flight_recorder,
    parse_dump,
    recorder_entries,
    recorder_env,
)
from supervisor.format.layout import (
    collectives_filename,
    collectives_request_filename,
    is_collectives_request,
    stack_dump_filename,
)
from supervisor.watch import collectives, hangs, network
from supervisor.watch.culprit import Probe, diagnose

# ---------------------------------------------------------------- the record


def entry(
    seq: int, op: str = "all_reduce", done: bool = True, pg: str = "0", desc: str = "default_pg"
) -> dict:
    """One entry of torch 2.13's _dump_fr_trace_json, the fields the summary reads."""
    return {
        "collective_seq_id": seq,
        "is_p2p": False,
        "pg_id": int(pg),
        "process_group": [pg, desc],
        "profiling_name": f"gloo:{op}",
        "input_sizes": [[4]],
        "retired": done,
        "time_created_ns": 1_700_000_000_000_000_000 + seq,
        "state": "scheduled",
    }


def trace(*entries: dict, status: dict | None = None) -> dict:
    return {"version": "2.10", "entries": list(entries), "pg_status": status or {}}


def test_the_summary_keeps_each_groups_progress_and_last_collectives():
    t = trace(
        *(entry(s) for s in range(1, 12)),
        entry(12, "barrier", done=False),
        entry(1, "all_gather", pg="1", desc="undefined"),
        {**entry(3, "send"), "is_p2p": True},
        status={
            "0": {"last_enqueued_collective": "12", "last_completed_collective": "11"},
            "1": {"last_enqueued_collective": "1", "last_completed_collective": "1"},
        },
    )
    g0, g1 = from_flight_recorder(t, keep=3)
    assert (g0.group, g0.desc, g0.entered, g0.finished, g0.pending) == ("0", "default_pg", 12, 11, True)
    assert [c.name() for c in g0.recent] == ["all_reduce #10", "all_reduce #11", "barrier #12"]
    assert (g0.at(12).backend, g0.at(12).done, g0.at(12).sizes) == ("gloo", False, "[[4]]")
    assert g0.label() == "group 0 (default_pg)" and g1.label() == "group 1"  # torch's "undefined" is no name
    assert not g1.pending and g0.at(9) is None


def test_without_a_status_the_entries_say_how_far_a_group_got():
    (g,) = from_flight_recorder(trace(entry(4), entry(5, done=False)))
    assert (g.entered, g.finished) == (5, 4)
    assert from_flight_recorder({"entries": "garbage", "pg_status": []}) == ()


def test_a_dump_round_trips_and_anything_else_is_refused():
    d = CollectiveDump(
        3, 77, "tok", "torch x flight recorder", from_flight_recorder(trace(entry(1))), step=41
    )
    assert parse_dump(d.encode()) == d
    for bad, why in (
        (b"[1]", "not a JSON object"),
        (b"{", "not valid JSON"),
        (json.dumps({**d.to_dict(), "rank": "3"}).encode(), "bad field"),
        (
            json.dumps({k: v for k, v in d.to_dict().items() if k != "token"}).encode(),
            "field 'token' missing",
        ),
        (json.dumps({**d.to_dict(), "groups": [{"group": "0"}]}).encode(), "missing"),
    ):
        with pytest.raises(ValueError, match=why):
            parse_dump(bad)


def test_the_watchdog_turns_the_recorder_on_unless_the_environment_says_otherwise():
    assert recorder_env({}, 512) == {ENV_FR_BUFFER: "512"}
    assert recorder_env({ENV_FR_BUFFER: "0"}, 512) == {}  # the operator's 0 stands
    assert recorder_env({ENV_NCCL_TRACE_BUFFER: "2000"}, 512) == {}
    assert recorder_env({}, 0) == {}
    assert recorder_entries({ENV_FR_BUFFER: "64"}) == 64 and recorder_entries({ENV_FR_BUFFER: "x"}) == 0
    assert recorder_entries({ENV_NCCL_TRACE_BUFFER: "9"}) == 9 and recorder_entries({}) == 0


# ---------------------------------------------------------------- who waits where


def dump(rank: int, *groups: GroupState, step: int = 23) -> CollectiveDump:
    return CollectiveDump(rank, 100 + rank, "tok", "test", groups, step=step)


def group(entered: int, finished: int, *ops: tuple[int, str], name: str = "0") -> GroupState:
    recent = tuple(Collective(s, op, "gloo", s <= finished, "[[1]]", 1000.0 + s) for s, op in ops)
    return GroupState(name, "default_pg", entered, finished, recent)


def test_a_rank_that_never_entered_the_collective_is_the_culprit():
    dumps = {
        0: dump(0, group(57, 56, (56, "all_reduce"), (57, "all_gather"))),
        1: dump(1, group(56, 56, (56, "all_reduce"))),
        2: dump(2, group(57, 56, (56, "all_reduce"), (57, "all_gather"))),
    }
    (s,) = collectives.find_stuck(dumps)
    assert (s.seq, s.op, s.waiting, s.culprits) == (57, "all_gather", (0, 2), [1])
    text = s.describe({r: d.step for r, d in dumps.items()}, 3, 3)
    assert text == (
        "ranks 0, 2 wait in all_gather #57 of group 0 (default_pg), after step 23; "
        "rank 1 never entered it (its last: all_reduce #56, finished)"
    )
    assert s.to_dict()["missing"] == [{"rank": 1, "last": "all_reduce #56"}]
    assert s.entered_t == 1057.0


def test_a_rank_that_entered_another_collective_is_the_odd_one_out():
    dumps = {r: dump(r, group(57, 56, (57, "all_reduce"))) for r in (0, 1, 3)}
    dumps[2] = dump(2, group(57, 56, (57, "barrier")))
    (s,) = collectives.find_stuck(dumps)
    assert (s.op, s.waiting, s.culprits) == ("all_reduce", (0, 1, 3), [2])
    assert "rank 2 entered barrier #57 instead" in s.describe({}, 4, 4)


def test_two_ranks_in_two_collectives_name_no_culprit():
    """With no majority, each rank is the odd one out for the other: said, nobody blamed."""
    (s,) = collectives.find_stuck(
        {0: dump(0, group(5, 4, (5, "all_reduce"))), 1: dump(1, group(5, 4, (5, "barrier")))}
    )
    assert s.op == "" and s.culprits == []
    assert "no majority to tell which rank is wrong" in s.describe({}, 2, 2)


def test_everyone_entered_and_nobody_finished_blames_no_rank_here():
    dumps = {r: dump(r, group(9, 8, (9, "all_reduce"))) for r in (0, 1)}
    (s,) = collectives.find_stuck(dumps)
    assert s.culprits == [] and s.waiting == (0, 1)
    assert s.describe({}, 2, 4).endswith(
        "every rank here entered it and none finished it: none is missing; ranks on other nodes: 2"
    )


def test_groups_that_finished_everything_are_not_stuck_and_the_blamed_group_comes_first():
    quiet = group(4, 4, (4, "all_reduce"), name="1")
    dumps = {
        0: dump(0, group(9, 8, (9, "all_reduce")), quiet, group(3, 2, (3, "all_gather"), name="2")),
        1: dump(1, group(9, 8, (9, "all_reduce")), quiet, group(2, 2, (2, "all_gather"), name="2")),
    }
    found = collectives.find_stuck(dumps)
    assert [(s.group, s.culprits) for s in found] == [("2", [1]), ("0", [])]


def test_the_collectives_name_the_culprit_wherever_its_stack_is():
    """A rank the collectives blame is the culprit even when its stack is in a collective too (it
    entered another one); without their word, the stack rule stands."""
    in_c10d = 'Thread 0x1 (most recent call first):\n  File "/v/torch/distributed/distributed_c10d.py", line 9 in barrier\n  File "/w/t.py", line 1 in <module>\n'
    probes = [Probe(r, 100 + r, "S", "", in_c10d) for r in range(3)]
    assert [f.rank for f in diagnose(probes, blamed=[2]).culprits] == [2]
    assert diagnose(probes).culprits == ()
    line = diagnose(probes, blamed=[2]).summary("ranks 0, 1 wait in all_reduce #5")
    assert line.startswith(
        "ranks 0, 1 wait in all_reduce #5; culprit rank 2 (pid 102) waits in a collective: barrier"
    )


def test_a_culprit_waiting_in_the_standard_library_is_shown_where_its_own_code_waits():
    dl = "/v/lib/python3.11/site-packages/torch/utils/data/dataloader.py"
    text = (
        "Thread 0x1 (most recent call first):\n"
        '  File "/usr/lib/python3.11/selectors.py", line 415 in select\n'
        '  File "/usr/lib/python3.11/multiprocessing/connection.py", line 947 in wait\n'
        f'  File "{dl}", line 1291 in _try_get_data\n'
        f'  File "{dl}", line 1505 in _next_data\n'
        '  File "/w/train.py", line 1 in <module>\n'
    )
    (f,) = diagnose([Probe(1, 101, "S", "poll_schedule_timeout", text)], blamed=[1]).culprits
    assert f.describe().startswith(
        "rank 1 (pid 101) is not in a collective: _try_get_data (data/dataloader.py:1291) <- "
        "_next_data (data/dataloader.py:1505) <- <module> (w/train.py:1) (waiting in select (python3.11/selectors.py:415))"
    )
    d = f.to_dict()
    assert [x["func"] for x in d["frames"]] == ["select", "wait", "_try_get_data"]
    assert [x["func"] for x in d["at"]] == ["_try_get_data", "_next_data", "<module>"]


# ---------------------------------------------------------------- asking a rank (FIFO, real torch)


def test_a_request_fifo_is_made_fresh_and_only_a_fifo_is_written_to(tmp_path):
    folder = tmp_path / "node0"
    path = folder / collectives_request_filename(3)
    assert is_collectives_request(str(path)) and not is_collectives_request(str(folder / "rank_00003.json"))
    with pytest.raises(FileNotFoundError):
        confined.open_fifo(tmp_path, path)
    folder.mkdir()
    path.symlink_to(tmp_path / "elsewhere")
    fd = confined.make_fifo(tmp_path, path)  # the link is replaced, never followed
    assert stat.S_ISFIFO(path.lstat().st_mode) and not (tmp_path / "elsewhere").exists()
    w = confined.open_fifo(tmp_path, path)
    os.write(w, b"tok\n")
    os.close(w)
    assert os.read(fd, 64) == b"tok\n"
    os.close(fd)
    with pytest.raises(OSError, match="No such device"):  # ENXIO: nobody reads it any more
        confined.open_fifo(tmp_path, path)
    path.unlink()
    path.write_text("planted")
    with pytest.raises(confined.Escape, match="not a FIFO"):
        confined.open_fifo(tmp_path, path)
    problems = collectives.request(folder, [3, 4], "tok")
    assert "not a FIFO" in problems[3] and "no request FIFO" in problems[4]


# A rank whose main thread waits (for its stdin to close) with the library's stack dump and reporter.
REPORTING_RANK = """
import sys
from pathlib import Path
import torch, torch.distributed as dist
from supervisor.format.layout import stack_dump_filename
from supervisor.resumable._collectives import CollectiveReporter
from supervisor.resumable._signals import register_stack_dump
dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
for _ in range(3):
    dist.all_reduce(torch.ones(2))
dist.barrier()
folder = Path(sys.argv[1])
r = CollectiveReporter.start(folder, folder.parent, 0, lambda: 41)
stacks = register_stack_dump(folder / stack_dump_filename(0), folder.parent) if r else None
print("ready" if r else "off", flush=True)
if r:
    sys.stdin.read()
    r.close()
"""


def test_a_rank_answers_from_torchs_flight_recorder_while_its_main_thread_waits(tmp_path):
    """torch 2.13 records gloo's collectives when TORCH_FR_BUFFER_SIZE is set; the reporter thread
    answers a request with them (and the step), and no reporter starts when the recorder is off."""
    folder = tmp_path / "node0"
    cmd = [sys.executable, "-c", REPORTING_RANK, str(folder)]
    env = dict(os.environ, PYTHONPATH=str(REPO))
    off = subprocess.run(
        cmd,
        env={k: v for k, v in env.items() if k != ENV_FR_BUFFER},
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert off.stdout.strip() == "off", off.stderr
    p = _reporting_rank(cmd, env)
    try:
        # gloo marks a collective finished in the recorder from a callback that may run after the
        # caller has returned, so a busy machine can show the last ones still running: ask again
        # (a new token each time) until all four are finished.
        deadline = time.monotonic() + 60
        for attempt in itertools.count():
            token = f"t1.{attempt}"
            assert not collectives.request(folder, [0], token)
            d = collectives.collect(folder, [0], token, time.monotonic() + 30)[0]
            if (d.groups and d.groups[0].finished == 4) or time.monotonic() > deadline:
                break
        assert (d.rank, d.pid, d.token, d.step, d.problem) == (0, p.pid, token, 41, "")
        assert d.source.startswith("torch 2.13") and "flight recorder" in d.source
        (g,) = d.groups
        assert (g.group, g.entered, g.finished) == ("0", 4, 4)
        assert [c.name() for c in g.recent] == [
            "all_reduce #1",
            "all_reduce #2",
            "all_reduce #3",
            "barrier #4",
        ]
        assert all(c.done and c.backend == "gloo" for c in g.recent)
        assert collectives.read_answer(folder / collectives_filename(0), "another") is None
        p.stdin.close()
        assert p.wait(timeout=60) == 0
    finally:
        p.kill()
        p.wait()
    assert "No such device" in collectives.request(folder, [0], "t2")[0]  # the rank is gone


def _reporting_rank(cmd: list[str], env: dict[str, str]) -> subprocess.Popen[str]:
    """REPORTING_RANK started with the flight recorder on, once it says it is ready."""
    p = subprocess.Popen(
        cmd, env={**env, ENV_FR_BUFFER: "64"}, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True
    )
    assert p.stdout is not None and p.stdout.readline().strip() == "ready"
    return p


def test_a_hung_ranks_stacks_are_dumped_before_it_is_asked_so_its_answer_never_runs_under_the_walk(
    tmp_path,
):
    """faulthandler walks every thread's frames from a signal handler without the GIL; a reporter
    woken by the question at that moment runs Python under the walk, and a drill's rank died of
    it (its dump cut mid-line, no answer). The watchdog dumps first, then asks: in the whole dump
    the reporter is still waiting for the question, and the answer comes after it."""
    folder = tmp_path / "node0"
    p = _reporting_rank(
        [sys.executable, "-c", REPORTING_RANK, str(folder)], dict(os.environ, PYTHONPATH=str(REPO))
    )
    try:
        path = folder / stack_dump_filename(0)
        dumps, unasked, answers = hangs.dump_then_ask(folder, {0: p.pid}, {0: path}, 30, "t1")
        assert not unasked and (answers[0].token, answers[0].step) == ("t1", 41)
        threads = dumps[0].strip().split("\n\n")
        assert threads[-1].splitlines()[-1].endswith("in <module>"), dumps[0]  # the main thread: last
        (reporter,) = [t for t in threads if "_collectives.py" in t]
        assert reporter.splitlines()[1].endswith("in _run"), reporter  # waiting in its read
        p.stdin.close()
        assert p.wait(timeout=60) == 0
    finally:
        p.kill()
        p.wait()


# ---------------------------------------------------------------- the network


def test_tcp_tables_name_connections_that_retransmit_unacknowledged_bytes():
    text = (
        "  sl  local_address rem_address   st tx_queue rx_queue tr tm->when retrnsmt   uid  timeout inode\n"
        "   0: 0200A8C0:9C40 0300A8C0:1F90 01 00000400:00000000 01:00000032 00000005     0        0 111 1 0 20 4 30 10 -1\n"
        "   1: 0200A8C0:9C41 0300A8C0:1F91 01 00000000:00000000 00:00000000 00000000     0        0 112 1 0 20 4 30 10 -1\n"
        "   2: 0200A8C0:9C42 0400A8C0:1F92 01 00000010:00000000 01:00000032 00000000     0        0 113 1 0 20 4 30 10 -1\n"
        "   3: 0100007F:9C43 0100007F:1F93 01 00000800:00000000 01:00000032 00000003     0        0 999 1 0 20 4 30 10 -1\n"
        "garbage\n"
    )
    rows = network.parse_tcp_table(text)
    assert [(r.local, r.remote, r.unacked, r.retransmits, r.inode) for r in rows[:1]] == [
        (("192.168.0.2", 40000), ("192.168.0.3", 8080), 1024, 5, 111)
    ]
    # 112: idle; 113: in flight, not retransmitted yet; 999: not this rank's
    assert [r.inode for r in network.stalled(rows, {111, 112, 113})] == [111]
    v6 = "  sl header\n   0: 0000000000000000FFFF00000300A8C0:1F90 0000000000000000FFFF00000400A8C0:1F91 01 00000001:00000000 01:0 00000002 0 0 5\n"
    assert network.parse_tcp_table(v6)[0].remote == ("192.168.0.4", 8081)


def test_the_link_toward_an_unreachable_peer_is_named_with_its_state():
    routes = network.parse_routes(
        "Iface\tDestination\tGateway \tFlags\tRefCnt\tUse\tMetric\tMask\t\tMTU\tWindow\tIRTT\n"
        "eth0\t00000000\t0100A8C0\t0003\t0\t0\t0\t00000000\t0\t0\t0\n"
        "ci0\t0000A8C0\t00000000\t0001\t0\t0\t0\t00FFFFFF\t0\t0\t0\n"
    )
    assert network.route_device(routes, "192.168.0.3") == "ci0"
    assert network.route_device(routes, "8.8.8.8") == "eth0"
    assert network.route_device(routes, "::1") == ""
    hosts = network.parse_hosts("127.0.0.1 localhost\n192.168.0.3 n2 n2.cluster # node 2\n")
    row = network.TcpRow(("192.168.0.2", 1), ("192.168.0.3", 2), network.ESTABLISHED, 4096, 6, 7)
    (u,) = network.summarize(0, [row, row], routes, hosts, {"ci0": "lowerlayerdown"})
    assert u.describe() == (
        "the network does not deliver rank 0's 2 connection(s) to n2 (192.168.0.3): 8192 bytes "
        "unacknowledged, retransmitted 6 times; the link ci0 here is lowerlayerdown"
    )
    assert "the link" not in network.summarize(0, [row], routes, {}, {"ci0": "up"})[0].describe()


def test_a_real_connection_whose_peer_stopped_reading_is_no_stall():
    """A full receive window is flow control, not loss: the bytes wait unacknowledged, nothing
    retransmits, nothing is named (as a rank waiting for a slow peer)."""
    srv = socket.socket()
    srv.bind(("127.0.0.1", 0))
    srv.listen(1)
    cli = socket.create_connection(srv.getsockname())
    peer, _ = srv.accept()
    cli.setblocking(False)
    try:
        with pytest.raises(BlockingIOError):
            while True:
                cli.send(b"x" * 65536)
        port = cli.getsockname()[1]
        (row,) = [
            r for r in network.parse_tcp_table(Path("/proc/self/net/tcp").read_text()) if r.local[1] == port
        ]
        assert row.unacked > 0 and row.retransmits == 0 and row.inode in network.socket_inodes(os.getpid())
        assert network.undelivered({0: os.getpid()}) == []
    finally:
        for s in (cli, peer, srv):
            s.close()


def test_an_async_collective_a_rank_never_waited_on_is_not_where_it_is_stuck():
    """The culprit launched all_reduce #42 without waiting (its record keeps it in flight) and
    stopped; the other finished #42 and waits in #43: the stuck one is #43, the culprit missing
    from it (the drill's hang-during-save, seen on a loaded CI run)."""
    dumps = {
        0: dump(0, group(42, 41, (41, "all_reduce"), (42, "all_reduce"))),
        1: dump(1, group(43, 42, (42, "all_reduce"), (43, "all_reduce"))),
    }
    (s,) = collectives.find_stuck(dumps)
    assert (s.seq, s.waiting, s.culprits) == (43, (1,), [0])
    assert "rank 0 never entered it (its last: all_reduce #42, not waited on (another rank finished it))" in (
        s.describe({}, 2, 2)
    )
    # a broadcast's root finishes before its receivers: its finish proves nothing for them
    bcast = {
        0: dump(0, group(7, 6, (7, "broadcast"))),
        1: dump(1, group(7, 7, (7, "broadcast"))),
    }
    (b,) = collectives.find_stuck(bcast)
    assert (b.seq, b.waiting, b.finished) == (7, (0,), (1,))
    # the only thing in flight is what another rank finished: no rank waits in a collective
    assert (
        collectives.find_stuck(
            {0: dump(0, group(5, 4, (5, "barrier"))), 1: dump(1, group(5, 5, (5, "barrier")))}
        )
        == []
    )
