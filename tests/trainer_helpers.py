"""Shared helpers for the end-to-end trainer tests: real torchrun, real files, real signals."""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from itertools import pairwise
from pathlib import Path

from commands import REPO
from waiting import PATIENCE_S

from supervisor.drill.runner import read_digest
from supervisor.format.heartbeat import Heartbeat, Phase
from supervisor.format.layout import RunDir
from supervisor.format.manifest import read_manifest
from supervisor.format.metrics import MetricsRecord, read_metrics
from supervisor.format.nodesummary import read_run_heartbeats
from supervisor.resumable._resume import verify_shares
from supervisor.watch.process import kill_tree
from train_ref import hold

# Small enough for CI (2 cores): ~0.05-0.2 s per step, 30 steps cross three saves.
STEPS = 30
SAVE_EVERY = 10
SEED = 7
EMA = ("--ema-decay", "0.9")  # the trainer keeps a moving average of its parameters


def trainer_env(hold_file: Path | None = None, **extra: str) -> dict[str, str]:
    """The trainer's environment; with ``hold_file``, its hold gate on (train_ref/hold.py)."""
    env = dict(os.environ)
    # torchrun's own store for the ranks, as torch does by default: its agent binds it and keeps it.
    # With TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 the agent picks a free port, closes it, and rank 0
    # binds it later: two torchruns starting at once on one host (two test workers) lost that race
    # (EADDRINUSE). The watchdog sets it only where torchrun may restart its ranks itself (more than
    # one node, or --max-restarts > 0; supervisor/watch/torchrun_cmd.py): not for these single-node runs.
    env.pop("TORCH_DISABLE_SHARE_RDZV_TCP_STORE", None)
    env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
    env.pop("SUPERVISOR_LAUNCH_ID", None)
    env.pop(hold.ENV_HOLD_FILE, None)
    if hold_file is not None:
        env[hold.ENV_HOLD_FILE] = str(hold_file)
    env.update(extra)
    return env


def torchrun_cmd(root: Path, nproc: int, *args: str) -> list[str]:
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
        "-m", "train_ref.train", "--ckpt-root", str(root), "--seed", str(SEED), *args,
    ]  # fmt: skip


def launch(root: Path, nproc: int, *args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
    """Start torchrun in its own session (so cleanup can kill the whole group)."""
    return subprocess.Popen(
        torchrun_cmd(root, nproc, *args),
        cwd=REPO,
        env=env or trainer_env(),
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


@dataclass(frozen=True)
class Result:
    rc: int
    output: str


def finish(proc: subprocess.Popen[str], timeout: float = PATIENCE_S) -> Result:
    try:
        out, _ = proc.communicate(timeout=timeout)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        out, _ = proc.communicate()
        raise AssertionError(f"torchrun did not finish in {timeout}s:\n{out[-4000:]}") from None
    return Result(proc.returncode, out)


def run(root: Path, nproc: int, *args: str, env: dict[str, str] | None = None) -> Result:
    return finish(launch(root, nproc, *args, env=env))


def run_ok(root: Path, nproc: int, *args: str, env: dict[str, str] | None = None) -> Result:
    r = run(root, nproc, *args, env=env)
    assert r.rc == 0, f"torchrun exited {r.rc}:\n{r.output[-4000:]}"
    return r


def kill_group(proc: subprocess.Popen[str]) -> None:
    """Kill a launch we started and everything under it (its ranks too: ``kill_tree``)."""
    if proc.poll() is None:
        kill_tree(proc.pid)


def read_jsonl(path: Path) -> list[dict]:
    """Complete JSON lines (a kill can leave the last one partial)."""
    out = []
    if path.exists():
        for line in path.read_text().splitlines():
            with contextlib.suppress(ValueError):
                out.append(json.loads(line))
    return out


def metrics(root: Path) -> list[MetricsRecord]:
    return read_metrics(RunDir.of(root).metrics)


def last_step(root: Path) -> int:
    m = metrics(root)
    return m[-1].step if m else 0


def losses_by_step(root: Path) -> dict[int, float]:
    """The loss of each step as the surviving trajectory saw it (a later launch overrides)."""
    return {m.step: m.loss for m in metrics(root)}


def final(root: Path) -> dict:
    return json.loads((root / "final.json").read_text())


def digest(root: Path) -> str:
    """The final parameters' digest, and the moving average's where the run kept one (``EMA``)."""
    d = read_digest(root)
    assert d is not None, f"no final digest in {root}"
    return d


def worker_pid(root: Path, rank: int, launched_after: float) -> int:
    """The pid of ``rank`` in the current launch, from its heartbeat (written at startup)."""
    for s in read_run_heartbeats(root):
        hb = s.heartbeat
        if hb and hb.rank == rank and hb.wall_time >= launched_after:
            return hb.pid
    raise AssertionError(f"no heartbeat of rank {rank} since the launch")


def heartbeat_exit_codes(root: Path) -> dict[int, int | None]:
    return {s.rank: s.heartbeat.exit_code for s in read_run_heartbeats(root) if s.heartbeat}


def committed(root: Path) -> list[str]:
    names = os.listdir(root) if root.exists() else []
    return sorted(n for n in names if n.startswith("step_") and ".tmp." not in n)


def copy_run(src: Path, dst: Path) -> Path:
    """A private copy of a run directory (checkpoints, metrics) without its heartbeats."""
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("heartbeats", ".lock"))
    return dst


def rewind(src: Path, dst: Path, step: int) -> Path:
    """A copy of a finished run as it was when ``step`` was its newest checkpoint: later
    checkpoints and final.json removed (metrics and sample logs kept; a relaunch appends)."""
    copy_run(src, dst)
    for name in committed(dst):
        if int(name.split("_")[1]) > step:
            shutil.rmtree(dst / name)
    (dst / "final.json").unlink()
    assert f"step_{step:08d}" in committed(dst), f"{src} has no checkpoint at step {step}"
    return dst


def train_args(parallel: str, *extra: str, steps: int = STEPS, save_every: int = SAVE_EVERY) -> list[str]:
    return ["--parallel", parallel, "--steps", str(steps), "--save-every", str(save_every), *extra]


class Goldens:
    """Uninterrupted runs, one per (parallel, nproc, extra trainer flags), made on first use and
    shared by the session."""

    def __init__(self, base: Path):
        self.base = base
        self.runs: dict[tuple[str, int, tuple[str, ...]], Path] = {}

    def get(self, parallel: str, nproc: int, *extra: str) -> Path:
        key = (parallel, nproc, extra)
        if key not in self.runs:
            root = self.base / "_".join(["golden", parallel, str(nproc), *(a.strip("-") for a in extra)])
            run_ok(root, nproc, *train_args(parallel, "--log-samples", *extra))
            self.runs[key] = root
        return self.runs[key]


_GOLDENS: Goldens | None = None


def shared_goldens(make_base: Callable[[], Path]) -> Goldens:
    """One Goldens for the whole pytest process, whichever test module asks first."""
    global _GOLDENS
    if _GOLDENS is None:
        _GOLDENS = Goldens(make_base())
    return _GOLDENS


def beats(root: Path) -> dict[int, Heartbeat]:
    """Each rank's heartbeat now (unreadable ones left out)."""
    return {s.rank: s.heartbeat for s in read_run_heartbeats(root) if s.heartbeat is not None}


class BeatLog:
    """Every heartbeat write of each rank seen by polling (``poll``): (mono_time, phase)."""

    def __init__(self, root: Path) -> None:
        self.root = root
        self.seen: dict[int, list[tuple[float, Phase]]] = {}

    def poll(self) -> None:
        for rank, b in beats(self.root).items():
            writes = self.seen.setdefault(rank, [])
            if not writes or writes[-1][0] != b.mono_time:
                writes.append((b.mono_time, b.phase))

    def first(self, *phases: Phase) -> float | None:
        """When some rank first wrote a heartbeat in one of ``phases`` (monotonic clock), if seen."""
        return min((t for w in self.seen.values() for t, p in w if p in phases), default=None)

    def longest_silence(self, until: float, since: float = 0.0) -> float:
        """The longest time a rank went without a heartbeat write, from ``since`` to ``until``."""
        return max(
            b[0] - a[0] for w in self.seen.values() for a, b in pairwise(w) if since <= a[0] and b[0] <= until
        )


def largest_share(root: Path, step: int, rank: int, world: int = 2) -> str:
    """The largest file ``rank`` checks in the spread deep verify of ``step`` (the split every rank
    computes from the manifest)."""
    m = read_manifest(root / f"step_{step:08d}")
    return max(verify_shares(m, world)[rank], key=lambda n: m.files[n].size)
