"""Per-step cost of the step-boundary agreement (preemption notice, save in flight), side by side.

The loop must agree at every step whether any rank got a preemption notice and whether every
rank's async save is done (so all commit at the same step). It used to be one 2-integer all-reduce
of its own per step; now the two flags ride on the loss all-reduce the step does anyway
(``Checkpointer.reduce_with_control``). On N torchrun ranks (gloo on CPU, the ``tiny`` config),
interleaved blocks of ``--steps`` real training steps:
- piggybacked: ``train_step`` + ``step_boundary`` as the reference loop runs them now;
- separate: the same plus the old per-step collective (a 2-integer all-reduce on the control group);
and, alone, that collective in a tight loop (its latency: what every step paid before, and what a
step pays now only in a loop that does not piggyback).

    .venv/bin/python bench/step_control.py [--nproc 2] [--steps 20] [--rounds 7] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--steps", type=int, default=20, help="steps per timed block")
    p.add_argument("--rounds", type=int, default=7, help="interleaved pairs of blocks")
    p.add_argument("--collectives", type=int, default=2000, help="all-reduces timed alone")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def launch(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="bench_ctl_", dir=args.dir))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
        __file__, "--worker", "--dir", str(work), "--steps", str(args.steps), "--rounds", str(args.rounds),
        "--collectives", str(args.collectives),
    ]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONPATH=str(REPO))
    try:
        return subprocess.call(cmd, env=env, cwd=REPO)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist

    from bench.checkpoint import make_trainer

    t = make_trainer(Path(args.dir) / "ckpt", "tiny")
    batches = iter(t.loader())
    ctl = t.r._ckpt.ctl_group

    def old_collective() -> None:
        flags = torch.tensor([0, 0], dtype=torch.int64)
        dist.all_reduce(flags, op=dist.ReduceOp.MAX, group=ctl)

    def block(separate: bool) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(args.steps):
            x, y, _ = next(batches)
            t.train_step(x, y)
            t.sampler.advance()
            t.state.step += 1
            if separate:
                old_collective()
            t.r._ckpt.step_boundary(False)
        dist.barrier()
        return (time.perf_counter() - t0) / args.steps

    block(False)  # warm-up: first steps allocate
    piggy, separate = [], []
    for r in range(args.rounds):  # which arm goes first alternates: no order bias
        if r % 2:
            separate.append(block(True))
            piggy.append(block(False))
        else:
            piggy.append(block(False))
            separate.append(block(True))
    dist.barrier()
    t0 = time.perf_counter()
    for _ in range(args.collectives):
        old_collective()
    alone = (time.perf_counter() - t0) / args.collectives
    t.r._ckpt.close()
    if t.d.rank == 0:
        med = statistics.median
        print(f"{t.d.world_size} ranks, tiny config, {args.rounds} x {args.steps} steps per arm")
        print(f"step, flags on the loss all-reduce     {med(piggy) * 1e3:9.3f} ms")
        print(f"step, plus its own control all-reduce  {med(separate) * 1e3:9.3f} ms")
        print(f"  piggybacked / separate               {med(piggy) / med(separate):9.3f}")
        saved = [b - a for a, b in zip(piggy, separate, strict=True)]  # each pair back to back
        print(f"  saved per step, median of pairs      {med(saved) * 1e6:9.1f} us")
        print(
            f"the control all-reduce alone           {alone * 1e6:9.1f} us  ({alone / med(piggy):.2%} of a step)"
        )
    dist.destroy_process_group()


def main() -> int:
    args = parse()
    if args.worker:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
