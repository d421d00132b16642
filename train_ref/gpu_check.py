"""``make gpu-check``: the GPU paths run for real on one CUDA machine, in a few minutes.

    python -m train_ref.gpu_check [--workdir DIR] [--keep]

Without CUDA: one line, exit 0 (CI stays green). With CUDA, every check is a real torchrun of the
reference trainer (tiny config, 30 steps, a save every 10, ``--deterministic``), compared with an
uninterrupted run of the same arguments by the final parameter digest:

- kill -9 of a rank held at step 15 (the hold gate: ``train_ref/hold.py``), then a relaunch: fp32
  (CUDA RNG: dropout), bf16 autocast;
- a preemption (SIGUSR1 at step 15: checkpoint of step 16, exit 75), then a relaunch: fp16 with
  GradScaler;
- async staging from pinned memory: a save called while the step that wrote the state is still
  running on the GPU, training going on right after it; the staged copy must equal the state at
  the call (``OrderedStager``; DCP's own DefaultStager is run beside it for comparison);
- a resume under another ``CUDA_VISIBLE_DEVICES`` mapping: saved with every GPU visible to every
  rank, resumed with each rank bound alone to another GPU (one GPU: bound by its UUID);
- NCCL with one rank per GPU (2+ when there are), kill -9 and relaunch.

One PASS/FAIL table; exit 1 when any check failed. Pure parts (the plan per GPU count, the table,
the exit code) are tested on CPU; the run itself is owed to a machine with a GPU.
"""

from __future__ import annotations

import train_ref.needs_torch  # noqa: F401  (first: without torch, one line naming the extra)

# isort: split
import argparse
import os
import runpy
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Any

from supervisor.drill.runner import read_digest
from supervisor.format.exitcodes import Exit
from supervisor.format.layout import FINAL
from supervisor.format.nodesummary import read_run_heartbeats
from supervisor.watch.process import kill_tree
from train_ref import hold

SKIP_LINE = "gpu-check: skipped: no CUDA device (torch.cuda.is_available() is False)"
BUDGET_S = 300.0  # the whole check, as the issue asks; a launch that hangs fails its check
LAUNCH_TIMEOUT_S = 150.0
STEPS, SAVE_EVERY, EVENT_STEP = 30, 10, 15
ENV_BIND = "GPU_CHECK_BIND"  # comma list: local rank i sees only the i-th entry (bind mode)
REPO = Path(__file__).resolve().parent.parent


class Status(str, Enum):
    PASS = "PASS"
    FAIL = "FAIL"
    SKIP = "SKIP"


@dataclass(frozen=True)
class Result:
    name: str
    status: Status
    detail: str
    seconds: float = 0.0


@dataclass(frozen=True)
class Spec:
    """One check: ``kind`` names the procedure, ``nproc`` ranks, extra trainer ``args``."""

    name: str
    kind: str  # kill9 | preempt | staging | remap | skip
    nproc: int = 1
    args: tuple[str, ...] = ()
    why: str = ""  # kind == skip: the reason, said in the table


def plan(n_gpus: int) -> list[Spec]:
    """The checks for a machine with ``n_gpus`` CUDA devices (pure; tested on CPU)."""
    pair = min(n_gpus, 2)
    specs = [
        Spec("kill -9 + resume, fp32 (CUDA RNG)", "kill9"),
        Spec("kill -9 + resume, bf16 autocast, EMA", "kill9", args=("--amp", "bf16", "--ema-decay", "0.99")),
        Spec("preemption + resume, fp16 + GradScaler", "preempt", args=("--amp", "fp16")),
        Spec("async staging from pinned memory, no tearing", "staging"),
        Spec(
            f"resume under another CUDA_VISIBLE_DEVICES ({pair} rank{'s' * (pair > 1)})", "remap", nproc=pair
        ),
    ]
    if n_gpus >= 2:
        specs.append(Spec(f"NCCL, {n_gpus} ranks (all GPUs), kill -9 + resume", "kill9", nproc=n_gpus))
    else:
        specs.append(Spec("NCCL, 2+ ranks", "skip", why="one GPU: NCCL ran with 1 rank in the checks above"))
    return specs


def table(results: list[Result], gpu: str, total_s: float) -> str:
    """The verdict table (pure): one row per check, the machine and the time in the last line."""
    width = max(len(r.name) for r in results)
    rows = [f"{'check':<{width}}  result  time    detail", "-" * (width + 40)]
    rows += [f"{r.name:<{width}}  {r.status.value:<6}  {r.seconds:5.1f}s  {r.detail}" for r in results]
    failed = sum(r.status is Status.FAIL for r in results)
    verdict = "FAIL" if failed else "PASS"
    rows.append(
        f"gpu-check: {verdict} ({failed} failed) on {gpu} in {total_s:.0f} s (budget {BUDGET_S:.0f} s)"
    )
    return "\n".join(rows)


def exit_code(results: list[Result]) -> int:
    return 1 if any(r.status is Status.FAIL for r in results) else 0


# ------------------------------------------------------------ running the trainer


GoldenKey = tuple[int, tuple[str, ...]]  # (nproc, trainer args)


def golden_keys(specs: list[Spec]) -> list[GoldenKey]:
    """The uninterrupted runs the checks compare with, each once (pure)."""
    keys = [(s.nproc, s.args) for s in specs if s.kind in ("kill9", "preempt", "remap")]
    return list(dict.fromkeys(keys))


def slug(name: str) -> str:
    return "".join(c if c.isalnum() else "_" for c in name).strip("_")


@dataclass
class Runner:
    """Launches of the reference trainer under ``work``; the goldens, made together up front."""

    work: Path
    goldens: dict[GoldenKey, str | CheckFailed]

    def cmd(self, root: Path, nproc: int, args: tuple[str, ...], bind: str = "") -> list[str]:
        target = ["-m", "train_ref.gpu_check", "--bind-worker"] if bind else ["-m", "train_ref.train"]
        return [
            sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
            *target, "--ckpt-root", str(root), "--steps", str(STEPS), "--save-every", str(SAVE_EVERY),
            "--seed", "3", "--parallel", "fsdp", "--deterministic", *args,
        ]  # fmt: skip

    def launch(
        self, root: Path, nproc: int, args: tuple[str, ...], gate: Path | None = None, bind: str = ""
    ) -> subprocess.Popen[str]:
        env = dict(os.environ, TORCH_DISABLE_SHARE_RDZV_TCP_STORE="1")
        env["PYTHONPATH"] = str(REPO) + os.pathsep + env.get("PYTHONPATH", "")
        env.pop(hold.ENV_HOLD_FILE, None)
        if gate is not None:
            env[hold.ENV_HOLD_FILE] = str(gate)
        if bind:
            env[ENV_BIND] = bind
        return subprocess.Popen(
            self.cmd(root, nproc, args, bind),
            cwd=REPO,
            env=env,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
            start_new_session=True,
        )

    def make_goldens(self, keys: list[GoldenKey]) -> None:
        """All uninterrupted runs at once (they share GPUs; deterministic kernels do not care):
        the slowest sets the time, not the sum. A failed one fails the checks that need it."""
        procs = {}
        try:
            for nproc, args in keys:
                root = self.work / f"golden_{nproc}_{slug('_'.join(args)) or 'fp32'}"
                procs[(nproc, args)] = (root, self.launch(root, nproc, args))
            for key, (root, proc) in procs.items():
                try:
                    self.goldens[key] = digest_of(root, finish(proc))
                except CheckFailed as e:
                    self.goldens[key] = CheckFailed(f"the uninterrupted run failed: {e}")
        finally:
            for _root, proc in procs.values():
                kill_group(proc)

    def golden(self, nproc: int, args: tuple[str, ...]) -> str:
        got = self.goldens[(nproc, args)]
        if isinstance(got, CheckFailed):
            raise got
        return got

    def interrupted(
        self, name: str, nproc: int, args: tuple[str, ...], sig: signal.Signals, resume_bind: str = ""
    ) -> tuple[str, str]:
        """Hold at EVENT_STEP, send ``sig`` to the last rank, release, relaunch (bound as asked):
        the relaunch's digest, and a note on how the first launch ended."""
        root, gate = self.work / name, self.work / f"{name}.hold"
        hold.hold_at(gate, EVENT_STEP)
        proc = self.launch(root, nproc, args, gate)
        try:
            acks = wait(
                lambda: hold.held(gate, nproc, EVENT_STEP), proc, f"{nproc} ranks held at step {EVENT_STEP}"
            )
            os.kill(acks[nproc - 1]["pid"], sig)
            if sig == signal.SIGKILL:  # the rest of the job goes too, at once: NCCL peers of a dead
                kill_group(proc)  # rank would wait in a collective until torchrun's stop timeout
            hold.release(gate)
            out = finish(proc, ok=False)
        finally:
            kill_group(proc)
        codes = {s.heartbeat.exit_code for s in read_run_heartbeats(root) if s.heartbeat}
        if sig == signal.SIGUSR1 and codes != {Exit.REQUEUE}:
            raise CheckFailed(
                f"preemption: heartbeat exit codes {sorted(map(str, codes))}, want 75\n{out[-1500:]}"
            )
        resumed = finish(self.launch(root, nproc, args, bind=resume_bind))
        step = resumed.split("resumed from step_")[1].split(",")[0] if "resumed from" in resumed else "?"
        return digest_of(root, resumed), f"resumed from step {int(step) if step.isdigit() else step}"


class CheckFailed(Exception):
    """A check's failure; ``str(e)`` is what the table says (the first line)."""


def wait(cond: Callable[[], object], proc: subprocess.Popen[str], what: str) -> dict[int, dict[str, Any]]:
    deadline = time.monotonic() + LAUNCH_TIMEOUT_S
    while not (got := cond()):
        if proc.poll() is not None:
            raise CheckFailed(
                f"the run ended (rc {proc.returncode}) before {what}\n{proc.communicate()[0][-1500:]}"
            )
        if time.monotonic() > deadline:
            raise CheckFailed(f"timed out waiting for {what}")
        time.sleep(0.05)
    return got  # type: ignore[return-value]


def finish(proc: subprocess.Popen[str], ok: bool = True) -> str:
    try:
        out, _ = proc.communicate(timeout=LAUNCH_TIMEOUT_S)
    except subprocess.TimeoutExpired:
        kill_group(proc)
        raise CheckFailed(f"a launch ran past {LAUNCH_TIMEOUT_S:.0f} s") from None
    if ok and proc.returncode != 0:
        lines = [ln for ln in out.splitlines() if "Error" in ln or "resumable:" in ln or "train_ref:" in ln]
        raise CheckFailed(f"torchrun exited {proc.returncode}: {(lines or ['?'])[-1].strip()}\n{out[-3000:]}")
    return out


def kill_group(proc: subprocess.Popen[str]) -> None:
    """torchrun and every rank (``kill_tree``: its group alone would leave them on the GPU)."""
    if proc.poll() is None:
        kill_tree(proc.pid)
        proc.wait()


def digest_of(root: Path, out: str) -> str:
    digest = read_digest(root)  # the parameters', and the moving average's where kept
    if digest is None:
        raise CheckFailed(f"no digest in {root / FINAL}\n{out[-1500:]}")
    return digest


# ------------------------------------------------------------ the checks


def check_interrupted(r: Runner, spec: Spec, sig: signal.Signals, bind: str = "") -> str:
    want = r.golden(spec.nproc, spec.args)
    got, how = r.interrupted(slug(spec.name), spec.nproc, spec.args, sig, bind)
    if got != want:
        raise CheckFailed(f"{how}: digest {got[:12]} != uninterrupted {want[:12]}")
    return f"{how}, digest {got[:12]} == uninterrupted"


def check_remap(r: Runner, spec: Spec) -> str:
    import torch

    n = torch.cuda.device_count()
    if spec.nproc >= 2:  # rank i ran on GPU i of all; now bound alone to GPU n-1-i
        bind, how = (
            ",".join(str(n - 1 - i) for i in range(spec.nproc)),
            "each rank bound alone to another GPU",
        )
    else:  # the same GPU, named by UUID and alone in the visible set
        uuid = str(torch.cuda.get_device_properties(0).uuid)
        bind, how = (uuid if uuid.startswith("GPU-") else f"GPU-{uuid}"), "one GPU: bound by UUID"
    return f"{how} ({ENV_BIND}={bind}); " + check_interrupted(r, spec, signal.SIGKILL, bind)


def check_staging() -> str:
    """The state as of the save call is what gets staged, though the step that wrote it is still
    queued on the GPU and training goes on right after the call."""
    import torch
    from torch.distributed.checkpoint.staging import DefaultStager

    from supervisor.resumable._staging import GPU_STAGING, OrderedStager

    def torn(stager_cls: type[DefaultStager]) -> int:
        x = torch.zeros(16 * 2**20, device="cuda")  # 64 MiB: the "parameters"
        y = torch.randn(2048, 2048, device="cuda")
        torch.cuda.synchronize()
        stager = stager_cls(GPU_STAGING)
        try:
            torch.cuda._sleep(10**9)  # the "optimizer step", still running when the save is called:
            x.fill_(7.0)  # ~0.5 s of GPU time queued before the write that produces the state
            future = stager.stage({"x": x})
            for _ in range(8):  # the next step's forward, launched right after the call
                y = y @ y.T / 2048
            assert isinstance(future, Future), "an async stager returns a Future"
            staged = future.result()["x"]  # before_optimizer_step: wait for staging
            x.add_(1)  # the next optimizer step
            torch.cuda.synchronize()
            return int((staged != 7.0).sum())
        finally:
            stager.close()

    ordered, default = torn(OrderedStager), torn(DefaultStager)
    if ordered:
        raise CheckFailed(f"OrderedStager staged {ordered} elements that are not the state at the save call")
    return f"staged == state at the call (DCP's DefaultStager alone: {default} torn elements)"


def run_checks(specs: list[Spec], work: Path) -> list[Result]:
    runner = Runner(work, {})
    runner.make_goldens(golden_keys(specs))
    out = []
    for spec in specs:
        t0 = time.monotonic()
        try:
            if spec.kind == "skip":
                out.append(Result(spec.name, Status.SKIP, spec.why))
                continue
            detail = {
                "kill9": lambda s: check_interrupted(runner, s, signal.SIGKILL),
                "preempt": lambda s: check_interrupted(runner, s, signal.SIGUSR1),
                "staging": lambda _s: check_staging(),
                "remap": lambda s: check_remap(runner, s),
            }[spec.kind](spec)
            out.append(Result(spec.name, Status.PASS, detail, time.monotonic() - t0))
        except Exception as e:  # a check that crashes is a FAIL with its reason, not the end of the run
            first, _, rest = str(e).partition("\n")
            out.append(Result(spec.name, Status.FAIL, f"{type(e).__name__}: {first}", time.monotonic() - t0))
            if rest:
                print(f"--- {spec.name}: output\n{rest}", file=sys.stderr)
        print(
            f"gpu-check: {out[-1].status.value} {spec.name} ({out[-1].seconds:.1f} s)",
            file=sys.stderr,
            flush=True,
        )
    return out


def bind_worker() -> None:
    """Run as a torchrun worker: see only GPU ``GPU_CHECK_BIND[LOCAL_RANK]``, then be the trainer
    (per-process binding as under SLURM's ``--gpus-per-task=1``). Set before CUDA starts."""
    order = os.environ[ENV_BIND].split(",")
    os.environ["CUDA_VISIBLE_DEVICES"] = order[int(os.environ.get("LOCAL_RANK", "0"))]
    sys.argv = ["train_ref.train", *sys.argv[2:]]
    # alter_sys: the trainer is __main__ as under `python -m`, so what it looks up by module name
    # (the annotations its options are built from) resolves in its own globals
    runpy.run_module("train_ref.train", run_name="__main__", alter_sys=True)


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if argv[:1] == ["--bind-worker"]:
        bind_worker()  # exits (the trainer's own exit)
    p = argparse.ArgumentParser(prog="train_ref.gpu_check", description=__doc__.split("\n")[0])
    p.add_argument("--workdir", type=Path, default=None, help="default: a temporary directory")
    p.add_argument("--keep", action="store_true", help="keep the run directories")
    args = p.parse_args(argv)
    import torch

    if not torch.cuda.is_available():
        print(SKIP_LINE)
        return 0
    n = torch.cuda.device_count()
    gpu = f"{n}x {torch.cuda.get_device_name(0)}, torch {torch.__version__}"
    work = args.workdir or Path(tempfile.mkdtemp(prefix="gpu-check-"))
    work.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    results = run_checks(plan(n), work)
    print(table(results, gpu, time.monotonic() - t0))
    if not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    return exit_code(results)


if __name__ == "__main__":
    sys.exit(main())
