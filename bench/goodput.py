"""Goodput under steady faults, side by side in one run (issue 40).

    .venv/bin/python bench/goodput.py [--steps 1500] [--every 10,30] [--variants torchrun,watch,standby,memory]

The reference trainer (tiny config, 2 ddp ranks, a disk save every ``--save-every`` steps) runs
``--steps`` steps uninterrupted under plain torchrun (its wall time is the reference, its digest
the golden one), then once per variant and fault period F with a kill -9 of a random rank of the
running launch every F seconds (the first F seconds after the start; each once the launch it hits
logged a step after the previous kill) until it is done:

- ``torchrun``: torchrun's own restarts (``--max-restarts=99``, TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1);
- ``watch``: `supervisor watch` over torchrun (``--max-restarts=0``);
- ``standby``: ``watch --standby``;
- ``memory``: ``watch --standby --memory-tier`` (the interval by the 3% rule).

Per run: goodput = uninterrupted wall / faulted wall; kills; steps redone in all (metrics records
beyond ``--steps``) and per kill; time lost per kill ((faulted - uninterrupted wall) / kills); the
watchdog's recovery per kill (its ``recovery`` events: failure -> first step; median, max); and
whether the final digest equals the golden one. Where the time lost per kill went: the recovery
(mean), the steps (every logged step's ``step_time`` summed, less the uninterrupted run's: the
steps redone and every step made slower, by the tier's copies or a standby's imports on the same
cores), and the rest (starts and ends, checkpoint waits, the part of a killed step never logged).
"""

from __future__ import annotations

import argparse
import json
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
NPROC = 2
VARIANTS = {
    "torchrun": None,
    "watch": (),
    "standby": ("--standby",),
    "memory": ("--standby", "--memory-tier"),
}
POLL_S = 0.05


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
        return (
            f"{self.variant:<9} F={self.every_s:>4.0f} s: goodput {goodput:.2f}, {self.kills} kills, "
            f"{self.redone} steps redone ({self.redone / kills:.1f} per kill), {lost:.2f} s lost per kill "
            f"({split}), {rec}, digest {'equal' if self.digest_equal else 'DIFFERENT'}"
        )


def step_time_s(logged: Sequence[MetricsRecord]) -> float:
    """The steps' own time summed (redone and slowed steps included)."""
    return sum(m.step_time for m in logged)


def train(root: Path, steps: int, save_every: int) -> list[str]:
    return [
        "-m", "train_ref.train", "--config", "tiny", "--parallel", "ddp", "--num-workers", "0",
        "--ckpt-root", str(root), "--steps", str(steps), "--save-every", str(save_every), "--seed", "0",
    ]  # fmt: skip


def command(variant: str, root: Path, steps: int, save_every: int) -> list[str]:
    flags = VARIANTS[variant]
    if flags is None:
        return [
            TORCHRUN,
            "--standalone",
            f"--nproc-per-node={NPROC}",
            "--max-restarts=99",
            *train(root, steps, save_every),
        ]
    watch = [sys.executable, "-m", "supervisor", "watch", "--ckpt-root", str(root), *flags]
    watch += ["--max-restarts", "1000", "--backoff-initial", "0", "--backoff-jitter", "0", "--"]
    return [*watch, TORCHRUN, "--standalone", f"--nproc-per-node={NPROC}", *train(root, steps, save_every)]


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


def records(root: Path) -> int:
    return len(read_metrics(RunDir.of(root).metrics)) if RunDir.of(root).metrics.exists() else 0


def faulted(
    variant: str, every_s: float, root: Path, steps: int, save_every: int, golden: str, seed: int
) -> Run:
    rng = random.Random(seed)
    run = Run(variant, every_s)
    env = dict(os.environ, OMP_NUM_THREADS="1")
    if variant == "torchrun":
        env["TORCH_DISABLE_SHARE_RDZV_TCP_STORE"] = "1"
    final = root / "final.json"
    t0 = time.monotonic()
    with (root.parent / f"{variant}.log").open("wb") as log:
        p = subprocess.Popen(
            command(variant, root, steps, save_every), cwd=REPO, env=env, stdout=log, stderr=log
        )
        next_kill, logged = t0 + every_s, 0
        while p.poll() is None:
            time.sleep(POLL_S)
            if time.monotonic() < next_kill or final.exists():
                continue
            pids = running_ranks(root, logged)
            if len(pids) == NPROC:
                os.kill(rng.choice(sorted(pids)), signal.SIGKILL)
                run.kills += 1
                next_kill, logged = time.monotonic() + every_s, records(root)
    run.wall_s = time.monotonic() - t0
    if p.returncode != 0:
        raise SystemExit(f"{variant} F={every_s}: exit {p.returncode}; see {root.parent / f'{variant}.log'}")
    logged_steps = read_metrics(RunDir.of(root).metrics)  # every step's record, redone ones too
    run.redone = len(logged_steps) - steps
    run.step_time_s = step_time_s(logged_steps)
    run.recoveries = [
        e["phases"]["total"]
        for e in read_events(events_path(root))
        if e["event"] == "recovery" and "total" in e.get("phases", {})
    ]
    run.digest_equal = json.loads(final.read_text())["params_sha256"] == golden
    return run


def uninterrupted(root: Path, steps: int, save_every: int) -> tuple[float, float, str]:
    """Its wall time, its steps' time summed, its digest."""
    env = dict(os.environ, OMP_NUM_THREADS="1")
    t0 = time.monotonic()
    cmd = [TORCHRUN, "--standalone", f"--nproc-per-node={NPROC}", *train(root, steps, save_every)]
    subprocess.run(cmd, cwd=REPO, env=env, check=True, capture_output=True)
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
    opts = p.parse_args()
    work = Path(tempfile.mkdtemp(prefix="bench-goodput-"))
    try:
        reference_s, reference_steps_s, golden = uninterrupted(
            work / "golden" / "run", opts.steps, opts.save_every
        )
        print(f"uninterrupted (torchrun): {reference_s:.1f} s for {opts.steps} steps", flush=True)
        for every in (float(f) for f in opts.every.split(",")):
            for variant in opts.variants.split(","):
                root = work / f"{variant}-{every:.0f}" / "run"
                root.parent.mkdir(parents=True)
                run = faulted(variant, every, root, opts.steps, opts.save_every, golden, opts.seed)
                print(run.row(reference_s, reference_steps_s), flush=True)
    except SystemExit:
        print(f"kept for a look: {work}", file=sys.stderr)
        raise
    shutil.rmtree(work, ignore_errors=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
