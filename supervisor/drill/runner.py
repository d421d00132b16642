"""Processes of the drill: the golden torchrun, the watchdog with the trainer, fault injection while
it runs, and a monitor that checks ``latest`` the whole time."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from supervisor.drill import inject, switch
from supervisor.drill.judge import StepRecord
from supervisor.drill.plan import IN_SAVE, SELF_INFLICTED, Fault, Kind
from supervisor.events import events_path, read_events
from supervisor.layout import MANIFEST, RunDir, parse_committed

POLL_S = 0.02
# Test-only knob of the reference trainer: widens the async write so a kill lands inside it.
ENV_SAVE_DELAY = "TRAIN_REF_SAVE_DELAY_S"


@dataclass(frozen=True)
class DrillConfig:
    workdir: Path
    ranks: int = 4
    steps: int = 60
    save_every: int = 10
    seed: int = 0
    parallel: str = "fsdp"
    hang_timeout_s: float = 4.0
    save_delay_s: float = 1.0
    fault_timeout_s: float = 180.0
    python: str = sys.executable

    def trainer_cmd(self, root: Path) -> list[str]:
        return [
            self.python, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={self.ranks}",
            "-m", "train_ref.train",
            "--ckpt-root", str(root),
            "--steps", str(self.steps),
            "--save-every", str(self.save_every),
            "--seed", str(self.seed),
            "--config", "tiny",
            "--parallel", self.parallel,
        ]  # fmt: skip

    def watch_cmd(self, root: Path) -> list[str]:
        return [
            self.python, "-m", "supervisor", "watch",
            "--ckpt-root", str(root),
            "--verify", "deep",
            "--hang-timeout", str(self.hang_timeout_s),
            "--backoff-initial", "0.2",
            "--",
            *self.trainer_cmd(root),
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env.setdefault("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", "1")
        return env


class MetricsTail:
    """Reads metrics.jsonl as it grows, stamping each record with when it was first seen."""

    def __init__(self, root: Path) -> None:
        self.path = RunDir.of(root).metrics
        self.records: list[StepRecord] = []
        self._offset = 0
        self._partial = b""

    def poll(self) -> list[StepRecord]:
        try:
            with open(self.path, "rb") as f:
                f.seek(self._offset)
                data = f.read()
        except FileNotFoundError:
            return []
        self._offset += len(data)
        lines = (self._partial + data).split(b"\n")
        self._partial = lines.pop()
        now = time.time()
        new = [rec for line in lines if (rec := parse_metrics_line(line, now)) is not None]
        self.records.extend(new)
        return new

    @property
    def last(self) -> StepRecord | None:
        return self.records[-1] if self.records else None

    @property
    def last_step(self) -> int | None:
        """For notes: the newest step seen (None before the first)."""
        return self.records[-1].step if self.records else None


def parse_metrics_line(line: bytes, seen: float) -> StepRecord | None:
    try:
        d = json.loads(line)
        return StepRecord(int(d["step"]), float(d["loss"]), float(d["lr"]), str(d.get("launch", "")), seen)
    except (ValueError, KeyError, TypeError):
        return None


def read_metrics(root: Path) -> list[StepRecord]:
    tail = MetricsTail(root)
    tail.poll()
    return tail.records


class LatestMonitor(threading.Thread):
    """Reads ``latest`` every few ms while the drill runs; records any moment it names a checkpoint
    that is not complete (a tmp name, or a directory without its manifest)."""

    def __init__(self, root: Path) -> None:
        super().__init__(daemon=True)
        self.root = root
        self.violations: list[str] = []
        self.reads = 0
        self._halt = threading.Event()

    def run(self) -> None:
        latest = RunDir.of(self.root).latest
        while not self._halt.is_set():
            try:
                name = latest.read_text().strip()
            except OSError:
                name = None
            if name is not None:
                self.reads += 1
                problem = self._problem(name)
                if problem and problem not in self.violations:
                    self.violations.append(problem)
            self._halt.wait(POLL_S / 2)

    def _problem(self, name: str) -> str:
        if parse_committed(name) is None:
            return f"latest named '{name}', not a committed checkpoint name"
        d = self.root / name
        # Checked in this order on purpose: a directory moved to quarantine between the first two
        # checks is gone by the third, and gone is not incomplete.
        if d.is_dir() and not (d / MANIFEST).exists() and d.exists():
            return f"latest named {name}, which had no {MANIFEST}"
        return ""

    def stop(self) -> None:
        self._halt.set()
        self.join(timeout=5)


@dataclass
class ScenarioRun:
    scenario: str
    root: Path
    injected: list[Fault] = field(default_factory=list)
    fault_times: list[float] = field(default_factory=list)
    save_in_flight: list[bool] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    records: list[StepRecord] = field(default_factory=list)
    digest: str | None = None
    exit_codes: list[int] = field(default_factory=list)
    latest_violations: list[str] = field(default_factory=list)
    latest_reads: int = 0
    events: list[dict[str, Any]] = field(default_factory=list)


def read_digest(root: Path) -> str | None:
    try:
        return str(json.loads(RunDir.of(root).final.read_text())["params_sha256"])
    except (OSError, ValueError, KeyError, TypeError):
        return None


def run_golden(cfg: DrillConfig, log: Path) -> tuple[list[StepRecord], str]:
    root = cfg.workdir / "golden"
    with open(log, "ab") as out:
        rc = subprocess.run(
            cfg.trainer_cmd(root), env=cfg.env(), stdout=out, stderr=subprocess.STDOUT
        ).returncode
    digest = read_digest(root)
    if rc != 0 or digest is None:
        raise RuntimeError(f"the golden run failed (exit {rc}); see {log}")
    return read_metrics(root), digest


class Watchdog:
    """One watchdog process (its own session, so a stop reaches every child)."""

    def __init__(
        self, cfg: DrillConfig, root: Path, log: Path, slow_saves: bool, hangs: switch.Switch | None
    ) -> None:
        self.out = open(log, "ab")  # noqa: SIM115 - closed in wait()
        env = cfg.env()
        if slow_saves:
            env[ENV_SAVE_DELAY] = str(cfg.save_delay_s)
        if hangs is not None:
            env[switch.ENV] = hangs.encode()
        self.proc = subprocess.Popen(
            cfg.watch_cmd(root), env=env, stdout=self.out, stderr=subprocess.STDOUT, start_new_session=True
        )

    def signal(self, sig: signal.Signals) -> None:
        self.proc.send_signal(sig)

    def wait(self, timeout: float) -> int:
        try:
            return self.proc.wait(timeout=timeout)
        except subprocess.TimeoutExpired:
            os.killpg(self.proc.pid, signal.SIGKILL)
            return self.proc.wait()
        finally:
            self.out.close()


def run_scenario(
    cfg: DrillConfig,
    scenario: str,
    faults: list[Fault],
    log: Path,
    progress: Callable[[str, ScenarioRun], None],
) -> ScenarioRun:
    root = cfg.workdir / scenario
    run = ScenarioRun(scenario, root)
    root.mkdir(parents=True, exist_ok=True)
    tail = MetricsTail(root)
    run.records = tail.records  # the same list: progress lines see the live step
    monitor = LatestMonitor(root)
    monitor.start()
    slow_saves = any(f.kind == Kind.DURING_SAVE for f in faults)
    hangs = hang_switch(cfg, scenario, faults)
    dog = Watchdog(cfg, root, log, slow_saves, hangs)
    try:
        for fault in faults:
            dog = _inject(cfg, run, fault, dog, tail, log, progress, slow_saves, hangs)
        _wait_for(lambda: dog.proc.poll() is not None, tail, cfg.fault_timeout_s * 2, dog, run, progress)
        run.exit_codes.append(dog.wait(timeout=5))
        tail.poll()
    finally:
        if dog.proc.poll() is None:
            os.killpg(dog.proc.pid, signal.SIGKILL)
            dog.proc.wait()
        monitor.stop()
    run.digest = read_digest(root)
    run.latest_violations = monitor.violations
    run.latest_reads = monitor.reads
    run.events = read_events(events_path(root))
    return run


def hang_switch(cfg: DrillConfig, scenario: str, faults: list[Fault]) -> switch.Switch | None:
    """The self-inflicted hangs of a scenario, for the trainer's drill switch (None: there are none)."""
    hangs = tuple(switch_hang(f) for f in faults if f.kind in SELF_INFLICTED)
    return switch.Switch(cfg.workdir / "switch" / scenario, hangs) if hangs else None


def switch_hang(f: Fault) -> switch.Hang:
    return switch.Hang(f.rank, f.at_step, switch.When.SAVE if f.kind in IN_SAVE else switch.When.STEP)


def _wait_for(
    cond: Callable[[], bool],
    tail: MetricsTail,
    timeout: float,
    dog: Watchdog,
    run: ScenarioRun,
    progress: Callable[[str, ScenarioRun], None],
) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        tail.poll()
        progress("", run)  # a periodic status line; the callback throttles it
        if cond():
            return True
        if dog.proc.poll() is not None:
            tail.poll()
            return cond()
        time.sleep(POLL_S)
    return False


def _inject(  # noqa: PLR0913  issue 14 point 4 turns injection into driver objects
    cfg: DrillConfig,
    run: ScenarioRun,
    fault: Fault,
    dog: Watchdog,
    tail: MetricsTail,
    log: Path,
    progress: Callable[[str, ScenarioRun], None],
    slow_saves: bool,
    hangs: switch.Switch | None,
) -> Watchdog:
    """Wait for the fault's step, inject it (or, for a self-inflicted hang, wait until the trainer
    says it blocked), and wait for the run to resume; return the watchdog now running (a new one
    after corrupt-latest, which stops the job)."""

    def wait(cond: Callable[[], bool]) -> bool:
        return _wait_for(cond, tail, cfg.fault_timeout_s, dog, run, progress)

    if fault.kind in SELF_INFLICTED:
        assert hangs is not None, "hang_switch() makes a switch for every self-inflicted hang"
        blocked = _await_self_inflicted(run, fault, hangs, wait)
        if blocked is None:
            return dog
        launch, t0, in_flight = blocked
    else:
        if not wait(lambda: tail.last is not None and tail.last.step >= fault.at_step):
            run.notes.append(f"not injected: the run never reached step {fault.at_step}")
            return dog
        if fault.kind == Kind.DURING_SAVE and not wait(
            lambda: inject.tmp_save_in_flight(run.root, fault.at_step)
        ):
            run.notes.append(f"not injected: no async save of step >= {fault.at_step} was seen in flight")
            return dog
        launch = tail.last.launch if tail.last else ""
        in_flight = inject.tmp_save_in_flight(run.root, 0)
        t0 = time.time()
        if fault.kind in (Kind.KILL9, Kind.DURING_SAVE, Kind.SIGSTOP):
            sig = signal.SIGSTOP if fault.kind == Kind.SIGSTOP else signal.SIGKILL
            pid = inject.signal_worker(run.root, fault.rank, launch, sig)
            if pid is None:
                run.notes.append(f"not injected: no heartbeat of rank {fault.rank} in launch {launch}")
                return dog
            run.notes.append(f"{fault.describe()}: sent {sig.name} to pid {pid} at step {tail.last_step}")
        elif fault.kind == Kind.PREEMPT:
            dog.signal(signal.SIGUSR1)
            run.notes.append(f"{fault.describe()}: at step {tail.last_step}")
        else:
            dog.signal(signal.SIGTERM)
            run.exit_codes.append(dog.wait(timeout=cfg.fault_timeout_s))
            tail.poll()
            did = inject.corrupt_newest(run.root, fault.corruption)
            run.notes.append(f"{fault.describe()}: job stopped at step {tail.last_step}; {did}")
            dog = Watchdog(cfg, run.root, log, slow_saves, hangs)
    run.injected.append(fault)
    run.fault_times.append(t0)
    run.save_in_flight.append(in_flight)
    progress(f"injected {fault.kind.value}", run)
    # A launch not seen before: the one the fault hit may not have logged a step yet when the
    # trainer hung itself, so "a launch other than the last one seen" would be too early.
    seen = {r.launch for r in tail.records} | {launch}
    if not wait(lambda: tail.last is not None and tail.last.launch not in seen):
        run.notes.append(f"no resumed step seen within {cfg.fault_timeout_s:.0f}s after {fault.kind.value}")
    else:
        progress(f"resumed at step {tail.last_step}", run)
    return dog


def _await_self_inflicted(
    run: ScenarioRun, fault: Fault, hangs: switch.Switch, wait: Callable[[Callable[[], bool]], bool]
) -> tuple[str, float, bool] | None:
    """Wait for the trainer's marker: the launch it hung, when, and whether an async save was in
    flight then (it stays so: nothing commits while the rank is stuck). None: it never blocked."""
    marker = hangs.marker(switch_hang(fault))
    if not wait(marker.exists) or (m := switch.read_marker(marker)) is None:
        run.notes.append(f"not injected: rank {fault.rank} never blocked at step {fault.at_step} ({marker})")
        return None
    in_flight = inject.tmp_save_in_flight(run.root, 0)
    run.notes.append(
        f"{fault.describe()}: rank {fault.rank} (pid {m.get('pid')}) blocked at step {m.get('step')} "
        f"({'an async save in flight' if in_flight else 'no save in flight'})"
    )
    return str(m.get("launch", "")), float(m.get("t", time.time())), in_flight
