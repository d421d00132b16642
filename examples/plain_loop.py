"""A plain PyTorch training loop (torchrun, gloo) over a map-style dataset, with DataLoader workers
and a shuffling sampler, made resumable: the lines marked ``# resumable`` are all it takes
(docs/adopting.md shows the diff).

    torchrun --standalone --nproc-per-node=2 examples/plain_loop.py --ckpt-root runs/ex --steps 200

Killed, hung or preempted under the watchdog (``python -m supervisor watch ... -- torchrun ...``),
SIGTERM sent to every process of the job as SLURM does, it resumes where it was and ends with the
same parameters as a run never interrupted; the fault drill proves it:
``python -m supervisor drill --trainer examples/plain_loop.py``.

The dataset draws its augmentation noise from the global torch RNG, as torchvision's random
transforms do: ``r.loader`` seeds each sample's draws from (seed, epoch, sample), so they are the
same with 0 or N workers and after a resume. Gradients are averaged by hand in one fixed order
(torch's DDP regroups its buckets after the first step, and after a resume at another step:
docs/architecture.md; on 2 ranks it is exact too, examples/accumulate.py uses it).
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset

from supervisor.resumable import Identity, Resumable, Saves  # resumable


class Points(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Points of a curve, each read with fresh noise (an augmentation from the global RNG)."""

    def __init__(self, n: int):
        self.x = torch.randn(n, 32, generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i] + 0.05 * torch.randn(32)
        return x, x.sum(dim=0, keepdim=True).sin()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt-root", type=Path, required=True)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--save-every", type=int, default=20)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--lr", type=float, default=1e-2)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--num-workers", type=int, default=2)
    a = p.parse_args()

    dist.init_process_group("gloo")
    world = dist.get_world_size()
    torch.manual_seed(a.seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    data = Points(2048)
    r = Resumable(  # resumable
        a.ckpt_root,  # resumable
        {"model": model, "optimizer": opt, "scheduler": sched},  # resumable
        steps=a.steps,  # resumable
        identity=Identity({"lr": a.lr, "batch": a.batch_size}, seed=a.seed),  # resumable
        saves=Saves(every_steps=a.save_every),  # resumable
    )  # resumable
    # was: DataLoader(data, batch_size=a.batch_size, sampler=DistributedSampler(data), num_workers=a.num_workers)
    loader = r.loader(data, batch_size=a.batch_size, shuffle=True, num_workers=a.num_workers)  # resumable
    step = r.resume()  # resumable (was: step = 0)
    while step < a.steps:
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            opt.zero_grad(set_to_none=True)
            loss.backward()
            for param in model.parameters():  # the mean gradient, in one fixed order
                assert param.grad is not None
                dist.all_reduce(param.grad)
                param.grad /= world
            opt.step()
            sched.step()
            step += 1
            if r.step_end(step, {"loss": loss.item(), "lr": sched.get_last_lr()[0]}):  # resumable
                break
    r.finish()  # resumable
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
