"""How fast is ``supervisor status --json`` on a big run? Target: under 200 ms in total.

Builds a synthetic run directory (4096 ranks' heartbeats, 200 committed checkpoints of 9 files
each, a state file with 50 launches), then times, alternating in one run:
``python -c pass`` (the floor: interpreter start) and ``python -m supervisor status --json``.

    .venv/bin/python bench/status.py [--ranks 4096] [--checkpoints 200] [--repeat 7]
"""

from __future__ import annotations

import argparse
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from supervisor.format.events import RunState, write_state
from supervisor.format.heartbeat import Heartbeat, Phase, write_heartbeat
from supervisor.format.layout import MANIFEST, step_dirname
from supervisor.format.manifest import CheckpointInfo, build_manifest
from supervisor.watch.restart_policy import LaunchRecord, Outcome

REPO = Path(__file__).resolve().parent.parent
SHARDS_PER_CKPT = 8
TARGET_S = 0.200


def build(root: Path, ranks: int, checkpoints: int) -> None:
    now = time.time()
    for r in range(ranks):
        write_heartbeat(
            root, Heartbeat(r, r % 8, f"node{r // 8}", 1000 + r, 5000, Phase.TRAIN, now, 3, ranks, 0.4, "L")
        )
    for i in range(checkpoints):
        step = (i + 1) * 100
        d = root / step_dirname(step)
        d.mkdir()
        (d / ".metadata").write_bytes(b"m" * 512)
        for s in range(SHARDS_PER_CKPT):
            (d / f"__{s}_0.distcp").write_bytes(bytes([s]) * 4096)
        (d / MANIFEST).write_text(build_manifest(d, CheckpointInfo(step, ranks)).to_json())
    (root / "latest").write_text(step_dirname(checkpoints * 100) + "\n")
    launches = tuple(
        LaunchRecord(n, f"L{n}", now - 1000 + n, now - 999 + n, Outcome.CRASH, "exit 1: crash", n, n, n)
        for n in range(1, 51)
    )
    write_state(root, RunState(status="running", launch_id="L", launch_count=51, launches=launches))


def timed(cmd: list[str]) -> tuple[float, float]:
    """Wall seconds and CPU seconds (user + system) of one run. On a shared, busy machine the wall
    time includes waiting for a core; the CPU time is what the command costs on an idle one."""
    r0 = resource.getrusage(resource.RUSAGE_CHILDREN)
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=REPO)
    wall = time.perf_counter() - t0
    r1 = resource.getrusage(resource.RUSAGE_CHILDREN)
    return wall, (r1.ru_utime - r0.ru_utime) + (r1.ru_stime - r0.ru_stime)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4096)
    p.add_argument("--checkpoints", type=int, default=200)
    p.add_argument("--repeat", type=int, default=7)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "run"
        root.mkdir()
        t0 = time.perf_counter()
        build(root, a.ranks, a.checkpoints)
        print(f"built {a.ranks} heartbeats + {a.checkpoints} checkpoints in {time.perf_counter() - t0:.1f}s")
        floor_cmd = [sys.executable, "-c", "pass"]
        status_cmd = [sys.executable, "-m", "supervisor", "status", "--ckpt-root", str(root), "--json"]
        timed(status_cmd)  # warm the page cache
        runs: dict[str, list[tuple[float, float]]] = {"floor": [], "status": []}
        for _ in range(a.repeat):
            runs["floor"].append(timed(floor_cmd))
            runs["status"].append(timed(status_cmd))
    print(f"{'command':<26}{'wall median':>12}{'wall min':>10}{'CPU median':>12}{'CPU min':>10}")
    med = {}
    for key, label in (("floor", "python -c pass"), ("status", "supervisor status --json")):
        wall = [w for w, _ in runs[key]]
        cpu = [c for _, c in runs[key]]
        med[key] = (statistics.median(wall), statistics.median(cpu))
        print(
            f"{label:<26}{med[key][0] * 1e3:>10.0f}ms{min(wall) * 1e3:>8.0f}ms"
            f"{med[key][1] * 1e3:>10.0f}ms{min(cpu) * 1e3:>8.0f}ms"
        )
    (fw, fc), (sw, sc) = med["floor"], med["status"]
    print(f"status / python -c pass: wall {sw / fw:.1f}x, CPU {sc / fc:.1f}x")
    load = os.getloadavg()[0]
    for what, v in (("wall", sw), ("CPU", sc)):
        verdict = "meets" if v < TARGET_S else "MISSES"
        print(f"target under {TARGET_S * 1e3:.0f} ms, {what} median: {verdict} ({v * 1e3:.0f} ms)")
    print(f"({os.cpu_count()} CPUs, load average {load:.1f} during the run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
