"""A cold load with and without its first files read ahead (supervisor/resumable/_readahead.py), alternated.

``bench/checkpoint.py`` runs each load variant once per repeat, between saves whose writeback and
prunes still move the disk; this bench asks one question on a quiet disk. The ``bench`` config
(FSDP, 2 ranks, gloo) saves one checkpoint, ``sync``s, then ``--trials`` times, in alternating
order: ``Checkpointer.load`` with the read-ahead, without it, and a raw read of each rank's own
shard (the floor), each after the checkpoint's pages are dropped (``posix_fadvise(DONTNEED)``),
from a barrier to a barrier. The first trial (a first load's one-off costs) is not counted.

    .venv/bin/python bench/cold_load.py [--trials 8]
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
from collections.abc import Callable
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.checkpoint import make_trainer, readahead_off, timed_all, torchrun_env  # noqa: E402 - after the path is set

KINDS = ("read ahead", "not read ahead", "raw read of the shard")


def worker(work: Path, trials: int) -> None:
    import torch.distributed as dist

    from bench.verify import raw_read
    from supervisor.format.heartbeat import Phase
    from supervisor.format.layout import dcp_shard_filename
    from supervisor.format.manifest import list_files
    from supervisor.store import list_checkpoints

    t = make_trainer(work / "ckpt", "bench")
    st, d = t.state, t.d
    st.step += 1
    t.r._ckpt.save(st, {}, blocking=True)
    ckpt = list_checkpoints(work / "ckpt")[0].path
    files = [ckpt / n for n in list_files(ckpt)]
    os.sync()

    def load() -> None:
        tracker = t.r._hb.tracker(Phase.LOAD, st.step)
        t.r._ckpt.load(ckpt, st, saved_world_size=d.world_size, skip=frozenset(), progress=tracker)

    def load_plain() -> None:
        with readahead_off():
            load()

    runs: dict[str, Callable[[], object]] = {
        "read ahead": load,
        "not read ahead": load_plain,
        "raw read of the shard": lambda: raw_read([ckpt / dcp_shard_filename(d.rank)]),
    }
    got: dict[str, list[float]] = {k: [] for k in KINDS}
    for i in range(trials + 1):
        for kind in KINDS[:: -1 if i % 2 else 1]:
            took = timed_all(runs[kind], files, cold=True)
            if i:
                got[kind].append(took)
    if d.rank == 0:
        for kind in KINDS:
            print(f"cold, {kind + ':':<22} median {statistics.median(got[kind]):.3f} s  "
                  f"({', '.join(f'{v:.3f}' for v in got[kind])})")  # fmt: skip
        raw = statistics.median(got["raw read of the shard"])
        for kind in KINDS[:2]:
            print(
                f"raw read / load, {kind + ':':<15} {raw / statistics.median(got[kind]):.3f}   (target >= 0.80)"
            )
    t.r._ckpt.close()
    dist.destroy_process_group()


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=8)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(Path(args.dir), args.trials)
        return 0
    with tempfile.TemporaryDirectory(prefix="bench_cold_load_", dir=args.dir) as work:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
               "--worker", "--trials", str(args.trials), "--dir", work]  # fmt: skip
        return subprocess.call(cmd, env=torchrun_env(None), cwd=REPO)


if __name__ == "__main__":
    sys.exit(main())
