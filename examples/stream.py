"""A language model trained on a stream (an ``IterableDataset`` read by DataLoader workers, each
taking its own shards, as torch's docs show), under torchrun with DDP, made resumable: the lines
marked ``# resumable`` are all it takes (docs/adopting.md).

    torchrun --standalone --nproc-per-node=2 examples/stream.py --ckpt-root runs/stream --steps 200

A stream has no sample numbers to jump to: ``r.loader`` saves, per rank, how many batches each
worker handed to the loop and whose batch comes next, and a resume replays each worker's share up
to there inside the worker (its random draws too). The shards stand in for files: each is made
from its number. Exact on 2 ranks with DDP (a sum of two gradients does not depend on DDP's
buckets; on more ranks average them in one fixed order, as examples/plain_loop.py does).
"""

from __future__ import annotations

import argparse
import random
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.utils.data import IterableDataset, get_worker_info

from supervisor.resumable import Identity, Resumable, Saves  # resumable

VOCAB, SEQ, SHARDS, PER_SHARD = 50, 24, 64, 40


class Shards(IterableDataset[tuple[torch.Tensor, torch.Tensor]]):
    """Token sequences from numbered shards: rank r's worker w of W reads every (world x W)-th
    shard from r x W + w; a token is masked now and then (python ``random``, as text pipelines do)."""

    def __init__(self, rank: int, world: int):
        self.rank, self.world = rank, world

    def __iter__(self) -> Iterator[tuple[torch.Tensor, torch.Tensor]]:
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info else (0, 1)
        for shard in range(self.rank * n + w, SHARDS, self.world * n):
            tokens = torch.randint(
                0, VOCAB, (PER_SHARD, SEQ + 1), generator=torch.Generator().manual_seed(shard)
            )
            for seq in tokens:
                x = seq[:-1].clone()
                if random.random() < 0.3:
                    x[random.randrange(SEQ)] = 0
                yield x, seq[1:]


class TinyLM(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.emb = nn.Embedding(VOCAB, 32)
        self.rnn = nn.GRU(32, 64, batch_first=True)
        self.drop = nn.Dropout(0.1)
        self.head = nn.Linear(64, VOCAB)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        h, _ = self.rnn(self.emb(x))
        return self.head(self.drop(h))


def forever(loader: Iterable[Any]) -> Iterator[Any]:
    """Pass after pass over the stream."""
    while True:
        yield from loader


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt-root", type=Path, required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=3e-3)
    p.add_argument("--batch-size", type=int, default=8)
    p.add_argument("--num-workers", type=int, default=2)
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    torch.manual_seed(a.seed)
    model = DDP(TinyLM())
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.01)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: min(1.0, (s + 1) / 20))
    r = Resumable(  # resumable
        a.ckpt_root,  # resumable
        {"model": model, "optimizer": opt, "scheduler": sched},  # resumable
        steps=a.steps,  # resumable
        identity=Identity({"lr": a.lr, "batch": a.batch_size}, seed=a.seed),  # resumable
        saves=Saves(every_steps=a.save_every),  # resumable
    )  # resumable
    # was: DataLoader(Shards(rank, world), batch_size=a.batch_size, num_workers=a.num_workers)
    loader = r.loader(Shards(rank, world), batch_size=a.batch_size, num_workers=a.num_workers)  # resumable
    start = r.resume()  # resumable (was: start = 0)
    for step, (x, y) in zip(range(start + 1, a.steps + 1), forever(loader), strict=False):
        loss = F.cross_entropy(model(x).flatten(0, 1), y.flatten())
        opt.zero_grad(set_to_none=True)
        loss.backward()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        sched.step()
        r.step_end(step, {"loss": loss.item(), "lr": sched.get_last_lr()[0]})  # resumable
    r.finish()  # resumable
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
