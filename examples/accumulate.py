"""Gradient accumulation, bf16 autocast on CPU, a moving average of the weights (``AveragedModel``)
and a warmup-then-cosine schedule (``SequentialLR``), under torchrun with DDP, made resumable: the
lines marked ``# resumable`` are all it takes (docs/adopting.md).

    torchrun --standalone --nproc-per-node=2 examples/accumulate.py --ckpt-root runs/acc --steps 200

Each optimizer step takes ``--accum`` micro-batches from the loader (DDP's ``no_sync`` on all but
the last), so the loader's position moves ``--accum`` batches a step; the average model is one of
the saved objects, and ``final.json`` gets its digest (``ema_sha256``) beside the model's, which
the fault drill compares with an uninterrupted run's. Exact on 2 ranks with DDP (a sum of two
gradients does not depend on DDP's buckets; on more ranks average them in one fixed order, as
examples/plain_loop.py does).
"""

from __future__ import annotations

import argparse
import contextlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.nn.parallel import DistributedDataParallel as DDP
from torch.optim.lr_scheduler import CosineAnnealingLR, LinearLR, SequentialLR
from torch.optim.swa_utils import AveragedModel, get_ema_multi_avg_fn
from torch.utils.data import TensorDataset

from supervisor.resumable import Identity, Resumable, Saves  # resumable


def forever(loader: Iterable[Any]) -> Iterator[Any]:
    """Epoch after epoch."""
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
    p.add_argument("--accum", type=int, default=3)
    p.add_argument("--warmup", type=int, default=10)
    p.add_argument("--num-workers", type=int, default=2)
    a = p.parse_args()

    dist.init_process_group("gloo")
    torch.manual_seed(a.seed)
    model = DDP(nn.Sequential(nn.Linear(16, 64), nn.GELU(), nn.Dropout(0.1), nn.Linear(64, 4)))
    ema = AveragedModel(model.module, multi_avg_fn=get_ema_multi_avg_fn(0.95))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr, weight_decay=0.05)
    warmup = LinearLR(opt, start_factor=0.1, total_iters=a.warmup)
    cosine = CosineAnnealingLR(opt, T_max=max(1, a.steps - a.warmup), eta_min=a.lr / 20)
    sched = SequentialLR(opt, [warmup, cosine], milestones=[a.warmup])
    g = torch.Generator().manual_seed(99)
    x = torch.randn(1200, 16, generator=g)
    data = TensorDataset(x, (x @ torch.randn(16, 4, generator=g)).tanh())
    r = Resumable(  # resumable
        a.ckpt_root,  # resumable
        {"model": model, "optimizer": opt, "scheduler": sched, "ema": ema},  # resumable
        steps=a.steps,  # resumable
        identity=Identity({"lr": a.lr, "accum": a.accum, "warmup": a.warmup}, seed=a.seed),  # resumable
        saves=Saves(every_steps=a.save_every),  # resumable
    )  # resumable
    # was: DataLoader(data, batch_size=a.batch_size, sampler=DistributedSampler(data), num_workers=a.num_workers)
    loader = r.loader(data, batch_size=a.batch_size, shuffle=True, num_workers=a.num_workers)  # resumable
    start = r.resume()  # resumable (was: start = 0)
    batches = forever(loader)
    for step in range(start + 1, a.steps + 1):
        total = 0.0
        for micro in range(a.accum):
            xb, yb = next(batches)
            last = micro == a.accum - 1
            with contextlib.nullcontext() if last else model.no_sync():
                with torch.autocast("cpu", dtype=torch.bfloat16):
                    loss = F.mse_loss(model(xb).float(), yb) / a.accum
                loss.backward()
            total += loss.item()
        torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
        opt.step()
        opt.zero_grad(set_to_none=True)
        sched.step()
        ema.update_parameters(model.module)
        r.step_end(step, {"loss": total, "lr": sched.get_last_lr()[0]})  # resumable
    r.finish()  # resumable
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
