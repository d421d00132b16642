"""Which bytes each rank checks in a resume's spread deep verify, and how many of them it loads next.

On the world size that saved a checkpoint, rank r loads the files it wrote (its DCP shard, its RNG
file; every rank DCP's index). A verify that checks files by size alone gives rank r other ranks'
shards: on a node of its own, its load then reads its shard cold, a second read of the
checkpoint's bytes. ``supervisor.resumable._resume.verify_shares`` gives each rank what it wrote. This counts
bytes, side by side for both splits, on a real checkpoint (made here by the reference trainer,
``tiny`` config, FSDP, ``--ranks`` ranks, unless ``--ckpt`` names one); no clock.

    .venv/bin/python bench/verify_split.py [--ranks 4] [--ckpt RUN/step_N]
"""

from __future__ import annotations

import argparse
import subprocess
import sys
import tempfile
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.checkpoint import torchrun_env  # noqa: E402 - after the path is set
from supervisor.format.manifest import Manifest, read_manifest  # noqa: E402
from supervisor.resumable._resume import split_by_size, verify_shares  # noqa: E402
from supervisor.store import list_checkpoints  # noqa: E402


def report(m: Manifest) -> None:
    sizes = {n: e.size for n, e in m.files.items()}
    print(f"step {m.step}: {m.world_size} ranks, {sum(sizes.values()):,} bytes in {len(sizes)} files")
    if not m.writers:
        print("  its manifest records no writers (format 1): both splits go by size")
        return
    for label, shares in (
        ("by size (before)", split_by_size(sizes, m.world_size)),
        ("what each wrote (verify_shares)", verify_shares(m, m.world_size)),
    ):
        own_total = checked_own = 0
        print(f"  {label}:")
        for r, share in enumerate(shares):
            own = set(m.writers.get(r, ()))
            mine = sum(sizes[n] for n in share)
            reused = sum(sizes[n] for n in share if n in own)
            own_total += sum(sizes[n] for n in own)
            checked_own += reused
            print(f"    rank {r}: checks {mine:>12,} B, of which it loads next {reused:>12,} B")
        largest = max(sum(sizes[n] for n in s) for s in shares)
        print(
            f"    bytes a rank checks and then loads itself: {checked_own / own_total:.0%} of what the "
            f"ranks load; largest share {largest / (sum(sizes.values()) / m.world_size):.2f}x the even share"
        )


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, default=4)
    p.add_argument("--ckpt", type=Path, default=None, help="a committed checkpoint (default: make one)")
    args = p.parse_args()
    if args.ckpt is not None:
        report(read_manifest(args.ckpt))
        return 0
    with tempfile.TemporaryDirectory(prefix="bench_verify_split_") as work:
        root = Path(work) / "run"
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.ranks}",
               "-m", "train_ref.train", "--ckpt-root", str(root), "--config", "tiny", "--parallel", "fsdp",
               "--steps", "10", "--save-every", "10", "--seed", "0"]  # fmt: skip
        subprocess.run(cmd, env=torchrun_env(None), cwd=REPO, check=True, capture_output=True)
        report(read_manifest(list_checkpoints(root)[0].path))
    return 0


if __name__ == "__main__":
    sys.exit(main())
