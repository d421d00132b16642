"""Stragglers on a noisy shared machine (issue 41's budget), measured on the watchdog's own events:

    .venv/bin/python tests/straggler_sweep.py --trials 20 --clean-steps 10000 [--slowdown 1.5]

Four ranks of the reference trainer (``--config small``: steps of about 0.1 s here; ddp, which
marks where its compute ends) run under `watch` (its straggler defaults: factor 1.3, window 20,
hold 3) on this machine, whatever else runs on it. ``--interval`` is the watchdog's
``--summary-interval``, the time between two judgements; a judgement sees a newer window only when
a beat came (one a second per rank), so the hold takes about 3 s whatever the interval: 30 steps
of 0.1 s, 3 of a large model's. Each trial limits one rank (the next one each time) with a cgroup
CPU quota: 1/SLOWDOWN of the CPU it used over the ``--gap`` clean steps just before, scaled by a
calibration trial first (``calibrate``), so "1/1.5 of its speed" is measured, not assumed;
``--slow-steps`` later the limit goes. After the trials, ``--clean-steps`` steps run with no limit.

A trial passes when a ``straggler`` event names its rank, kind compute, within ``--deadline``
steps: from the first step the rank had not reported when the limit was set (conservative: a
beat is up to a second old) to the last step of the window that flagged it. Any other
``straggler`` event is a false flag: a rank flagged while no limit was on it (a trial's rank
flagged up to a window after its limit went is its trial's, late). Each trial's achieved
slowdown is measured from the beats: its rank's trimmed-mean compute under the limit over before,
against the other ranks' same ratio (the machine's own drift cancels).
"""

from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE.parent))  # run as a script too

from straggler_helpers import cpu_limit, cpu_seconds, watched_ddp  # noqa: E402
from sweep_cli import run_and_report  # noqa: E402
from waiting import watchdog_events  # noqa: E402

from supervisor.format.heartbeat import StepTime, read_heartbeat_folder  # noqa: E402
from supervisor.watch.stragglers import DEFAULT_WINDOW, trimmed_mean  # noqa: E402

RANKS = 4
WARMUP = 30  # steps before the first trial (imports, a steady pace)
POLL_S = 0.1


@dataclass
class Trial:
    rank: int
    cpus: float  # the quota it got
    first: int  # the first limited step (as conservative as the beats allow)
    last: int  # the last step under the limit
    flagged_at: int | None = None  # the last step of the window that flagged it
    slowdown: float | None = None

    @property
    def steps_to_flag(self) -> int | None:
        return None if self.flagged_at is None else self.flagged_at - self.first + 1

    def describe(self) -> str:
        got = "never flagged" if self.steps_to_flag is None else f"flagged after {self.steps_to_flag} steps"
        slow = "unmeasured" if self.slowdown is None else f"{self.slowdown:.2f}"
        return f"{got}, achieved slowdown {slow}"


@dataclass
class Sweep:
    deadline: int
    trials: list[Trial] = field(default_factory=list)
    calibration: Trial | None = None  # the quota's scale set on it (calibrate)
    scale: float = 1.0
    false_flags: list[dict] = field(default_factory=list)
    steps: int = 0
    clean_steps: int = 0
    wall_s: float = 0.0
    step_s: float = 0.0

    def passed(self) -> list[Trial]:
        return [t for t in self.trials if t.steps_to_flag is not None and t.steps_to_flag <= self.deadline]

    def failures(self) -> list[str]:
        passed = self.passed()
        late = [
            f"trial: rank {t.rank} limited from step {t.first} ({t.describe()})"
            for t in self.trials
            if t not in passed
        ]
        return late + [
            f"false flag: rank {e['rank']} at step {e['step']}, {e['kind']} {e['value']}"
            for e in self.false_flags
        ]

    def report(self) -> str:
        deadline = self.deadline
        lat = sorted(t.steps_to_flag for t in self.trials if t.steps_to_flag is not None)
        slow = [t.slowdown for t in self.trials if t.slowdown is not None]
        mid = statistics.median(slow) if slow else 0.0
        flags = [(e["rank"], e["step"], e["kind"], e["value"]) for e in self.false_flags[:10]]
        return "\n".join([
            f"{len(self.passed())} of {len(self.trials)} trials flagged within {deadline} steps "
            f"(steps to the flag: {lat})",
            f"quota scale {self.scale:.2f} (calibration trial: {self.calibration.describe() if self.calibration else '-'})",
            f"achieved slowdowns: min {min(slow, default=0):.2f} median {mid:.2f} max {max(slow, default=0):.2f}",
            f"false flags: {len(self.false_flags)} in {self.steps} steps x {RANKS} ranks "
            f"({self.clean_steps} clean steps after the trials) {flags}",
            f"wall {self.wall_s:.0f}s, {self.step_s * 1000:.0f} ms compute per step (median)",
        ])  # fmt: skip


class Series:
    """Every rank's step timings as its beats bring them, and its pid."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.folder: Path | None = None
        self.times: dict[int, dict[int, StepTime]] = {}
        self.pids: dict[int, int] = {}

    def read(self) -> None:
        if self.folder is None:
            found = watchdog_events(self.root, "heartbeat_dir")
            if not found:
                return
            self.folder = Path(found[0]["path"])
        for s in read_heartbeat_folder(self.folder):
            hb = s.heartbeat
            if hb is None:
                continue
            self.pids[hb.rank] = hb.pid
            mine = self.times.setdefault(hb.rank, {})
            for t in hb.step_times:
                mine[t.step] = t

    def step(self) -> int:
        """The step every rank has reported."""
        if len(self.times) < RANKS:
            return 0
        return min(max(t, default=0) for t in self.times.values())

    def of(self, rank: int) -> int:
        return max(self.times.get(rank, {}), default=0)


def wait_step(series: Series, step: int, proc: subprocess.Popen[bytes], timeout: float = 3600.0) -> None:
    deadline = time.monotonic() + timeout
    while series.step() < step:
        if proc.poll() is not None:
            raise RuntimeError(f"the watchdog exited {proc.returncode} at step {series.step()}")
        if time.monotonic() > deadline:
            raise TimeoutError(f"step {step} not reached in {timeout:.0f}s (at {series.step()})")
        time.sleep(POLL_S)
        series.read()


def trial(
    series: Series, proc: subprocess.Popen[bytes], rank: int, opts: argparse.Namespace, scale: float = 1.0
) -> Trial:
    pid = series.pids[rank]
    cpu0, t0 = cpu_seconds(pid), time.monotonic()
    wait_step(series, series.step() + opts.gap, proc)
    cpus = (cpu_seconds(pid) - cpu0) / (time.monotonic() - t0) / opts.slowdown * scale
    with cpu_limit([pid], cpus):
        series.read()
        first = series.of(rank) + 1
        wait_step(series, first + opts.slow_steps, proc)
        last = series.of(rank)
    return Trial(rank, cpus, first, last)


def run(workdir: Path, opts: argparse.Namespace) -> Sweep:
    root = workdir / "run"
    root.mkdir(parents=True)
    total = WARMUP + (opts.trials + 1) * (opts.gap + opts.slow_steps) + opts.gap + opts.clean_steps
    sweep = Sweep(opts.deadline)
    started = time.monotonic()
    with watched_ddp(root, RANKS, opts.config, total + 1000, opts.interval, 120) as proc:
        series = Series(root)
        wait_step(series, WARMUP, proc)
        sweep.calibration = trial(series, proc, 0, opts)
        sweep.scale = calibrate(series, sweep.calibration, opts.slowdown)
        # rank 0 next after the other three: a flag from its calibration must clear first (one still
        # on when its trial began made no new event: that trial counted as never flagged)
        sweep.trials = [trial(series, proc, (i + 1) % RANKS, opts, sweep.scale) for i in range(opts.trials)]
        after = series.step() + opts.gap
        wait_step(series, after + opts.clean_steps, proc)
        time.sleep(3 * opts.interval)  # the last windows judged
        series.read()
        end = series.step()
    sweep.wall_s = time.monotonic() - started
    sweep.steps, sweep.clean_steps = end - WARMUP, end - after
    attribute(sweep, watchdog_events(root, "straggler"))
    for t in sweep.trials:
        t.slowdown = achieved(series, t)
    computes = [t.compute_s for r in series.times.values() for t in r.values()]
    sweep.step_s = statistics.median(computes) if computes else 0.0
    return sweep


def calibrate(series: Series, t: Trial, slowdown: float) -> float:
    """How much more CPU than 1/SLOWDOWN of what it used a rank needs to be SLOWDOWN times slower:
    the calibration trial's achieved slowdown over SLOWDOWN (a rank's CPU over the gap counts
    its time in the collectives too, so that quota slowed its compute by 1.7-2.6 for 1.5)."""
    t.slowdown = got = achieved(series, t)
    return got / slowdown if got else 1.0


def attribute(sweep: Sweep, events: list[dict]) -> None:
    """Each ``straggler`` event: its trial's flag (the first, kind compute; the calibration's
    counts for nothing), or a false one."""
    limited = ([sweep.calibration] if sweep.calibration else []) + sweep.trials
    for e in events:
        on = [t for t in limited if t.rank == e["rank"] and t.first <= e["step"] <= t.last + DEFAULT_WINDOW]
        if not on:
            sweep.false_flags.append(e)
        elif on[0].flagged_at is None and e["kind"] == "compute":
            on[0].flagged_at = e["step"]


def achieved(series: Series, t: Trial, settle: int = 5) -> float | None:
    """The trial rank's trimmed-mean compute under the limit over its clean steps before, against
    the median of the others' same ratio."""

    def ratio(rank: int) -> float | None:
        ts = series.times.get(rank, {})
        before = [ts[s].compute_s for s in range(t.first - 25, t.first - 1) if s in ts]
        under = [ts[s].compute_s for s in range(t.first + settle, t.last + 1) if s in ts]
        if len(before) < 10 or len(under) < 10:
            return None
        return trimmed_mean(under, 0.1) / trimmed_mean(before, 0.1)

    mine, others = ratio(t.rank), [r for p in series.times if p != t.rank and (r := ratio(p)) is not None]
    return None if mine is None or not others else mine / statistics.median(others)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--trials", type=int, default=20)
    p.add_argument("--clean-steps", type=int, default=10_000)
    p.add_argument("--slowdown", type=float, default=1.5, help="each trial's rank gets 1/SLOWDOWN of its CPU")
    p.add_argument("--slow-steps", type=int, default=60)
    p.add_argument("--gap", type=int, default=40, help="clean steps between two trials")
    p.add_argument("--deadline", type=int, default=30)
    p.add_argument("--interval", type=float, default=1.0, help="the watchdog's --summary-interval")
    p.add_argument("--config", default="small", help="the reference trainer's config (train_ref/config.py)")
    p.add_argument("--workdir", type=Path)
    opts = p.parse_args()
    return run_and_report(opts.workdir, "straggler-sweep-", lambda work: run(work, opts))


if __name__ == "__main__":
    sys.exit(main())
