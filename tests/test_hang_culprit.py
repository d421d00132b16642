"""Naming the culprit of a hang (supervisor/watch/culprit.py: pure, on faulthandler text and /proc state),
and the trainer's drill switch that makes a real hang (train_ref/rank_faults.py)."""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import subprocess
import sys
import threading
from pathlib import Path

import pytest
from waiting import PATIENCE_S, wait_for

from supervisor.drill import rank_faults
from supervisor.drill.faultctl import FaultFS
from supervisor.drill.switch import BLOCKING_FUNCTION, ENV, Hang, Switch, When, read_marker
from supervisor.watch.culprit import Probe, Where, diagnose, in_collective, main_thread, parse_dump
from supervisor.watch.process import dump_stacks, proc_state

SITE = "/venv/lib/python3.11/site-packages"
WORKER = """Thread 0x00007f1c2effd6c0 (most recent call first):
  File "/usr/lib/python3.11/threading.py", line 324 in wait
  File "/usr/lib/python3.11/concurrent/futures/thread.py", line 81 in _worker
  File "/usr/lib/python3.11/threading.py", line 975 in run
  File "/usr/lib/python3.11/threading.py", line 1038 in _bootstrap_inner
  File "/usr/lib/python3.11/threading.py", line 995 in _bootstrap

"""
MAIN_TAIL = """  File "/w/train_ref/train.py", line 398 in loop
  File "/w/train_ref/train.py", line 368 in run
  File "/w/train_ref/train.py", line 520 in main
  File "/w/train_ref/train.py", line 551 in <module>
  File "<frozen runpy>", line 88 in _run_code
  File "<frozen runpy>", line 198 in _run_module_as_main
"""


def dump(*inner: str, current_is_main: bool = True) -> str:
    """A faulthandler all-threads dump: a worker thread, then the main thread whose innermost
    frames are ``inner`` (file:func) above the training loop."""
    frames = "".join(f'  File "{f.split(":")[0]}", line 7 in {f.split(":")[1]}\n' for f in inner)
    head = "Current thread" if current_is_main else "Thread"
    worker = WORKER.replace("Thread 0x", "Current thread 0x") if not current_is_main else WORKER
    return f"{worker}{head} 0x00007f1c3f0b6740 (most recent call first):\n{frames}{MAIN_TAIL}"


IN_ALLREDUCE = dump(
    f"{SITE}/torch/distributed/distributed_c10d.py:all_reduce",
    f"{SITE}/torch/distributed/c10d_logger.py:wrapper",
    "/w/supervisor/resumable/_checkpointer.py:step_boundary",
)
IN_FSDP = dump(f"{SITE}/torch/distributed/fsdp/_fully_shard/_fsdp_param_group.py:wait_for_unshard")
STUCK = dump("/w/train_ref/rank_faults.py:stuck_read", "/w/train_ref/rank_faults.py:maybe_hang")
# DDP's gradient all-reduce waits in C++ under autograd: only the engine's entry shows.
IN_DDP_BACKWARD = dump(
    f"{SITE}/torch/autograd/graph.py:_engine_run_backward",
    f"{SITE}/torch/autograd/__init__.py:backward",
    f"{SITE}/torch/_tensor.py:backward",
)


def test_parse_dump_finds_threads_and_main_thread():
    threads = parse_dump(STUCK)
    assert [t.current for t in threads] == [False, True]
    frames = main_thread(STUCK)
    assert frames is not None and frames[0].func == "stuck_read" and frames[-1].func == "_run_module_as_main"
    assert frames[0].short() == "stuck_read (train_ref/rank_faults.py:7)"
    # The signal may land on any thread: the main thread is the one that started in a module.
    other = main_thread(dump("/w/x.py:spin", current_is_main=False))
    assert other is not None and other[0].func == "spin"
    assert main_thread("") is None and main_thread("garbage\nmore garbage") is None


def test_a_real_faulthandler_dump_parses(tmp_path):
    """The format as this CPython writes it, with a second thread waiting."""
    go = threading.Event()
    t = threading.Thread(target=go.wait, daemon=True)
    t.start()
    path = tmp_path / "dump.txt"
    with open(path, "w") as f:
        faulthandler.dump_traceback(file=f, all_threads=True)
    go.set()
    t.join()
    text = path.read_text()
    assert len(parse_dump(text)) >= 2
    frames = main_thread(text)
    assert frames is not None
    assert frames[0].func == "test_a_real_faulthandler_dump_parses", frames[:2]
    assert not in_collective(frames)


def test_in_collective_is_about_the_innermost_frame():
    assert in_collective(main_thread(IN_ALLREDUCE) or ())
    assert in_collective(main_thread(IN_FSDP) or ())
    assert in_collective(main_thread(IN_DDP_BACKWARD) or ())
    assert not in_collective(main_thread(STUCK) or ())
    assert not in_collective(())


def test_the_rank_outside_the_collective_is_the_culprit():
    d = diagnose(
        [
            Probe(0, 100, "S", "futex_wait_queue", IN_ALLREDUCE),
            Probe(1, 101, "S", "anon_pipe_read", STUCK),
            Probe(2, 102, "S", "futex_wait_queue", IN_FSDP),
        ]
    )
    assert [f.rank for f in d.culprits] == [1] and not d.suspects
    assert d.waiting == [0, 2]
    s = d.summary()
    assert "culprit rank 1 (pid 101) is not in a collective: stuck_read" in s, s
    assert "anon_pipe_read" in s and "ranks 0, 2 wait in a collective" in s
    c = d.culprits[0].to_dict()
    assert (c["rank"], c["pid"], c["where"]) == (1, 101, "elsewhere")
    assert [f["func"] for f in c["frames"]] == ["stuck_read", "maybe_hang", "loop"]  # the innermost three


def test_stopped_ranks_are_the_culprits_whatever_their_stack():
    d = diagnose([Probe(0, 100, "S", "", STUCK), Probe(1, 101, "T", "do_signal_stop", IN_ALLREDUCE)])
    assert [(f.rank, f.where) for f in d.culprits] == [(1, Where.STOPPED)]
    assert "rank 1 (pid 101) is stopped (SIGSTOP?)" in d.summary()


def test_a_rank_without_a_dump_is_a_suspect():
    d = diagnose(
        [Probe(0, 100, "S", "futex_wait_queue", IN_ALLREDUCE), Probe(1, 101, "D", "nfs_wait_bit", None)]
    )
    assert not d.culprits and [f.rank for f in d.suspects] == [1]
    assert "suspect rank 1 (pid 101) wrote no stack dump [state D, in nfs_wait_bit]" in d.summary()
    assert d.suspects[0].to_dict()["where"] == "no_dump"


def test_no_culprit_when_everyone_waits_or_everyone_is_elsewhere():
    waiting = diagnose([Probe(0, 1, "S", "", IN_ALLREDUCE), Probe(1, 2, "S", "", IN_FSDP)])
    assert not waiting.culprits and "culprit is on another node" in waiting.summary()
    shared = diagnose([Probe(0, 1, "S", "", STUCK), Probe(1, 2, "S", "", STUCK)])
    assert not shared.culprits and "no culprit named" in shared.summary()
    alone = diagnose([Probe(0, 1, "S", "", STUCK)])
    assert [f.rank for f in alone.culprits] == [0]
    assert diagnose([]).summary() == ""


# ---------------------------------------------------------------- the trainer's drill switch


def test_switch_round_trip_and_bad_value(tmp_path):
    sw = Switch(tmp_path, (Hang(1, 37), Hang(0, 50, When.SAVE)))
    assert Switch.decode(sw.encode()) == sw
    assert sw.marker(Hang(1, 37)) != sw.marker(Hang(1, 37, When.SAVE))
    with pytest.raises(ValueError, match=f"{ENV} is not a drill switch"):
        Switch.decode('{"hangs": [{"rank": 1}]}')
    assert rank_faults.stuck_read.__name__ == BLOCKING_FUNCTION


def test_switch_is_inert_unset_and_for_other_ranks_and_steps(tmp_path, monkeypatch):
    monkeypatch.delenv(ENV, raising=False)
    rank_faults.DrillFaults.from_env(0, "L").maybe_hang(37, When.STEP)  # returns: nothing set
    monkeypatch.setenv(ENV, Switch(tmp_path, (Hang(1, 37),)).encode())
    f = rank_faults.DrillFaults.from_env(0, "L")
    f.maybe_hang(37, When.STEP)  # another rank's hang
    g = rank_faults.DrillFaults.from_env(1, "L")
    g.maybe_hang(36, When.STEP)
    g.maybe_hang(37, When.SAVE)
    assert not list(tmp_path.iterdir())
    monkeypatch.setenv(ENV, "nonsense")
    with pytest.raises(SystemExit, match=f"resumable: {ENV} is not a drill switch"):
        rank_faults.DrillFaults.from_env(1, "L")


HANGING_RANK = """
import sys
from pathlib import Path
from supervisor.drill.rank_faults import DrillFaults, When
from supervisor.resumable._signals import PreemptionFlag, register_stack_dump
flag = PreemptionFlag()
flag.install()
stacks = register_stack_dump(Path(sys.argv[1]), Path(sys.argv[1]).parent)
DrillFaults.from_env(1, sys.argv[2]).maybe_hang(37, When.STEP)
print("ran on past step 37", flush=True)
"""


def _back_in_read(pid: int) -> bool:
    """Every signal sent was delivered and handled, and the rank sleeps in its read again."""
    state, wchan = proc_state(pid)
    status = Path(f"/proc/{pid}/status").read_text().splitlines()
    pending = any(int(x.split()[1], 16) for x in status if x.startswith(("SigPnd:", "ShdPnd:")))
    return state == "S" and not pending and ("pipe_read" in wchan or not wchan)


def test_the_hang_survives_sigterm_and_dumps_its_stack_then_fires_only_once(tmp_path):
    """The real trainer's signal handlers: SIGTERM (preemption flag) and SIGCONT do not cure it,
    SIGUSR2's faulthandler dump still shows where it is stuck; a relaunch runs on past the step."""
    sw = Switch(tmp_path / "markers", (Hang(1, 37),))
    env = dict(os.environ, **{ENV: sw.encode()})
    stacks = tmp_path / "stacks.txt"
    cmd = [sys.executable, "-c", HANGING_RANK, str(stacks), "launch-1"]
    p = subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        marker = sw.marker(Hang(1, 37))
        wait_for(marker.exists, "marker", proc=p)
        m = read_marker(marker)
        assert m is not None and (m["rank"], m["step"], m["pid"], m["launch"]) == (1, 37, p.pid, "launch-1")
        assert json.loads(marker.read_text())["when"] == "step"
        for sig in (signal.SIGTERM, signal.SIGCONT, signal.SIGUSR1):
            p.send_signal(sig)
        wait_for(lambda: _back_in_read(p.pid), "the handlers ran and the read resumed", proc=p)
        p.send_signal(signal.SIGUSR2)
        wait_for(lambda: stacks.exists() and "stuck_read" in stacks.read_text(), "stack dump", proc=p)
        frames = main_thread(stacks.read_text())
        assert frames is not None and frames[0].func == BLOCKING_FUNCTION, frames
        assert p.poll() is None
    finally:
        p.kill()
        p.wait()
    again = subprocess.Popen([*cmd[:-1], "launch-2"], env=env, stdout=subprocess.PIPE, text=True)
    try:
        out, _ = again.communicate(timeout=PATIENCE_S)
    except subprocess.TimeoutExpired:  # seen once in CI (it had printed its line): say where it is
        state, before = proc_state(again.pid), stacks.stat().st_size
        again.send_signal(signal.SIGUSR2)
        wait_for(lambda: stacks.stat().st_size > before, "its stack dump")
        again.kill()
        raise AssertionError(f"the relaunch never ended ({state}): {stacks.read_text()[before:]}") from None
    assert again.returncode == 0 and "ran on past step 37" in out, (again.returncode, out)


THREADED_RANK = HANGING_RANK.replace(
    "flag = PreemptionFlag()",
    "import threading, time\n"
    "for _ in range(4):\n"
    "    threading.Thread(target=time.sleep, args=(1e6,), daemon=True).start()\n"
    "flag = PreemptionFlag()",
)


def test_a_slowly_written_dump_is_read_whole_once_the_handler_returned(faultfs: FaultFS) -> None:
    """faulthandler writes a dump in many small writes, the main thread last; each write to this
    mount waits, so a dump takes seconds: the watchdog reads it once the handler is done, not when
    the file first grows (a read then had half a dump, without the main thread, under load)."""
    sw = Switch(faultfs.mountpoint / "markers", (Hang(1, 37),))
    stacks = faultfs.mountpoint / "stacks.txt"
    cmd = [sys.executable, "-c", THREADED_RANK, str(stacks), "launch-1"]
    p = subprocess.Popen(cmd, env=dict(os.environ, **{ENV: sw.encode()}), stdout=subprocess.PIPE, text=True)
    try:
        wait_for(sw.marker(Hang(1, 37)).exists, "marker", proc=p)
        wait_for(lambda: _back_in_read(p.pid), "the rank in its read", proc=p)  # past the marker's write
        rid = faultfs.delay("/stacks.txt", 0.01, ops=["write"])
        got = dump_stacks({1: p.pid}, {1: stacks}, wait_s=600)
        frames = main_thread(got[1])
        assert frames and frames[0].func == BLOCKING_FUNCTION, f"half a dump: {got[1]}"
        assert got[1] == stacks.read_text()
        assert faultfs.hits(rid) > 20, "the dump was not written slowly: it proves nothing"
    finally:
        p.kill()
        p.wait()
