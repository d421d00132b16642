"""Reference trainer: wiring of the building blocks. Args -> build -> resume -> loop -> save.

    torchrun --nproc-per-node=N -m train_ref.train --ckpt-root DIR --steps S --save-every K --seed X
        [--parallel ddp|fsdp] [--async-save|--sync-save] [--keep K] [--num-workers W]
        [--config tiny|bench] [--allow-config-change] [--allow-data-change] [--corpus FILE]
        [--log-samples] [--verify quick|deep] [--io-retry S] [--allow-fresh-start]
        [--max-failed-saves N] [--max-unsaved-s S] [--signing-key env:NAME|FILE]
        [--remote URL [--remote-endpoint URL] [--remote-keep N] [--milestone-every M]
         [--remote-busy skip|wait] [--remote-wait-timeout S] [--remote-flush-timeout S]
         [--remote-attempts N]]

Outputs in the checkpoint root: ``metrics.jsonl`` (rank 0, appended across launches),
``final.json`` (at the end), ``samples/rank_NNNNN.jsonl`` (with --log-samples), heartbeats and
checkpoints in the store's layout; with --remote also ``supervisor/remote.json`` and
``supervisor/events.remote.jsonl``. Exit codes: supervisor.format.exitcodes.Exit (0 done, 65 mismatch,
66 no usable checkpoint, 74 storage (unreadable at resume, or failed saves past the save policy),
75 preempted and checkpointed, 77 a checkpoint that would have run code refused, 78 bad config,
1 remote unreachable with nothing local to resume).
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
from typing import NoReturn

import numpy as np
import torch
import torch.distributed as dist

from supervisor import store
from supervisor.format.atomic import atomic_write_json, restrict_umask
from supervisor.format.exitcodes import Exit
from supervisor.format.heartbeat import HeartbeatWriter, Phase, stack_dump_path
from supervisor.format.layout import FINAL, RunDir
from supervisor.format.manifest import CheckpointInfo
from supervisor.format.metrics import MetricsRecord
from supervisor.ioerrors import backoff_s, retry_transient
from supervisor.redact import redact_log_handlers
from supervisor.safepickle import UnsafePickle
from supervisor.signing import SigningKeyError, add_signing_key_arg, load_key
from supervisor.tiers.uploader import Uploader
from train_ref import tiering
from train_ref.appender import LineAppender
from train_ref.checkpointer import Checkpointer, CommitInfo, SaveOutcome, StorageGaveUp
from train_ref.config import CONFIGS, TrainConfig, config_hash, get_config
from train_ref.data import Corpus, WindowDataset, collate
from train_ref.devices import ENV_VISIBLE, DeviceError, device_index
from train_ref.drill_faults import DrillFaults, When
from train_ref.hold import HoldGate
from train_ref.model import GPT
from train_ref.parallel import MODES, build, full_tensor, params_digest, sync_grads
from train_ref.resume import RETRY_LATER, Choice, choose_checkpoint
from train_ref.safe_load import refusal_line
from train_ref.sampler import ResumableBatchSampler
from train_ref.save_policy import DEFAULT_MAX_FAILED_SAVES, SavePolicy
from train_ref.schedule import WarmupCosine
from train_ref.signals import PreemptionFlag, register_stack_dump
from train_ref.state import ABLATABLE, RANK_ITEMS, TrainState, seed_rank_rng

log = logging.getLogger("train_ref")

# Resume sanity: warn when the first losses after a resume leave the saved window's range by more
# than this many standard deviations (plus a small absolute slack for flat windows).
LOSS_JUMP_SIGMAS = 4.0
LOSS_JUMP_SLACK = 0.05
SANITY_STEPS = 3
# Installed before the model is built, so a preemption notice during startup is not lost.
PREEMPTION = PreemptionFlag()
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
    p.add_argument(
        "--allow-fresh-start",
        action="store_true",
        help="start from step 0 when no checkpoint is usable even though some are quarantined",
    )
    p.add_argument(
        "--io-retry",
        type=float,
        default=store.IO_RETRY_S,
        metavar="SECONDS",
        help="retry checkpoints that cannot be read this long at resume, then exit 74",
    )
    p.add_argument(
        "--max-failed-saves",
        type=int,
        default=DEFAULT_MAX_FAILED_SAVES,
        metavar="N",
        help="exit 74 after N failed saves in a row (a full disk, EIO...); until then training goes on",
    )
    p.add_argument(
        "--max-unsaved-s",
        type=float,
        default=0.0,
        metavar="SECONDS",
        help="also exit 74 when a save fails and nothing was committed for this long (0: no limit)",
    )
    p.add_argument("--log-samples", action="store_true", help="per-rank sample ids of every step")
    p.add_argument(
        "--amp",
        choices=("off", "fp16", "bf16"),
        default="off",
        help="autocast; fp16 adds loss scaling (GradScaler), on CUDA and on CPU alike",
    )
    p.add_argument(
        "--deterministic",
        action="store_true",
        help="torch.use_deterministic_algorithms(True): needed for a bit-exact resume on GPUs",
    )
    p.add_argument(
        "--verify",
        choices=VERIFY,
        default="deep",
        help="checkpoint check before loading: deep = every file's checksum (DCP has none), quick = sizes",
    )
    tiering.add_args(p)
    add_signing_key_arg(p)
    p.set_defaults(sign_key=None)  # the key itself, loaded by main (signing_key)
    # Test-only: skip restoring these state items on resume, to prove each one matters.
    p.add_argument("--ablate", action="append", default=[], choices=ABLATABLE, help=argparse.SUPPRESS)
    return p.parse_args(argv)


@dataclass(frozen=True)
class Dist:
    rank: int
    local_rank: int
    world_size: int
    device: torch.device
    problem: str = ""  # a device setup this rank cannot train with (one line; exit 78)


def init_group(backend: str, alone: bool) -> None:
    """torchrun's group (env://), or, started without torchrun, a group of one on an in-memory
    store (rather than env://'s traceback about MASTER_ADDR)."""
    if alone:
        dist.init_process_group(backend, store=dist.HashStore(), rank=0, world_size=1)
    else:
        dist.init_process_group(backend)


def init_distributed() -> Dist:
    """The process group, and this rank's device: ``devices.device_index`` (LOCAL_RANK when every
    local rank has its own visible GPU, device 0 when the process sees exactly one)."""
    rank, local = int(os.environ.get("RANK", "0")), int(os.environ.get("LOCAL_RANK", "0"))
    alone = "WORLD_SIZE" not in os.environ
    if alone:
        print(
            "train_ref: not started by torchrun: running as one process (world size 1); for N ranks: "
            "torchrun --nproc-per-node=N -m train_ref.train ...",
            file=sys.stderr,
            flush=True,
        )
    if not torch.cuda.is_available():
        init_group("gloo", alone)
        return Dist(rank, local, dist.get_world_size(), torch.device("cpu"))
    problem = ""
    try:
        index = device_index(
            local,
            int(os.environ.get("LOCAL_WORLD_SIZE", "1")),
            torch.cuda.device_count(),
            os.environ.get(ENV_VISIBLE, ""),
        )
        torch.cuda.set_device(index)
    except DeviceError as e:  # every rank of the node sees the same counts: all refuse alike
        index, problem = 0, str(e)
    init_group("cpu:gloo,cuda:nccl", alone)
    return Dist(rank, local, dist.get_world_size(), torch.device("cuda", index), problem)


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
        # Identical initial parameters on every rank; fsdp never builds the whole model (parallel.py).
        self.model = build(lambda: GPT(cfg.model), args.parallel, d.device, args.seed)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
        )
        self.schedule = WarmupCosine.of(cfg)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule)
        self.amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(args.amp)
        # Loss scaling for fp16, on CUDA and CPU alike (one code path, tested on CPU); disabled, its
        # state is an empty dict, saved and restored all the same.
        self.scaler = torch.amp.GradScaler(d.device.type, enabled=args.amp == "fp16")
        self.dataset = WindowDataset(
            tok.encode(corpus.text), cfg.model.block_size, cfg.crop_max, cfg.mask_prob, tok.mask_id, args.seed
        )
        self.sampler = ResumableBatchSampler(
            len(self.dataset), cfg.global_batch, d.rank, d.world_size, args.seed
        )
        self.state = TrainState(
            self.model,
            self.optimizer,
            self.scheduler,
            self.scaler,
            self.sampler,
            cfg.loss_window,
            replicated=args.parallel == "ddp",
        )
        self.ckpt = Checkpointer(
            self.root,
            async_save=args.async_save,
            keep=args.keep,
            info=info,
            hb=hb,
            policy=save_policy(args),
            on_commit=uploader.submit if uploader else None,
        )
        self.samples_file: LineAppender | None = None
        self.drill = DrillFaults.from_env(d.rank, launch)  # inert unless `supervisor drill` set it
        self.hold = HoldGate.from_env(d.rank, launch)  # test-only; None unless TRAIN_REF_HOLD_FILE is set

    # ------------------------------------------------------------ exits

    def exit(self, code: Exit, phase: Phase, msg: str = "") -> NoReturn:
        rc = deliberate_exit(self.hb, self.d.rank, self.state.step, phase, code, msg)
        dist.destroy_process_group()
        sys.exit(rc)

    # ------------------------------------------------------------ resume

    def resume(self, choice: Choice) -> None:
        """Load the chosen checkpoint everywhere: shards (resharded), then per-rank RNG streams."""
        seed_rank_rng(self.args.seed, self.d.rank, 0)
        if choice.ckpt is None:
            log.info("no checkpoint in %s: starting at step 0", self.root)
            return
        ckpt = choice.ckpt
        ablate = frozenset(self.args.ablate)
        self.state.ablate = ablate
        restored = self.ckpt.load(
            ckpt,
            self.state,
            saved_world_size=choice.world_size,
            skip=ablate & frozenset(RANK_ITEMS),
            progress=self.hb.tracker(Phase.LOAD, choice.manifest.step if choice.manifest else 0),
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

    def loader(self) -> torch.utils.data.DataLoader[tuple[torch.Tensor, torch.Tensor, int]]:
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
        # The loss all-reduce also carries the step boundary's flags (preemption, save in flight).
        mean_loss = self.ckpt.reduce_with_control(loss.detach().float(), PREEMPTION.set)
        return float(mean_loss) / self.d.world_size, float(full_tensor(norm)), lr

    def run(self) -> None:
        """Train to --steps; the logs are closed on every way out (the exit skips teardown)."""
        with contextlib.ExitStack() as files:
            run = RunDir.of(self.root)
            metrics = LineAppender(run.metrics) if self.d.rank == 0 else None
            if metrics:
                files.callback(metrics.close)
            if self.args.log_samples:
                samples = run.samples(self.d.rank)
                samples.parent.mkdir(exist_ok=True)
                self.samples_file = LineAppender(samples)
                files.callback(self.samples_file.close)
            self.loop(metrics)

    def loop(self, metrics: LineAppender | None) -> None:
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
                metrics.append(
                    MetricsRecord(
                        st.step, loss, lr, norm, round(last_dt, 6), self.hb.restart_count, self.launch
                    ).to_line()
                )
            if self.samples_file:
                self.samples_file.append(json.dumps({"launch": self.launch, "step": st.step, "ids": ids}))
            if start > 0 and len(first_losses) < SANITY_STEPS:
                first_losses.append(loss)
                if len(first_losses) == min(SANITY_STEPS, args.steps - start):
                    self.check_losses(first_losses)
            self.hb.beat(st.step, Phase.TRAIN, last_step_s=last_dt)
            self.drill.maybe_hang(st.step, When.STEP)
            if self.ckpt.step_boundary(PREEMPTION.set):
                PREEMPTION.ignore_further()
                if st.step < args.steps:
                    self.preempted()
                if rank0:
                    log.warning("preemption signal at the last step %d: finishing normally", st.step)
            if st.step % args.save_every == 0 and st.step < args.steps:
                self.save(blocking=False)
                self.drill.maybe_hang(st.step, When.SAVE)
            if self.hold is not None:
                hold_if_asked(self.hold, st.step, lambda: self.hb.beat(st.step, Phase.TRAIN))
        if st.step > start:
            self.final_save()
        self.ckpt.close()

    def final_save(self) -> None:
        """The end of training (commits any in-flight save first): retried with backoff while the
        save policy allows (it raises StorageGaveUp, exit 74, when it does not)."""
        rng = random.Random()  # not the global one: that belongs to the training loop
        while not (outcome := self.save_now()).committed:
            if self.d.rank == 0:  # the others wait for rank 0 in the next save's first exchange
                time.sleep(backoff_s(outcome.failures, rng))

    def save(self, blocking: bool) -> SaveOutcome | None:
        self.hb.beat(self.state.step, Phase.SAVE)
        meta = {
            "config": self.cfg.name,
            "launch": self.launch,
            "sampler": self.sampler.state_dict(),
            "loss": self.state.losses[-1] if self.state.losses else None,
        }
        outcome = self.ckpt.save(self.state, meta, blocking=blocking)
        self.hb.beat(self.state.step, Phase.TRAIN)
        return outcome

    def save_now(self) -> SaveOutcome:
        """A synchronous save, whose outcome always comes back."""
        outcome = self.save(blocking=True)
        assert outcome is not None, "a blocking save returns its outcome"
        return outcome

    def preempted(self) -> NoReturn:
        """Asked to stop: finish any in-flight save, save this step synchronously, exit REQUEUE."""
        if self.d.rank == 0:
            log.warning(
                "preemption signal: checkpointing step %d, then exit %d", self.state.step, Exit.REQUEUE
            )
        outcome = self.save_now()
        self.ckpt.close()
        self.close_uploader(min(self.args.remote_flush_timeout, tiering.PREEMPT_FLUSH_TIMEOUT_S))
        if not outcome.committed:  # requeued, it would resume from an older checkpoint anyway
            self.exit(
                Exit.STORAGE,
                Phase.SAVE,
                f"storage: the preemption checkpoint of step {self.state.step} failed ({outcome.error}); "
                f"nothing committed: the relaunch resumes from {outcome.latest or 'step 0'}; exit 74, retryable",
            )
        self.exit(Exit.REQUEUE, Phase.SAVE)

    def close_uploader(self, timeout_s: float) -> None:
        if self.uploader is not None:
            step = self.state.step
            tiering.close_uploader(self.uploader, timeout_s, lambda: self.hb.beat(step, Phase.SAVE))
            self.uploader = None

    def finish(self) -> None:
        """The final digest (phase DIGEST, progress in bytes hashed) and ``final.json``, which is
        retried on a storage error for --io-retry seconds: the checkpoint is committed by now, so
        a report that cannot be written is a warning, not a failed run."""
        n_bytes = sum(p.numel() * p.element_size() for p in self.model.parameters())
        digest = params_digest(self.model, self.hb.tracker(Phase.DIGEST, self.state.step, n_bytes))
        if self.d.rank != 0:
            return
        final = {
            "step": self.state.step,
            "world_size": self.d.world_size,
            "params_sha256": digest,
            "parallel": self.args.parallel,
            "config": self.cfg.name,
            "loss": self.state.losses[-1] if self.state.losses else None,
        }
        try:
            retry_transient(
                lambda: atomic_write_json(RunDir.of(self.root).final, final),
                deadline_s=self.args.io_retry,
                what=f"writing {FINAL}",
                fix=lambda _e: "the checkpoint is committed; the digest is in this log",
                on_retry=lambda msg: log.warning("%s", msg),
            )
        except store.StorageUnavailable as e:
            log.warning("%s", e)
        log.info("done at step %d, params_sha256 %s", self.state.step, digest)


def save_policy(args: argparse.Namespace) -> SavePolicy:
    return SavePolicy(max_failed_saves=args.max_failed_saves, max_unsaved_s=args.max_unsaved_s)


def hold_if_asked(gate: HoldGate, step: int, beat: Callable[[], object]) -> bool:
    """Test-only gate (train_ref/hold.py): every rank holds after ``step`` when any rank's view of
    the hold file says so (one may have read it just before it was written). Agreed by an
    all-reduce, so no rank goes on into a collective with a held peer. Returns whether it held."""
    want = torch.tensor([int(gate.wanted(step))], dtype=torch.int64)
    dist.all_reduce(want, op=dist.ReduceOp.MAX)
    if want.item():
        gate.hold(step, beat, lambda: PREEMPTION.set)
    return bool(want.item())


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
    if args.deterministic:  # before CUDA starts: cuBLAS reads its workspace setting once
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    d = init_distributed()
    logging.basicConfig(
        level=logging.INFO if d.rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {d.rank}] %(levelname)s %(message)s",
    )
    redact_log_handlers()  # a --remote URL or a backend's error may carry credentials
    restrict_umask()  # nothing this run creates is world-writable (docs/security.md)
    args.ckpt_root.mkdir(parents=True, exist_ok=True)
    hb = HeartbeatWriter(args.ckpt_root, rank=d.rank, local_rank=d.local_rank, world_size=d.world_size)
    hb.beat(0, Phase.STARTUP)
    stacks = register_stack_dump(stack_dump_path(args.ckpt_root, d.rank))  # open until exit
    signal_problem = PREEMPTION.install()
    corpus = Corpus.load(args.corpus)
    cfg = get_config(args.config, corpus.tokenizer.vocab_size)
    args.sign_key, key_problem = signing_key(args)
    run = CheckpointInfo(
        step=0,  # each commit sets its step and meta
        world_size=d.world_size,
        model_config_hash=config_hash(cfg),
        data_fingerprint=corpus.fingerprint,
        parallelism={"mode": args.parallel, "world_size": d.world_size, "global_batch": cfg.global_batch},
        torch_version=torch.__version__,
    )
    info = CommitInfo(run, sign_key=args.sign_key)
    problem = d.problem or config_problem(args, cfg, d.world_size) or key_problem or signal_problem
    choice = Choice("", error=f"bad config: {problem}", code=Exit.BAD_CONFIG) if problem else None
    choice = choice or choose_checkpoint(
        args,
        store.Expectation(
            model_config_hash=run.model_config_hash,
            data_fingerprint=run.data_fingerprint,
            allow_config_change=args.allow_config_change,
            allow_data_change=args.allow_data_change,
        ),
        cfg,
        hb,
    )
    if choice.error:
        why = "cannot resume" if choice.code in (RETRY_LATER, Exit.STORAGE) else "refused"
        code = deliberate_exit(hb, d.rank, 0, Phase.STARTUP, choice.code, f"{why}: {choice.error}")
        dist.destroy_process_group()
        return code
    uploader = tiering.start_uploader(args.ckpt_root, args) if args.remote and d.rank == 0 else None
    trainer = Trainer(args, d, cfg, corpus, hb, info, choice.launch, uploader)
    try:
        trainer.resume(choice)
    except UnsafePickle as e:  # nothing of it ran; every rank read the same file and refused it
        msg = refusal_line(e, args.ckpt_root, choice.ckpt)
        code = deliberate_exit(hb, d.rank, 0, Phase.LOAD, Exit.UNTRUSTED, msg)
        dist.destroy_process_group()
        return code
    except DeviceError as e:  # every rank's file has the same format: all refuse alike
        print(f"train_ref: cannot resume: {e}", file=sys.stderr, flush=True)
        code = deliberate_exit(hb, d.rank, 0, Phase.LOAD, Exit.BAD_CONFIG)
        dist.destroy_process_group()
        return code
    try:
        trainer.run()
    except StorageGaveUp as e:  # raised on every rank at the same save
        trainer.close_uploader(0.0)
        trainer.exit(Exit.STORAGE, Phase.SAVE, str(e))
    trainer.finish()
    trainer.close_uploader(args.remote_flush_timeout)
    code = deliberate_exit(hb, d.rank, trainer.state.step, Phase.DONE, Exit.OK)
    dist.destroy_process_group()
    stacks.close()
    return code


def signing_key(args: argparse.Namespace) -> tuple[bytes | None, str]:
    """--signing-key's key (None without it), and a one-line problem when it cannot be used."""
    if not args.signing_key:
        return None, ""
    try:
        return load_key(args.signing_key, outside=(args.ckpt_root, args.remote)), ""
    except SigningKeyError as e:
        return None, str(e)


def config_problem(args: argparse.Namespace, cfg: TrainConfig, world: int) -> str:
    """One line saying what is wrong with the command line, or ''."""
    if cfg.global_batch % world:
        return f"global batch {cfg.global_batch} of config '{cfg.name}' does not split over {world} ranks"
    if args.save_every < 1 or args.steps < 0:
        return "--save-every must be >= 1 and --steps >= 0"
    if args.keep < store.MIN_KEEP:
        return f"--keep {args.keep}: keep at least {store.MIN_KEEP} so a corrupt newest has a fallback"
    if problem := save_policy(args).problem():
        return problem
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
