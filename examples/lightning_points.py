"""A LightningModule trained by Lightning's own ``Trainer.fit`` (DDP over gloo, under torchrun), made
resumable by one callback: the lines marked ``# resumable`` are all it takes (docs/adopting.md#lightning).

    torchrun --standalone --nproc-per-node=2 examples/lightning_points.py --ckpt-root runs/lt --steps 200

The same model and data as examples/plain_loop.py (augmentation noise from the global RNG, a
shuffled map-style dataset, DataLoader workers, dropout), an ordinary ``train_dataloader``, and
``configure_optimizers`` with a per-step scheduler. Killed, hung or preempted under the watchdog it
resumes mid-epoch where it was and ends bit-identical to an uninterrupted run:
``python -m supervisor drill --trainer examples/lightning_points.py``. Lightning's DDP gradient
average is exact on 2 ranks (a + b, then halved), so its bucketing needs no care there.
"""

from __future__ import annotations

import argparse
import os
from pathlib import Path

import lightning.pytorch as pl
import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, Dataset

from supervisor.resumable import Identity, ResumableCallback, Saves  # resumable


class Points(Dataset[tuple[torch.Tensor, torch.Tensor]]):
    """Points of a curve, each read with fresh noise (an augmentation from the global RNG)."""

    def __init__(self, n: int):
        self.x = torch.randn(n, 32, generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, torch.Tensor]:
        x = self.x[i] + 0.05 * torch.randn(32)
        return x, x.sum(dim=0, keepdim=True).sin()


class Curve(pl.LightningModule):
    def __init__(self, lr: float, batch_size: int, num_workers: int):
        super().__init__()
        self.lr, self.batch_size, self.num_workers = lr, batch_size, num_workers
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        return F.mse_loss(self.net(x), y)

    def configure_optimizers(self):  # type: ignore[no-untyped-def]
        opt = torch.optim.AdamW(self.parameters(), lr=self.lr)
        sched = torch.optim.lr_scheduler.CosineAnnealingLR(opt, T_max=1000)
        return {"optimizer": opt, "lr_scheduler": {"scheduler": sched, "interval": "step"}}

    def train_dataloader(self) -> DataLoader[tuple[torch.Tensor, torch.Tensor]]:
        return DataLoader(
            Points(2048), batch_size=self.batch_size, shuffle=True, num_workers=self.num_workers
        )


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

    torch.manual_seed(a.seed)
    model = Curve(a.lr, a.batch_size, a.num_workers)
    resumable = ResumableCallback(  # resumable
        a.ckpt_root,  # resumable
        steps=a.steps,  # resumable
        identity=Identity({"lr": a.lr, "batch": a.batch_size}, seed=a.seed),  # resumable
        saves=Saves(every_steps=a.save_every),  # resumable
    )  # resumable
    local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
    trainer = pl.Trainer(
        accelerator="cpu",
        strategy="ddp",
        devices=local,
        num_nodes=int(os.environ.get("WORLD_SIZE", "1")) // local,
        max_steps=a.steps,
        use_distributed_sampler=False,  # resumable (the callback's loader shards the data)
        enable_checkpointing=False,  # resumable (the callback checkpoints)
        callbacks=[resumable],  # resumable
        logger=False,
        enable_progress_bar=False,
        enable_model_summary=False,
    )
    trainer.fit(model)


if __name__ == "__main__":
    main()
