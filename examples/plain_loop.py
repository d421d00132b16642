"""A plain PyTorch training loop (torchrun, gloo) made resumable: the lines marked ``# resumable``
are all it takes (docs/adopting.md shows the diff).

    torchrun --standalone --nproc-per-node=2 examples/plain_loop.py --ckpt-root runs/ex --steps 200

Killed, hung or preempted under the watchdog (``python -m supervisor watch ... -- torchrun ...``),
it resumes where it was and ends with the same parameters as a run never interrupted; the fault
drill proves it: ``python -m supervisor drill --trainer examples/plain_loop.py``.

Two habits keep a loop exact after a resume, with or without this toolkit: every random choice of
the data is a function of (seed, step, rank) (here the synthetic batch; a sampler with a state
would be one of the saved objects), and gradients are averaged in one fixed order (torch's DDP
regroups its buckets after the first step, and after a resume at another step: docs/trainer.md).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

from supervisor.resumable import Identity, Resumable, Saves  # resumable


def batch(seed: int, step: int, rank: int) -> tuple[torch.Tensor, torch.Tensor]:
    """This rank's batch of ``step``: a function of (seed, step, rank) only."""
    g = torch.Generator().manual_seed((seed * 1_000_003 + step) * 1_009 + rank)
    x = torch.randn(16, 32, generator=g)
    return x, x.sum(dim=1, keepdim=True).sin()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt-root", type=Path, required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-2)
    a = p.parse_args()

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(a.seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    r = Resumable(  # resumable
        a.ckpt_root,  # resumable
        {"model": model, "optimizer": opt, "scheduler": sched},  # resumable
        steps=a.steps,  # resumable
        identity=Identity({"lr": a.lr, "model": "mlp-32-64-1"}, seed=a.seed),  # resumable
        saves=Saves(every_steps=a.save_every),  # resumable
    )  # resumable
    for step in range(r.resume() + 1, a.steps + 1):  # resumable (was: range(1, a.steps + 1))
        x, y = batch(a.seed, step, dist.get_rank())
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for param in model.parameters():  # the mean gradient, in one fixed order
            assert param.grad is not None
            dist.all_reduce(param.grad)
            param.grad /= world
        opt.step()
        sched.step()
        r.step_end(step, {"loss": loss.item(), "lr": sched.get_last_lr()[0]})  # resumable
    r.finish()  # resumable
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
