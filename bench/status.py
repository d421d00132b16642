"""How fast is ``supervisor status --json`` on a big run? Target: at most 150 ms in total and at
most 10x ``python -c pass``.

Builds a synthetic run directory (4096 ranks' heartbeats, 200 committed checkpoints of 9 files
each, a state file with 50 launches), then times, alternating in one run:
``python -c pass`` (the floor: interpreter start) and ``python -m supervisor status --json``.
With ``--nodes N`` the ranks are spread over N nodes as watchdogs leave them: one node summary
per node (heartbeats/node_NNNNN.json, written by the watchdog's own code) and one state file per
node (state.json, state.nodeN.json, each with the launches); without, one rank file per rank in
the run directory (ranks without a watchdog) and one state file.

    .venv/bin/python bench/status.py [--ranks 4096] [--nodes 0] [--checkpoints 200] [--repeat 7]
    .venv/bin/python bench/status.py --ranks 16384 --nodes 2048 --checkpoints 500
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
from supervisor.format.heartbeat import Heartbeat, HeartbeatSnapshot, Phase, write_heartbeat
from supervisor.format.launches import LaunchRecord, Outcome
from supervisor.format.layout import MANIFEST, step_dirname
from supervisor.format.manifest import CheckpointInfo, build_manifest
from supervisor.format.nodesummary import write_summary
from supervisor.watch.liveness import Clock, PhaseTimeouts
from supervisor.watch.node_summary import NodeFacts, build_summary

REPO = Path(__file__).resolve().parent.parent
SHARDS_PER_CKPT = 8
TARGET_S = 0.150
TARGET_RATIO = 10.0
# Long enough that the summaries stay fresh while timed (a live run's are rewritten every 5 s);
# stale ones would make status read every rank's record, which is the node-lost path.
SUMMARY_INTERVAL_S = 600.0


def beat(rank: int, ranks: int, per_node: int, now: float) -> Heartbeat:
    host = f"node{rank // per_node}"
    return Heartbeat(rank, rank % per_node, host, 1000 + rank, 5000, Phase.TRAIN, now, 3, ranks, 0.4, "L")


def build_heartbeats(root: Path, ranks: int, nodes: int) -> None:
    """Rank files (nodes 0), or one summary per node as its watchdog would publish it."""
    now = time.time()
    if not nodes:
        for r in range(ranks):
            write_heartbeat(root, beat(r, ranks, 8, now))
        return
    per_node = -(-ranks // nodes)
    for n in range(nodes):
        beats = [beat(r, ranks, per_node, now) for r in range(n * per_node, min(ranks, (n + 1) * per_node))]
        snaps = [HeartbeatSnapshot(b.rank, "", b, record=b.to_dict()) for b in beats]
        facts = NodeFacts(
            n, f"node{n}", 2000 + n, SUMMARY_INTERVAL_S, "running", "launch 51 running", None, 51, 50, "L"
        )
        write_summary(root, *build_summary(snaps, facts, Clock(now), PhaseTimeouts()))


def build(root: Path, ranks: int, checkpoints: int, nodes: int = 0) -> None:
    now = time.time()
    build_heartbeats(root, ranks, nodes)
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
    for n in range(max(nodes, 1)):
        write_state(
            root, RunState(node=n, status="running", launch_id="L", launch_count=51, launches=launches)
        )


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
    p.add_argument("--nodes", type=int, default=0, help="spread the ranks over N watchdogs' node summaries")
    p.add_argument("--checkpoints", type=int, default=200)
    p.add_argument("--repeat", type=int, default=7)
    a = p.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        root = Path(tmp) / "run"
        root.mkdir()
        t0 = time.perf_counter()
        build(root, a.ranks, a.checkpoints, a.nodes)
        how = f"in {a.nodes} node summaries" if a.nodes else "as rank files"
        print(
            f"built {a.ranks} heartbeats {how} + {a.checkpoints} checkpoints "
            f"in {time.perf_counter() - t0:.1f}s"
        )
        floor_cmd = [sys.executable, "-c", "pass"]
        status_cmd = [sys.executable, "-m", "supervisor", "status", "--ckpt-root", str(root), "--json"]
        # Bytecode as `pip install` leaves it: with PYTHONDONTWRITEBYTECODE (set here on the
        # helpers' machines) every run would compile supervisor/ again, ~30 ms that no installed
        # copy pays.
        subprocess.run([sys.executable, "-m", "compileall", "-q", str(REPO / "supervisor")], check=True)
        # The first call quick-checks every checkpoint and remembers those that pass
        # (supervisor/store/quickcache.py); the timed ones find them unchanged. It also warms the page cache.
        first_wall, first_cpu = timed(status_cmd)
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
    print(
        f"first status (no quick checks remembered yet): {first_wall * 1e3:.0f} ms wall, {first_cpu * 1e3:.0f} ms CPU"
    )
    load = os.getloadavg()[0]
    for what, v, floor in (("wall", sw, fw), ("CPU", sc, fc)):
        verdict = "meets" if v <= TARGET_S and v <= TARGET_RATIO * floor else "MISSES"
        print(
            f"target <= {TARGET_S * 1e3:.0f} ms and <= {TARGET_RATIO:g}x python -c pass, {what} median: "
            f"{verdict} ({v * 1e3:.0f} ms, {v / floor:.1f}x)"
        )
    print(f"({os.cpu_count()} CPUs, load average {load:.1f} during the run)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
