"""What a load's plan exchange costs rank 0 as the world grows: 16, 256 and 4,096 simulated ranks.

With a process group, ``dcp.load`` gathers every rank's local load plan to rank 0
(``gather_object``: rank 0 unpickles N plans), runs the global plan step, which for a load is the
identity (``create_default_global_load_plan``), and scatters the plans back
(``scatter_object_list``: rank 0 pickles N plans), while every other rank waits for it. The
trainer's load (``safe_load.load_dcp``) plans on each rank alone (``no_dist``) and then agrees
on the outcome with one all-reduce of a single number; rank 0 decodes nothing.

No processes: one real local load plan is made from a real checkpoint of the ``bench`` model
and its AdamW state (saved here, one process: the same items as one FSDP rank's plan, each rank
holding a shard of every parameter), and rank 0's part of DCP's exchange is timed on it for N
simulated ranks: N unpickles and N pickles of that plan. Bytes into and out of rank 0 are
counted. The local plan itself, the same on every rank either way, is timed once beside it.

    .venv/bin/python bench/load_plan_scale.py [--ranks 16 256 4096] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import pickle
import shutil
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 256, 4096])
    p.add_argument("--dir", default=None, help="where to write the checkpoint (default: a temp dir)")
    return p.parse_args(argv)


def local_plan(work: Path) -> tuple[object, float]:
    """One rank's local load plan of a real ``bench`` checkpoint, and the time it took to make."""
    import torch
    import torch.distributed.checkpoint as dcp

    from supervisor.resumable._objects import Objects
    from supervisor.resumable._optim_state import prime_for_load
    from supervisor.resumable._safe_load import SafeFileSystemReader, SafeLoadPlanner
    from train_ref.config import get_config
    from train_ref.data import Corpus
    from train_ref.model import GPT

    cfg = get_config("bench", Corpus.load(None).tokenizer.vocab_size)
    model = GPT(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prime_for_load(opt)  # the state a load reads into, as after the first step
    state = Objects({"model": model, "optimizer": opt})
    ckpt = work / "step_00000001"
    dcp.save({"app": state}, storage_writer=dcp.FileSystemWriter(ckpt), no_dist=True)
    reader = SafeFileSystemReader(ckpt)
    planner = SafeLoadPlanner(reader)
    t0 = time.perf_counter()
    metadata = reader.read_metadata()
    planner.set_up_planner({"app": state.state_dict()}, metadata, True)
    reader.set_up_storage_reader(metadata, True)
    plan = planner.create_local_plan()
    return plan, time.perf_counter() - t0


def rank0_exchange_s(plan: object, world: int) -> float:
    """Rank 0's CPU in DCP's plan exchange for ``world`` ranks: decode N plans, encode N."""
    sent = pickle.dumps(plan)
    t0 = time.perf_counter()
    for _ in range(world):
        pickle.loads(sent)
    for _ in range(world):
        pickle.dumps(plan)
    return time.perf_counter() - t0


def main() -> int:
    import warnings

    args = parse()
    work = Path(tempfile.mkdtemp(prefix="bench_load_plan_", dir=args.dir))
    try:
        with warnings.catch_warnings():  # no_dist's "assuming ... a single process"
            warnings.simplefilter("ignore")
            plan, plan_s = local_plan(work)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    size = len(pickle.dumps(plan))
    items = len(getattr(plan, "items", []))
    print(
        f"one rank's local load plan: {items} items, {size / 1024:.0f} KiB pickled, made in {plan_s * 1e3:.0f} ms"
    )
    print(f"{'ranks':>6} | {'DCP exchange: into rank 0, MiB':>30} {'rank 0 CPU, s':>13} {'ms/rank':>8} | "
          f"{'each rank alone: into rank 0':>28} {'rank 0 CPU':>10}")  # fmt: skip
    rows = {}
    for n in args.ranks:
        rows[n] = rank0_exchange_s(plan, n)
        print(
            f"{n:>6} | {size * n / (1 << 20):>30.1f} {rows[n]:>13.2f} {rows[n] / n * 1e3:>8.2f} | "
            f"{'8 bytes (one all-reduce)':>28} {'0':>10}"
        )
    small, big = min(rows), max(rows)
    print(f"{small} -> {big} ranks (x{big / small:g}): DCP's exchange on rank 0 x{rows[big] / rows[small]:,.1f}; "
          f"each rank alone: flat (its own local plan, {plan_s * 1e3:.0f} ms, either way)")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
