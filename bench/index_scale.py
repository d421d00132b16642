"""DCP's one index vs an index per rank as the world grows: the save's plan exchange on rank 0, and
the index every rank reads at a resume, for 16, 256 and 1,024 simulated FSDP ranks; then a resume
on half as many ranks, which needs every rank's index merged.

With one index (DCP's default), a save gathers every rank's save plan to rank 0 (``gather_object``:
N unpickles), builds the global plan and the index from them (``create_global_plan``), scatters
the plans back (N pickles), gathers the write results (N more unpickles, counted here as the plans
are: they hold the same items) and pickles the index; at a resume every rank reads and unpickles
that whole index (``load_restricted``, as the trainer does), which holds a chunk per rank of every
sharded tensor. With an index per rank (supervisor/resumable/_dcp_index.py, the trainer's choice for sharded
state), a rank pickles its own index and reads it back at a resume on the same layout: the same
work whatever the world size. Each index holds where every item went (its shard file, offset and
length), as DCP's ``finish`` fills it in from the write results.

A world-size change (N saved ranks resumed on W = N/2) needs every rank's index, merged. Read by
every rank, that is N files on each (N x W over the job, all served by the shared filesystem);
``safe_load.every_index`` reads each once over the job: rank r reads indexes r, r+W, ... and
merges them, and every rank merges the all-gathered parts. Both run here on real index files in
a temporary directory (the collective left out: the parts are pickled and unpickled as they
travel), the files opened counted.

No processes: one real local save plan of the ``bench`` model and its AdamW state (one process:
the same items as one FSDP rank's plan) is copied for N simulated ranks, each copy's chunks moved
to that rank's rows, so that DCP's own global plan step and checks run on them as on N real
ranks'. Everything is timed on this one core.

    .venv/bin/python bench/index_scale.py [--ranks 16 256 1024]
"""

from __future__ import annotations

import argparse
import dataclasses
import io
import math
import os
import pickle
import sys
import tempfile
import time
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--ranks", type=int, nargs="+", default=[16, 256, 1024])
    return p.parse_args(argv)


def local_plan() -> Any:
    """One rank's local save plan of the ``bench`` model and its AdamW state."""
    import torch
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    from supervisor.resumable._objects import Objects
    from supervisor.resumable._optim_state import prime_for_load
    from train_ref.config import get_config
    from train_ref.data import Corpus
    from train_ref.model import GPT

    cfg = get_config("bench", Corpus.load(None).tokenizer.vocab_size)
    model = GPT(cfg.model)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    prime_for_load(opt)
    planner = DefaultSavePlanner()
    planner.set_up_planner(
        {"app": Objects({"model": model, "optimizer": opt}).state_dict()}, is_coordinator=True
    )
    return planner.create_local_plan()


def as_rank(plan: Any, rank: int, world: int) -> Any:
    """``plan`` as rank ``rank`` of ``world`` would make it: each tensor ``world`` times as long
    along its first dim, this rank's chunk (a DTensor's shard) at its own rows; a scalar stays
    whole on every rank, as FSDP's step counters do (DCP keeps one)."""
    from torch import Size
    from torch.distributed.checkpoint.planner import WriteItemType

    items = []
    for item in plan.items:
        td = item.tensor_data
        if td is None or len(td.size) == 0:
            items.append(item)
            continue
        rows = td.chunk.sizes[0]
        offsets = Size((rank * rows, *td.chunk.offsets[1:]))
        chunk = dataclasses.replace(td.chunk, offsets=offsets)
        size = Size((world * td.size[0], *td.size[1:]))
        index = dataclasses.replace(item.index, offset=offsets)
        td = dataclasses.replace(td, chunk=chunk, size=size)
        items.append(dataclasses.replace(item, index=index, type=WriteItemType.SHARD, tensor_data=td))
    return dataclasses.replace(plan, items=items)


def one_index(plans: list[Any], first_rank: int = 0) -> tuple[float, bytes]:
    """Rank 0's CPU in DCP's save exchange for these plans (of ranks ``first_rank``, ... in
    order), and the pickled index it writes."""
    from torch.distributed.checkpoint.default_planner import DefaultSavePlanner

    sent = [pickle.dumps(p) for p in plans]  # each rank's own pickling: not rank 0's time
    t0 = time.perf_counter()
    got = [pickle.loads(s) for s in sent]  # the plans gathered
    final, metadata = DefaultSavePlanner().create_global_plan(got)
    for p in final:  # scattered back
        pickle.dumps(p)
    for s in sent:  # the write results gathered (as many items as the plans)
        pickle.loads(s)
    metadata.storage_data = stored(plans, first_rank)
    blob = pickle.dumps(metadata)
    return time.perf_counter() - t0, blob


def stored(plans: list[Any], first_rank: int) -> dict[Any, Any]:
    """Where each item of ``plans`` went, as DCP's writer reports it: one record after another in
    its rank's shard file."""
    from torch.distributed.checkpoint.filesystem import _StorageInfo

    from supervisor.format.layout import dcp_shard_filename

    where = {}
    for rank, plan in enumerate(plans, first_rank):
        offset = 0
        for item in plan.items:
            td = item.tensor_data
            length = 100 if td is None else math.prod(td.chunk.sizes) * td.properties.dtype.itemsize
            where[item.index] = _StorageInfo(dcp_shard_filename(rank), offset, length)
            offset += length
    return where


def read_s(blob: bytes) -> float:
    """A rank's CPU to unpickle an index through the allowlist, as every rank does at a resume
    (``load_dcp``: the cycle collector off)."""
    from supervisor.resumable._safe_load import no_gc
    from supervisor.safepickle import load_restricted

    with no_gc():
        t0 = time.perf_counter()
        load_restricted(blob, "index")
        return time.perf_counter() - t0


def world_change(plan: Any, n: int, tmp: Path) -> dict[str, float]:
    """N saved ranks' own indexes, loaded on W = N/2: every rank reading every index vs
    ``every_index``'s shares (CPU on the busiest rank, files each rank opens)."""
    from torch.distributed.checkpoint.filesystem import FileSystem
    from torch.distributed.checkpoint.metadata import Metadata

    from supervisor.format.layout import dcp_index_filename
    from supervisor.resumable._dcp_index import merged
    from supervisor.resumable._safe_load import _assembled, _index_part, no_gc, read_index

    class Counted(FileSystem):
        """DCP's local file system, counting the files it opens."""

        opened = 0

        @contextmanager
        def create_stream(self, path: str | os.PathLike[str], mode: str) -> Iterator[io.IOBase]:
            self.opened += 1
            with super().create_stream(path, mode) as stream:
                yield stream

    w = n // 2
    ckpt = tmp / f"saved_by_{n}"
    ckpt.mkdir()
    for r in range(n):
        (ckpt / dcp_index_filename(r)).write_bytes(one_index([as_rank(plan, r, n)], first_rank=r)[1])
    with no_gc():
        fs = Counted()
        t0 = time.perf_counter()
        every = merged([read_index(fs, ckpt / dcp_index_filename(r)) for r in range(n)])
        all_s, all_opened = time.perf_counter() - t0, fs.opened
        parts, part_s, part_opened = [], 0.0, 0
        for me in range(w):  # each new rank's share, one after another here
            fs = Counted()
            t0 = time.perf_counter()
            parts.append(pickle.dumps(_index_part(ckpt, fs, me, w)))
            part_s, part_opened = max(part_s, time.perf_counter() - t0), max(part_opened, fs.opened)
        t0 = time.perf_counter()  # on every rank: the parts all-gathered, merged and checked
        md = _assembled(ckpt, [pickle.loads(b) for b in parts])
        merge_s = time.perf_counter() - t0
    assert isinstance(md, Metadata) and md.state_dict_metadata.keys() == every.state_dict_metadata.keys()
    index_mib = sum((ckpt / dcp_index_filename(r)).stat().st_size for r in range(n)) / (1 << 20)
    return {"w": w, "all_s": all_s, "all_opened": all_opened, "all_mib": index_mib,
            "part_opened": part_opened, "cpu_s": part_s + merge_s,
            "gathered_mib": sum(len(b) for b in parts) / (1 << 20)}  # fmt: skip


def main() -> int:
    args = parse()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = local_plan()
    one_index([as_rank(plan, r, 2) for r in range(2)])  # first calls' one-off costs, not counted
    print(f"one rank's save plan: {len(plan.items)} items; times are one core's CPU")
    print(f"{'ranks':>6} | {'one index: rank 0 save, s':>25} {'index, MiB':>10} {'each rank reads it, s':>21} | "
          f"{'per rank: rank 0 save, s':>24} {'index, MiB':>10} {'each rank reads it, s':>21}")  # fmt: skip
    rows = {}
    for n in args.ranks:
        plans = [as_rank(plan, r, n) for r in range(n)]
        save_s, blob = one_index(plans)
        mine_s, mine = one_index(plans[:1])  # a rank alone: its plan, its own index
        rows[n] = (save_s, read_s(blob), mine_s, read_s(mine))
        print(f"{n:>6} | {save_s:>25.2f} {len(blob) / (1 << 20):>10.1f} {rows[n][1]:>21.2f} | "
              f"{mine_s:>24.3f} {len(mine) / (1 << 20):>10.2f} {rows[n][3]:>21.3f}")  # fmt: skip
        del plans, blob
    small, big = min(rows), max(rows)
    print(f"{small} -> {big} ranks (x{big / small:g}): one index: rank 0's save x{rows[big][0] / rows[small][0]:.1f}, "
          f"each rank's read x{rows[big][1] / rows[small][1]:.1f} (the job's reads x{big / small * rows[big][1] / rows[small][1]:,.0f}); "
          f"per rank: x{rows[big][2] / rows[small][2]:.1f} and x{rows[big][3] / rows[small][3]:.1f}")  # fmt: skip
    print("\na world-size change: N ranks' own indexes merged on W = N/2 new ranks; CPU of each new rank")
    print(f"{'N -> W':>12} | {'every rank reads all: files a rank':>34} {'over the job':>12} {'MiB a rank':>10} "
          f"{'CPU, s':>7} | {'shares: files a rank':>20} {'over the job':>12} {'MiB a rank, gathered':>20} "
          f"{'CPU, s':>7}")  # fmt: skip
    with tempfile.TemporaryDirectory() as tmp:
        for n in args.ranks:
            c = world_change(plan, n, Path(tmp))
            w = int(c["w"])
            print(f"{f'{n} -> {w}':>12} | {c['all_opened']:>34,.0f} {c['all_opened'] * w:>12,.0f} "
                  f"{c['all_mib']:>10.1f} {c['all_s']:>7.2f} | {c['part_opened']:>20,.0f} {n:>12,} "
                  f"{c['gathered_mib']:>20.1f} {c['cpu_s']:>7.2f}")  # fmt: skip
    return 0


if __name__ == "__main__":
    sys.exit(main())
