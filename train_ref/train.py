"""Reference trainer: wiring of the building blocks. Args -> build -> resume -> loop -> save.

    torchrun --nproc-per-node=N -m train_ref.train --ckpt-root DIR --steps S --save-every K --seed X
        [--parallel ddp|fsdp] [--async-save|--sync-save] [--keep K] [--num-workers W]
        [--config tiny|bench] [--allow-config-change] [--allow-data-change] [--corpus FILE]
        [--log-samples] [--verify quick|deep]
        [--remote URL [--remote-endpoint URL] [--remote-keep N] [--milestone-every M]
         [--remote-busy skip|wait] [--remote-wait-timeout S] [--remote-flush-timeout S]
         [--remote-attempts N]]

Outputs in the checkpoint root: ``metrics.jsonl`` (rank 0, appended across launches),
``final.json`` (at the end), ``samples/rank_NNNNN.jsonl`` (with --log-samples), heartbeats and
checkpoints in the store's layout; with --remote also ``supervisor/remote.json`` and
``supervisor/events.remote.jsonl``. Exit codes: supervisor.exitcodes.Exit (0 done, 65 mismatch,
75 preempted and checkpointed, 78 bad config, 1 remote unreachable with nothing local to resume).
"""

from __future__ import annotations

import argparse
import atexit
import contextlib
import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import IO, NoReturn

import numpy as np
import torch
import torch.distributed as dist

from supervisor import store
from supervisor.exitcodes import Exit
from supervisor.fsutil import atomic_write_json
from supervisor.heartbeat import ENV_LAUNCH_ID, HeartbeatWriter, Phase
from supervisor.layout import FINAL, METRICS, RunDir
from supervisor.tiers.remote import RemoteUnavailable
from supervisor.tiers.uploader import Uploader
from train_ref import tiering
from train_ref.checkpointer import Checkpointer, CommitInfo
from train_ref.config import CONFIGS, TrainConfig, config_hash, get_config
from train_ref.data import Corpus, WindowDataset, collate
from train_ref.hold import HoldGate
from train_ref.model import GPT
from train_ref.parallel import MODES, full_tensor, parallelize, params_digest, sync_grads
from train_ref.sampler import ResumableBatchSampler
from train_ref.schedule import WarmupCosine
from train_ref.signals import PreemptionFlag, register_stack_dump
from train_ref.state import ABLATABLE, RANK_ITEMS, TrainState, seed_rank_rng

log = logging.getLogger("train_ref")

SAMPLES = "samples"
# Resume sanity: warn when the first losses after a resume leave the saved window's range by more
# than this many standard deviations (plus a small absolute slack for flat windows).
LOSS_JUMP_SIGMAS = 4.0
LOSS_JUMP_SLACK = 0.05
SANITY_STEPS = 3
# Installed before the model is built, so a preemption notice during startup is not lost.
PREEMPTION = PreemptionFlag()
# The remote is unreachable and nothing local is valid: a transient failure, relaunch later.
RETRY_LATER = Exit(1)
VERIFY = ("quick", "deep")


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="train_ref.train", description=__doc__.split("\n")[0])
    p.add_argument("--ckpt-root", required=True, type=Path)
    p.add_argument("--steps", required=True, type=int, help="stop after this many steps in total")
    p.add_argument("--save-every", type=int, default=50)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--parallel", choices=MODES, default="fsdp")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--async-save", dest="async_save", action="store_true", default=True)
    g.add_argument("--sync-save", dest="async_save", action="store_false")
    p.add_argument("--keep", type=int, default=store.DEFAULT_KEEP)
    p.add_argument("--num-workers", type=int, default=0)
    p.add_argument("--config", choices=sorted(CONFIGS), default="tiny")
    p.add_argument("--corpus", default=None, help="UTF-8 text file (default: the built-in corpus)")
    p.add_argument("--allow-config-change", action="store_true")
    p.add_argument("--allow-data-change", action="store_true")
    p.add_argument("--log-samples", action="store_true", help="per-rank sample ids of every step")
    p.add_argument("--amp", choices=("off", "fp16", "bf16"), default="off", help="autocast (CUDA only)")
    p.add_argument(
        "--verify",
        choices=VERIFY,
        default="deep",
        help="checkpoint check before loading: deep = every file's checksum (DCP has none), quick = sizes",
    )
    tiering.add_args(p)
    # Test-only: skip restoring these state items on resume, to prove each one matters.
    p.add_argument("--ablate", action="append", default=[], choices=ABLATABLE, help=argparse.SUPPRESS)
    return p.parse_args(argv)


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device


def init_distributed() -> Dist:
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    if torch.cuda.is_available():
        torch.cuda.set_device(local)
        dist.init_process_group("cpu:gloo,cuda:nccl")
        device = torch.device("cuda", local)
    else:
        dist.init_process_group("gloo")
        device = torch.device("cpu")
    return Dist(rank, local, dist.get_world_size(), device)


class Trainer:
    """One launch of the training job on this rank."""

    def __init__(
        self,
        args: argparse.Namespace,
        d: Dist,
        cfg: TrainConfig,
        corpus: Corpus,
        hb: HeartbeatWriter,
        info: CommitInfo,
        launch: str,
        uploader: Uploader | None = None,
    ):
        self.args, self.d, self.cfg, self.corpus, self.hb, self.launch = args, d, cfg, corpus, hb, launch
        self.root: Path = args.ckpt_root
        self.uploader = uploader  # rank 0 with --remote only

        tok = corpus.tokenizer
        torch.manual_seed(args.seed)  # identical initial parameters on every rank
        self.model = parallelize(GPT(cfg.model).to(d.device), args.parallel, d.device)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
        )
        self.schedule = WarmupCosine.of(cfg)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule)
        self.amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.amp)
        # Loss scaling only matters for fp16 on CUDA; elsewhere the scaler is disabled (its state is
        # still saved and restored, as an empty dict) so the code path is the same everywhere.
        self.scaler = torch.amp.GradScaler(
            d.device.type, enabled=d.device.type == "cuda" and args.amp == "fp16"
        )
        self.dataset = WindowDataset(
            tok.encode(corpus.text), cfg.model.block_size, cfg.crop_max, cfg.mask_prob, tok.mask_id, args.seed
        )
        self.sampler = ResumableBatchSampler(
            len(self.dataset), cfg.global_batch, d.rank, d.world_size, args.seed
        )
        self.state = TrainState(
            self.model, self.optimizer, self.scheduler, self.scaler, self.sampler, cfg.loss_window
        )
        self.ckpt = Checkpointer(
            self.root,
            async_save=args.async_save,
            keep=args.keep,
            info=info,
            on_commit=uploader.submit if uploader else None,
        )
        self.samples_file = None
        self.hold = HoldGate.from_env(d.rank, launch)  # test-only; None unless TRAIN_REF_HOLD_FILE is set

    # ------------------------------------------------------------ exits

    def exit(self, code: Exit, phase: Phase) -> NoReturn:
        code = deliberate_exit(self.hb, self.d.rank, self.state.step, phase, code)
        dist.destroy_process_group()
        sys.exit(code)

    # ------------------------------------------------------------ resume

    def resume(self, choice: Choice) -> None:
        """Load the chosen checkpoint everywhere: shards (resharded), then per-rank RNG streams."""
        seed_rank_rng(self.args.seed, self.d.rank, 0)
        if choice.ckpt is None:
            log.info("no checkpoint in %s: starting at step 0", self.root)
            return
        self.hb.beat(0, Phase.LOAD)
        ckpt = choice.ckpt
        ablate = frozenset(self.args.ablate)
        self.state.ablate = ablate
        restored = self.ckpt.load(
            ckpt, self.state, saved_world_size=choice.world_size, skip=ablate & frozenset(RANK_ITEMS)
        )
        self.state.ablate = frozenset()
        if not restored:
            seed_rank_rng(self.args.seed, self.d.rank, self.state.step)
            if self.d.rank == 0:
                log.warning(
                    "world size %d -> %d: per-rank RNG derived from (seed, rank, step %d)",
                    choice.world_size,
                    self.d.world_size,
                    self.state.step,
                )
        if ablate and self.d.rank == 0:
            log.warning("TEST-ONLY: resume skipped restoring %s", ", ".join(sorted(ablate)))
        self.check_schedule(ckpt.name)

    def check_schedule(self, name: str) -> None:
        step = self.state.step
        lr = self.optimizer.param_groups[0]["lr"]
        want = self.cfg.lr * self.schedule(step)
        if self.d.rank != 0:
            return
        log.info("resumed from %s, next step %d", name, step + 1)
        if self.scheduler.last_epoch != step or not math.isclose(lr, want, rel_tol=1e-9):
            log.warning(
                "resume sanity: LR %.6g (scheduler at step %d) but the schedule says %.6g at step %d",
                lr,
                self.scheduler.last_epoch,
                want,
                step,
            )

    def check_losses(self, first: list[float]) -> None:
        window = list(self.state.losses)[: -len(first) or None]
        if self.d.rank != 0 or len(window) < 2:
            return
        mean = sum(window) / len(window)
        std = math.sqrt(sum((x - mean) ** 2 for x in window) / (len(window) - 1))
        limit = LOSS_JUMP_SIGMAS * std + LOSS_JUMP_SLACK
        worst = max(first, key=lambda x: abs(x - mean))
        if abs(worst - mean) > limit:
            log.warning(
                "resume sanity: loss %.4f after resume vs saved window mean %.4f (std %.4f, limit ±%.4f)",
                worst,
                mean,
                std,
                limit,
            )
        else:
            log.info(
                "resume sanity: first losses %s within ±%.4f of the saved window mean %.4f",
                ", ".join(f"{x:.4f}" for x in first),
                limit,
                mean,
            )

    # ------------------------------------------------------------ loop

    def loader(self) -> torch.utils.data.DataLoader:
        # Its own seeded generator: without it, iter() draws from the global torch RNG and the
        # resumed run diverges at once (torch-cpu.md).
        return torch.utils.data.DataLoader(
            self.dataset,
            batch_sampler=self.sampler,
            num_workers=self.args.num_workers,
            collate_fn=collate,
            generator=torch.Generator().manual_seed(self.args.seed),
        )

    def perturb(self, x: torch.Tensor, y: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Main-process randomness standing in for user code that draws from python ``random``
        (variable sequence length) and numpy (random token noise); both must be restored."""
        n = random.randint(self.cfg.trunc_min, self.cfg.model.block_size)
        x, y = x[:, :n].clone(), y[:, :n]
        noise = np.random.random_sample(tuple(x.shape)) < self.cfg.noise_prob
        tokens = np.random.randint(0, self.corpus.tokenizer.mask_id, size=tuple(x.shape))
        x[torch.from_numpy(noise)] = torch.from_numpy(tokens)[torch.from_numpy(noise)]
        return x, y

    def train_step(self, x: torch.Tensor, y: torch.Tensor) -> tuple[float, float, float]:
        x, y = self.perturb(x, y)
        x, y = x.to(self.d.device), y.to(self.d.device)
        self.model.train()
        with torch.autocast(self.d.device.type, dtype=self.amp_dtype, enabled=self.amp_dtype is not None):
            loss = self.model(x, y)
        self.scaler.scale(loss).backward()
        sync_grads(self.model, self.args.parallel)
        self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.ckpt.before_optimizer_step()
        self.scaler.step(self.optimizer)
        self.scaler.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        mean_loss = loss.detach().float().clone()
        dist.all_reduce(mean_loss)
        return float(mean_loss) / self.d.world_size, float(full_tensor(norm)), lr

    def run(self) -> None:
        """Train to --steps; the logs are closed on every way out (the exit skips teardown)."""
        with contextlib.ExitStack() as files:
            metrics = files.enter_context(open(self.root / METRICS, "a")) if self.d.rank == 0 else None
            if self.args.log_samples:
                (self.root / SAMPLES).mkdir(exist_ok=True)
                name = self.root / SAMPLES / f"rank_{self.d.rank:05d}.jsonl"
                self.samples_file = files.enter_context(open(name, "a"))
            self.loop(metrics)

    def loop(self, metrics: IO[str] | None) -> None:
        args, st = self.args, self.state
        start = st.step
        rank0 = self.d.rank == 0
        batches = iter(self.loader())
        first_losses: list[float] = []
        last_dt = 0.0
        self.hb.beat(st.step, Phase.TRAIN, force=True)
        while st.step < args.steps:
            t0 = time.perf_counter()
            x, y, ids = next(batches)
            loss, norm, lr = self.train_step(x, y)
            self.sampler.advance()
            st.step += 1
            st.losses.append(loss)
            last_dt = time.perf_counter() - t0
            if metrics:
                metrics.write(
                    json.dumps(
                        {
                            "step": st.step,
                            "loss": loss,
                            "lr": lr,
                            "grad_norm": norm,
                            "step_time": round(last_dt, 6),
                            "restart_count": self.hb.restart_count,
                            "launch": self.launch,
                        }
                    )
                    + "\n"
                )
                metrics.flush()
            if self.samples_file:
                self.samples_file.write(
                    json.dumps({"launch": self.launch, "step": st.step, "ids": ids}) + "\n"
                )
                self.samples_file.flush()
            if start > 0 and len(first_losses) < SANITY_STEPS:
                first_losses.append(loss)
                if len(first_losses) == min(SANITY_STEPS, args.steps - start):
                    self.check_losses(first_losses)
            self.hb.beat(st.step, Phase.TRAIN, last_step_s=last_dt)
            if self.ckpt.step_boundary(PREEMPTION.set):
                PREEMPTION.ignore_further()
                if st.step < args.steps:
                    self.preempted()
                if rank0:
                    log.warning("preemption signal at the last step %d: finishing normally", st.step)
            if st.step % args.save_every == 0 and st.step < args.steps:
                self.save(blocking=False)
            if self.hold is not None:
                hold_if_asked(self.hold, st.step, lambda: self.hb.beat(st.step, Phase.TRAIN))
        if st.step > start:
            self.save(blocking=True)  # the final save (commits any in-flight one first)
        self.ckpt.close()

    def save(self, blocking: bool) -> None:
        self.hb.beat(self.state.step, Phase.SAVE)
        meta = {
            "config": self.cfg.name,
            "launch": self.launch,
            "sampler": self.sampler.state_dict(),
            "loss": self.state.losses[-1] if self.state.losses else None,
        }
        self.ckpt.save(self.state, meta, blocking=blocking)
        self.hb.beat(self.state.step, Phase.TRAIN)

    def preempted(self) -> NoReturn:
        """Asked to stop: finish any in-flight save, save this step synchronously, exit REQUEUE."""
        if self.d.rank == 0:
            log.warning(
                "preemption signal: checkpointing step %d, then exit %d", self.state.step, Exit.REQUEUE
            )
        self.save(blocking=True)
        self.ckpt.close()
        self.close_uploader(min(self.args.remote_flush_timeout, tiering.PREEMPT_FLUSH_TIMEOUT_S))
        self.exit(Exit.REQUEUE, Phase.SAVE)

    def close_uploader(self, timeout_s: float) -> None:
        if self.uploader is not None:
            step = self.state.step
            tiering.close_uploader(self.uploader, timeout_s, lambda: self.hb.beat(step, Phase.SAVE))
            self.uploader = None

    def finish(self) -> None:
        digest = params_digest(self.model)
        if self.d.rank == 0:
            atomic_write_json(
                self.root / FINAL,
                {
                    "step": self.state.step,
                    "world_size": self.d.world_size,
                    "params_sha256": digest,
                    "parallel": self.args.parallel,
                    "config": self.cfg.name,
                    "loss": self.state.losses[-1] if self.state.losses else None,
                },
            )
            log.info("done at step %d, params_sha256 %s", self.state.step, digest)


@dataclass(frozen=True)
class Choice:
    """Rank 0's decision, broadcast to every rank: which checkpoint, or why none may be used."""

    launch: str
    ckpt: Path | None = None
    world_size: int = 0
    error: str = ""
    code: Exit = Exit.OK


def choose_checkpoint(args: argparse.Namespace, expect: store.Expectation, cfg: TrainConfig) -> Choice:
    """Rank 0 asks the store (walk-back, quarantine, compatibility; with --remote first across both
    tiers) and tells every rank."""
    box: list[Choice | None] = [None]
    if dist.get_rank() == 0:
        launch = os.environ.get(ENV_LAUNCH_ID) or f"{time.strftime('%Y%m%dT%H%M%S')}-{os.getpid()}"
        box[0] = _choose(args, expect, cfg, launch)
    dist.broadcast_object_list(box, src=0)
    assert box[0] is not None
    return box[0]


def _choose(args: argparse.Namespace, expect: store.Expectation, cfg: TrainConfig, launch: str) -> Choice:
    root, deep = args.ckpt_root, args.verify == "deep"
    try:
        if args.remote:
            # Verified there (local deep check, or the download's checksums): the pick below
            # only reads the choice back.
            tiering.resume(root, args, expect, deep)
            deep = False
        v = store.pick(root, deep=deep, expect=expect).chosen
    except store.MismatchError as e:
        return Choice(launch, error=str(e), code=Exit.MISMATCH)
    except store.StoreError as e:
        return Choice(launch, error=str(e), code=Exit.BAD_CONFIG)
    except RemoteUnavailable as e:
        return Choice(launch, error=str(e), code=RETRY_LATER)
    if v is None or v.manifest is None:
        return Choice(launch)
    problem = batch_problem(v.ref.name, v.manifest.parallelism.get("global_batch"), cfg)
    if problem:
        return Choice(launch, error=problem, code=Exit.BAD_CONFIG)
    return Choice(launch, v.ref.path, v.manifest.world_size)


def hold_if_asked(gate: HoldGate, step: int, beat: Callable[[], object]) -> bool:
    """Test-only gate (train_ref/hold.py): every rank holds after ``step`` when any rank's view of
    the hold file says so (one may have read it just before it was written). Agreed by an
    all-reduce, so no rank goes on into a collective with a held peer. Returns whether it held."""
    want = torch.tensor([int(gate.wanted(step))], dtype=torch.int64)
    dist.all_reduce(want, op=dist.ReduceOp.MAX)
    if want.item():
        gate.hold(step, beat)
    return bool(want.item())


def batch_problem(name: str, saved: int | None, cfg: TrainConfig) -> str:
    """The sampler's position counts global batches, so it cannot map onto another global batch
    size (not even with --allow-config-change): one line naming both values, or ''."""
    if saved is None or int(saved) == cfg.global_batch:
        return ""
    return (
        f"{name} was saved with global batch {saved} but config '{cfg.name}' has global batch "
        f"{cfg.global_batch}; the data position cannot carry over: use a config with global batch "
        f"{saved}, or start a new --ckpt-root"
    )


def deliberate_exit(
    hb: HeartbeatWriter, rank: int, step: int, phase: Phase, code: Exit, msg: str = ""
) -> int:
    """Record a deliberate exit code in the heartbeat (torchrun itself reports only 1)."""
    if msg and rank == 0:
        print(f"train_ref: {msg}", file=sys.stderr, flush=True)
    hb.beat(step, phase, exit_code=int(code))
    return int(code)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    d = init_distributed()
    logging.basicConfig(
        level=logging.INFO if d.rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {d.rank}] %(levelname)s %(message)s",
    )
    args.ckpt_root.mkdir(parents=True, exist_ok=True)
    hb = HeartbeatWriter(args.ckpt_root, rank=d.rank, local_rank=d.local_rank, world_size=d.world_size)
    hb.beat(0, Phase.STARTUP)
    stacks = register_stack_dump(RunDir.of(args.ckpt_root).stack_dump(d.rank))  # open until exit
    PREEMPTION.install()
    corpus = Corpus.load(args.corpus)
    cfg = get_config(args.config, corpus.tokenizer.vocab_size)
    info = CommitInfo(
        model_config_hash=config_hash(cfg),
        data_fingerprint=corpus.fingerprint,
        parallelism={"mode": args.parallel, "world_size": d.world_size, "global_batch": cfg.global_batch},
    )
    problem = config_problem(args, cfg, d.world_size)
    choice = Choice("", error=f"bad config: {problem}", code=Exit.BAD_CONFIG) if problem else None
    choice = choice or choose_checkpoint(
        args,
        store.Expectation(
            model_config_hash=info.model_config_hash,
            data_fingerprint=info.data_fingerprint,
            allow_config_change=args.allow_config_change,
            allow_data_change=args.allow_data_change,
        ),
        cfg,
    )
    if choice.error:
        why = "cannot resume" if choice.code == RETRY_LATER else "refused"
        code = deliberate_exit(hb, d.rank, 0, Phase.STARTUP, choice.code, f"{why}: {choice.error}")
        dist.destroy_process_group()
        return code
    uploader = tiering.start_uploader(args.ckpt_root, args) if args.remote and d.rank == 0 else None
    trainer = Trainer(args, d, cfg, corpus, hb, info, choice.launch, uploader)
    trainer.resume(choice)
    trainer.run()
    trainer.finish()
    trainer.close_uploader(args.remote_flush_timeout)
    code = deliberate_exit(hb, d.rank, trainer.state.step, Phase.DONE, Exit.OK)
    dist.destroy_process_group()
    stacks.close()
    return code


def config_problem(args: argparse.Namespace, cfg: TrainConfig, world: int) -> str:
    """One line saying what is wrong with the command line, or ''."""
    if cfg.global_batch % world:
        return f"global batch {cfg.global_batch} of config '{cfg.name}' does not split over {world} ranks"
    if args.save_every < 1 or args.steps < 0:
        return "--save-every must be >= 1 and --steps >= 0"
    if args.keep < store.MIN_KEEP:
        return f"--keep {args.keep}: keep at least {store.MIN_KEEP} so a corrupt newest has a fallback"
    if args.amp != "off" and not torch.cuda.is_available():
        return f"--amp {args.amp} needs CUDA"
    if args.remote:
        try:
            tiering.policy(args)
        except store.StoreError as e:
            return str(e)
    return ""


def exit_now(code: int) -> NoReturn:
    """Exit once everything is committed, closed and flushed, without the interpreter's teardown:
    the C++ destructors of the gloo groups spent ~2 s there on every rank (measured: 2.0 s from the
    last atexit handler to the process exit, 0.03 s this way). atexit handlers still run."""
    atexit._run_exitfuncs()
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


if __name__ == "__main__":
    try:
        rc = main()
    except SystemExit as e:  # a deliberate exit (preemption: 75) raised from inside the loop
        if not isinstance(e.code, int):
            raise
        rc = e.code
    exit_now(rc)
