"""The remote tier, measured side by side in one run.

    .venv/bin/python bench/tiers.py [--size-mib 128] [--files 4] [--rounds 3] [--steps 60]
        [--sections 1,2,3] [--trainer-steps 100] [--trainer-save-every 5]

1. Upload: ``RemoteTier.upload`` (hash while reading, manifest last, fsync and rename on a
   directory) next to a plain copy of the same bytes to the same target (``shutil.copyfile`` per
   file for the directory tier, s3fs ``put`` for S3), and the same for a download (``download``:
   hash while writing, local commit; plain: copytree / s3fs ``get``). Each plain copy is also
   timed with an fsync of what it wrote (+fsync), the fair baseline for a durable tier.
   Targets: a second directory and a moto S3 server on loopback (a subprocess, so it does not share
   this process's GIL). Median of ``--rounds`` after a warm-up round, the order alternated.
   Ratio = tier throughput / plain throughput.
2. Training-loop stall, synthetic: a numpy loop (a fixed matmul per step) that commits a checkpoint
   every ``--save-every`` steps through the store, with no remote, then with an Uploader to each
   target, the variants interleaved over ``--rounds``. Ratio = median (and p95) step time with the
   remote / without. The saves themselves are not timed (they are the same in every variant); what
   is timed is the steps while uploads run, plus any time ``submit`` blocked.
3. Training-loop stall, real trainer: torchrun, 2 ranks, the tiny config, a checkpoint every
   ``--trainer-save-every`` steps, without a remote, then with ``--remote`` to each target, the
   variants interleaved over ``--rounds``; step times from its metrics.jsonl (the first
   ``WARMUP_STEPS`` of each run dropped). Ratio = median (and p95) step time with / without.
"""

from __future__ import annotations

import argparse
import os
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from supervisor import store
from supervisor.format.atomic import fsync_file, fsync_tree
from supervisor.format.layout import RunDir
from supervisor.format.manifest import CheckpointInfo
from supervisor.format.metrics import read_metrics
from supervisor.tiers.remote import RemoteTier, open_remote
from supervisor.tiers.uploader import Uploader, UploadPolicy

REPO = Path(__file__).resolve().parents[1]
MB = 1e6
CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "bench",
    "AWS_SECRET_ACCESS_KEY": "bench",
    "AWS_DEFAULT_REGION": "us-east-1",
}


# ---------------------------------------------------------------- setup


def start_moto() -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = Path(sys.executable).with_name("moto_server")
    proc = subprocess.Popen(
        [str(exe), "-H", "127.0.0.1", "-p", str(port)], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL
    )
    deadline = time.monotonic() + 60
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return proc, f"http://127.0.0.1:{port}"
        except OSError:
            if time.monotonic() > deadline or proc.poll() is not None:
                proc.kill()
                raise SystemExit("moto_server did not start (pip install 'moto[server]')") from None
            time.sleep(0.1)


def write_checkpoint(root: Path, step: int, size: int, files: int) -> store.CheckpointRef:
    tmp = store.begin(root, step)
    rng = np.random.default_rng(step)
    for i in range(files):
        (tmp / f"__{i}_0.distcp").write_bytes(rng.integers(0, 256, size // files, dtype=np.uint8).tobytes())
    return store.commit(root, tmp, CheckpointInfo(step, files))


class Target:
    """One remote: a fresh tier root per call, and the plain copy to the same kind of place."""

    def __init__(self, kind: str, base: Path, endpoint: str) -> None:
        self.kind, self.base, self.endpoint, self.n = kind, base, endpoint, 0
        if kind == "s3":
            open_remote("s3://bench-tiers", endpoint=endpoint).backend.fs.mkdir("bench-tiers")

    def fresh(self) -> RemoteTier:
        self.n += 1
        if self.kind == "dir":
            return open_remote(str(self.base / f"tier{self.n}"))
        return open_remote(f"s3://bench-tiers/tier{self.n}", endpoint=self.endpoint)

    def plain_put(self, ref: store.CheckpointRef, durable: bool) -> Callable[[], None]:
        tier = self.fresh()
        if self.kind == "dir":
            dest = tier.backend.root / ref.name

            def put() -> None:
                dest.mkdir(parents=True)
                for p in sorted(ref.path.iterdir()):
                    shutil.copyfile(p, dest / p.name)
                    if durable:
                        fsync_file(dest / p.name)

            return put
        fs, root = tier.backend.fs, tier.backend.root  # an S3 PUT is durable when it returns
        return lambda: fs.put(str(ref.path), f"{root}/{ref.name}", recursive=True)

    def plain_get(self, tier: RemoteTier, name: str, dest: Path, durable: bool) -> None:
        if self.kind == "dir":
            shutil.copytree(tier.backend.root / name, dest)
        else:
            tier.backend.fs.get(f"{tier.backend.root}/{name}", str(dest), recursive=True)
        if durable:
            fsync_tree(dest)


def timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


# ---------------------------------------------------------------- 1. transfer throughput


def transfer(target: Target, ref: store.CheckpointRef, work: Path, rounds: int) -> dict[str, float]:
    """MB/s of each way, median of ``rounds`` after one untimed warm-up round."""
    nbytes = store.validate(ref).manifest.total_bytes
    ways = ("plain_up", "durable_up", "tier_up", "plain_down", "durable_down", "tier_down")
    times: dict[str, list[float]] = {k: [] for k in ways}
    for r in range(rounds + 1):
        tier = target.fresh()
        runs = {
            "plain_up": target.plain_put(ref, durable=False),
            "durable_up": target.plain_put(ref, durable=True),
            "tier_up": lambda t=tier: t.upload(ref),
            "plain_down": lambda t=tier, d=work / "down-plain": target.plain_get(t, ref.name, d, False),
            "durable_down": lambda t=tier, d=work / "down-durable": target.plain_get(t, ref.name, d, True),
            "tier_down": lambda t=tier, d=work / "down-tier": t.download(ref.step, d),
        }
        order = ways if r % 2 == 0 else (*ways[2::-1], *ways[:2:-1])  # uploads before downloads
        for way in order:
            dt = timed(runs[way])
            if r > 0:
                times[way].append(dt)
        for way in ("plain", "durable", "tier"):
            shutil.rmtree(work / f"down-{way}", ignore_errors=True)
    return {k: nbytes / statistics.median(v) / MB for k, v in times.items()}


# ---------------------------------------------------------------- 2. synthetic stall


def synthetic_loop(root: Path, steps: int, save_every: int, size: int, files: int, uploader: Uploader | None):
    a = np.random.default_rng(0).standard_normal((384, 384))
    step_times = []
    for step in range(1, steps + 1):
        t0 = time.perf_counter()
        for _ in range(8):
            a = np.tanh(a @ a.T / 384.0)
        step_times.append(time.perf_counter() - t0)
        if step % save_every == 0:
            ref = write_checkpoint(root, step, size, files)
            if uploader:
                t0 = time.perf_counter()
                uploader.submit(ref)
                step_times[-1] += time.perf_counter() - t0  # a submit that blocked is a stall
            else:
                store.prune(root, keep=2)
    return step_times


def p95(xs: list[float]) -> float:
    return sorted(xs)[max(0, round(0.95 * len(xs)) - 1)]


# ---------------------------------------------------------------- 3. real trainer


WARMUP_STEPS = 5


def trainer_step_times(root: Path, steps: int, save_every: int, remote: list[str]) -> list[float]:
    cmd = [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2",
        "-m", "train_ref.train", "--ckpt-root", str(root), "--steps", str(steps),
        "--save-every", str(save_every), *remote,
    ]  # fmt: skip
    env = {**os.environ, "TORCH_DISABLE_SHARE_RDZV_TCP_STORE": "1", "PYTHONPATH": str(REPO)}
    subprocess.run(cmd, cwd=REPO, env=env, check=True, timeout=1800, capture_output=True)
    return [r.step_time for r in read_metrics(RunDir.of(root).metrics)][WARMUP_STEPS:]


# ---------------------------------------------------------------- main


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--size-mib", type=int, default=128, help="checkpoint size for the transfer test")
    ap.add_argument("--files", type=int, default=4)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=60, help="steps of the synthetic loop")
    ap.add_argument("--save-every", type=int, default=10)
    ap.add_argument("--stall-size-mib", type=int, default=64, help="checkpoint size in the loop")
    ap.add_argument("--trainer-steps", type=int, default=100, help="steps of each real-trainer run")
    ap.add_argument("--trainer-save-every", type=int, default=5)
    ap.add_argument("--sections", default="1,2,3", help="which of the three measurements to run")
    ap.add_argument("--dir", type=Path, default=None, help="scratch directory (default: a temp dir)")
    args = ap.parse_args()
    sections = {int(x) for x in args.sections.split(",")}
    os.environ.update({k: os.environ.get(k, v) for k, v in CREDENTIALS.items()})
    work = Path(tempfile.mkdtemp(prefix="bench-tiers-", dir=args.dir))
    moto, endpoint = start_moto()
    try:
        targets = {k: Target(k, work / "shared", endpoint) for k in ("dir", "s3")}
        if 1 in sections:
            transfers(args, targets, work)
        if 2 in sections:
            synthetic(args, targets, work)
        if 3 in sections:
            trainer(args, targets, work, endpoint)
    finally:
        moto.kill()
        moto.wait()
        shutil.rmtree(work, ignore_errors=True)


def transfers(args: argparse.Namespace, targets: dict[str, Target], work: Path) -> None:
    ref = write_checkpoint(work / "run", 1, args.size_mib << 20, args.files)
    print(f"1. transfer of {args.size_mib} MiB in {args.files} files, median of {args.rounds} (MB/s)")
    print("   plain: copyfile / copytree / s3fs put / get; +fsync: the same, then fsync what was written")
    print("   (an S3 PUT is durable when it returns: its +fsync up is the plain put again)")
    head = f"{'plain':>7} {'+fsync':>7} {'tier':>7} {'tier/plain':>10} {'tier/+fsync':>11}"
    print(f"{'':<7} {'upload':^46}   {'download':^46}")
    print(f"{'target':<7} {head}   {head}")
    for kind, target in targets.items():
        r = transfer(target, ref, work, args.rounds)
        cells = []
        for way in ("up", "down"):
            plain, durable, tier = r[f"plain_{way}"], r[f"durable_{way}"], r[f"tier_{way}"]
            cells.append(
                f"{plain:7.0f} {durable:7.0f} {tier:7.0f} {tier / plain:10.2f} {tier / durable:11.2f}"
            )
        print(f"{kind:<7} {cells[0]}   {cells[1]}")


def synthetic(args: argparse.Namespace, targets: dict[str, Target], work: Path) -> None:
    size = args.stall_size_mib << 20
    print(
        f"\n2. synthetic loop: {args.steps} steps, a {args.stall_size_mib} MiB checkpoint every "
        f"{args.save_every}, {args.rounds} interleaved rounds; step time with the remote / without"
    )
    variants = ("off", *targets)
    times: dict[str, list[float]] = {v: [] for v in variants}
    notes: dict[str, list[str]] = {v: [] for v in variants}
    for r in range(args.rounds):  # interleaved, so a change in the machine's load hits all alike
        for kind in variants[r % 3 :] + variants[: r % 3]:
            root = work / f"loop-{kind}-{r}"
            if kind == "off":
                times[kind] += synthetic_loop(root, args.steps, args.save_every, size, args.files, None)
                continue
            up = Uploader(root, targets[kind].fresh(), UploadPolicy(local_keep=2)).start()
            times[kind] += synthetic_loop(root, args.steps, args.save_every, size, args.files, up)
            synced = up.close(flush_timeout_s=300)
            notes[kind].append(f"{'synced' if synced else 'NOT synced'}/{len(up.status().skipped)} skipped")
    report(variants, times, notes)


def trainer(args: argparse.Namespace, targets: dict[str, Target], work: Path, endpoint: str) -> None:
    print(
        f"\n3. real trainer: torchrun, 2 ranks, tiny config, {args.trainer_steps} steps, a checkpoint "
        f"every {args.trainer_save_every}, {args.rounds} interleaved rounds; step time with --remote / without"
    )
    variants = ("off", *targets)
    times: dict[str, list[float]] = {v: [] for v in variants}
    for r in range(args.rounds):
        for kind in variants[r % 3 :] + variants[: r % 3]:
            extra = []
            if kind != "off":
                extra = ["--remote", targets[kind].fresh().url]
                extra += ["--remote-endpoint", endpoint] if kind == "s3" else []
            times[kind] += trainer_step_times(
                work / f"train-{kind}-{r}", args.trainer_steps, args.trainer_save_every, extra
            )
    report(variants, times, {v: [] for v in variants})


def report(variants: tuple[str, ...], times: dict[str, list[float]], notes: dict[str, list[str]]) -> None:
    base = times["off"]
    for kind in variants:
        on = times[kind]
        print(
            f"{kind:<7} median {statistics.median(on) * 1e3:7.2f} ms  p95 {p95(on) * 1e3:7.2f} ms  "
            f"ratio median {statistics.median(on) / statistics.median(base):.2f}  "
            f"p95 {p95(on) / p95(base):.2f}  {' '.join(notes[kind])}".rstrip()
        )


if __name__ == "__main__":
    main()
