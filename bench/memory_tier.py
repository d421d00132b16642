"""The memory tier (docs/tiers.md#the-memory-tier), measured side by side in one run.

    .venv/bin/python bench/memory_tier.py [--configs tiny,bench] [--steps 60] [--rounds 2]

Each measurement is a child process of this script: one rank (gloo, world size 1), the reference
trainer's GPT of the config, AdamW, random tokens, in a plain loop under ``Resumable`` with no
periodic disk save, as a user's loop would be.

1. Training overhead: the same loop without the tier and with it (its folder in /dev/shm, the
   interval chosen by the 3% rule: ``Saves.memory_every`` 0), the variants interleaved over
   ``--rounds``; each run's step time is the mean over its steps after the first 5 (not the
   median: a snapshot every N steps costs one step in N, which a median never sees).
   Overhead = the median over the rounds of (mean with / mean without) - 1. Budget: <= 3%.
2. Load: a run with a snapshot every step ends with a disk checkpoint of its last step (the final
   save) and that step's snapshot in memory; the watchdog's side (``watch.memory.Memory``) picks
   and verifies the snapshot, then two children resume: one from the memory snapshot, one from
   the disk (hot: the files were just written, and read once before timing), each timing its
   ``resume()`` (the pick's check or the quick verify, then the copy into the state). Ratio =
   disk / memory. Budget: >= 3.
3. The snapshots' cost in one process (``in_one_process``, ``--blocks N``): blocks of N steps
   with snapshots and without, alternating, 20 pairs; the median of the pairs' ratios. Free of
   the drift between processes that makes 1. noisy on this machine (its rounds spread -11% to
   +18%); not the tier's fixed costs (a stat and a few flags a step), which 1. includes.
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

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from supervisor.format.events import EventLog  # noqa: E402
from supervisor.format.heartbeat import ENV_LAUNCH_ID, ENV_RESTART_COUNT  # noqa: E402
from supervisor.format.layout import MEMORY_DIR_ENV  # noqa: E402
from supervisor.watch.memory import Memory  # noqa: E402

WARMUP_STEPS = 5
PAIRS = 20  # of blocks with snapshots and without, in one process
AFTERMATH = 3  # steps after a snapshot that it may slow (supervisor/resumable/_memory.py: 2)
VOCAB = 96
BUDGET_OVERHEAD = 0.03
BUDGET_LOAD = 3.0


# ---------------------------------------------------------------- the child: one rank's loop


def child(opts: argparse.Namespace) -> None:
    """Train ``--steps`` (or resume only: ``--steps`` equal to the resumed step), print one JSON
    line: the step times, the resume's seconds, the step resumed at."""
    import torch
    import torch.distributed as dist

    from supervisor.resumable import Identity, Resumable, Saves
    from train_ref.config import get_config
    from train_ref.model import GPT

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    torch.manual_seed(0)
    cfg = get_config(opts.config, VOCAB)
    model = GPT(cfg.model)
    optim = torch.optim.AdamW(model.parameters(), lr=1e-4)
    r = Resumable(
        opts.root,
        {"model": model, "optimizer": optim},
        steps=opts.steps,
        identity=Identity({"config": opts.config}, seed=0),
        saves=Saves(every_steps=10**9, memory_every=opts.memory_every),
    )
    t0 = time.perf_counter()
    step = r.resume()
    resume_s = time.perf_counter() - t0
    if opts.blocks:  # every other block of steps takes no snapshot (the A/B in one process)
        tier = r._memory
        assert tier is not None, "--blocks: run under the memory tier's folder"
        due = tier.due
        tier.due = lambda s, *a: (s - 1) // opts.blocks % 2 == 0 and due(s, *a)  # type: ignore[method-assign]
    gen = torch.Generator().manual_seed(step)
    batch, block = cfg.global_batch, cfg.model.block_size
    times = []
    while step < opts.steps:
        t = time.perf_counter()
        x = torch.randint(0, VOCAB, (batch, block + 1), generator=gen)
        loss = model(x[:, :-1], x[:, 1:])
        optim.zero_grad(set_to_none=True)
        loss.backward()
        optim.step()
        step += 1
        r.step_end(step, {"loss": float(loss.detach()), "lr": 1e-4})
        times.append(time.perf_counter() - t)
    r.finish()
    dist.destroy_process_group()
    print(json.dumps({"times": times, "resume_s": resume_s, "start": r.start}))


def run_child(
    config: str,
    root: Path,
    steps: int,
    memory: Path | None,
    memory_every: int = 0,
    launch: int = 1,
    blocks: int = 0,
) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k not in (MEMORY_DIR_ENV, ENV_LAUNCH_ID, ENV_RESTART_COUNT)}
    env.update(
        {
            "PYTHONPATH": str(REPO),
            "OMP_NUM_THREADS": env.get("OMP_NUM_THREADS", "1"),
            ENV_LAUNCH_ID: f"bench-{launch}",
            ENV_RESTART_COUNT: str(launch - 1),
        }
    )
    if memory is not None:
        env[MEMORY_DIR_ENV] = str(memory)
    cmd = [sys.executable, __file__, "--child", "--config", config, "--root", str(root)]
    cmd += ["--steps", str(steps), "--memory-every", str(memory_every), "--blocks", str(blocks)]
    r = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=3600, check=False)
    if r.returncode != 0:
        raise SystemExit(f"bench child failed ({r.returncode}): {r.stderr[-3000:]}")
    return dict(json.loads(r.stdout.strip().splitlines()[-1]))


# ---------------------------------------------------------------- the parent: side by side


def fresh(work: Path, name: str) -> Path:
    p = work / name
    shutil.rmtree(p, ignore_errors=True)
    p.mkdir(parents=True)
    return p


def overhead(
    config: str, steps: int, rounds: int, work: Path, shm: Path
) -> tuple[float, float, float, list[float]]:
    """Mean step time without and with the tier (each the median of the rounds), the overhead:
    the median of the rounds' ratios (a round's two runs are side by side in time; this machine's
    speed drifts by 10-20% between runs minutes apart), and each round's ratio."""
    off: list[float] = []
    on: list[float] = []
    for i in range(rounds):
        for variant in ("off", "on") if i % 2 == 0 else ("on", "off"):
            mem = fresh(shm, "memory") if variant == "on" else None
            out = run_child(config, fresh(work, "run") / "r", steps, mem)
            (on if variant == "on" else off).append(statistics.fmean(out["times"][WARMUP_STEPS:]))
    ratios = [b / a for a, b in zip(off, on, strict=True)]
    return statistics.median(off), statistics.median(on), statistics.median(ratios) - 1, ratios


def in_one_process(config: str, steps: int, block: int, work: Path, shm: Path) -> tuple[float, list[float]]:
    """The snapshots' cost in one process (none of the 10-20% drift between processes): blocks of
    ``block`` steps with snapshots and without, alternating; each pair's ratio of mean step times
    (a block's first AFTERMATH steps left out: the previous block's last copy slows them). Not the
    tier's fixed costs (a stat and a few flags a step), which the side-by-side runs include."""
    out = run_child(config, fresh(work, "run") / "r", steps, fresh(shm, "memory"), blocks=block)
    times = out["times"]
    ratios = []
    for on in range(0, len(times) - 2 * block + 1, 2 * block):
        with_ = statistics.fmean(times[on + AFTERMATH : on + block])
        without = statistics.fmean(times[on + block + AFTERMATH : on + 2 * block])
        ratios.append(with_ / without)
    return statistics.median(ratios) - 1, ratios


def load(config: str, steps: int, work: Path, shm: Path) -> tuple[float, float, int]:
    """Resume seconds from memory and from the disk (hot), and the snapshot's size in bytes."""
    root, mem = fresh(work, "run") / "r", fresh(shm, "memory")
    run_child(config, root, steps, mem, memory_every=1)
    memory = Memory(EventLog(root, 0))
    memory.folder = mem
    picked = memory.pick(2, disk_step=steps)
    if picked != steps:
        raise SystemExit(f"the watchdog's side picked {picked}, not step {steps}: see {root}/supervisor/")
    size = sum(p.stat().st_size for p in mem.rglob("*.data"))
    from_memory = run_child(config, root, steps, mem, launch=2)
    for p in root.rglob("*"):  # hot: every file of the checkpoint read once
        if p.is_file():
            p.read_bytes()
    from_disk = run_child(config, root, steps, None, launch=3)
    assert from_memory["start"] == from_disk["start"] == steps, (from_memory, from_disk)
    return from_memory["resume_s"], from_disk["resume_s"], size


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--configs", default="tiny,bench")
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--config", default="tiny", help=argparse.SUPPRESS)
    p.add_argument("--root", type=Path, help=argparse.SUPPRESS)
    p.add_argument(
        "--blocks",
        type=int,
        default=50,
        help=f"steps per block of the A/B in one process ({PAIRS} pairs; 0: none)",
    )
    p.add_argument("--memory-every", type=int, default=0, help=argparse.SUPPRESS)
    opts = p.parse_args()
    if opts.child:
        child(opts)
        return 0
    work = Path(tempfile.mkdtemp(prefix="bench-memory-"))
    shm = Path(
        tempfile.mkdtemp(prefix="bench-memory-", dir="/dev/shm" if os.path.isdir("/dev/shm") else None)
    )
    failed = False
    try:
        for config in opts.configs.split(","):
            a, b, over, ratios = overhead(config, opts.steps, opts.rounds, work, shm)
            ok = over <= BUDGET_OVERHEAD
            failed |= not ok
            print(
                f"{config}: step {a * 1e3:.1f} ms without the tier, {b * 1e3:.1f} ms with it: overhead "
                f"{over * 100:+.2f}% (budget {BUDGET_OVERHEAD * 100:.0f}%: {'met' if ok else 'NOT met'}); "
                f"the rounds: {' '.join(f'{(r - 1) * 100:+.1f}%' for r in sorted(ratios))}"
            )
            if opts.blocks:
                over, ratios = in_one_process(config, 2 * PAIRS * opts.blocks, opts.blocks, work, shm)
                ok = over <= BUDGET_OVERHEAD
                failed |= not ok
                print(
                    f"{config}: in one process, blocks of {opts.blocks} steps with snapshots and without: "
                    f"overhead {over * 100:+.2f}% (budget {BUDGET_OVERHEAD * 100:.0f}%: "
                    f"{'met' if ok else 'NOT met'}); the {len(ratios)} pairs: "
                    f"{' '.join(f'{(r - 1) * 100:+.1f}%' for r in sorted(ratios))}"
                )
            mem_s, disk_s, size = load(config, min(opts.steps, 20), work, shm)
            ok = disk_s / mem_s >= BUDGET_LOAD
            failed |= not ok
            print(
                f"{config}: resume of {size / 1e6:.1f} MB from memory {mem_s:.3f} s, from the disk (hot) "
                f"{disk_s:.3f} s: {disk_s / mem_s:.1f}x (budget {BUDGET_LOAD:.0f}x: {'met' if ok else 'NOT met'})"
            )
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(shm, ignore_errors=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
