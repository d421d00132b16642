"""A small stand-in for ``torchrun ... -m train_ref.train`` in watchdog process tests: no torch.

The launcher starts ``--ranks`` worker processes, each in a session of its own, and exits 1 when
any worker fails, 0 when all finish; it has no SIGUSR1 handler, like torchrun's agent. How it ends
a launch with a failed worker, ``--launcher``:
- ``torchrun`` (default): kills the other workers at the first non-zero exit, as torchrun does;
- ``wait-all``: waits for every worker (a launcher that lets each rank finish on its own).
The watchdog must be right with either, so the tests run both.

Each worker resumes from the newest valid checkpoint in ``--root``, steps with ``--step-s`` sleeps
in lockstep with its peers, writes heartbeats through supervisor.format.heartbeat, commits a tiny
checkpoint through supervisor.store every ``--ckpt-every`` steps (phase save), and can crash, stop
itself, or exit with a code, once or on every launch. After each step it honours the hold gate of
train_ref/hold.py (``TRAIN_REF_HOLD_FILE``; write the file before the launch: these ranks do not
agree on it as the real trainer's do); with ``--hold-in-save`` every rank holds inside the save of
that step instead, silent in phase save (a save as long as the test wants); with ``--wait-in-save``
it holds there beating as a wait for its peers (no progress: ranks in different collectives after
a failed save did so for ten minutes, issue 44). SIGUSR2: faulthandler
dump of every thread to the rank's stack file.

SIGUSR1 (the watchdog sends it to every rank): rank 0 decides, as the real trainer's agreement
would: it checkpoints at its next step boundary and exits 75. The other ranks learn it in their
next "collective" (the lockstep wait for their peers): under ``wait-all`` they record 75 and exit
75, like the real trainer's ranks; under ``torchrun`` they stay inside that collective until the
launcher kills them, so their code is never recorded. Each outcome is thus made deterministically,
never left to a race between a rank and its launcher.

Storage and process-tree cases (tests/test_watch_faults.py): ``--fault read`` reads
``--read-file`` in phase verify (blocked there by a faultfs rule, the rank sits in the kernel);
``--survive-save-errors`` reports a failed save in the heartbeat and trains on, as the real trainer
does; ``--no-final-beat`` finishes without the last heartbeat (it could not be written);
``--silent`` writes no heartbeat at all; ``--spawn-child`` gives each rank a child like a DataLoader
worker (no SIGUSR1 handler; it notes a SIGTERM in its file under ``children/``); ``--plain`` runs
one rank as the launched process itself (a plain script, no launcher). A ``--silent`` rank cannot
learn of a preemption from its peers, so it acts on SIGUSR1 itself.
"""

from __future__ import annotations

import argparse
import faulthandler
import itertools
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from supervisor import store
from supervisor.format.exitcodes import Exit
from supervisor.format.heartbeat import (
    ENV_RESTART_COUNT,
    HeartbeatWriter,
    Phase,
    read_heartbeat,
    stack_dump_path,
)
from supervisor.format.layout import heartbeat_filename
from supervisor.format.manifest import CheckpointInfo
from train_ref.hold import HoldGate

STATE_FILE = "state.txt"
LAUNCHERS = ("torchrun", "wait-all")
PEER_POLL_S = 0.005


def parse(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--root", required=True, type=Path)
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--worker", type=int, default=None, help="(internal) run as this rank")
    p.add_argument("--launcher", choices=LAUNCHERS, default="torchrun")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--step-s", type=float, default=0.05)
    p.add_argument("--ckpt-every", type=int, default=5)
    p.add_argument("--hold-in-save", action="store_true", help="hold inside the save, without beating")
    p.add_argument(
        "--wait-in-save",
        action="store_true",
        help="hold inside the save, beating as a rank waiting for its peers does (no progress)",
    )
    p.add_argument(
        "--fault",
        choices=("crash", "kill", "stop", "exit", "startup-hang", "read", "quarantine"),
        default=None,
    )
    p.add_argument("--fault-step", type=int, default=0)
    p.add_argument("--fault-rank", type=int, default=0, help="rank 0 saves: its faults follow its commits")
    p.add_argument("--fault-code", type=int, default=1)
    p.add_argument("--fault-launches", type=int, default=1, help="fault in the first N launches (0: all)")
    p.add_argument("--ignore-sigterm", action="store_true")
    p.add_argument("--read-file", default="probe.bin", help="--fault read: the file (under --root) to read")
    p.add_argument("--survive-save-errors", action="store_true", help="a failed save is reported, not fatal")
    p.add_argument("--no-final-beat", action="store_true", help="finish without the last heartbeat")
    p.add_argument("--silent", action="store_true", help="write no heartbeat")
    p.add_argument("--spawn-child", action="store_true", help="each rank starts a DataLoader-like child")
    p.add_argument("--plain", action="store_true", help="run one rank as the launched process itself")
    return p.parse_args(argv)


WAIT_IN_SAVE = "its peers in the save's exchange"  # --wait-in-save's wait


class SilentWriter(HeartbeatWriter):
    """--silent: a rank that writes no heartbeat (a command the watchdog knows only from /proc)."""

    def beat(self, *args: object, **kwargs: object) -> bool:
        return False


# A DataLoader-like child: no SIGUSR1 handler (the default action kills it), notes a SIGTERM.
CHILD = """import os, signal, sys, time
path = sys.argv[1]
def term(*_):
    with open(path, "a") as f:
        f.write("sigterm\\n")
    os._exit(0)
signal.signal(signal.SIGTERM, term)
with open(path, "a") as f:
    f.write("started\\n")
while True:
    time.sleep(1)
"""


def spawn_child(root: Path, rank: int) -> subprocess.Popen:
    folder = root / "children"
    folder.mkdir(exist_ok=True)
    return subprocess.Popen([sys.executable, "-c", CHILD, str(folder / f"rank{rank}_{os.getpid()}.txt")])


def read_file(root: Path, name: str, step: int, hb: HeartbeatWriter) -> None:
    """--fault read: read a file in phase verify, naming it in the heartbeat first (a faultfs
    block rule keeps the read from ever returning)."""
    path = root / name
    hb.beat(step, Phase.VERIFY, force=True, total=path.stat().st_size, io_path=name)
    with open(path, "rb") as f:
        f.read()


def save_or_report(root: Path, step: int, world: int, hb: HeartbeatWriter) -> None:
    """--survive-save-errors: a save that fails is removed and reported in the heartbeat
    (save_failures, last_error), and training goes on, as the real trainer does."""
    try:
        save(root, step, world)
    except OSError as e:
        for tmp in root.glob(f"step_{step:08d}.tmp.*"):
            shutil.rmtree(tmp, ignore_errors=True)
        hb.save_failures += 1
        hb.last_error = f"save of step_{step:08d}: {type(e).__name__}: {e}"
    else:
        hb.save_failures, hb.last_error = 0, ""
    hb.beat(step, Phase.TRAIN, force=True)


def newest_valid_step(root: Path) -> int:
    for ref in store.list_checkpoints(root):
        if store.validate(ref).ok:
            return int((ref.path / STATE_FILE).read_text())
    return 0


def save(root: Path, step: int, world: int) -> None:
    tmp = store.begin(root, step)
    (tmp / STATE_FILE).write_text(str(step))
    store.commit(root, tmp, CheckpointInfo(step, world))


class PeerPreempted(Exception):
    """Rank 0 stopped for a preemption while this rank waited for it."""


def wait_for_peers(folder: Path, rank: int, world: int, step: int, launch_id: str) -> None:
    """Lockstep like a collective: wait until every other rank of this launch reached ``step``
    (so a stopped rank stalls the others, and ranks die within one step of each other). Raises
    PeerPreempted when rank 0 exited for a preemption instead: every other rank ends up here."""
    for r in range(world):
        while r != rank:
            hb = read_heartbeat(folder / heartbeat_filename(r), r).heartbeat
            if hb is not None and hb.launch_id == launch_id:
                if r == 0 and hb.exit_code == Exit.REQUEUE:
                    raise PeerPreempted
                if hb.step >= step:
                    break
            time.sleep(PEER_POLL_S)


def stay_in_collective() -> None:
    """A rank inside a collective whose peer is gone: nothing happens until it is killed."""
    while True:
        time.sleep(3600)


def worker(a: argparse.Namespace, rank: int) -> int:
    dump = stack_dump_path(a.root, rank)
    dump.parent.mkdir(parents=True, exist_ok=True)
    faulthandler.register(signal.SIGUSR2, file=open(dump, "a"), all_threads=True)  # noqa: SIM115
    if a.ignore_sigterm:
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
    preempted = []
    signal.signal(signal.SIGUSR1, lambda *_: preempted.append(True))
    launch = int(os.environ.get(ENV_RESTART_COUNT, "0"))
    faulty = (
        a.fault is not None and rank == a.fault_rank and (a.fault_launches == 0 or launch < a.fault_launches)
    )
    writer = SilentWriter if a.silent else HeartbeatWriter
    hb = writer(a.root, rank=rank, local_rank=rank, world_size=a.ranks, interval_s=0.0)
    gate = HoldGate.from_env(rank, hb.launch_id)
    if a.spawn_child:
        spawn_child(a.root, rank)
    hb.beat(0, Phase.STARTUP)
    if faulty and a.fault == "startup-hang":
        time.sleep(3600)
    step = newest_valid_step(a.root)
    hb.beat(step, Phase.LOAD)
    while step < a.steps:
        try:
            if not a.silent:
                wait_for_peers(hb.folder, rank, a.ranks, step, hb.launch_id)
        except PeerPreempted:
            if a.launcher == "torchrun":
                stay_in_collective()
            hb.beat(step, Phase.TRAIN, exit_code=Exit.REQUEUE)
            return Exit.REQUEUE
        if faulty and step == a.fault_step:
            if a.fault == "read":
                read_file(a.root, a.read_file, step, hb)
            if a.fault == "crash":
                os._exit(1)
            if a.fault == "kill":  # as kill -9 from outside: no exit code, no exception
                os.kill(os.getpid(), signal.SIGKILL)
            if a.fault == "quarantine":  # as a rank whose load found its checkpoint corrupt
                newest = store.list_checkpoints(a.root)[0]
                store.quarantine(a.root, newest, f"{newest.name}: a record failed at load (fake trainer)")
                hb.beat(step, Phase.LOAD, exit_code=1)
                return 1
            if a.fault == "stop":
                os.kill(os.getpid(), signal.SIGSTOP)
            if a.fault == "exit":
                hb.beat(step, Phase.TRAIN, exit_code=a.fault_code)
                return a.fault_code
        t0 = time.monotonic()
        time.sleep(a.step_s)
        step += 1
        hb.beat(step, Phase.TRAIN, last_step_s=time.monotonic() - t0)
        stop = bool(preempted) and (rank == 0 or a.silent)
        if stop or step % a.ckpt_every == 0:
            hb.beat(step, Phase.SAVE, force=True)
            if (a.hold_in_save or a.wait_in_save) and gate is not None and gate.wanted(step):
                waits = lambda: hb.beat(step, Phase.SAVE, waiting=WAIT_IN_SAVE)  # noqa: B023, E731 - called right here
                gate.hold(step, waits if a.wait_in_save else lambda: None)
            if rank == 0 and a.survive_save_errors:
                save_or_report(a.root, step, a.ranks, hb)
            elif rank == 0:
                save(a.root, step, a.ranks)
            if stop:
                hb.beat(step, Phase.TRAIN, exit_code=Exit.REQUEUE)
                return Exit.REQUEUE
        if gate is not None and gate.wanted(step):
            # held, it beats as a trainer's own ``Resumable.beat()`` does: each call progress
            held = itertools.count(1)
            gate.hold(step, lambda: hb.beat(step, Phase.TRAIN, progress=next(held)))  # noqa: B023 - called right here
    if not a.no_final_beat:
        hb.beat(step, Phase.DONE, exit_code=0)
    return 0


def launcher(a: argparse.Namespace, argv: list[str]) -> int:
    procs = [
        subprocess.Popen([sys.executable, __file__, *argv, "--worker", str(r)], start_new_session=True)
        for r in range(a.ranks)
    ]
    while True:
        codes = [p.poll() for p in procs]
        failed = any(c not in (None, 0) for c in codes)
        if failed and a.launcher == "torchrun":
            for p in procs:
                if p.poll() is None:
                    p.kill()
            return 1
        if None not in codes:
            return 1 if failed else 0
        time.sleep(0.02)


def main(argv: list[str]) -> int:
    a = parse(argv)
    a.root.mkdir(parents=True, exist_ok=True)
    if a.worker is not None:
        return worker(a, a.worker)
    if a.plain:
        a.ranks = 1
        return worker(a, 0)
    return launcher(a, argv)


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
