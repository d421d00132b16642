"""The CPU a relaunch costs, and the goodput it leaves on cores the training ranks keep busy.

    .venv/bin/python bench/relaunch_cpu.py [--nproc 2] [--every 10,30] [--repeats 3] [--steps 2000]

Every relaunch that starts its ranks as fresh interpreters pays each rank's imports once more
(torch, torch.distributed, DCP with DTensor, the reference trainer); a relaunch by the watchdog
(``--standby`` too) also starts a new torchrun agent, torchrun's own restarts keep theirs. Started
ahead (``--standby``), that CPU leaves the recovery's critical path, but not the cores: where the
ranks keep them busy it is taken from the steps all the same. With C CPU-seconds per relaunch, a
kill every F seconds, ``cores`` cores of which the uninterrupted training keeps ``u`` busy, the CPU
a faulted run has (cores x its wall) must hold the training's (u x the uninterrupted wall) and
C per kill, so, whatever the recovery does,

    goodput <= (cores - C / F) / u        (at most 1)

Measured here, each the median of ``--repeats`` (user + system seconds, from ``wait4``):

- ``rank``: ``python -c 'import train_ref.train'`` (what a reference trainer's rank imports
  before its first step; DCP and DTensor come with it);
- ``agent``: ``torchrun --nproc-per-node 1 --no-python true`` less one ``true``: the agent's
  imports and its rendezvous store, the launch of one worker;
- ``fork``: a child forked by a process that has imported the same, which imports it again
  (all cached) and exits: what a rank would cost started by a fork server instead of an exec;
- ``u``: bench/goodput.py's uninterrupted run (``--steps``, ``--nproc`` ranks): the CPU of
  torchrun's process tree from a quarter to three quarters of its steps, per second;
- the slowdown: the same run's wall over that window with a standby's imports (``nproc`` ranks'
  and an agent's, as above) started at its start, less the wall without them, the runs
  alternated. Where it is more than C / cores, the idle share of the cores did not absorb the
  imports: each kill under ``watch --standby`` then costs at least that much, and a kill every
  F seconds leaves at most 1 - slowdown / F;
- the same with one interpreter's imports beside it (``rank``'s, no agent): what a fork server
  started ahead would cost once per relaunch, had it forked the ranks itself (and done their
  rendezvous without torchrun's agent): the bound such a design would have.

Bounds, not a measurement of goodput: bench/goodput.py measures that (and must stay below them).
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from bench.goodput import TORCHRUN, Setup, Tail  # noqa: E402 - after the path is set
from supervisor.format.layout import RunDir  # noqa: E402
from supervisor.watch.process import descendants, process_table  # noqa: E402

POLL_S = 0.05
RANK_IMPORTS = "import train_ref.train"
ENV = {**os.environ, "PYTHONPATH": str(REPO), "OMP_NUM_THREADS": "1"}


def child_cpu(cmd: list[str]) -> float:
    """User + system CPU seconds of ``cmd`` and what it waited for."""
    with tempfile.TemporaryFile() as err:
        proc = subprocess.Popen(cmd, env=ENV, stdout=subprocess.DEVNULL, stderr=err)
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
    out = subprocess.run(
        [sys.executable, "-c", script], env=ENV, capture_output=True, text=True, check=True, timeout=600
    )
    return [float(line) for line in out.stdout.split()]


def tree_cpu(pid: int) -> float:
    """User + system CPU seconds of ``pid`` and its descendants alive now."""
    table = process_table()
    ticks = sum(table[p].cpu_ticks for p in [pid, *descendants(pid, table)] if p in table)
    return ticks / os.sysconf("SC_CLK_TCK")


def window(steps: int, nproc: int, inject: list[list[str]]) -> tuple[float, float]:
    """The uninterrupted goodput run's wall and its process tree's CPU from a quarter to three
    quarters of its steps; ``inject``: commands started at the window's start (a standby's
    imports), which it does not count. A window that ends before they do is refused: their
    slowdown would be understated."""
    with tempfile.TemporaryDirectory(prefix="bench-relaunch-") as tmp:
        root = Path(tmp) / "r"
        cmd = Setup(steps=steps, save_every=10, nproc=nproc).torchrun(root)
        proc = subprocess.Popen(cmd, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        tail = Tail(RunDir.of(root).metrics)

        def reach(step: int) -> tuple[float, float]:
            while not tail.seen or tail.seen[-1][1] < step:
                if proc.poll() is not None:
                    raise SystemExit(f"{' '.join(cmd)} ended ({proc.returncode}) before step {step}")
                time.sleep(POLL_S)
                tail.poll()
            return time.monotonic(), tree_cpu(proc.pid)

        t0, c0 = reach(steps // 4)
        extra = [
            subprocess.Popen(c, cwd=REPO, env=ENV, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
            for c in inject
        ]
        t1, c1 = reach(3 * steps // 4)
        if any(e.poll() is None for e in extra):
            proc.terminate()  # torchrun passes it to its ranks
            proc.wait()
            raise SystemExit(f"the window ended before the imports beside it did: more --steps than {steps}")
        if proc.wait() != 0 or any(e.returncode != 0 for e in extra):
            raise SystemExit(f"{' '.join(cmd)} or what it was given to import beside it failed")
    return t1 - t0, c1 - c0


def bound(cores: int, cpu: float, every: float, busy: float) -> float:
    """The module docstring's bound on goodput: ``cpu`` CPU-s per kill, a kill every ``every`` s."""
    return min(1.0, (cores - cpu / every) / busy)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--nproc", type=int, default=2, help="ranks per relaunch")
    p.add_argument("--steps", type=int, default=2000, help="steps of the run that measures u")
    p.add_argument("--every", default="10,30", help="fault periods F in seconds")
    p.add_argument("--repeats", type=int, default=3)
    opts = p.parse_args()
    true = shutil.which("true") or "/bin/true"
    rank = [child_cpu([sys.executable, "-c", RANK_IMPORTS]) for _ in range(opts.repeats)]
    bare = [child_cpu([true]) for _ in range(opts.repeats)]
    agent_cmd = [TORCHRUN, "--nproc-per-node", "1", "--standalone", "--no-python", true]
    agent = [child_cpu(agent_cmd) for _ in range(opts.repeats)]
    fork = forked_cpu(opts.repeats)
    r, a, f = (
        statistics.median(rank),
        statistics.median(agent) - statistics.median(bare),
        statistics.median(fork),
    )
    print(f"a rank's imports:  {r:.2f} CPU-s (runs: {' '.join(f'{x:.2f}' for x in rank)})")
    print(f"torchrun's agent:  {a:.2f} CPU-s (runs: {' '.join(f'{x:.2f}' for x in agent)}, less `true`)")
    print(f"a forked rank:     {f:.3f} CPU-s (runs: {' '.join(f'{x:.3f}' for x in fork)})")
    cores = os.cpu_count() or 1
    one = [sys.executable, "-c", RANK_IMPORTS]
    beside = {"none": [], "standby": [one] * opts.nproc + [agent_cmd], "one": [one]}
    runs: dict[str, list[tuple[float, float]]] = {k: [] for k in beside}
    order = [*beside]
    for i in range(opts.repeats):  # side by side, the order rotated
        for k in order[i % len(order) :] + order[: i % len(order)]:
            runs[k].append(window(opts.steps, opts.nproc, beside[k]))
    wall = statistics.median(w for w, _ in runs["none"])
    u = statistics.median(c / w for w, c in runs["none"])
    slowed = {k: statistics.median(w for w, _ in runs[k]) - wall for k in ("standby", "one")}

    def walls(k: str) -> str:
        return " ".join(f"{w:.1f}" for w, _ in runs[k])

    print(
        f"the training keeps {u:.2f} of {cores} cores busy ({opts.nproc} ranks, tiny, ddp; {wall:.1f} s window)"
    )
    print(
        f"a standby's imports started beside it ({opts.nproc} ranks' and an agent's) slow it by "
        f"{slowed['standby']:.2f} s (runs: {walls('standby')} s against {walls('none')} s)"
    )
    print(
        f"one interpreter's imports beside it (a fork server's, which then forks every rank) slow it by "
        f"{slowed['one']:.2f} s (runs: {walls('one')} s)"
    )
    watch_cpu, restart_cpu, fork_cpu = opts.nproc * r + a, opts.nproc * r, opts.nproc * f + a
    print(
        f"per relaunch of {opts.nproc} ranks: {watch_cpu:.2f} CPU-s by the watchdog (a new agent), "
        f"{restart_cpu:.2f} by torchrun's own restarts, {fork_cpu:.2f} by a fork server beside a new agent"
    )
    for every in (float(x) for x in opts.every.split(",")):
        print(
            f"kill every {every:g} s: by CPU alone goodput <= {bound(cores, watch_cpu, every, u):.2f} (watchdog), "
            f"<= {bound(cores, restart_cpu, every, u):.2f} (torchrun's restarts), "
            f"<= {bound(cores, fork_cpu, every, u):.2f} (fork server); "
            f"by the slowdown a standby's imports cause, <= {1 - slowed['standby'] / every:.2f} (watch --standby), "
            f"<= {1 - slowed['one'] / every:.2f} (a fork server's, started ahead)"
        )
    return 0


if __name__ == "__main__":
    sys.exit(main())
