"""Real stragglers for tests: ranks of the reference trainer under the watchdog, and one rank's CPU
limited by the kernel (a cgroup's CPU quota: cgroup v2 ``cpu.max``, or v1 ``cpu.cfs_quota_us``),
the rank left as it is otherwise."""

from __future__ import annotations

import contextlib
import os
import subprocess
import sys
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path

from commands import REPO, supervisor_cmd
from trainer_helpers import trainer_env

from supervisor.watch.process import kill_tree, read_proc

V2 = Path("/sys/fs/cgroup")
V1 = Path("/sys/fs/cgroup/cpu")
PERIOD_US = 10_000


def cpu_cgroup_root() -> tuple[Path, str] | None:
    """Where a CPU-limited cgroup can be made here, and which interface ("v2" or "v1"); None
    when neither is writable (not root, no cpu controller)."""
    if (V2 / "cgroup.controllers").exists() and "cpu" in (V2 / "cgroup.subtree_control").read_text():
        return (V2, "v2") if os.access(V2, os.W_OK) else None
    if (V1 / "cpu.cfs_quota_us").exists() and os.access(V1, os.W_OK):
        return V1, "v1"
    return None


def cpu_seconds(pid: int) -> float:
    """CPU time (user + system) of one process, all its threads."""
    info = read_proc(pid)
    if info is None:
        raise ProcessLookupError(pid)
    return info.cpu_ticks / os.sysconf("SC_CLK_TCK")


@contextlib.contextmanager
def cpu_limit(pids: Sequence[int], cpus: float) -> Iterator[Path]:
    """``pids`` (every thread) in a new cgroup allowed ``cpus`` CPUs (a quota per 100 ms period),
    moved back and the cgroup removed on the way out. OSError where it cannot be done."""
    found = cpu_cgroup_root()
    if found is None:
        raise OSError("no writable cgroup cpu controller here")
    base, kind = found
    group = base / f"resumable-straggler-{uuid.uuid4().hex[:8]}"
    group.mkdir()
    quota = max(1000, int(cpus * PERIOD_US))
    try:
        if kind == "v2":
            (group / "cpu.max").write_text(f"{quota} {PERIOD_US}\n")
        else:
            (group / "cpu.cfs_period_us").write_text(f"{PERIOD_US}\n")
            (group / "cpu.cfs_quota_us").write_text(f"{quota}\n")
        for pid in pids:
            with contextlib.suppress(ProcessLookupError, OSError):
                (group / "cgroup.procs").write_text(f"{pid}\n")
        yield group
    finally:
        with contextlib.suppress(OSError):
            for pid in (group / "cgroup.procs").read_text().split():
                with contextlib.suppress(OSError):
                    (base / "cgroup.procs").write_text(f"{pid}\n")
        with contextlib.suppress(OSError):
            group.rmdir()


@contextlib.contextmanager
def watched_ddp(
    root: Path, ranks: int, config: str, steps: int, interval_s: float, stop_wait_s: float
) -> Iterator[subprocess.Popen[bytes]]:
    """The watchdog, judging every ``interval_s``, over ``ranks`` ddp ranks of the reference
    trainer (ddp marks where its compute ends), no saves; its output in ``root.parent/job.log``.
    Stopped on the way out with SIGTERM, which it passes to its whole tree (a SIGKILL to its group
    would leave the ranks running: torchrun starts each in a session of its own); SIGKILL to its
    group if it is not gone within ``stop_wait_s``."""
    cmd = supervisor_cmd("watch", "--ckpt-root", str(root), "--summary-interval", str(interval_s))
    cmd += ["--hang-timeout", "300", "--"]
    cmd += [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={ranks}"]
    cmd += ["-m", "train_ref.train", "--config", config, "--parallel", "ddp", "--num-workers", "0"]
    cmd += ["--ckpt-root", str(root), "--steps", str(steps), "--save-every", "100000", "--seed", "0"]
    with (root.parent / "job.log").open("wb") as log:
        proc = subprocess.Popen(
            cmd, cwd=REPO, env=trainer_env(OMP_NUM_THREADS="1"), stdout=log, stderr=subprocess.STDOUT,
            start_new_session=True,
        )  # fmt: skip
        try:
            yield proc
        finally:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=stop_wait_s)
                except subprocess.TimeoutExpired:
                    kill_tree(proc.pid)
                    proc.wait()
