"""Hang detection latency and mean time to recovery, side by side in one run.

1. Hang detection: SIGSTOP one rank of the fake trainer (no torch) under the watchdog; latency =
   the `hang` event's time minus the SIGSTOP. Target: at most the configured timeout + 2 s.
   Also (where FUSE can be mounted) a read that never returns: the fake trainer's rank 1 reads a
   file on the fault filesystem whose reads are blocked, in phase verify; latency = the
   `blocked_io` event's time (it names rank, phase and path, before the stack dumps) minus the
   moment the read blocked (the filesystem's own record).
2. MTTR with the real trainer (torchrun, 2 ranks, tiny config, gloo on CPU): `kill -9` of rank 1,
   then the time until a rank reports its first step of the resumed run, for
   - the watchdog (torchrun --max-restarts=0 under `supervisor watch`), with its default
     `--dead-rank-grace` (a vanished rank may be a clean exit whose last heartbeat did not land)
     and with `--dead-rank-grace 0`: the difference is what the grace costs,
   - plain `torchrun --max-restarts=1` (with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, without which
     its restart hangs here),
   - the floor: a cold torchrun resuming from the same kind of checkpoint, from exec to its first
     step (process start, torch import, rendezvous, state load). Target: watchdog <= floor + 1 s.

    .venv/bin/python bench/mttr.py [--trials 1] [--hang-timeout 2]
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from supervisor.format.events import events_path
from supervisor.format.heartbeat import Heartbeat, Phase
from supervisor.format.nodesummary import read_run_heartbeats

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
TORCHRUN = str(Path(PY).parent / "torchrun")
FAKE = str(REPO / "tests" / "fake_trainer.py")
KILL_AT_STEP = 15
TRAIN = ["-m", "train_ref.train", "--steps", "400", "--save-every", "10", "--seed", "1"]


def beats(root: Path) -> list[Heartbeat]:
    return [s.heartbeat for s in read_run_heartbeats(root) if s.heartbeat is not None]


def wait_for(cond: Callable[[], object], timeout: float = 300.0) -> object:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        got = cond()
        if got:
            return got
        time.sleep(0.02)
    raise TimeoutError("condition not met")


def rank_at(root: Path, rank: int, step: int) -> Heartbeat | None:
    return next(
        (b for b in beats(root) if b.rank == rank and b.phase == Phase.TRAIN and b.step >= step), None
    )


def first_new_step(root: Path, old_pids: set[int]) -> Heartbeat | None:
    """The first train heartbeat of a process that did not exist before the kill."""
    new = [b for b in beats(root) if b.pid not in old_pids and b.phase == Phase.TRAIN and b.last_step_s > 0]
    return min(new, key=lambda b: b.wall_time) if new else None


def stop(p: subprocess.Popen) -> None:
    if p.poll() is None:
        p.send_signal(signal.SIGTERM)
        try:
            p.wait(60)
        except subprocess.TimeoutExpired:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()


def spawn(argv: list[str], env: dict[str, str] | None = None) -> subprocess.Popen:
    return subprocess.Popen(
        argv, cwd=REPO, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True
    )


def hang_latency(tmp: Path, timeout_s: float) -> float:
    root = tmp / "hang"
    watch = [PY, "-m", "supervisor", "watch", "--ckpt-root", str(root), "--hang-timeout", str(timeout_s)]
    watch += ["--kill-grace", "1", "--dump-wait", "1", "--no-progress", "0", "--"]
    p = spawn([*watch, PY, FAKE, "--root", str(root), "--steps", "100000", "--step-s", "0.05"])
    try:
        hb = wait_for(lambda: rank_at(root, 1, 5))
        t_stop = time.time()
        os.kill(hb.pid, signal.SIGSTOP)

        def hang_event() -> float | None:
            try:
                lines = events_path(root).read_text().splitlines()
            except OSError:
                return None
            return next((json.loads(x)["t"] for x in lines if '"event": "hang"' in x), None)

        return float(wait_for(hang_event, 60)) - t_stop
    finally:
        stop(p)


def watch_cmd(root: Path, opts: list[str], command: list[str]) -> list[str]:
    """``python -m supervisor watch --ckpt-root ROOT OPTS -- COMMAND``."""
    return [PY, "-m", "supervisor", "watch", "--ckpt-root", str(root), *opts, "--", *command]


def hang_latency_blocked_read(tmp: Path, timeout_s: float) -> float | None:
    """A read that never returns (faultfs block) -> the hang event; None where FUSE is unusable."""
    from supervisor.drill.faultctl import FaultFS, fuse_unavailable

    if fuse_unavailable() is not None:
        return None
    with FaultFS.start(tmp / "backing", tmp / "mnt") as fs:
        root = fs.mountpoint / "run"
        root.mkdir()
        (root / "probe.bin").write_bytes(bytes(4096))
        rule = fs.block("/run/probe.bin", ops=["read"])
        opts = ["--verify-timeout", str(timeout_s), "--kill-grace", "1", "--dump-wait", "1"]
        opts += ["--reap-timeout", "1", "--no-progress", "0"]
        fake = [PY, FAKE, "--root", str(root), "--steps", "100000", "--fault", "read", "--fault-rank", "1"]
        p = spawn(watch_cmd(root, opts, [*fake, "--fault-step", "5"]))
        try:
            (blocked,) = fs.wait_blocked(rule, timeout=300)

            named = wait_for(lambda: first_event(root, "blocked_io"), 60)  # rank, phase, path
            return float(named) - blocked.since
        finally:
            fs.clear(rule)
            stop(p)


def first_event(root: Path, kind: str) -> float | None:
    try:
        lines = events_path(root).read_text().splitlines()
    except OSError:
        return None
    return next((json.loads(x)["t"] for x in lines if f'"event": "{kind}"' in x), None)


def mttr(
    tmp: Path, name: str, argv_for: Callable[[Path], list[str]], env: dict[str, str] | None = None
) -> tuple[float, float | None]:
    """kill -9 -> the first step of the resumed run; and, under the watchdog, kill -9 -> its
    verdict on the launch (the `launch_end` event): the part the dead-rank grace can lengthen."""
    root = tmp / name
    p = spawn(argv_for(root), env)
    try:
        victim = wait_for(lambda: rank_at(root, 1, KILL_AT_STEP))
        old = {b.pid for b in beats(root)}
        t_kill = time.time()
        os.kill(victim.pid, signal.SIGKILL)
        first = wait_for(lambda: first_new_step(root, old))
        decided = first_event(root, "launch_end")
        return first.wall_time - t_kill, None if decided is None else decided - t_kill
    finally:
        stop(p)


def floor(tmp: Path) -> float:
    """A cold torchrun that resumes from a checkpoint: exec -> first step done."""
    root = tmp / "floor"
    prep = spawn(
        [
            TORCHRUN,
            "--standalone",
            "--nproc-per-node=2",
            *TRAIN[:2],
            "--steps",
            "20",
            "--save-every",
            "10",
            "--seed",
            "1",
            "--ckpt-root",
            str(root),
        ]
    )
    prep.wait()
    old = {b.pid for b in beats(root)}
    t0 = time.time()
    p = spawn([TORCHRUN, "--standalone", "--nproc-per-node=2", *TRAIN, "--ckpt-root", str(root)])
    try:
        first = wait_for(lambda: first_new_step(root, old))
        return first.wall_time - t0
    finally:
        stop(p)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--hang-timeout", type=float, default=2.0)
    ap.add_argument("--hang-trials", type=int, default=3)
    a = ap.parse_args()
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")

    def watchdog(root: Path, *opts: str) -> list[str]:
        trainer = [TORCHRUN, "--standalone", "--nproc-per-node=2", "--max-restarts=0", *TRAIN]
        return watch_cmd(root, list(opts), [*trainer, "--ckpt-root", str(root)])

    def plain(root: Path) -> list[str]:
        return [
            TORCHRUN,
            "--standalone",
            "--nproc-per-node=2",
            "--max-restarts=1",
            *TRAIN,
            "--ckpt-root",
            str(root),
        ]

    rows: dict[str, list[float]] = {
        "hang": [],
        "hang_read": [],
        "watchdog": [],
        "watchdog_nograce": [],
        "decided": [],
        "decided_nograce": [],
        "torchrun": [],
        "floor": [],
    }
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        for i in range(a.hang_trials):
            rows["hang"].append(hang_latency(tmp / f"h{i}", a.hang_timeout))
            read = hang_latency_blocked_read(tmp / f"r{i}", a.hang_timeout)
            if read is not None:
                rows["hang_read"].append(read)
        for i in range(a.trials):
            rows["floor"].append(floor(tmp / f"f{i}"))
            for key, opts in (("", ()), ("_nograce", ("--dead-rank-grace", "0"))):
                total, decided = mttr(tmp / f"w{key}{i}", "run", lambda root, o=opts: watchdog(root, *o))
                rows[f"watchdog{key}"].append(total)
                rows[f"decided{key}"].append(decided)  # type: ignore[arg-type]
            rows["torchrun"].append(mttr(tmp / f"t{i}", "run", plain, env)[0])
    if not rows["hang_read"]:
        print("(blocked-read hang detection not measured: FUSE cannot be mounted here)")
        del rows["hang_read"]
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"{'measure':<56}{'median':>8}{'min':>8}{'max':>8}")
    labels = {
        "hang": f"hang detection, SIGSTOP -> hang event (timeout {a.hang_timeout:g}s)",
        "hang_read": f"hang detection, blocked read -> blocked_io (timeout {a.hang_timeout:g}s)",
        "floor": "floor: cold torchrun resume -> first step",
        "watchdog": "MTTR watchdog: kill -9 -> first resumed step",
        "watchdog_nograce": "MTTR watchdog --dead-rank-grace 0: same",
        "decided": "watchdog: kill -9 -> launch_end (default grace)",
        "decided_nograce": "watchdog --dead-rank-grace 0: kill -9 -> launch_end",
        "torchrun": "MTTR torchrun --max-restarts=1: same",
    }
    for k, label in labels.items():
        if k in rows:
            v = rows[k]
            print(f"{label:<56}{med[k]:>7.2f}s{min(v):>7.2f}s{max(v):>7.2f}s")
    for k in ("hang", "hang_read"):
        if k in rows:
            ok = max(rows[k]) <= a.hang_timeout + 2
            print(
                f"{labels[k]}: worst {max(rows[k]):.2f}s vs target timeout + 2 s = {a.hang_timeout + 2:g}s: "
                f"{'meets' if ok else 'MISSES'}"
            )
    print(
        f"dead-rank grace costs {med['decided'] - med['decided_nograce']:+.2f}s until the verdict, "
        f"{med['watchdog'] - med['watchdog_nograce']:+.2f}s of MTTR (medians)"
    )
    over = med["watchdog"] - med["floor"]
    print(
        f"MTTR watchdog - floor: {over:+.2f}s (target <= +1 s: {'meets' if over <= 1 else 'MISSES'}); "
        f"watchdog / torchrun: {med['watchdog'] / med['torchrun']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
