"""A training loop written for Hugging Face Accelerate (``accelerator.prepare``, ``accelerator.backward``)
under torchrun, made resumable: the lines marked ``# resumable`` are all it takes
(docs/adopting.md#accelerate).

    torchrun --standalone --nproc-per-node=2 examples/accelerate_points.py --ckpt-root runs/acc --steps 200

The same model and data as examples/plain_loop.py. The model, optimizer and scheduler go through
``accelerator.prepare`` (DDP over gloo on CPU: exact on 2 ranks, a + b then halved); the
DataLoader does not: ``r.loader`` resumes it mid-epoch with the same samples and noise, which
Accelerate's own sharded loader cannot. Killed, hung or preempted under the watchdog it ends
bit-identical to an uninterrupted run:
``python -m supervisor drill --trainer examples/accelerate_points.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from accelerate import Accelerator
from torch import nn
from torch.utils.data import Dataset

from supervisor.resumable import AccelerateResumable, Identity, Saves  # resumable


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

    accelerator = Accelerator(cpu=True)
    torch.manual_seed(a.seed)
    model = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=a.lr)
    sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
    data = Points(2048)
    model, opt, sched = accelerator.prepare(model, opt, sched)
    r = AccelerateResumable(  # resumable
        accelerator,  # resumable
        a.ckpt_root,  # resumable
        {"model": model, "optimizer": opt, "scheduler": sched},  # resumable
        steps=a.steps,  # resumable
        identity=Identity({"lr": a.lr, "batch": a.batch_size}, seed=a.seed),  # resumable
        saves=Saves(every_steps=a.save_every),  # resumable
    )  # resumable
    # was: loader = accelerator.prepare(DataLoader(data, batch_size=a.batch_size, shuffle=True, ...))
    loader = r.loader(data, batch_size=a.batch_size, shuffle=True, num_workers=a.num_workers)  # resumable
    step = r.resume()  # resumable (was: accelerator.load_state(...), step = 0)
    model.train()
    while step < a.steps:
        for x, y in loader:
            loss = F.mse_loss(model(x), y)
            accelerator.backward(loss)
            opt.step()
            sched.step()
            opt.zero_grad(set_to_none=True)
            step += 1
            if r.step_end(step, {"loss": loss.item(), "lr": sched.get_last_lr()[0]}):  # resumable
                break
    r.finish()  # resumable
    accelerator.end_training()


if __name__ == "__main__":
    main()
