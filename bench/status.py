"""How fast is ``supervisor status --json`` on a big run? Target: under 200 ms in total.

Builds a synthetic run directory (4096 ranks' heartbeats, 200 committed checkpoints of 9 files
each, a state file with 50 launches), then times, alternating in one run:
``python -c pass`` (the floor: interpreter start) and ``python -m supervisor status --json``.

    .venv/bin/python bench/status.py [--ranks 4096] [--checkpoints 200] [--repeat 7]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from supervisor.events import RunState, write_state  # noqa: E402
from supervisor.heartbeat import Heartbeat, Phase, write_heartbeat  # noqa: E402
from supervisor.layout import MANIFEST, step_dirname  # noqa: E402
from supervisor.manifest import build_manifest  # noqa: E402
from supervisor.policy import LaunchRecord, Outcome  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
SHARDS_PER_CKPT = 8
TARGET_S = 0.200


def build(root: Path, ranks: int, checkpoints: int) -> None:
    now = time.time()
    for r in range(ranks):
        write_heartbeat(root, Heartbeat(r, r % 8, f"node{r // 8}", 1000 + r, 5000, Phase.TRAIN, now, 3, ranks, 0.4, "L"))
    for i in range(checkpoints):
        step = (i + 1) * 100
        d = root / step_dirname(step)
        d.mkdir()
        (d / ".metadata").write_bytes(b"m" * 512)
        for s in range(SHARDS_PER_CKPT):
            (d / f"__{s}_0.distcp").write_bytes(bytes([s]) * 4096)
        (d / MANIFEST).write_text(build_manifest(d, step=step, world_size=ranks).to_json())
    (root / "latest").write_text(step_dirname(checkpoints * 100) + "\n")
    launches = tuple(
        LaunchRecord(n, f"L{n}", now - 1000 + n, now - 999 + n, Outcome.CRASH, "exit 1: crash", n, n, n)
        for n in range(1, 51)
    )
    write_state(root, RunState(status="running", launch_id="L", launch_count=51, launches=launches))


def timed(cmd: list[str]) -> float:
    t0 = time.perf_counter()
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL, cwd=REPO)
    return time.perf_counter() - t0


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
        floor, status = [], []
        for _ in range(a.repeat):
            floor.append(timed(floor_cmd))
            status.append(timed(status_cmd))
    f, s = statistics.median(floor), statistics.median(status)
    print(f"{'command':<28}{'median':>10}{'min':>10}{'max':>10}")
    print(f"{'python -c pass':<28}{f * 1e3:>8.0f}ms{min(floor) * 1e3:>8.0f}ms{max(floor) * 1e3:>8.0f}ms")
    print(f"{'supervisor status --json':<28}{s * 1e3:>8.0f}ms{min(status) * 1e3:>8.0f}ms{max(status) * 1e3:>8.0f}ms")
    print(f"status / python -c pass: {s / f:.1f}x; status - floor: {(s - f) * 1e3:.0f} ms")
    verdict = "meets" if s < TARGET_S else "MISSES"
    print(f"target: status under {TARGET_S * 1e3:.0f} ms total: {verdict} ({s * 1e3:.0f} ms, {os.cpu_count()} CPUs)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
