"""A model trained by the Hugging Face ``Trainer`` (DDP over gloo, under torchrun), made resumable by one
callback: the lines marked ``# resumable`` are all it takes (docs/adopting.md#hugging-face-trainer).

    torchrun --standalone --nproc-per-node=2 examples/hf_points.py --ckpt-root runs/hf --steps 200

The same model and data as examples/plain_loop.py (augmentation noise from the global RNG, a
shuffled map-style dataset, DataLoader workers, dropout), a small torch module whose ``forward``
returns its loss as the Trainer expects (nothing downloaded), and the Trainer's own optimizer
(AdamW) and linear schedule. Its own checkpoints are off (``save_strategy="no"``): the callback
checkpoints. Killed, hung or preempted under the watchdog it resumes mid-epoch where it was and
ends bit-identical to an uninterrupted run:
``python -m supervisor drill --trainer examples/hf_points.py``.
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.data import Dataset
from transformers import Trainer, TrainingArguments

from supervisor.resumable import Identity, ResumableTrainerCallback, Saves  # resumable


class Points(Dataset[dict[str, torch.Tensor]]):
    """Points of a curve, each read with fresh noise (an augmentation from the global RNG)."""

    def __init__(self, n: int):
        self.x = torch.randn(n, 32, generator=torch.Generator().manual_seed(1234))

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, i: int) -> dict[str, torch.Tensor]:
        x = self.x[i] + 0.05 * torch.randn(32)
        return {"x": x, "labels": x.sum(dim=0, keepdim=True).sin()}


class Curve(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.net = nn.Sequential(nn.Linear(32, 64), nn.ReLU(), nn.Dropout(0.1), nn.Linear(64, 1))

    def forward(self, x: torch.Tensor, labels: torch.Tensor) -> dict[str, torch.Tensor]:
        out = self.net(x)
        return {"loss": F.mse_loss(out, labels), "logits": out}


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
    args = TrainingArguments(
        output_dir=str(a.ckpt_root / "trainer_output"),
        use_cpu=True,
        max_steps=a.steps,
        per_device_train_batch_size=a.batch_size,
        learning_rate=a.lr,
        seed=a.seed,
        dataloader_num_workers=a.num_workers,
        save_strategy="no",  # resumable (the callback checkpoints)
        ddp_find_unused_parameters=False,
        logging_steps=10,
        report_to="none",
        disable_tqdm=True,
    )
    resumable = ResumableTrainerCallback(  # resumable
        a.ckpt_root,  # resumable
        identity=Identity({"lr": a.lr, "batch": a.batch_size}, seed=a.seed),  # resumable
        saves=Saves(every_steps=a.save_every),  # resumable
    )  # resumable
    trainer = Trainer(
        model=Curve(),
        args=args,
        train_dataset=Points(2048),
        callbacks=[resumable],  # resumable
    )
    trainer.train()


if __name__ == "__main__":
    main()
