"""A torchrun worker that writes no heartbeat and whose entry point uses torchelastic's @record:
``--raise-rank R`` raises ValueError on rank R (its root cause, for the watchdog to name); the
other ranks wait until torchrun stops them. Without it every rank exits 0."""

from __future__ import annotations

import argparse
import os
import threading

from torch.distributed.elastic.multiprocessing.errors import record


def fail(rank: int) -> None:
    raise ValueError(f"boom on rank {rank}")


@record
def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--raise-rank", type=int, default=None)
    rank = int(os.environ["RANK"])
    if p.parse_args().raise_rank is None:
        return
    if rank == p.parse_args().raise_rank:
        fail(rank)
    threading.Event().wait()  # until torchrun, seeing the failed rank, stops this one


if __name__ == "__main__":
    main()
