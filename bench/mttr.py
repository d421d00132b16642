"""Hang detection latency and mean time to recovery, side by side in one run.

1. Hang detection: SIGSTOP one rank of the fake trainer (no torch) under the watchdog; latency =
   the verdict's time (the `hang` event's ``detected``) minus the SIGSTOP, and the event's own
   time (after the stack dumps). Target: the verdict at most the configured timeout + 0.5 s. The
   trials' stops are spread evenly over one ``--poll-interval`` after the rank is seen at step 5
   (else each lands at the same moment of the watchdog's poll, and a quiet machine measures the
   best case every time).
   Also (where FUSE can be mounted) a read that never returns: the fake trainer's rank 1 reads a
   file on the fault filesystem whose reads are blocked, in phase verify; latency = the
   `blocked_io` event's time (it names rank, phase and path, before the stack dumps) minus the
   moment the read blocked (the filesystem's own record).
2. MTTR with the real trainer (torchrun, 2 ranks, tiny config, gloo on CPU): `kill -9` of rank 1,
   then the time until both new ranks have done their first step of the resumed run (the
   ``first_step`` mark of their heartbeats, written at once), for
   - the watchdog (torchrun --max-restarts=0 under `supervisor watch`), with its default
     `--dead-rank-grace` (a vanished rank may be a clean exit whose last heartbeat did not land)
     and with `--dead-rank-grace 0`: the difference is what the grace costs,
   - plain `torchrun --max-restarts=1` (with TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1, without which
     its restart hangs here),
   - the floor: a cold torchrun resuming from the same kind of checkpoint, from exec to its first
     step (process start, torch import, rendezvous, state load),
   - the watchdog with --standby (the relaunch is the launch started ahead, its ranks waiting with
     their imports done; the kill comes once they are ready). Target: <= 0.5x torchrun's.
   Each with its breakdown: the ranks' marks (process started, torch imported, rendezvous done,
   state loaded, first step) as seconds after the kill (the floor: after its exec), and the
   watchdog's own `recovery` event (detected, tree killed, backoff, pick, command started).

    .venv/bin/python bench/mttr.py [--trials 5] [--hang-timeout 2] [--hang-trials 3] [--nograce]
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

from supervisor.format.atomic import hostname
from supervisor.format.events import events_path
from supervisor.format.heartbeat import Heartbeat, Phase
from supervisor.format.layout import STANDBY_READY_PREFIX, RunDir
from supervisor.format.nodesummary import read_run_heartbeats
from supervisor.watch import recovery
from supervisor.watch.config import DEFAULT_POLL_S
from supervisor.watch.recovery import Moment

REPO = Path(__file__).resolve().parent.parent
PY = sys.executable
TORCHRUN = str(Path(PY).parent / "torchrun")
FAKE = str(REPO / "tests" / "fake_trainer.py")
KILL_AT_STEP = 15
NPROC = 2
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


def resumed(root: Path, old_pids: set[int]) -> dict[Moment, float] | None:
    """The ranks' moments (recovery.rank_moments) of the processes that did not exist before the
    kill, once all NPROC of them have made their first step."""
    new = [b for b in beats(root) if b.pid not in old_pids]
    if len(new) < NPROC:
        return None
    at = recovery.rank_moments(new, hostname())
    return at if recovery.complete(at) else None


def since(at: dict[Moment, float], t0: float) -> dict[str, float]:
    return {m.value: t - t0 for m, t in at.items()}


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


def hang_latency(tmp: Path, timeout_s: float, offset_s: float) -> tuple[float, float]:
    """SIGSTOP (``offset_s`` after rank 1 is seen at step 5) -> the watchdog's hang verdict (the
    event's ``detected``), and -> the hang event itself, written after the stack dumps
    (--dump-wait 1)."""
    root = tmp / "hang"
    watch = [PY, "-m", "supervisor", "watch", "--ckpt-root", str(root), "--hang-timeout", str(timeout_s)]
    watch += ["--kill-grace", "1", "--dump-wait", "1", "--no-progress", "0", "--"]
    p = spawn([*watch, PY, FAKE, "--root", str(root), "--steps", "100000", "--step-s", "0.05"])
    try:
        hb = wait_for(lambda: rank_at(root, 1, 5))
        time.sleep(offset_s)
        t_stop = time.time()
        os.kill(hb.pid, signal.SIGSTOP)

        def hang_event() -> float | None:
            try:
                lines = events_path(root).read_text().splitlines()
            except OSError:
                return None
            return next((json.loads(x) for x in lines if '"event": "hang"' in x), None)

        ev = wait_for(hang_event, 60)
        assert isinstance(ev, dict)
        return ev["detected"] - t_stop, ev["t"] - t_stop
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


def standby_ready(root: Path) -> bool:
    """With --standby: its ranks wait, imports done (each wrote its ready file)."""
    try:
        lines = events_path(root).read_text().splitlines()
    except OSError:
        return False
    ids = [json.loads(x)["launch_id"] for x in lines if '"event": "standby"' in x]
    return (
        bool(ids) and len(list(RunDir.of(root).launch_dir(ids[-1]).glob(f"{STANDBY_READY_PREFIX}*"))) >= NPROC
    )


def recovery_event(root: Path) -> dict[str, float] | None:
    """The watchdog's breakdown of its relaunch (the `recovery` event's phases)."""
    try:
        lines = events_path(root).read_text().splitlines()
    except OSError:
        return None
    recs = [json.loads(x) for x in lines if '"event": "recovery"' in x]
    return recs[-1]["phases"] if recs else None


def mttr(
    tmp: Path, name: str, argv_for: Callable[[Path], list[str]], env: dict[str, str] | None = None
) -> tuple[float, float | None, dict[str, float]]:
    """kill -9 -> the first step of the resumed run; under the watchdog, kill -9 -> its verdict
    on the launch (the `launch_end` event: the part the dead-rank grace can lengthen); and the
    breakdown: each rank moment as seconds after the kill, plus the watchdog's own phases."""
    root = tmp / name
    p = spawn(argv_for(root), env)
    try:
        victim = wait_for(lambda: rank_at(root, 1, KILL_AT_STEP))
        if "--standby" in argv_for(root):
            wait_for(lambda: standby_ready(root))
        old = {b.pid for b in beats(root)}
        t_kill = time.time()
        os.kill(victim.pid, signal.SIGKILL)
        at = wait_for(lambda: resumed(root, old))
        assert isinstance(at, dict)
        decided = first_event(root, "launch_end")
        parts = since(at, t_kill)
        if decided is not None:
            ours = wait_for(lambda: recovery_event(root), 60)
            assert isinstance(ours, dict)
            parts.update({f"watchdog: {k}": v for k, v in ours.items()})
        return at[Moment.FIRST_STEP] - t_kill, None if decided is None else decided - t_kill, parts
    finally:
        stop(p)


def floor(tmp: Path) -> tuple[float, dict[str, float]]:
    """A cold torchrun that resumes from a checkpoint: exec -> first step done, and its breakdown."""
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
    if prep.wait() != 0:
        raise RuntimeError(f"the floor's first run failed (exit {prep.returncode}) in {root}")
    old = {b.pid for b in beats(root)}
    t0 = time.time()
    p = spawn([TORCHRUN, "--standalone", "--nproc-per-node=2", *TRAIN, "--ckpt-root", str(root)])
    try:
        at = wait_for(lambda: resumed(root, old))
        assert isinstance(at, dict)
        return at[Moment.FIRST_STEP] - t0, since(at, t0)
    finally:
        stop(p)


HANG_MARGIN_S = 0.5  # hang detection target: the timeout + this


def median_parts(parts: list[dict[str, float]]) -> dict[str, float]:
    """Per key, the median over the trials that have it, in first-seen order."""
    keys = list(dict.fromkeys(k for p in parts for k in p))
    return {k: statistics.median(p[k] for p in parts if k in p) for k in keys}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--trials", type=int, default=1)
    ap.add_argument("--hang-timeout", type=float, default=2.0)
    ap.add_argument("--hang-trials", type=int, default=3)
    ap.add_argument("--nograce", action="store_true", help="also the watchdog with --dead-rank-grace 0")
    a = ap.parse_args()
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")

    def watchdog(*opts: str) -> Callable[[Path], list[str]]:
        def argv(root: Path) -> list[str]:
            trainer = [TORCHRUN, "--standalone", f"--nproc-per-node={NPROC}", "--max-restarts=0", *TRAIN]
            return watch_cmd(root, list(opts), [*trainer, "--ckpt-root", str(root)])

        return argv

    def plain(root: Path) -> list[str]:
        trainer = [TORCHRUN, "--standalone", f"--nproc-per-node={NPROC}", "--max-restarts=1", *TRAIN]
        return [*trainer, "--ckpt-root", str(root)]

    variants: dict[str, tuple[Callable[[Path], list[str]], dict[str, str] | None]] = {
        "watchdog": (watchdog(), None),
        "torchrun": (plain, env),
        "standby": (watchdog("--standby"), None),
    }
    if a.nograce:
        variants["watchdog_nograce"] = (watchdog("--dead-rank-grace", "0"), None)
    rows: dict[str, list[float]] = {"hang": [], "hang_event": [], "hang_read": [], "floor": []}
    parts: dict[str, list[dict[str, float]]] = {"floor": []}
    with tempfile.TemporaryDirectory() as t:
        tmp = Path(t)
        for i in range(a.hang_trials):
            detected, event = hang_latency(tmp / f"h{i}", a.hang_timeout, DEFAULT_POLL_S * i / a.hang_trials)
            rows["hang"].append(detected)
            rows["hang_event"].append(event)
            read = hang_latency_blocked_read(tmp / f"r{i}", a.hang_timeout)
            if read is not None:
                rows["hang_read"].append(read)
        for i in range(a.trials):  # alternated, so load drifts hit every variant alike
            total, brk = floor(tmp / f"f{i}")
            rows["floor"].append(total)
            parts["floor"].append(brk)
            for name, (argv_for, var_env) in variants.items():
                total, decided, brk = mttr(tmp / f"{name}{i}", "run", argv_for, var_env)
                rows.setdefault(name, []).append(total)
                parts.setdefault(name, []).append(brk)
                if decided is not None:
                    rows.setdefault(f"decided_{name}", []).append(decided)
    report(rows, parts, a.hang_timeout)
    return 0


def report(rows: dict[str, list[float]], parts: dict[str, list[dict[str, float]]], timeout: float) -> None:
    if not rows["hang_read"]:
        print("(blocked-read hang detection not measured: FUSE cannot be mounted here)")
    rows = {k: v for k, v in rows.items() if v}
    med = {k: statistics.median(v) for k, v in rows.items()}
    print(f"{'measure':<60}{'median':>8}{'min':>8}{'max':>8}  n")
    labels = {
        "hang": f"hang detection, SIGSTOP -> hang verdict (timeout {timeout:g}s)",
        "hang_event": "  ... -> hang event, after the stack dumps (--dump-wait 1)",
        "hang_read": f"hang detection, blocked read -> blocked_io (timeout {timeout:g}s)",
        "floor": "floor: cold torchrun resume, exec -> first step",
        "watchdog": "MTTR watchdog: kill -9 -> first resumed step",
        "watchdog_nograce": "MTTR watchdog --dead-rank-grace 0: same",
        "standby": "MTTR watchdog --standby: same",
        "torchrun": "MTTR torchrun --max-restarts=1: same",
        "decided_watchdog": "watchdog: kill -9 -> launch_end (default grace)",
        "decided_watchdog_nograce": "watchdog --dead-rank-grace 0: kill -9 -> launch_end",
        "decided_standby": "watchdog --standby: kill -9 -> launch_end",
    }
    for k, label in labels.items():
        if k in rows:
            v = rows[k]
            print(f"{label:<60}{med[k]:>7.2f}s{min(v):>7.2f}s{max(v):>7.2f}s  {len(v)}")
    for k in ("hang", "hang_read"):
        if k in rows:
            ok = max(rows[k]) <= timeout + HANG_MARGIN_S
            print(
                f"{labels[k]}: worst {max(rows[k]):.2f}s vs target timeout + {HANG_MARGIN_S:g} s = "
                f"{timeout + HANG_MARGIN_S:g}s: {'meets' if ok else 'MISSES'}"
            )
    if not parts["floor"]:
        return
    print("\nbreakdown, medians: ranks' marks in s after the kill (floor: after exec); watchdog: its phases")
    for name, p in parts.items():
        print(f"  {name:<18}" + ", ".join(f"{k} {v:.2f}" for k, v in median_parts(p).items()))
    print(f"\nMTTR watchdog - floor: {med['watchdog'] - med['floor']:+.2f}s (medians)")
    for name in ("watchdog", "watchdog_nograce", "standby"):
        if name in med:
            ratio = med[name] / med["torchrun"]
            verdict = "meets" if ratio <= 0.5 else "MISSES"
            print(f"{name} / torchrun --max-restarts=1: {ratio:.2f}x (target <= 0.5x: {verdict})")


if __name__ == "__main__":
    sys.exit(main())
