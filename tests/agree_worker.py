"""Run under torchrun by test_agree.py: the commit's gather reaches rank 0 only, in rank order, for
objects of different sizes; the step-boundary flags riding on a reduction reach every rank alike,
and so do those of a loop that does not piggyback (step_boundary's own all-reduce)."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from supervisor import store
from supervisor.format.heartbeat import HeartbeatWriter
from supervisor.format.manifest import CheckpointInfo
from train_ref import agree
from train_ref.checkpointer import Checkpointer, CommitInfo


def main() -> int:
    root = Path(sys.argv[1])
    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    hb = HeartbeatWriter(root, rank=rank, local_rank=rank, world_size=world)
    ckpt = Checkpointer(
        root,
        async_save=False,
        retention=store.RetentionPolicy(keep=2),
        info=CommitInfo(CheckpointInfo(0, world)),
        hb=hb,
    )
    # Rank r sends r+1 file names: sizes differ, so the padding and lengths are exercised.
    gathered = agree.gather_to_root(
        {f"__{rank}_{i}.distcp": i for i in range(rank + 1)}, ckpt.ctl_group, lambda: 0
    )
    # Rank 1 alone got a notice: the sum of the payload and the agreed flag, on every rank.
    total = ckpt.reduce_with_control(torch.tensor([float(rank), 1.0]), preempt_requested=rank == 1)
    piggybacked = ckpt.step_boundary(preempt_requested=False)  # this call's argument comes too late
    own = ckpt.step_boundary(preempt_requested=rank == world - 1)  # nothing carried: its own all-reduce
    quiet = ckpt.step_boundary(preempt_requested=False)
    # A file per rank: lines printed by several ranks at once may interleave on torchrun's stdout.
    result = {"gathered": gathered, "total": total.tolist(), "flags": [piggybacked, own, quiet]}
    (root / f"result_{rank}.json").write_text(json.dumps(result))
    ckpt.close()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
