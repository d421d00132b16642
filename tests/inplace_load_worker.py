"""Run under torchrun by test_train_parallel.py: an fsdp model large enough that its records are read
in place (64 KiB and more per shard), its AdamW state allocated for the load, both loaded back into
a fresh model and optimizer bit for bit; then the same saved with an index per rank (each rank
alone, supervisor/resumable/_dcp_index.py) and loaded back, each rank reading only its own index, straight
into its tensors (supervisor/resumable/_direct_read.py: each tensor one whole chunk there).

Rank 0 prints a line per rank: ``rank R in_place N primed P equal E per_rank_equal E read NAMES
direct D`` (the indexes that rank read in the second load; D: which of the two loads read
directly, ``01``: the second alone; DCP's one index holds a chunk of each rank per tensor)."""

from __future__ import annotations

import shutil
import sys
import tempfile
from dataclasses import replace
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp

from supervisor.resumable import _safe_load
from supervisor.resumable._objects import Objects
from supervisor.resumable._optim_state import prime_for_load
from supervisor.resumable._shard_writer import shard_writer
from train_ref.config import get_config
from train_ref.model import GPT
from train_ref.parallel import build
from train_ref.train import exit_now


def local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if hasattr(t, "to_local") else t


def trained(seed: int, steps: int) -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    cfg = replace(get_config("tiny", vocab_size=67).model, n_embd=128, dropout=0.0)
    model = build(lambda: GPT(cfg), "fsdp", torch.device("cpu"), seed=seed)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3, weight_decay=0.1)
    g = torch.Generator().manual_seed(1)
    for _ in range(steps):
        x = torch.randint(0, 67, (2, 16), generator=g)
        model(x, x).backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
    return model, opt


def snapshot(model: torch.nn.Module, opt: torch.optim.Optimizer) -> list[torch.Tensor]:
    """This rank's shards of every parameter and state tensor, in a fixed order."""
    out = [local(p.detach()).clone() for _, p in sorted(model.named_parameters())]
    for p in (p for _, p in sorted(model.named_parameters())):
        out += [local(v).clone() for _, v in sorted(opt.state[p].items())]
    return out


def same(got: list[torch.Tensor], want: list[torch.Tensor]) -> bool:
    return len(got) == len(want) and all(
        a.dtype == b.dtype and a.shape == b.shape and torch.equal(a, b)
        for a, b in zip(got, want, strict=True)
    )


def main() -> int:
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    model, opt = trained(seed=5, steps=2)
    want = snapshot(model, opt)
    root = Path(tempfile.mkdtemp(prefix="inplace_")) if rank == 0 else None
    got_root: list[Path | None] = [root]
    dist.broadcast_object_list(got_root, src=0)
    ckpt = Path(str(got_root[0])) / "step_00000002"
    dcp.save(
        {"app": Objects({"model": model, "optimizer": opt})}, storage_writer=shard_writer(ckpt, ckpt.parent)
    )

    alone = ckpt.parent / "step_00000003"  # each rank's own index: no plan exchange
    dcp.save(
        {"app": Objects({"model": model, "optimizer": opt})},
        storage_writer=shard_writer(alone, ckpt.parent),
        use_collectives=False,
    )

    fresh, fresh_opt = trained(seed=9, steps=0)  # other weights, no optimizer state
    counted = {"in_place": 0}
    real = _safe_load.read_in_place

    def counting(*args: object) -> bool | str:
        done = real(*args)  # type: ignore[arg-type]
        counted["in_place"] += done is True
        return done

    _safe_load.read_in_place = counting  # type: ignore[assignment]
    direct: list[bool] = []  # per load: whether every item was one to read directly
    real_plan = _safe_load._direct_read.plan

    def planning(*args: object) -> object:
        got = real_plan(*args)  # type: ignore[arg-type]
        direct.append(got is not None)
        return got

    _safe_load._direct_read.plan = planning  # type: ignore[assignment]
    primed = prime_for_load(fresh_opt)
    _safe_load.load_dcp(ckpt, {"app": Objects({"model": fresh, "optimizer": fresh_opt})}, None)
    equal = same(snapshot(fresh, fresh_opt), want)

    again, again_opt = trained(seed=11, steps=0)
    prime_for_load(again_opt)
    read: list[str] = []
    real_index = _safe_load.SafeFileSystemReader._read_index

    def reading(self: _safe_load.SafeFileSystemReader, path: Path) -> object:
        read.append(path.name)
        return real_index(self, path)

    _safe_load.SafeFileSystemReader._read_index = reading  # type: ignore[assignment, method-assign]
    _safe_load.load_dcp(alone, {"app": Objects({"model": again, "optimizer": again_opt})}, None)
    per_rank_equal = same(snapshot(again, again_opt), want)
    mine = (
        f"rank {rank} in_place {counted['in_place']} primed {primed} equal {equal} "
        f"per_rank_equal {per_rank_equal} read {','.join(read)} direct {''.join(str(int(d)) for d in direct)}"
    )
    lines: list[str] | None = [""] * dist.get_world_size() if rank == 0 else None
    dist.gather_object(mine, lines)  # one writer: ranks printing at once interleave on the pipe
    if rank == 0:
        assert lines is not None
        sys.stdout.write("".join(f"{line}\n" for line in lines))
        sys.stdout.flush()
        shutil.rmtree(ckpt.parent, ignore_errors=True)
    dist.barrier()  # every rank done with gloo before any tears it down (see parallel_worker.py)
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_now(main())  # as the trainer exits: gloo's C++ teardown aborts now and then (parallel_worker.py)
