"""The CPU a relaunch costs, and the goodput it leaves where the training ranks use every core.

    .venv/bin/python bench/relaunch_cpu.py [--nproc 2] [--cores 2] [--every 10,30] [--repeats 3]

Every relaunch that starts its ranks as fresh interpreters (torchrun's own restarts, the
watchdog's, a ``--standby`` started ahead of the failure) pays each rank's imports once more
(torch, torch.distributed, DCP with DTensor, the reference trainer), and a new torchrun agent
pays its own. Started ahead (``--standby``), that CPU leaves the recovery's critical path, but
where the training ranks keep every core busy (2 ranks on this 2-core VM) it is taken from the
steps all the same. So, whatever the recovery does, a kill every F seconds leaves at most

    goodput <= 1 - CPU per relaunch / (F * cores)

Measured here, each the median of ``--repeats`` (user + system seconds of the child, from
``wait4``):

- ``rank``: ``python -c 'import train_ref.train'`` (what a reference trainer's rank imports
  before its first step; DCP and DTensor come with it);
- ``agent``: ``torchrun --nproc-per-node 1 --no-python true`` less one ``true``: the agent's
  imports and its rendezvous store, the launch of one worker;
- ``fork``: a child forked by a process that has imported the same, which imports it again
  (all cached) and exits: what a rank would cost started by a fork server instead of an exec.

The bound is printed for the exec path (``nproc`` ranks and an agent) and for a fork server
beside a kept agent. A bound, not a measurement of goodput: bench/goodput.py measures that.
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
TORCHRUN = str(Path(sys.executable).parent / "torchrun")
RANK_IMPORTS = "import train_ref.train"


def child_cpu(cmd: list[str]) -> float:
    """User + system CPU seconds of ``cmd`` and what it waited for."""
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=err)
        _, status, usage = os.wait4(proc.pid, 0)
        proc.returncode = os.waitstatus_to_exitcode(status)  # reaped here: Popen must not wait again
        if proc.returncode != 0:
            err.seek(0)
            raise SystemExit(f"{' '.join(cmd)} failed ({proc.returncode}): {err.read()[-2000:].decode()}")
    return usage.ru_utime + usage.ru_stime


def forked_cpu(repeats: int) -> list[float]:
    """In a child that has imported a rank's modules: the CPU of each of ``repeats`` forks of it."""
    script = (
        f"import os, sys\n{RANK_IMPORTS}\n"
        f"for _ in range({repeats}):\n"
        "    pid = os.fork()\n"
        f"    if pid == 0:\n        {RANK_IMPORTS}\n        os._exit(0)\n"
        "    _, status, ru = os.wait4(pid, 0)\n"
        "    assert status == 0, status\n"
        "    print(ru.ru_utime + ru.ru_stime)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-c", script], env=env, capture_output=True, text=True, check=True, timeout=600
    )
    return [float(line) for line in out.stdout.split()]


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks per relaunch")
    p.add_argument("--cores", type=int, default=os.cpu_count() or 1, help="cores the ranks keep busy")
    p.add_argument("--every", default="10,30", help="fault periods F in seconds")
    p.add_argument("--repeats", type=int, default=3)
    opts = p.parse_args()
    true = shutil.which("true") or "/bin/true"
    rank = [child_cpu([sys.executable, "-c", RANK_IMPORTS]) for _ in range(opts.repeats)]
    bare = [child_cpu([true]) for _ in range(opts.repeats)]
    agent = [
        child_cpu([TORCHRUN, "--nproc-per-node", "1", "--standalone", "--no-python", true])
        for _ in range(opts.repeats)
    ]
    fork = forked_cpu(opts.repeats)
    r, a, f = (
        statistics.median(rank),
        statistics.median(agent) - statistics.median(bare),
        statistics.median(fork),
    )
    print(f"a rank's imports:  {r:.2f} CPU-s (runs: {' '.join(f'{x:.2f}' for x in rank)})")
    print(f"torchrun's agent:  {a:.2f} CPU-s (runs: {' '.join(f'{x:.2f}' for x in agent)}, less `true`)")
    print(f"a forked rank:     {f:.3f} CPU-s (runs: {' '.join(f'{x:.3f}' for x in fork)})")
    exec_cpu, fork_cpu = opts.nproc * r + a, opts.nproc * f + a
    print(
        f"per relaunch of {opts.nproc} ranks: exec {exec_cpu:.2f} CPU-s, a fork server beside the agent {fork_cpu:.2f}"
    )
    for every in (float(x) for x in opts.every.split(",")):
        budget = every * opts.cores
        print(
            f"kill every {every:g} s on {opts.cores} busy cores: goodput <= {1 - exec_cpu / budget:.2f} (exec), "
            f"<= {1 - fork_cpu / budget:.2f} (fork server; <= {1 - opts.nproc * f / budget:.2f} without an agent)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
