"""What heartbeats cost the shared filesystem: metadata operations per node per second, before
(every rank rewrites its file in the run directory) and after (ranks write node-local, the
watchdog publishes one node summary per interval), counted with strace, not timed.

One node is simulated in one process: ``--ranks-per-node`` real HeartbeatWriters, each beating
once per simulated second (the writer's own throttle: at most one write a second per rank in a
phase), for ``--seconds`` simulated seconds, and the watchdog reads its ranks' files as its
monitor does after they assembled (each rank's file per ``--poll-interval``, 0.5 s): before from
the run directory, after from the node-local folder, where it also runs the Publisher once per
``--summary-interval`` simulated seconds. ``strace -f -y`` records every syscall; those naming a
path under the run directory (the shared filesystem) are counted, by syscall. No clock is read:
the counts are per simulated second.

    .venv/bin/python bench/heartbeat_load.py [--ranks-per-node 8] [--seconds 60] [--summary-interval 5]
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections import Counter
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from supervisor.format.heartbeat import HeartbeatWriter, Phase, read_heartbeat
from supervisor.format.layout import HEARTBEAT_DIR_ENV, RunDir, heartbeat_filename
from supervisor.watch.liveness import PhaseTimeouts
from supervisor.watch.node_summary import NodeFacts, Publisher

# Syscalls that cost a shared filesystem a metadata round trip (namespace lookups and changes,
# opens, and fsync's commit); reads, writes and closes of an open file are counted apart.
METADATA = re.compile(
    r"^(open|openat|creat|stat|lstat|newfstatat|statx|fstat|access|faccessat2?|mkdir|mkdirat|rename|renameat2?|unlink|unlinkat|rmdir|fsync|fdatasync|getdents64|readlink|chmod|utimensat)$"
)
POLLS_PER_S = 2  # the watchdog's default --poll-interval, 0.5 s
LINE = re.compile(r"^(?:\[pid\s+\d+\]\s+|\d+\s+)?(\w+)\((.*)$")


def child(mode: str, root: Path, local: Path, ranks: int, seconds: int, interval: int) -> None:
    """The simulated node: beats (and publishes) on a simulated clock."""
    if mode == "after":
        os.environ[HEARTBEAT_DIR_ENV] = str(local)
    writers = [
        HeartbeatWriter(root, rank=r, local_rank=r, world_size=ranks, interval_s=0.0) for r in range(ranks)
    ]
    watched = local if mode == "after" else RunDir.of(root).heartbeats
    pub = Publisher(
        root, local, NodeFacts(0, "node0", os.getpid(), float(interval), "running"), PhaseTimeouts()
    )
    print("START", flush=True)  # what comes before (imports, setup) is not counted
    os.stat(f"{root}/.bench-start")  # the marker in the strace log
    for second in range(seconds):
        for w in writers:
            w.beat(second, Phase.TRAIN, last_step_s=1.0)
        for _poll in range(POLLS_PER_S):
            for r in range(ranks):
                read_heartbeat(watched / heartbeat_filename(r), r)
        if mode == "after" and second % interval == interval - 1:
            pub.publish()


def count(mode: str, tmp: Path, a: argparse.Namespace) -> tuple[Counter[str], Counter[str]]:
    """(metadata ops, other ops) on the run directory during the simulated seconds, by syscall."""
    root, local = tmp / mode / "run", tmp / mode / "local"
    root.mkdir(parents=True)
    (root / ".bench-start").touch()
    log = tmp / f"{mode}.strace"
    cmd = ["strace", "-f", "-y", "-qq", "-o", str(log), sys.executable, __file__, "--child", mode]
    cmd += ["--root", str(root), "--local", str(local), "--ranks-per-node", str(a.ranks_per_node)]
    cmd += ["--seconds", str(a.seconds), "--summary-interval", str(a.summary_interval)]
    subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL)
    meta: Counter[str] = Counter()
    other: Counter[str] = Counter()
    started = False
    shared = str(root)
    for line in log.read_text().splitlines():
        m = LINE.match(line)
        if not m:
            continue
        name, args = m.groups()
        if not started:
            started = ".bench-start" in args
            continue
        if shared in args:
            (meta if METADATA.match(name) else other)[name] += 1
    return meta, other


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks-per-node", type=int, default=8)
    p.add_argument("--seconds", type=int, default=60, help="simulated seconds")
    p.add_argument("--summary-interval", type=int, default=5, help="the watchdog's --summary-interval")
    p.add_argument("--child", choices=("before", "after"), help=argparse.SUPPRESS)
    p.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    p.add_argument("--local", type=Path, help=argparse.SUPPRESS)
    a = p.parse_args()
    if a.child:
        child(a.child, a.root, a.local, a.ranks_per_node, a.seconds, a.summary_interval)
        return 0
    if shutil.which("strace") is None:
        print("bench/heartbeat_load.py: strace not found; install it (apt-get install strace) and rerun")
        return 2
    with tempfile.TemporaryDirectory() as t:
        runs = {mode: count(mode, Path(t), a) for mode in ("before", "after")}
    print(
        f"one node, {a.ranks_per_node} ranks beating once a second, the watchdog reading them "
        f"{POLLS_PER_S}x a second, {a.seconds} simulated seconds; after: node-local heartbeats, "
        f"summary every {a.summary_interval}s"
    )
    names = sorted({n for meta, other in runs.values() for n in (*meta, *other)})
    print(f"{'syscall on the run dir':<24}{'before /s':>12}{'after /s':>12}")
    for n in names:
        kind = "" if METADATA.match(n) else " (data)"
        vals = [(runs[m][0] + runs[m][1])[n] / a.seconds for m in ("before", "after")]
        print(f"{n + kind:<24}{vals[0]:>12.2f}{vals[1]:>12.2f}")
    before, after = (sum(runs[m][0].values()) / a.seconds for m in ("before", "after"))
    print(f"{'metadata ops / node / s':<24}{before:>12.2f}{after:>12.2f}")
    print(f"after / before: {after / before:.3f} ({before / after:.0f}x fewer)" if after else "after: none")
    files = {m: sum(runs[m][0][n] for n in ("rename", "renameat", "renameat2")) / a.seconds for m in runs}
    print(f"files replaced / node / s: before {files['before']:.2f}, after {files['after']:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
