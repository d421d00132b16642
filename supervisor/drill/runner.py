"""Processes of the drill: the golden torchrun, the watchdog with the trainer, fault injection while
it runs, and a monitor that checks ``latest`` the whole time."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

from supervisor.drill import inject, storage, switch
from supervisor.drill.drivers import DRIVERS, Driver, switch_hang
from supervisor.drill.faultctl import Controller, FaultFS
from supervisor.drill.judge import StepRecord, StorageFacts
from supervisor.drill.plan import PREEMPT_AS, PREEMPT_SLURM, SELF_INFLICTED, Fault, Kind
from supervisor.format.events import events_path, read_logged
from supervisor.format.eventtypes import Event, Logged
from supervisor.format.hooks import ENV_BOUNDARY_HOOK, ENV_SAVE_DELAY, ENV_WORKER_HOOK
from supervisor.format.layout import MANIFEST, RunDir, parse_committed
from supervisor.format.metrics import parse_line
from supervisor.format.statediff import Comparison
from supervisor.options import POSITIVE, option
from supervisor.store import list_checkpoints
from supervisor.watch.process import descendants, process_table, send

POLL_S = 0.02
GOLDEN = "golden"  # workdir/golden: the uninterrupted run
GOLDEN_KEPT = "golden-kept"  # workdir/golden-kept: every checkpoint it committed (switch.Keep)
MOUNTS = "mnt"  # workdir/mnt/<scenario>: where a storage scenario's fault filesystem is mounted


def new_workdir() -> Path:
    return Path("drill-runs") / time.strftime("%Y%m%d-%H%M%S")


@dataclass(frozen=True)
class DrillConfig:
    """The drill's run; each option field is its ``drill`` flag (supervisor.options)."""

    seed: int = option("drives fault steps, ranks and chaos; printed for replay", 0)
    ranks: int = option("worker processes of the trainer (torchrun --nproc-per-node)", 4, check=POSITIVE)
    steps: int = option("training steps of every run, golden and faulted", 80, check=POSITIVE)
    save_every: int = option("a checkpoint every this many steps", 10, check=POSITIVE)
    parallel: str = option("the trainer's parallelism", "fsdp", choices=("fsdp", "ddp"))
    hang_timeout_s: float = option(
        "the watchdog's train-phase timeout", 4.0, flag="--hang-timeout", check=POSITIVE
    )
    workdir: Path = option(
        "where the runs, their logs and the report go (must be new or empty)", default_factory=new_workdir
    )
    num_workers: int = option(
        "DataLoader workers per rank (the trainer's --num-workers: the drill's trainers take it)", 2
    )
    preempt_as: str = option(
        "how the preempt scenario preempts: slurm = SIGTERM to every process of the job (SLURM's "
        "preemption, time limit, scancel), then the job started again; notice = SIGUSR1 to every "
        "process (--signal without B:)",
        PREEMPT_SLURM,
        choices=PREEMPT_AS,
    )
    save_delay_s: float = 1.0
    fault_timeout_s: float = 180.0
    python: str = sys.executable
    watch_extra: tuple[str, ...] = ()  # more watchdog flags (tests/hang_faults.py: --standby, restarts)
    # A user's script (supervisor.resumable.Resumable inside) instead of the reference trainer: it gets the
    # five options every trainer has, not the reference trainer's --config and --parallel.
    trainer: Path | None = option(
        "drill your own script (started by torchrun with --ckpt-root --steps --save-every --seed "
        "--num-workers) "
        "instead of the reference trainer; e.g. examples/plain_loop.py",
        None,
        metavar="SCRIPT",
    )

    def trainer_cmd(self, root: Path, extra: Sequence[str] = ()) -> list[str]:
        # The reference trainer keeps a moving average of its parameters: its resume is proven too.
        own = ("--config", "tiny", "--parallel", self.parallel, "--ema-decay", "0.99")
        return [
            self.python, "-m", "torch.distributed.run", "--standalone",
            f"--nproc-per-node={self.ranks}",
            *((str(self.trainer),) if self.trainer else ("-m", "train_ref.train")),
            "--ckpt-root", str(root),
            "--steps", str(self.steps),
            "--save-every", str(self.save_every),
            "--seed", str(self.seed),
            "--num-workers", str(self.num_workers),
            *(() if self.trainer else own),
            *extra,
        ]  # fmt: skip

    def watch_cmd(
        self, root: Path, watch_args: Sequence[str] = (), train_args: Sequence[str] = ()
    ) -> list[str]:
        return [
            self.python, "-m", "supervisor", "watch",
            "--ckpt-root", str(root),
            "--verify", "deep",
            "--hang-timeout", str(self.hang_timeout_s),
            "--backoff-initial", "0.2",
            "--require-heartbeat",
            *self.watch_extra,
            *watch_args,
            "--",
            *self.trainer_cmd(root, train_args),
        ]  # fmt: skip

    def env(self) -> dict[str, str]:
        # No TORCH_DISABLE_SHARE_RDZV_TCP_STORE here: the drill's single-node torchruns, under the
        # watchdog or not, keep torch's own store, free of the port race the setting brings (the
        # agent picks a port, closes it, rank 0 binds it later; supervisor/watch/torchrun_cmd.py).
        return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


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
    r = parse_line(line)
    return None if r is None else StepRecord(r.step, r.loss, r.lr, r.launch, seen)


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
    events: list[Logged[Event]] = field(default_factory=list)
    storage: StorageFacts | None = None  # what a storage fault's driver saw
    comparison: Comparison | None = None  # its checkpoints vs golden's, when the digest differs


def read_digest(root: Path) -> str | None:
    """The run's final parameter digest, and its moving average's where it kept one (the
    reference trainer's ``--ema-decay``): "<params> ema <average>"; None without ``final.json``."""
    try:
        final = json.loads(RunDir.of(root).final.read_text())
        ema = final.get("ema_sha256")
        return str(final["params_sha256"]) + (f" ema {ema}" if ema else "")
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None


def run_golden(cfg: DrillConfig, log: Path) -> tuple[list[StepRecord], str]:
    """The uninterrupted run; every checkpoint it commits is kept (``GOLDEN_KEPT``), whatever its
    retention, for a faulted run's comparison."""
    root = cfg.workdir / GOLDEN
    keep = switch.Keep(root, cfg.workdir / GOLDEN_KEPT)
    env = {**cfg.env(), ENV_BOUNDARY_HOOK: switch.HOOK, switch.ENV_KEEP: keep.encode()}
    with open(log, "ab") as out:
        rc = subprocess.run(cfg.trainer_cmd(root), env=env, stdout=out, stderr=subprocess.STDOUT).returncode
    digest = read_digest(root)
    if rc != 0 or digest is None:
        raise RuntimeError(f"the golden run failed (exit {rc}); see {log}")
    return read_metrics(root), digest


def golden_checkpoints(cfg: DrillConfig) -> dict[int, Path]:
    """Golden's committed checkpoints by step: those kept aside, and those its run dir still holds."""
    found: dict[int, Path] = {}
    for folder in (cfg.workdir / GOLDEN_KEPT, cfg.workdir / GOLDEN):
        found |= {ref.step: ref.path for ref in list_checkpoints(folder)}
    return found


def compare_with_golden(cfg: DrillConfig, run: ScenarioRun) -> Comparison:
    """The run's checkpoints against golden's of the same steps, item by item, by the trainer's
    python (``supervisor.resumable._compare`` loads them with torch; the drill never imports it)."""
    golden = golden_checkpoints(cfg)
    pairs = [(r.step, golden[r.step], r.path) for r in list_checkpoints(run.root) if r.step in golden]
    if not pairs:
        return Comparison()
    cmd = [cfg.python, "-m", "supervisor.resumable._compare"]
    for step, g, r in sorted(pairs):
        cmd += ["--pair", str(step), str(g), str(r)]
    what = "python -m supervisor.resumable._compare"
    try:
        p = subprocess.run(cmd, env=cfg.env(), capture_output=True, text=True, timeout=cfg.fault_timeout_s)
    except subprocess.TimeoutExpired:
        return Comparison(problems=(f"{what} took over {cfg.fault_timeout_s:.0f}s",))
    last = (p.stdout.strip().splitlines() or [""])[-1]
    try:
        return Comparison.from_json(last)
    except ValueError as e:
        err = (p.stderr.strip().splitlines() or [str(e)])[-1]
        return Comparison(problems=(f"{what} exited {p.returncode}: {err}",))


@dataclass(frozen=True)
class Job:
    """What a scenario runs under the watchdog: the run dir as the job sees it (for a storage fault
    the fault filesystem's mount; the drill reads the backing dir), its environment, extra flags."""

    root: Path
    env: dict[str, str]
    watch_args: tuple[str, ...] = ()
    train_args: tuple[str, ...] = ()


class Watchdog:
    """One watchdog process (its own session, so a stop reaches every child)."""

    def __init__(self, cfg: DrillConfig, job: Job, log: Path) -> None:
        self.out = open(log, "ab")  # noqa: SIM115 - closed in wait()
        self.proc = subprocess.Popen(
            cfg.watch_cmd(job.root, job.watch_args, job.train_args),
            env=job.env,
            stdout=self.out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
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

    def signal_all(self, sig: int) -> list[int]:
        """``sig`` to every process of the job, as SLURM signals a job step: the watchdog and each
        of its descendants (torchrun's agent, the ranks, their DataLoader workers), in /proc's
        order. Returns the pids signalled."""
        pids = [self.proc.pid, *descendants(self.proc.pid, process_table())]
        return send(pids, sig)

    def kill(self) -> None:
        if self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait()


@dataclass
class Scene:
    """A scenario while it runs, as the code that injects a fault sees it: wait on the run (an
    event: a step, a file, a heartbeat), strike, record what was done, wait for the resume."""

    cfg: DrillConfig
    run: ScenarioRun
    tail: MetricsTail
    dog: Watchdog
    progress: Callable[[str, ScenarioRun], None]
    job: Job
    log: Path
    fs: Controller | None = None  # the fault filesystem's, for a storage fault
    hangs: switch.Switch | None = None  # the self-inflicted hangs the trainer is told of

    @property
    def root(self) -> Path:
        """The run dir as the drill reads it (past every fault rule)."""
        return self.run.root

    def note(self, msg: str) -> None:
        self.run.notes.append(msg)

    def step(self) -> int:
        """The last step the run logged."""
        return self.tail.last.step if self.tail.last else 0

    def save_in_flight(self) -> bool:
        return inject.tmp_save_in_flight(self.root, 0)

    def wait(
        self,
        cond: Callable[[], bool],
        observe: Callable[[], None] | None = None,
        timeout: float | None = None,
    ) -> bool:
        """Until ``cond()`` holds (``observe()`` on every poll), the watchdog ends, or the timeout
        (the fault timeout unless given)."""
        deadline = time.monotonic() + (self.cfg.fault_timeout_s if timeout is None else timeout)
        while time.monotonic() < deadline:
            self.tail.poll()
            if observe is not None:
                observe()
            self.progress("", self.run)  # a periodic status line; the callback throttles it
            if cond():
                return True
            if self.dog.proc.poll() is not None:
                self.tail.poll()
                return cond()
            time.sleep(POLL_S)
        return False

    def reach(self, fault: Fault, committed: int = 0) -> str | None:
        """Wait until the run logged the fault's step (and committed ``committed`` checkpoints);
        the launch running then, or None (noted: the fault was not injected)."""
        if not self.wait(
            lambda: (
                self.tail.last is not None
                and self.tail.last.step >= fault.at_step
                and (not committed or len(list_checkpoints(self.root)) >= committed)
            )
        ):
            more = f" with {committed} committed checkpoints" if committed else ""
            self.note(f"not injected: the run never reached step {fault.at_step}{more}")
            return None
        return self.tail.last.launch if self.tail.last else ""

    def kill(self, fault: Fault, launch: str, sig: signal.Signals = signal.SIGKILL) -> bool:
        pid = inject.signal_worker(self.root, fault.rank, launch, sig, watched_as=self.job.root)
        if pid is None:
            self.note(f"not injected: no heartbeat of rank {fault.rank} in launch {launch}")
            return False
        self.note(f"{fault.describe()}: sent {sig.name} to pid {pid} at step {self.step()}")
        return True

    def restart(self) -> None:
        """A new watchdog for the same job (after one was stopped)."""
        self.dog = Watchdog(self.cfg, self.job, self.log)

    def struck(self, fault: Fault, t0: float, in_flight: bool) -> None:
        self.run.injected.append(fault)
        self.run.fault_times.append(t0)
        self.run.save_in_flight.append(in_flight)
        self.progress(f"injected {fault.kind.value}", self.run)

    def await_resume(self, fault: Fault, launch: str, observe: Callable[[], None] | None = None) -> bool:
        """Wait for a step of a launch not seen before: the one the fault hit may not have logged a
        step yet when the trainer hung itself, so "a launch other than the last one seen" would be
        too early."""
        seen = {r.launch for r in self.tail.records} | {launch}
        if not self.wait(lambda: self.tail.last is not None and self.tail.last.launch not in seen, observe):
            self.note(f"no resumed step seen within {self.cfg.fault_timeout_s:.0f}s after {fault.kind.value}")
            return False
        self.progress(f"resumed at step {self.tail.last_step}", self.run)
        return True


def job_for(
    cfg: DrillConfig,
    root: Path,
    faults: list[Fault],
    hangs: switch.Switch | None,
    driver: Driver | None,
) -> Job:
    env = cfg.env()
    if any(f.kind == Kind.DURING_SAVE for f in faults):
        env[ENV_SAVE_DELAY] = str(cfg.save_delay_s)
    if hangs is not None:
        env[switch.ENV] = hangs.encode()
        env[ENV_BOUNDARY_HOOK] = switch.HOOK
        if any(h.how == switch.How.LOADER for h in hangs.hangs):
            env[ENV_WORKER_HOOK] = switch.WORKER_HOOK
    # the flags each fault's driver needs (the storage driver's, or one per kind: memory's tier)
    drivers = [driver] if driver else [DRIVERS[k]() for k in dict.fromkeys(f.kind for f in faults)]
    args = [d.job_args(cfg) for d in drivers]
    return Job(root, env, tuple(a for w, _ in args for a in w), tuple(a for _, t in args for a in t))


def run_scenario(
    cfg: DrillConfig,
    scenario: str,
    faults: list[Fault],
    log: Path,
    progress: Callable[[str, ScenarioRun], None],
) -> ScenarioRun:
    """Run one scenario under the watchdog. A storage fault puts the run dir on the fault
    filesystem (mounted over ``workdir/<scenario>``, unmounted at the end whatever happens)."""
    root = cfg.workdir / scenario
    run = ScenarioRun(scenario, root)
    root.mkdir(parents=True, exist_ok=True)
    tail = MetricsTail(root)
    run.records = tail.records  # the same list: progress lines see the live step
    hangs = hang_switch(cfg, scenario, faults)
    driver = storage.driver_for(faults)
    monitor = LatestMonitor(root)
    with contextlib.ExitStack() as mounted:
        fs = mounted.enter_context(FaultFS.start(root, cfg.workdir / MOUNTS / scenario)) if driver else None
        job = job_for(cfg, fs.mountpoint if fs else root, faults, hangs, driver)
        monitor.start()
        scene = Scene(cfg, run, tail, Watchdog(cfg, job, log), progress, job, log, fs, hangs)
        try:
            for fault in faults:
                facts = (driver or DRIVERS[fault.kind]()).drive(scene, fault)
                if facts is not None:
                    run.storage = facts
            scene.wait(lambda: scene.dog.proc.poll() is not None, timeout=cfg.fault_timeout_s * 2)
            run.exit_codes.append(scene.dog.wait(timeout=5))
            tail.poll()
        finally:
            scene.dog.kill()
            monitor.stop()
    run.digest = read_digest(root)
    run.latest_violations = monitor.violations
    run.latest_reads = monitor.reads
    run.events = read_logged(events_path(root))
    if run.storage is not None:
        run.storage = storage.at_end(run.storage, root)
    return run


def hang_switch(cfg: DrillConfig, scenario: str, faults: list[Fault]) -> switch.Switch | None:
    """The self-inflicted hangs of a scenario, for the trainer's drill switch (None: there are none)."""
    hangs = tuple(switch_hang(f) for f in faults if f.kind in SELF_INFLICTED)
    return switch.Switch(cfg.workdir / "switch" / scenario, hangs) if hangs else None
