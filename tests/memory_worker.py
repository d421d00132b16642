"""One launch of a plain loop on one rank or a few (no torchrun), for tests/test_memory_tier.py:
a model with a buffer its forward changes (BatchNorm), AdamW, a schedule, a shuffled loader whose
samples draw noise from the global torch RNG, and python's and numpy's RNGs drawn in every step.
Under the environment a watchdog gives its ranks (the memory tier's folder, the launch number),
so the test plays the watchdog.

    python tests/memory_worker.py --root DIR --steps N [--save-every K] [--lr LR]
        [--die-after S | --die-at S | --die-in-snapshot S] [--memory-every N] [--reduce]
        [--store FILE --rank R --world-size W]

``--store``: one of W ranks (DDP), meeting the others through a file store (a fresh path per
launch); each can be given a memory folder of its own, as one rank per node. ``--die-at S``:
SIGKILL itself right after step S once its memory copy is whole, whatever the disk holds (every
rank at the same step).
``--memory-every N``: a memory snapshot every N steps (default 1). ``--reduce``: each step's loss
goes through ``Resumable.reduce`` (as a trainer that logs the mean loss does), which carries the
step's control flags: ``step_end`` then makes no collective of its own. ``--die-in-snapshot S``:
the last rank SIGKILLs itself in the middle of its memory snapshot of step S (its state being
captured), every other rank right after step S: a kill -9 that lands while one rank copies.

``--die-after S``: SIGKILL itself right after the first step >= S whose memory snapshot is
written (the loop waits for its copy first), the disk's save before it committed first (an async
save commits at a later step's end; on a busy machine that came after the run's end, and the
worker finished with no kill), as a kill -9 would end it.
"""

from __future__ import annotations

import argparse
import os
import random
import signal
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import Dataset

from supervisor import store
from supervisor.resumable import Identity, Resumable, Saves


class KillInSnapshot:
    """A user's item that SIGKILLs its rank when its state is taken at step ``at`` (the memory
    snapshot's capture: no disk save falls on that step)."""

    def __init__(self, at: int) -> None:
        self.at, self.step = at, 0

    def state_dict(self) -> dict[str, int]:
        if self.at and self.step == self.at:
            os.kill(os.getpid(), signal.SIGKILL)
        return {}

    def load_state_dict(self, state: dict[str, int]) -> None:
        pass


class Noisy(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    def __init__(self, n: int) -> None:
        self.x = torch.randn(n, 8, generator=torch.Generator().manual_seed(11))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i] + 0.1 * torch.randn(8)
        return x, x.sum(dim=0, keepdim=True).cos()


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--root", type=Path, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--die-after", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--die-at", type=int, default=0)
    p.add_argument("--memory-every", type=int, default=1)
    p.add_argument("--die-in-snapshot", type=int, default=0)
    p.add_argument("--reduce", action="store_true")
    p.add_argument("--store", type=Path)
    p.add_argument("--rank", type=int, default=0)
    p.add_argument("--world-size", type=int, default=1)
    a = p.parse_args()
    store_ = dist.FileStore(str(a.store), a.world_size) if a.store else dist.HashStore()
    dist.init_process_group("gloo", store=store_, rank=a.rank, world_size=a.world_size)
    torch.manual_seed(0)
    net = nn.Sequential(nn.Linear(8, 16), nn.BatchNorm1d(16), nn.ReLU(), nn.Dropout(0.2), nn.Linear(16, 1))
    model = DDP(net) if a.world_size > 1 else net
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=100)
    last = a.rank == a.world_size - 1
    killer = KillInSnapshot(a.die_in_snapshot if last else 0)
    r = Resumable(
        a.root,
        {"model": model, "optimizer": opt, "scheduler": sched, "killer": killer},
        steps=a.steps,
        identity=Identity({"lr": a.lr}, seed=5),
        saves=Saves(every_steps=a.save_every, memory_every=a.memory_every),
    )
    loader = r.loader(Noisy(64), batch_size=4, shuffle=True)
    step = r.resume()
    while step < a.steps:
        for x, y in loader:
            scale = 1.0 + 0.01 * (random.random() + float(np.random.rand()))
            loss = F.mse_loss(model(x), y) * scale
            opt.zero_grad(set_to_none=True)
            loss.backward()
            opt.step()
            sched.step()
            if a.reduce:
                r.reduce(loss.detach().reshape(1))
            step += 1
            killer.step = step
            done = r.step_end(step, {"loss": float(loss)})
            if step in (a.die_at, a.die_in_snapshot):
                if r._memory is not None:
                    r._memory.wait()  # its copy whole, as a kill -9 a moment later would find it
                os.kill(os.getpid(), signal.SIGKILL)
            if a.die_after and step >= a.die_after:
                memory = r._memory
                assert memory is not None, "no memory tier: the test sets its folder"
                memory.wait()
                r._ckpt.finish()  # the async save in flight committed now, as a later step end would
                saved = store.list_checkpoints(a.root)
                on_disk = bool(saved) and saved[0].step >= step // a.save_every * a.save_every
                if memory.last == step and not memory.broken and on_disk:
                    os.kill(os.getpid(), signal.SIGKILL)
            if done:
                break
    r.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
