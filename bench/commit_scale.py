"""What one commit costs as the world grows: 16, 256 and 4,096 simulated ranks, side by side.

No processes: each simulated rank's report is what a real rank sends at the commit (its files:
``__R_0.distcp``, its own DCP index ``__R_index.metadata`` (FSDP's sharded state: one per rank,
supervisor/resumable/_dcp_index.py) and its per-rank state file, each with size and xxh3-128), and its files exist, small and already synced (as DCP leaves its shards), in a real tmp
dir. Per world size N:
- the gather: bytes received per rank and over the job, and the time to decode the reports, for
  the old all-gather (every rank received and unpickled all N reports: O(N^2) over the job) and
  for ``_agree.gather_to_root`` (rank 0 receives N length-prefixed buffers padded to the largest,
  the others receive nothing: O(N)); its decode is timed with the real ``_pack``/``unpack_all``;
- the manifest: rank 0's ``checkpointer.commit_reports`` (``supervisor.store.commit`` with every
  rank's report: the directory fsyncs (each rank fsynced its own files), the writers check, the
  manifest, rename, ``latest``), timed on the real files;
and the same per rank, which stays flat when the growth is linear.

    .venv/bin/python bench/commit_scale.py [--ranks 16 256 4096] [--rounds 3] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import pickle
import shutil
import statistics
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from supervisor.format.layout import dcp_index_filename, dcp_shard_filename, rank_state_filename  # noqa: E402  after the path
from supervisor.format.manifest import CheckpointInfo, FileEntry  # noqa: E402

if TYPE_CHECKING:
    from supervisor.resumable._checkpointer import RankFiles

SHARD_BYTES = 4096  # on disk; the size recorded is what matters to the manifest, not the bytes
STATE_BYTES = 1024
INDEX_BYTES = 512


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 256, 4096])
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    return p.parse_args(argv)


def reports(world: int) -> list[RankFiles]:
    """What each simulated rank sends rank 0: its files with size and checksum."""
    from supervisor.resumable._checkpointer import RankFiles

    out = []
    for r in range(world):
        files = {
            dcp_shard_filename(r): SHARD_BYTES,
            dcp_index_filename(r): INDEX_BYTES,
            rank_state_filename(r): STATE_BYTES,
        }
        out.append(RankFiles({n: FileEntry(size, f"{r:016x}{size:016x}") for n, size in files.items()}))
    return out


def write_files(tmp: Path, reps: list[RankFiles]) -> None:
    tmp.mkdir()
    for rep in reps:
        for name, e in rep.entries.items():
            with open(tmp / name, "wb") as f:
                f.write(b"\0" * e.size)
    os.sync()  # each writer synced its own files before reporting (DCP's sync_files)


def timed(fn: Callable[[], object], rounds: int) -> float:
    ts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        fn()
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def one_size(world: int, work: Path, rounds: int) -> dict[str, float]:
    import torch

    from supervisor.resumable import _agree
    from supervisor.resumable._checkpointer import commit_reports

    reps = reports(world)
    pickled = [pickle.dumps(r) for r in reps]
    packed = [_agree._pack(r) for r in reps]
    widest = max(p.numel() for p in packed)
    received = torch.cat([torch.nn.functional.pad(p, (0, widest - p.numel())) for p in packed])
    old_decode = timed(lambda: [pickle.loads(b) for b in pickled], rounds)
    new_decode = timed(lambda: _agree.unpack_all(received, world), rounds)
    assert _agree.unpack_all(received, world) == reps

    info = CheckpointInfo(step=0, world_size=world)
    commits = []
    for i in range(rounds):
        root = work / f"n{world}_{i}"
        tmp = root / f"step_{i + 1:08d}.tmp.bench"
        root.mkdir()
        write_files(tmp, reps)
        t0 = time.perf_counter()
        commit_reports(root, tmp, dataclasses.replace(info, step=i + 1), reps)
        commits.append(time.perf_counter() - t0)
        shutil.rmtree(root)
    total = sum(len(b) for b in pickled)
    return {
        "old_bytes_job": total * world,
        "new_bytes_job": widest * world,
        "old_decode_s": old_decode,  # on every rank
        "new_decode_s": new_decode,  # on rank 0 only
        "commit_s": statistics.median(commits),
    }


def main() -> int:
    args = parse()
    work = Path(tempfile.mkdtemp(prefix="bench_commit_", dir=args.dir))
    try:
        rows = {n: one_size(n, work, args.rounds) for n in args.ranks}
    finally:
        shutil.rmtree(work, ignore_errors=True)
    mib = 1 << 20
    print(f"{'ranks':>6} | {'gather: old all-gather, MiB':>27} {'new to rank 0':>14} | "
          f"{'decode ms: old each rank':>24} {'new rank 0':>10} | {'commit ms':>9} {'us/rank':>8}")  # fmt: skip
    for n, r in rows.items():
        print(
            f"{n:>6} | {r['old_bytes_job'] / mib:>27.2f} {r['new_bytes_job'] / mib:>14.3f} | "
            f"{r['old_decode_s'] * 1e3:>24.2f} {r['new_decode_s'] * 1e3:>10.2f} | "
            f"{r['commit_s'] * 1e3:>9.1f} {r['commit_s'] / n * 1e6:>8.1f}"
        )
    small, big = min(rows), max(rows)
    grow = big / small
    print(f"{small} -> {big} ranks (x{grow:g}):")
    print(f"  bytes moved, old all-gather  x{rows[big]['old_bytes_job'] / rows[small]['old_bytes_job']:,.0f}")
    print(f"  bytes moved, gather to root  x{rows[big]['new_bytes_job'] / rows[small]['new_bytes_job']:,.0f}")
    print(f"  commit time (rank 0)         x{rows[big]['commit_s'] / rows[small]['commit_s']:,.1f}")
    print(f"  decode, rank 0               x{rows[big]['new_decode_s'] / rows[small]['new_decode_s']:,.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
