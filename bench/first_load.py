"""A resume's load, the first in a fresh process: optimizer state allocated for it vs made by torch.

A resume loads into a fresh optimizer. torch 2.13 gives an optimizer without state its state by
one ``step()`` over zero gradients before DCP can load into it; the trainer instead allocates an
Adam(W)'s state for the load to fill (supervisor/resumable/_optim_state.py). This bench saves one checkpoint
of the ``bench`` config (FSDP, 2 ranks, gloo), then launches ``--trials`` fresh torchruns of each
kind, alternated, each timing ``Checkpointer.load`` from a barrier to a barrier, and prints the
medians side by side.

    .venv/bin/python bench/first_load.py [--trials 3]
"""

from __future__ import annotations

import argparse
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

from bench.checkpoint import make_trainer, torchrun_env  # noqa: E402 - after the path is set

KINDS = ("torch", "allocated")


def worker(work: Path, kind: str) -> None:
    import torch.distributed as dist

    import supervisor.resumable._checkpointer as checkpointer
    from supervisor.format.heartbeat import Phase
    from supervisor.store import list_checkpoints

    if kind == "torch":  # the trainer without its allocation: torch's _init_optim_state runs
        checkpointer.prime_for_load = lambda _optimizer: False
    t = make_trainer(work / "ckpt", "bench")
    st, d = t.state, t.d
    if kind == "save":
        x, y, _ = next(iter(t.loader()))
        t.train_step(x, y)
        st.step += 1
        t.r._ckpt.save(st, {}, blocking=True)
    else:
        newest = list_checkpoints(work / "ckpt")[0].path
        dist.barrier()
        t0 = time.perf_counter()
        tracker = t.r._hb.tracker(Phase.LOAD, st.step)
        t.r._ckpt.load(newest, st, saved_world_size=d.world_size, skip=frozenset(), progress=tracker)
        dist.barrier()
        if d.rank == 0:
            print(f"LOAD_S {time.perf_counter() - t0:.4f}", flush=True)
    t.r._ckpt.close()
    dist.destroy_process_group()


def launch(work: Path, kind: str) -> float | None:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2", __file__,
           "--worker", kind, "--dir", str(work)]  # fmt: skip
    out = subprocess.run(cmd, env=torchrun_env(None), cwd=REPO, capture_output=True, text=True, check=True)
    got = [line.split()[1] for line in out.stdout.splitlines() if line.startswith("LOAD_S ")]
    return float(got[0]) if got else None


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--trials", type=int, default=3)
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--worker", choices=("save", *KINDS), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.worker:
        worker(Path(args.dir), args.worker)
        return 0
    work = Path(tempfile.mkdtemp(prefix="bench_first_load_", dir=args.dir))
    try:
        launch(work, "save")
        got: dict[str, list[float]] = {k: [] for k in KINDS}
        for _ in range(args.trials):
            for kind in KINDS:
                s = launch(work, kind)
                if s is None:
                    raise SystemExit(f"bench: the {kind} launch printed no load time")
                got[kind].append(s)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    for kind in KINDS:
        print(f"first load, optimizer state {kind + ':':<11} median {statistics.median(got[kind]):.3f} s  "
              f"({', '.join(f'{v:.3f}' for v in got[kind])})")  # fmt: skip
    ratio = statistics.median(got["allocated"]) / statistics.median(got["torch"])
    print(f"allocated / torch's: {ratio:.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
