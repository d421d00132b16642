"""Goodput under steady faults, side by side in one run (issue 40).

    .venv/bin/python bench/goodput.py [--steps 1500] [--every 10,30] [--variants torchrun,watch,...] [--nproc 2]

The reference trainer (tiny config, ``--nproc`` ddp ranks, a disk save every ``--save-every`` steps) runs
``--steps`` steps uninterrupted under plain torchrun (its wall time is the reference, its digest
the golden one), then once per variant and fault period F with a kill -9 of a random rank of the
running launch every F seconds (the first F seconds after the start; each once the launch it hits
logged a step after the previous kill) until it is done:

- ``torchrun``: torchrun's own restarts (``--max-restarts=99``, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1);
- ``watch``: `supervisor watch --no-memory-tier` over torchrun (``--max-restarts=0``);
- ``standby``: ``watch --standby --no-memory-tier``;
- ``memory``: ``watch --standby`` with its memory tier (on by default; the interval by the 3% rule);
- ``memory1``: the same with a snapshot every step (``--memory-every 1``).

Per run: goodput = uninterrupted wall / faulted wall; kills; steps redone in all (metrics records
beyond ``--steps``) and per kill; time lost per kill ((faulted - uninterrupted wall) / kills); the
watchdog's recovery per kill (its ``recovery`` events: failure -> first step; median, max); and
whether the final digest equals the golden one. Where the time lost per kill went: the recovery
(mean), the steps (every logged step's ``step_time`` summed, less the uninterrupted run's: the
steps redone and every step made slower, by the tier's copies or a standby's imports on the same
cores), and the rest (starts and ends, checkpoint waits, the part of a killed step never logged).

The wall-time figures compare runs minutes apart, and this VM's speed drifts 10-20% between
runs: more than a few kills cost. So each kill's loss is also measured on the run's own clock
(``local``): the bench tails the metrics file and notes when each step appeared; a kill at t
after step s, at the pace p (steps per second) of the ``PACE_S`` seconds before it, costs
T(s + W) - t - W / p, where T(s + W) is when step s + W first appeared after the kill and W the
steps of half the fault period at that pace: detection, restart, the steps redone and every step
the recovery slowed (a next standby's imports too, where they end within that window), against the
same run a moment before.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import random
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from supervisor.format.events import events_path, read_events  # noqa: E402
from supervisor.format.heartbeat import ENV_LAUNCH_ID  # noqa: E402
from supervisor.format.layout import RunDir  # noqa: E402
from supervisor.format.metrics import MetricsRecord, read_metrics  # noqa: E402

TORCHRUN = str(Path(sys.executable).parent / "torchrun")
VARIANTS = {
    "torchrun": None,
    "watch": ("--no-memory-tier",),
    "standby": ("--standby", "--no-memory-tier"),
    "memory": ("--standby",),
    "memory1": ("--standby",),
}
TRAINER_FLAGS = {"memory1": ("--memory-every", "1")}
POLL_S = 0.01
PACE_S = 2.0  # the pace a kill interrupts: the steps of the seconds before it


@dataclass
class Tail:
    """The metrics file as it grows: each record's step and when the bench first saw it (every
    ``POLL_S``); its records are appended, redone steps included."""

    path: Path
    offset: int = 0
    seen: list[tuple[float, int]] = field(default_factory=list)  # (monotonic time, step)

    def poll(self) -> None:
        try:
            with self.path.open("rb") as f:
                f.seek(self.offset)
                chunk = f.read()
        except FileNotFoundError:
            return
        now, whole = time.monotonic(), chunk.rfind(b"\n") + 1
        self.seen += [(now, int(json.loads(line)["step"])) for line in chunk[:whole].splitlines()]
        self.offset += whole


def local_loss(
    seen: Sequence[tuple[float, int]], kill: float, until: float, last: int, after_s: float
) -> float | None:
    """A kill's loss on the run's own clock (the module's docstring); None where the run had no
    pace before it (a kill in a launch's first seconds) or did not reach its window's end before
    ``until`` (the next kill)."""
    before = [(t, s) for t, s in seen if t <= kill]
    if not before:
        return None
    t_k, s_k = before[-1]
    earlier = [(t, s) for t, s in before if t <= t_k - PACE_S]
    if not earlier or earlier[-1][1] >= s_k:
        return None
    t_0, s_0 = earlier[-1]
    pace = (s_k - s_0) / (t_k - t_0)
    target = min(s_k + max(1, round(pace * after_s)), last)
    after = [t for t, s in seen if kill < t <= until and s >= target]
    if not after or target <= s_k:
        return None
    return after[0] - kill - (target - s_k) / pace


@dataclass
class Run:
    variant: str
    every_s: float
    wall_s: float = 0.0
    kills: int = 0
    redone: int = 0
    recoveries: list[float] = field(default_factory=list)
    step_time_s: float = 0.0  # the logged steps' step_time, summed
    digest_equal: bool = False
    local: list[float] = field(default_factory=list)  # each kill's loss on the run's own clock

    def row(self, reference_s: float, reference_steps_s: float) -> str:
        goodput = reference_s / self.wall_s
        kills = max(self.kills, 1)
        lost = (self.wall_s - reference_s) / kills
        rec = (
            f"recovery median {statistics.median(self.recoveries):.2f} s, max {max(self.recoveries):.2f} s"
            if self.recoveries
            else "recovery: not reported"
        )
        recovery = sum(self.recoveries) / kills
        steps = (self.step_time_s - reference_steps_s) / kills
        split = f"recovery {recovery:.2f} + steps {steps:.2f} + rest {lost - recovery - steps:.2f}"
        if not self.recoveries:
            split = f"steps {steps:.2f} + the rest {lost - steps:.2f}"
        local = (
            f"local loss per kill median {statistics.median(self.local):.2f} s, max {max(self.local):.2f} s "
            f"({len(self.local)} kills measured)"
            if self.local
            else "local loss: no kill measured"
        )
        return (
            f"{self.variant:<9} F={self.every_s:>4.0f} s: goodput {goodput:.2f}, {self.kills} kills, "
            f"{self.redone} steps redone ({self.redone / kills:.1f} per kill), {lost:.2f} s lost per kill "
            f"({split}), {local}, {rec}, digest {'equal' if self.digest_equal else 'DIFFERENT'}"
        )


def step_time_s(logged: Sequence[MetricsRecord]) -> float:
    """The steps' own time summed (redone and slowed steps included)."""
    return sum(m.step_time for m in logged)


@dataclass(frozen=True)
class Setup:
    steps: int
    save_every: int
    nproc: int  # ranks, on this machine's cores: 2 leave none to spare, 1 leaves one

    def torchrun(self, root: Path, *flags: str) -> list[str]:
        """torchrun of the reference trainer on ``root`` (``flags``: torchrun's, then the trainer's
        after a ``--``)."""
        mine, theirs = (
            (flags, ()) if "--" not in flags else (flags[: flags.index("--")], flags[flags.index("--") + 1 :])
        )
        return [
            TORCHRUN, "--standalone", f"--nproc-per-node={self.nproc}", *mine,
            "-m", "train_ref.train", "--config", "tiny", "--parallel", "ddp", "--num-workers", "0",
            "--ckpt-root", str(root), "--steps", str(self.steps), "--save-every", str(self.save_every),
            "--seed", "0", *theirs,
        ]  # fmt: skip


def command(variant: str, root: Path, setup: Setup) -> list[str]:
    flags = VARIANTS[variant]
    if flags is None:
        return setup.torchrun(root, "--max-restarts=99")
    watch = [sys.executable, "-m", "supervisor", "watch", "--ckpt-root", str(root), *flags]
    watch += ["--max-restarts", "1000", "--backoff-initial", "0", "--backoff-jitter", "0", "--"]
    return [*watch, *setup.torchrun(root, "--", *TRAINER_FLAGS.get(variant, ()))]


def running_ranks(root: Path, after: int) -> list[int]:
    """The pids of the ranks of the launch that trains now, once it logged a step past record
    number ``after`` (a kill lands on a launch that trains, not on one still starting): torchrun's
    workers (LOCAL_RANK in their environment) of the reference trainer on this root, of the launch
    that wrote the newest metrics line (a standby's ranks wait under the next launch's id)."""
    rows = read_metrics(RunDir.of(root).metrics) if RunDir.of(root).metrics.exists() else []
    if len(rows) <= after:
        return []
    launch = rows[-1].launch
    pids = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            argv = Path(f"/proc/{name}/cmdline").read_bytes().split(b"\0")
            env = Path(f"/proc/{name}/environ").read_bytes().split(b"\0")
        except OSError:
            continue
        worker = any(e.startswith(b"LOCAL_RANK=") for e in env)  # torchrun's agent has none
        if not worker or b"train_ref.train" not in argv or str(root).encode() not in argv:
            continue
        ids = [e.split(b"=", 1)[1].decode() for e in env if e.startswith(f"{ENV_LAUNCH_ID}=".encode())]
        if not ids or ids[0] == launch:
            pids.append(int(name))
    return pids


def faulted(variant: str, every_s: float, root: Path, setup: Setup, golden: str, seed: int) -> Run:
    rng = random.Random(seed)
    run = Run(variant, every_s)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if variant == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    final = root / "final.json"
    tail, kills = Tail(RunDir.of(root).metrics), []
    t0 = time.monotonic()
    with (root.parent / f"{variant}.log").open("wb") as log:
        p = subprocess.Popen(command(variant, root, setup), cwd=REPO, env=env, stdout=log, stderr=log)
        next_kill, logged = t0 + every_s, 0
        while p.poll() is None:
            time.sleep(POLL_S)
            tail.poll()
            if time.monotonic() < next_kill or final.exists():
                continue
            pids = running_ranks(root, logged)
            if len(pids) == setup.nproc:
                os.kill(rng.choice(sorted(pids)), signal.SIGKILL)
                kills.append(time.monotonic())
                next_kill, logged = kills[-1] + every_s, len(tail.seen)
    run.wall_s = time.monotonic() - t0
    tail.poll()
    run.kills = len(kills)
    ends = [*kills[1:], math.inf]
    run.local = [
        x
        for x in (
            local_loss(tail.seen, k, e, setup.steps, every_s / 2) for k, e in zip(kills, ends, strict=True)
        )
        if x is not None
    ]
    if p.returncode != 0:
        raise SystemExit(f"{variant} F={every_s}: exit {p.returncode}; see {root.parent / f'{variant}.log'}")
    logged_steps = read_metrics(RunDir.of(root).metrics)  # every step's record, redone ones too
    run.redone = len(logged_steps) - setup.steps
    run.step_time_s = step_time_s(logged_steps)
    run.recoveries = [
        e["phases"]["total"]
        for e in read_events(events_path(root))
        if e["event"] == "recovery" and "total" in e.get("phases", {})
    ]
    run.digest_equal = json.loads(final.read_text())["params_sha256"] == golden
    return run


def uninterrupted(root: Path, setup: Setup) -> tuple[float, float, str]:
    """Its wall time, its steps' time summed, its digest."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    subprocess.run(setup.torchrun(root), cwd=REPO, env=env, check=True, capture_output=True)
    wall = time.monotonic() - t0
    return (
        wall,
        step_time_s(read_metrics(RunDir.of(root).metrics)),
        json.loads((root / "final.json").read_text())["params_sha256"],
    )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=1500)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--every", default="10,30", help="fault periods F in seconds, comma-separated")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--seed", type=int, default=0, help="which rank each kill hits")
    p.add_argument("--nproc", type=int, default=2, help="ranks (2: every core trains; 1: one core to spare)")
    opts = p.parse_args()
    setup = Setup(opts.steps, opts.save_every, opts.nproc)
    work = Path(tempfile.mkdtemp(prefix="bench-goodput-"))
    try:
        reference_s, reference_steps_s, golden = uninterrupted(work / "golden" / "run", setup)
        print(f"uninterrupted (torchrun): {reference_s:.1f} s for {opts.steps} steps", flush=True)
        for every in (float(f) for f in opts.every.split(",")):
            for variant in opts.variants.split(","):
                root = work / f"{variant}-{every:.0f}" / "run"
                root.parent.mkdir(parents=True)
                run = faulted(variant, every, root, setup, golden, opts.seed)
                print(run.row(reference_s, reference_steps_s), flush=True)
    except SystemExit:
        print(f"kept for a look: {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
