"""The reference trainer with its run dir on the fault filesystem (no rules set) vs on the plain
directory underneath, side by side in one run: is the FUSE passthrough fast enough to run the
storage-fault tests and drills on, and is the run through it the same run (equal final digest)?

On 2 ranks (torchrun, gloo, CPU), ``tiny`` config, ``--steps`` steps with a DCP save every
``--save-every``, the two placements interleaved ``--repeats`` times; medians and their ratio.
Target: the faultfs run within 2x of the plain one, and bit-identical.

    .venv/bin/python bench/faultfs.py [--repeats 3] [--steps 30] [--save-every 5] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from supervisor.drill.faultctl import FaultFS, fuse_unavailable  # noqa: E402


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=5)
    p.add_argument("--dir", default=None, help="parent of the temp dirs (default: the system's)")
    return p.parse_args(argv)


def train(root: Path, a: argparse.Namespace) -> tuple[float, str]:
    """One uninterrupted run; (seconds, final params digest)."""
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "train_ref.train", "--ckpt-root", str(root), "--steps", str(a.steps), "--save-every", str(a.save_every),
    ]  # fmt: skip
    env = {**os.environ, "PYTHONPATH": str(REPO), "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1"}
    t = time.perf_counter()
    r = subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    took = time.perf_counter() - t
    if r.returncode != 0:
        raise SystemExit(f"trainer on {root} failed ({r.returncode}):\n{r.stdout[-3000:]}{r.stderr[-3000:]}")
    return took, json.loads((root / "final.json").read_text())["params_sha256"]


def tree_bytes(root: Path) -> int:
    return sum(f.stat().st_size for f in root.rglob("*") if f.is_file())


def main(argv: list[str] | None = None) -> int:
    a = parse(argv)
    if reason := fuse_unavailable():
        print(f"bench/faultfs.py skipped: {reason}")
        return 0
    base = Path(tempfile.mkdtemp(prefix="bench-faultfs-", dir=a.dir))
    times: dict[str, list[float]] = {"plain": [], "faultfs": []}
    digests: set[str] = set()
    with FaultFS.start(base / "backing", base / "mnt") as fs:
        for i in range(a.repeats):
            for name, parent in (("plain", base / "plain"), ("faultfs", fs.mountpoint)):
                took, digest = train(parent / f"run{i}", a)
                times[name].append(took)
                digests.add(digest)
        ops = fs.ops()
        size = tree_bytes(fs.backing / "run0")
    plain, fuse = statistics.median(times["plain"]), statistics.median(times["faultfs"])
    print(
        f"trainer: 2 ranks, tiny, {a.steps} steps, a save every {a.save_every}; run dir {size / 1e6:.1f} MB"
    )
    print(f"{'placement':<10} {'median s':>9}  runs")
    for name, ts in times.items():
        print(f"{name:<10} {statistics.median(ts):>9.2f}  {' '.join(f'{t:.2f}' for t in ts)}")
    print(f"faultfs / plain: {fuse / plain:.2f}x (target <= 2x)")
    print(f"same final digest on both: {len(digests) == 1}")
    print(
        "FUSE operations (all runs): "
        + ", ".join(f"{k} {v}" for k, v in sorted(ops.items(), key=lambda kv: -kv[1]))
    )
    return 0 if len(digests) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
