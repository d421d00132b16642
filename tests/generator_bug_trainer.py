"""A user's trainer with the bug docs/adopting.md#data warns of: its DataLoader, made after
``resume()``, has no ``generator=``, so making its iterator draws a seed from the global torch RNG
right after the resume restored it. Dropout draws from that RNG too: a resumed run leaves the
uninterrupted one at its first step, and its checkpoints hold the evidence (the RNG state, one draw
ahead). tests/test_drill_diverge.py drills it; the drill must say so.

    torchrun --standalone --nproc-per-node=2 tests/generator_bug_trainer.py --ckpt-root R --steps 30
"""

from __future__ import annotations

import argparse
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn
from torch.utils.data import DataLoader, TensorDataset

from supervisor.resumable import ByIndex, Identity, Resumable, ResumableBatchSampler, Saves

SAMPLES, GLOBAL_BATCH = 256, 16


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ckpt-root", type=Path, required=True)
    p.add_argument("--steps", type=int, default=30)
    p.add_argument("--save-every", type=int, default=10)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--num-workers", type=int, default=2)  # the drill passes its own
    a = p.parse_args()

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    data = torch.Generator().manual_seed(a.seed)
    xs = torch.randn(SAMPLES, 16, generator=data)
    dataset = ByIndex(TensorDataset(xs, xs.sum(dim=1, keepdim=True).sin()))
    sampler = ResumableBatchSampler(SAMPLES, GLOBAL_BATCH, rank, world, a.seed)
    torch.manual_seed(a.seed)
    model = nn.Sequential(nn.Linear(16, 32), nn.ReLU(), nn.Dropout(0.2), nn.Linear(32, 1))
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    r = Resumable(
        a.ckpt_root,
        {"model": model, "optimizer": opt, "sampler": sampler},
        steps=a.steps,
        identity=Identity({"model": "mlp-16-32-1"}, seed=a.seed),
        saves=Saves(every_steps=a.save_every),
    )
    start = r.resume()
    # the bug: no generator= (whatever the workers: the iterator draws their base seed)
    batches = iter(DataLoader(dataset, batch_sampler=sampler, num_workers=a.num_workers))
    for step in range(start + 1, a.steps + 1):
        x, y = next(batches)
        loss = F.mse_loss(model(x), y)
        opt.zero_grad(set_to_none=True)
        loss.backward()
        for param in model.parameters():  # the mean gradient, in one fixed order
            assert param.grad is not None
            dist.all_reduce(param.grad)
            param.grad /= world
        opt.step()
        sampler.advance()
        r.step_end(step, {"loss": loss.item(), "lr": opt.param_groups[0]["lr"]})
    r.finish()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
