"""Run under torchrun by test_train_parallel.py: the fsdp model built on the meta device and sharded
holds, on every world size, exactly the parameters of the same model built whole (ddp's build)."""

from __future__ import annotations

import torch
import torch.distributed as dist

from supervisor.resumable import params_digest
from train_ref.config import get_config
from train_ref.model import GPT
from train_ref.parallel import build
from train_ref.train import exit_now


def main() -> int:
    dist.init_process_group("gloo")
    cpu = torch.device("cpu")
    cfg = get_config("tiny", vocab_size=67).model  # 67: an odd size, so shards are uneven
    sharded = build(lambda: GPT(cfg), "fsdp", cpu, seed=5)
    whole = build(lambda: GPT(cfg), "ddp", cpu, seed=5)
    got, want = params_digest(sharded), params_digest(whole)
    never_whole = all(p.to_local().numel() < p.numel() for p in sharded.parameters() if p.shape[0] >= 3)
    if dist.get_rank() == 0:
        print(f"sharded {got} whole {want} never_whole {never_whole}", flush=True)
    # Every rank done with gloo before any tears it down; and no interpreter teardown after
    # (exit_now): a rank aborted there now and then ("terminate called without an active
    # exception", SIGABRT, from gloo's C++ destructors) after a correct digest, the barrier alone
    # notwithstanding (1 in 7 runs of this test file here, 3 ranks on 2 cores).
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    exit_now(main())  # as the trainer exits: gloo's C++ teardown aborts now and then (above)
