"""A full cyclic-GC pass in the reference trainer's process, before and after ``gc.freeze()``.

``train.main`` freezes what it has built before its loop (imports, model, loaded state), so the
collector's full passes, which land anywhere in the loop (a step, an async save's call), no longer
walk it. The ``bench`` config on one rank (torchrun, gloo): ``--rounds`` full collections timed
each way, and the objects they walk.

    .venv/bin/python bench/gc_pause.py [--rounds 5]
"""

from __future__ import annotations

import argparse
import gc
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.checkpoint import make_trainer, torchrun_env  # noqa: E402 - after the path is set


def full_pass() -> float:
    t0 = time.perf_counter()
    gc.collect()
    return time.perf_counter() - t0


def worker(rounds: int, work: Path) -> None:
    make_trainer(work / "ckpt", "bench")
    walked = len(gc.get_objects())
    before = [full_pass() for _ in range(rounds)]
    gc.freeze()
    after = [full_pass() for _ in range(rounds)]
    print(f"objects a full pass walks: {walked} before gc.freeze(), {len(gc.get_objects())} after")
    for name, got in (("before", before), ("after", after)):
        print(f"full pass {name + ':':<7} median {statistics.median(got) * 1e3:7.2f} ms  "
              f"(max {max(got) * 1e3:.2f} ms, {rounds} passes)")  # fmt: skip
    print(f"after / before: {statistics.median(after) / statistics.median(before):.4f}")


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--dir", default=None, help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(args.rounds, Path(args.dir))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench_gc_") as work:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1",
               __file__, "--worker", "--rounds", str(args.rounds), "--dir", work]  # fmt: skip
        return subprocess.call(cmd, env=torchrun_env(Path(work) / "heartbeats"), cwd=REPO)


if __name__ == "__main__":
    sys.exit(main())
