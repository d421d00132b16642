"""torchelastic's error files, read without torch (supervisor/watch/rootcause.py): files written
by torch's own ErrorHandler, torchrun's layout of the workers' files, and garbage."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from supervisor.format.heartbeat import Heartbeat, Phase
from supervisor.watch import oom
from supervisor.watch.rootcause import (
    KILLED,
    MAX_ERROR_FILE_BYTES,
    RootCause,
    describe_ends,
    errored_local_ranks,
    find_root_cause,
    parse_error_file,
    rank_ends,
)


def raise_here(msg: str) -> None:
    raise KeyError(msg)


def torch_writes(path: Path, monkeypatch, msg: str = "no such key") -> int:
    """torch's ErrorHandler records an exception raised here into ``path``; the raising line."""
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        raise_here(msg)
    except KeyError as e:
        ErrorHandler().record_exception(e)
    return raise_here.__code__.co_firstlineno + 1


def test_a_file_torch_wrote_names_type_message_and_the_raising_line(tmp_path, monkeypatch):
    line = torch_writes(tmp_path / "error.json", monkeypatch)
    rc = parse_error_file((tmp_path / "error.json").read_bytes())
    assert (rc.type, rc.message) == ("KeyError", "'no such key'")
    assert (rc.file, rc.line) == (__file__, line)
    assert rc.timestamp > 0
    assert rc.describe() == f"KeyError: 'no such key' ({__file__}:{line})"


def test_torchruns_copy_and_the_older_string_format():
    """torchrun's own file adds errorCode; older torch wrote message as a string, timestamp at the
    top; a message naming no exception class is kept whole."""
    copy = {"message": {"message": "RuntimeError: x", "extraInfo": {"timestamp": "7"}, "errorCode": 1}}
    assert parse_error_file(json.dumps(copy)) == RootCause("RuntimeError", "x", timestamp=7)
    old = {"message": "Signal 9 (SIGKILL) received by PID 5", "timestamp": 8}
    assert parse_error_file(json.dumps(old)) == RootCause(
        "", "Signal 9 (SIGKILL) received by PID 5", timestamp=8
    )


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (b"", "not valid JSON"),
        (b"[" * 100_000, "not valid JSON"),
        (b"[1]", "not a torchelastic error file"),
        (b'{"msg": 1}', "not a torchelastic error file"),
        (b'{"message": 5}', "neither text nor"),
        # a pickle-looking payload is only text to a JSON parser: nothing in it runs
        (b"\x80\x04\x95cos\nsystem\n", "not valid JSON"),
    ],
)
def test_garbage_is_a_short_reason(text, why):
    with pytest.raises(ValueError, match=why):
        parse_error_file(text)


def test_workers_files_first_earliest_wins_with_its_global_rank(tmp_path, monkeypatch):
    """torchrun's layout <logs>/<run>/attempt_0/<local rank>/error.json: the earliest failure is
    the root cause (torchrun's rule), its global rank from this host's heartbeats."""
    logs = tmp_path / "elastic"
    for local, stamp in ((0, "20"), (1, "10")):
        path = logs / "run_x" / "attempt_0" / str(local) / "error.json"
        path.parent.mkdir(parents=True)
        msg = {"message": f"ValueError: rank {local}", "extraInfo": {"timestamp": stamp}}
        path.write_text(json.dumps({"message": msg}))
    cause, problems = find_root_cause(tmp_path / "error.json", logs, {0: 4, 1: 5})
    assert problems == [] and errored_local_ranks(logs) == {0, 1}
    assert errored_local_ranks(tmp_path / "missing") == set()
    assert cause is not None and (cause.rank, cause.local_rank, cause.message) == (5, 1, "rank 1")
    assert cause.describe().startswith("rank 5: ValueError: rank 1")
    unknown, _ = find_root_cause(tmp_path / "error.json", logs, {})
    assert unknown is not None and unknown.rank is None and unknown.describe().startswith("local rank 1: ")


def test_the_commands_own_file_when_no_worker_wrote_one(tmp_path, monkeypatch):
    line = torch_writes(tmp_path / "error.json", monkeypatch, "plain script")
    cause, problems = find_root_cause(tmp_path / "error.json", tmp_path / "missing", {})
    assert problems == [] and cause is not None
    assert (cause.type, cause.line, cause.rank, cause.source) == (
        "KeyError",
        line,
        None,
        str(tmp_path / "error.json"),
    )
    assert find_root_cause(tmp_path / "nothing.json", tmp_path / "missing", {}) == (None, [])


def test_unusable_files_are_named_never_guessed(tmp_path):
    logs = tmp_path / "elastic"
    bad = logs / "r" / "attempt_0" / "0" / "error.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    big = tmp_path / "error.json"
    big.write_bytes(b" " * (MAX_ERROR_FILE_BYTES + 1))
    cause, problems = find_root_cause(big, logs, {})
    assert cause is None
    assert problems == [f"{bad}: not valid JSON", f"{big}: larger than {MAX_ERROR_FILE_BYTES} bytes"]


def test_resumable_records_an_uncaught_exception_as_record_would(tmp_path):
    """A trainer without @record: Resumable's hook (supervisor/resumable/_signals.py) writes the
    exception that ends the process in torch's format, the traceback still goes to stderr; a file
    @record already wrote is left alone."""
    path = tmp_path / "error.json"
    code = (
        "from supervisor.resumable._signals import record_uncaught\n"
        "record_uncaught()\n"
        "def load():\n"
        "    raise RuntimeError('DataLoader worker (pid(s) 4242) exited unexpectedly')\n"
        "load()\n"
    )
    env = {**os.environ, "TORCHELASTIC_ERROR_FILE": str(path)}
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert (
        p.returncode == 1 and "Traceback" in p.stderr and "exited unexpectedly" in p.stderr.splitlines()[-1]
    )
    rc = parse_error_file(path.read_bytes())
    assert (rc.type, rc.message) == ("RuntimeError", "DataLoader worker (pid(s) 4242) exited unexpectedly")
    assert (rc.file, rc.line) == ("<string>", 4) and rc.timestamp > 0
    path.write_text('{"message": "written by @record"}')
    p = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 1 and json.loads(path.read_text()) == {"message": "written by @record"}


def _hb(rank: int, t: float, died_of: str = "", pid: int = 0, step: int = 23) -> Heartbeat:
    return Heartbeat(rank, rank, "vm", pid or 100 + rank, step, Phase.TRAIN, t, died_of=died_of)


def test_the_first_rank_to_fail_by_time_is_the_root_cause_the_others_its_consequences():
    """kill -9 of rank 0: it wrote nothing; rank 1 died of the lost peer right after, with an
    exception in its heartbeat; rank 2's error file (a trainer with @record) came later still."""
    reset = "RuntimeError: [../gloo/transport/tcp/pair.cc:534] Connection reset by peer (t.py:9)"
    late = RootCause("ValueError", "late", "t.py", 12, rank=2, at=1006.0)
    beats = [_hb(1, 1005.2, died_of=reset), _hb(0, 1004.9), _hb(2, 1001.0)]
    ends = rank_ends(beats, gone={0, 1, 2}, causes=[late])
    assert [(e.rank, e.signal) for e in ends] == [(0, True), (1, False), (2, False)]
    assert ends[0].how == KILLED and ends[2].how == "ValueError: late (t.py:12)"
    line = describe_ends(ends)
    assert line.startswith("rank 0 (pid 100) at step 23: killed by a signal (no exception recorded")
    assert f"; then, as a consequence: rank 1 (pid 101) at step 23: {reset}; rank 2 " in line


def test_an_exception_before_the_killed_ranks_last_beat_came_first():
    """Rank 1 raised while rank 0 still beat: rank 1 is the root cause, rank 0's death followed."""
    ends = rank_ends([_hb(0, 1010.0), _hb(1, 1004.0, died_of="ValueError: boom")], gone={0, 1})
    assert [e.rank for e in ends] == [1, 0]
    assert rank_ends([_hb(0, 1010.0), _hb(1, 1004.0)], gone=set()) == []  # nobody failed


def test_the_oom_killers_word_where_the_kernel_says_so(tmp_path):
    records = [
        b"6,100,5,-;python[77]: segfault at 0\n",
        b"3,101,6,-;Out of memory: Killed process 4321 (python) total-vm:9kB, anon-rss:8kB\n SUBSYSTEM=x\n",
        b"3,102,7,-;Memory cgroup out of memory: Killed process 43210 (python)\n",
    ]
    assert oom.kill_line(records, 4321).startswith("Out of memory: Killed process 4321 (python)")
    assert oom.kill_line(records, 432) == "" and oom.kill_line([b"\xff\xfe;garbage"], 1) == ""
    assert oom.parse_oom_count("low 0\nhigh 0\nmax 3\noom 2\noom_kill 2\n") == 2
    assert oom.parse_oom_count("oom_kill_disable 0\nunder_oom 0\noom_kill 5\n") == 5
    assert oom.parse_oom_count("garbage") is None
    v2, v1 = "0::/job/step_0\n", "4:memory:/slurm/uid_0/job_7\n2:cpu,cpuacct:/\n"
    assert oom.cgroup_files(v2, "/cg") == ["/cg/job/step_0/memory.events"]
    assert oom.cgroup_files(v1, "/cg") == ["/cg/memory/slurm/uid_0/job_7/memory.oom_control"]
    (tmp_path / "proc").write_text(v2)
    (tmp_path / "cg" / "job" / "step_0").mkdir(parents=True)
    (tmp_path / "cg" / "job" / "step_0" / "memory.events").write_text("oom 1\noom_kill 1\n")
    assert oom.cgroup_oom_kills(str(tmp_path / "proc"), str(tmp_path / "cg")) == 1
    assert oom.cgroup_oom_kills(str(tmp_path / "nothing")) is None
    assert oom.killed_note(4321, "Out of memory: Killed process 4321", None, None).startswith(
        "killed by SIGKILL (signal 9) from the OOM killer (kernel: Out of memory"
    )
    assert "the OOM killer? its memory cgroup counted 1 OOM kill(s)" in oom.killed_note(1, "", 0, 1)
    assert oom.killed_note(1, "", 1, 1) == "" and oom.killed_note(1, "", None, 3) == ""
    oom.kernel_kill_line(1)  # the real /dev/kmsg, readable or not: never raises
