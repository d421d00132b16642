"""Checkpoint cost of the reference trainer, measured side by side in one run (bench config, FSDP).

On 2 ranks (torchrun, gloo on CPU), with the ~50M-parameter ``bench`` model and its AdamW state:
1. time the training loop is blocked per save: async DCP (the call + the wait for staging before
   the next optimizer step) vs sync DCP (save + commit) vs rank 0 ``torch.save`` of the gathered
   full state dict (the single-file way);
2. sync save throughput vs ``dd conv=fsync`` writing the same number of bytes;
3. DCP load time vs a raw read of the same files (both from the page cache: dropping caches would
   disturb other work on the machine);
4. end-to-end overhead of saving every ``--interval`` steps (the trainer's default ``--save-every``):
   ``--window`` steps with one async save in the middle vs the same steps without, interleaved;
   the extra time of that one save, divided by ``--interval`` steps of training. (A CPU step of
   the bench model takes seconds, so timing whole 50-step intervals would take an hour.)
Targets: async blocking <= 5% of sync; sync >= 80% of dd; overhead <= 3%.

    .venv/bin/python bench/checkpoint.py [--repeats 3] [--interval 50] [--window 6] [--dir /tmp]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))


def parse(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--interval", type=int, default=50, help="steps between saves (trainer default)")
    p.add_argument("--window", type=int, default=6, help="steps timed around one save")
    p.add_argument("--dir", default=None, help="where to write (default: a temp dir)")
    p.add_argument("--nproc", type=int, default=2)
    p.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    return p.parse_args(argv)


def launch(args: argparse.Namespace) -> int:
    work = Path(tempfile.mkdtemp(prefix="bench_ckpt_", dir=args.dir))
    env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1", PYTHONPATH=str(REPO))
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={args.nproc}",
        __file__, "--worker", "--dir", str(work), "--repeats", str(args.repeats), "--interval", str(args.interval),
        "--window", str(args.window),
    ]  # fmt: skip
    print("$", " ".join(cmd), flush=True)
    try:
        return subprocess.call(cmd, env=env, cwd=REPO)
    finally:
        shutil.rmtree(work, ignore_errors=True)


def make_trainer(root: Path, config: str, extra: list[str] | None = None) -> Any:
    """A reference ``train.Trainer`` on this torchrun rank (FSDP, ``config``), at step 0, with
    its rank RNG seeded: what the benches drive step by step."""
    import torch

    from supervisor.format.heartbeat import HeartbeatWriter
    from supervisor.format.manifest import CheckpointInfo
    from train_ref import train
    from train_ref.checkpointer import CommitInfo
    from train_ref.config import config_hash, get_config
    from train_ref.data import Corpus

    targs = train.parse_args(
        ["--ckpt-root", str(root), "--steps", "0", "--config", config, "--parallel", "fsdp", *(extra or [])]
    )
    d = train.init_distributed()
    root.mkdir(parents=True, exist_ok=True)
    corpus = Corpus.load(None)
    cfg = get_config(config, corpus.tokenizer.vocab_size)
    run = CheckpointInfo(
        step=0,
        world_size=d.world_size,
        model_config_hash=config_hash(cfg),
        data_fingerprint=corpus.fingerprint,
        parallelism={"mode": "fsdp", "world_size": d.world_size},
        torch_version=torch.__version__,
    )
    hb = HeartbeatWriter(root, rank=d.rank, local_rank=d.local_rank, world_size=d.world_size)
    t = train.Trainer(targs, d, cfg, corpus, hb, CommitInfo(run), "bench")
    train.seed_rank_rng(0, d.rank, 0)
    return t


def worker(args: argparse.Namespace) -> None:
    import torch
    import torch.distributed as dist
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.state_dict import StateDictOptions, get_state_dict

    from supervisor.format.manifest import list_files
    from supervisor.store import list_checkpoints

    root = Path(args.dir) / "ckpt"
    t = make_trainer(root, "bench")
    d = t.d
    rank0 = d.rank == 0
    batches = iter(t.loader())
    st = t.state

    def steps(n: int, save_at: int | None = None) -> float:
        dist.barrier()
        t0 = time.perf_counter()
        for i in range(n):
            x, y, _ = next(batches)
            t.train_step(x, y)
            t.sampler.advance()
            st.step += 1
            t.ckpt.step_boundary(False)
            if save_at is not None and i + 1 == save_at:
                t.ckpt.save(st, {}, blocking=False)
        t.ckpt.finish()
        dist.barrier()
        return time.perf_counter() - t0

    def say(msg: str) -> None:
        if rank0:
            print(msg, flush=True)

    n_params = sum(p.numel() for p in t.model.parameters())
    step_s = steps(3) / 3
    say(f"bench model: {n_params / 1e6:.1f}M parameters, {d.world_size} ranks, {step_s:.3f} s/step")

    sync_s, dcp_s, async_s, ts_s, dd_s, load_s, read_s = [], [], [], [], [], [], []
    for i in range(args.repeats):
        dist.barrier()
        t0 = time.perf_counter()
        dcp.save({"app": st}, checkpoint_id=Path(args.dir) / f"bare_{i}", process_group=t.ckpt.dcp_group)
        dist.barrier()
        dcp_s.append(time.perf_counter() - t0)
        if rank0:
            shutil.rmtree(Path(args.dir) / f"bare_{i}")

        st.step += 1
        dist.barrier()
        t.ckpt.save(st, {}, blocking=True)
        sync_s.append(t.ckpt.last_blocking_s)

        st.step += 1
        dist.barrier()
        t.ckpt.save(st, {}, blocking=False)
        call = t.ckpt.last_blocking_s
        t.ckpt.last_staging_wait_s = 0.0
        steps(1)  # trains while the save runs; waits for staging before its optimizer step
        async_s.append(call + t.ckpt.last_staging_wait_s)

        dist.barrier()
        t0 = time.perf_counter()
        msd, osd = get_state_dict(
            t.model, t.optimizer, options=StateDictOptions(full_state_dict=True, cpu_offload=True)
        )
        if rank0:
            path = Path(args.dir) / "full.pt"
            with open(path, "wb") as f:
                torch.save({"model": msd, "optim": osd}, f)
                f.flush()
                os.fsync(f.fileno())
        dist.barrier()
        ts_s.append(time.perf_counter() - t0)
        del msd, osd

        newest = list_checkpoints(root)[0].path
        files = [newest / n for n in list_files(newest)]
        nbytes = sum(p.stat().st_size for p in files)
        if rank0:
            out = Path(args.dir) / "dd.bin"
            mib = -(-nbytes // (1 << 20))
            t0 = time.perf_counter()
            subprocess.run(["dd", "if=/dev/zero", f"of={out}", "bs=1M", f"count={mib}", "conv=fsync"],
                           check=True, capture_output=True)  # fmt: skip
            dd_s.append(time.perf_counter() - t0)
            out.unlink()
            t0 = time.perf_counter()
            for p in files:
                with open(p, "rb", buffering=0) as f:
                    while f.read(8 << 20):
                        pass
            read_s.append(time.perf_counter() - t0)
        dist.barrier()
        t0 = time.perf_counter()
        dcp.load({"app": st}, checkpoint_id=newest, process_group=t.ckpt.dcp_group)
        dist.barrier()
        load_s.append(time.perf_counter() - t0)

    base, saving = [], []
    for _ in range(2):  # interleaved so drift of the machine hits both alike
        base.append(steps(args.window))
        saving.append(steps(args.window, save_at=args.window // 2))
    t.ckpt.close()

    if rank0:
        med = statistics.median
        gb = nbytes / 1e9
        extra = med(saving) - med(base)
        overhead = extra / (args.interval * med(base) / args.window)
        rows = {
            "checkpoint_bytes": nbytes,
            "sync_dcp_blocking_s": med(sync_s),
            "bare_dcp_save_s": med(dcp_s),
            "async_dcp_blocking_s": med(async_s),
            "rank0_torch_save_s": med(ts_s),
            "dd_fsync_s": med(dd_s),
            "dcp_load_s": med(load_s),
            "raw_read_s": med(read_s),
            "steps_without_save_s": med(base),
            "steps_with_one_save_s": med(saving),
        }
        print(json.dumps(rows, indent=1))
        print(
            f"checkpoint: {gb:.3f} GB in {len(files)} files; interval {args.interval} steps of {step_s:.3f} s"
        )
        print(f"async blocking / sync blocking        {med(async_s) / med(sync_s):8.3f}   (target <= 0.05)")
        print(f"rank-0 torch.save / sync DCP          {med(ts_s) / med(sync_s):8.3f}")
        print(f"sync DCP throughput / dd conv=fsync   {med(dd_s) / med(sync_s):8.3f}   (target >= 0.80)")
        print(f"bare dcp.save throughput / dd         {med(dd_s) / med(dcp_s):8.3f}   (without commit)")
        print(
            f"  sync {gb / med(sync_s):.2f} GB/s, bare dcp.save {gb / med(dcp_s):.2f} GB/s, dd {gb / med(dd_s):.2f} GB/s"
        )
        print(f"DCP load time / raw read time         {med(load_s) / med(read_s):8.3f}")
        print(
            f"one save costs {extra:.2f} s of training ({args.window}-step window, {med(base) / args.window:.2f} s/step)"
        )
        print(f"training overhead, 1 save per {args.interval} steps {overhead:8.2%}   (target <= 3%)")
    dist.destroy_process_group()


def main() -> int:
    args = parse()
    if args.worker:
        worker(args)
        return 0
    return launch(args)


if __name__ == "__main__":
    sys.exit(main())
