"""Reference trainer: wiring of the building blocks. Args -> build -> resume -> loop -> save.

    torchrun --nproc-per-node=N -m train_ref.train --ckpt-root DIR --steps S --save-every K --seed X
        [--parallel ddp|fsdp] [--async-save|--sync-save] [--keep K] [--num-workers W]
        [--config tiny|bench|wide] [--ema-decay D] [--allow-config-change] [--allow-data-change] [--corpus FILE]
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

import train_ref.needs_torch  # noqa: F401  (first: without torch, one line naming the extra)

# isort: split
import argparse
import atexit
import contextlib
import gc
import json
import logging
import math
import os
import random
import sys
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any, NoReturn

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.elastic.multiprocessing.errors import record

from supervisor import options, store
from supervisor.format.appender import LineAppender
from supervisor.format.atomic import restrict_umask
from supervisor.format.exitcodes import Exit
from supervisor.format.layout import RunDir
from supervisor.options import nested, option
from supervisor.redact import redact_log_handlers
from supervisor.resumable import (
    DeviceError,
    Identity,
    Resumable,
    ResumableBatchSampler,
    ResumeOptions,
    Saves,
    TrainState,
    device_index,
    full_tensor,
    install_signals,
    refuse_start,
)
from supervisor.signing import SigningKeyError, add_signing_key_arg, load_key
from supervisor.store.retention_policy import add_retention_args, policy_from_args
from train_ref.config import CONFIGS, TrainConfig, get_config
from train_ref.data import Corpus, WindowDataset, collate
from train_ref.ema import EMA
from train_ref.hold import HoldGate
from train_ref.model import GPT
from train_ref.parallel import MODES, build, sync_grads
from train_ref.schedule import WarmupCosine

log = logging.getLogger("train_ref")


def _override(what: str) -> Any:
    return option(f"{what} (default: the config's)", None)


@dataclass(frozen=True)
class TrainerOptions:
    """The reference trainer's command line, typed: each option field is one flag, its default and
    its help (``supervisor.options``); ``saves`` and ``resume`` are the Resumable's own options."""

    ckpt_root: Path = option("the run directory: checkpoints, heartbeats, metrics.jsonl, final.json")
    steps: int = option("stop after this many steps in total")
    seed: int = option("data order, initial weights and every RNG", 0)
    parallel: str = option("how the model is spread over the ranks", "fsdp", choices=MODES)
    config: str = option(
        "the model and optimizer config (train_ref/config.py)", "tiny", choices=sorted(CONFIGS)
    )
    lr: float | None = _override("peak learning rate")
    weight_decay: float | None = _override("AdamW weight decay")
    decay_steps: int | None = _override("cosine horizon")
    corpus: str | None = option("UTF-8 text file (default: the built-in corpus)", None)
    num_workers: int = option("DataLoader worker processes", 2)
    log_samples: bool = option("per-rank sample ids of every step", False)
    amp: str = option(
        "autocast; fp16 adds loss scaling (GradScaler), on CUDA and on CPU alike",
        "off",
        choices=("off", "fp16", "bf16"),
    )
    deterministic: bool = option(
        "torch.use_deterministic_algorithms(True): needed for a bit-exact resume on GPUs", False
    )
    ema_decay: float = option(
        "keep a moving average of the parameters (the shadow model) with this decay, e.g. 0.999; "
        "saved and resumed with the rest, its digest in final.json (0: none)",
        0.0,
        check=lambda v: "" if v == 0 or 0 < v < 1 else "must be between 0 and 1 (0: none)",
    )
    saves: Saves = nested(Saves)
    resume: ResumeOptions = nested(ResumeOptions)
    signing_key: str | None = None  # --signing-key's source (supervisor.signing's flag, shared)
    # Test-only: skip restoring these state items on resume, to prove each one matters.
    ablate: tuple[str, ...] = option(
        "test-only: skip restoring ITEM on resume", (), choices=TrainState.ABLATABLE, hidden=True
    )


def parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="train_ref.train", description=__doc__.split("\n")[0])
    options.add_options(p, TrainerOptions)
    add_retention_args(p, milestones=False)  # --keep, --keep-every-s, --keep-best, --keep-all
    add_signing_key_arg(p)
    return p


def parse_args(argv: list[str] | None) -> TrainerOptions:
    p = parser()
    args = p.parse_args(argv)
    try:  # a policy out of range is a usage error, one line (exit 2)
        retention = policy_from_args(args, milestones=False)
    except store.StoreError as e:
        p.error(str(e))
    kept = {"keep": retention.keep, "retention": retention} if retention else {}  # else Saves' defaults
    saves = options.build(Saves, args, **kept)
    opts: TrainerOptions = options.build(TrainerOptions, args, saves=saves, signing_key=args.signing_key)
    return opts


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
            os.environ.get("CUDA_VISIBLE_DEVICES", ""),
        )
        torch.cuda.set_device(index)
    except DeviceError as e:  # every rank of the node sees the same counts: all refuse alike
        index, problem = 0, str(e)
    init_group("cpu:gloo,cuda:nccl", alone)
    return Dist(rank, local, dist.get_world_size(), torch.device("cuda", index), problem)


def identity(opts: TrainerOptions, cfg: TrainConfig, corpus: Corpus) -> Identity:
    """Everything that changes this trainer's trajectory: the whole config (model shape,
    optimizer, schedule length, augmentation), the precision mode and the seed (data order,
    initial weights, every RNG); the data by its fingerprint."""
    fields = {"amp": opts.amp, **_flat(asdict(cfg))}
    if opts.ema_decay:  # only when kept: runs without one keep their config hash
        fields["ema_decay"] = opts.ema_decay
    return Identity(
        fields,
        data=corpus.fingerprint,
        seed=opts.seed,
        name=cfg.name,
        global_batch=cfg.global_batch,
        mode=opts.parallel,
        changeable=CHANGEABLE,
    )


def _flat(d: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
    out: dict[str, Any] = {}
    for k, v in d.items():
        out.update(_flat(v, f"{prefix}{k}.") if isinstance(v, Mapping) else {f"{prefix}{k}": v})
    return out


# What --allow-config-change applies on resume (Reference.apply_config_change; everything the
# loop reads from the config each step is applied by building with the new config). Anything
# else (model shape, global batch, loss window, precision, seed) is refused, naming the field.
CHANGEABLE = frozenset(
    {"name", "lr", "min_lr", "warmup_steps", "decay_steps", "weight_decay", "grad_clip"}
    | {"crop_max", "mask_prob", "trunc_min", "noise_prob", "model.dropout"}
)


class Reference(Resumable):
    """The reference trainer's Resumable: its sampler position in every manifest, its EMA's digest
    in final.json, and the config changes it can apply."""

    def __init__(self, trainer: Trainer, opts: TrainerOptions):
        self.trainer = trainer
        super().__init__(
            opts.ckpt_root,
            trainer.state,
            steps=opts.steps,
            identity=identity(opts, trainer.cfg, trainer.corpus),
            saves=opts.saves,
            options=opts.resume,
            loss_window=trainer.cfg.loss_window,
        )

    def save_meta(self) -> dict[str, Any]:
        return {**super().save_meta(), "sampler": self.trainer.sampler.state_dict()}

    def final_fields(self) -> dict[str, Any]:
        ema = self.trainer.ema
        return {"ema_sha256": ema.digest(self.digest_tracker(ema.shadow.values()))} if ema else {}

    def apply_config_change(self, diff: Mapping[str, tuple[Any, Any]]) -> None:
        """The load restored the saved LR, weight decay and schedule (optimizer param groups, the
        scheduler's base LRs and its schedule object): put this run's config in their place."""
        t = self.trainer
        cfg, step = t.cfg, t.state.step
        t.schedule.__dict__.update(asdict(WarmupCosine.of(cfg)))  # the object LambdaLR calls
        t.scheduler.base_lrs = [cfg.lr] * len(t.optimizer.param_groups)
        for g in t.optimizer.param_groups:
            g.update(initial_lr=cfg.lr, lr=cfg.lr * t.schedule(step), weight_decay=cfg.weight_decay)
        t.scheduler._last_lr = [g["lr"] for g in t.optimizer.param_groups]


class Trainer:
    """One launch of the training job on this rank: the model, its data and the loop; the
    checkpoint lifecycle is ``self.r`` (a Resumable)."""

    def __init__(self, opts: TrainerOptions, d: Dist, cfg: TrainConfig, corpus: Corpus):
        self.opts, self.d, self.cfg, self.corpus = opts, d, cfg, corpus
        tok = corpus.tokenizer
        # Identical initial parameters on every rank; fsdp never builds the whole model (parallel.py).
        self.model = build(lambda: GPT(cfg.model), opts.parallel, d.device, opts.seed)
        self.optimizer = torch.optim.AdamW(
            self.model.parameters(), lr=cfg.lr, betas=(0.9, 0.95), weight_decay=cfg.weight_decay
        )
        self.schedule = WarmupCosine.of(cfg)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(self.optimizer, self.schedule)
        self.amp_dtype = {"fp16": torch.float16, "bf16": torch.bfloat16}.get(opts.amp)
        # Loss scaling for fp16, on CUDA and CPU alike (one code path, tested on CPU); disabled, its
        # state is an empty dict, saved and restored all the same.
        self.scaler = torch.amp.GradScaler(d.device.type, enabled=opts.amp == "fp16")
        self.dataset = WindowDataset(
            tok.encode(corpus.text), cfg.model.block_size, cfg.crop_max, cfg.mask_prob, tok.mask_id, opts.seed
        )
        self.sampler = ResumableBatchSampler(
            len(self.dataset), cfg.global_batch, d.rank, d.world_size, opts.seed
        )
        self.state = TrainState(
            self.model,
            self.optimizer,
            self.scheduler,
            self.scaler,
            self.sampler,
            replicated=opts.parallel == "ddp",
        )
        self.ema = EMA(self.model, opts.ema_decay) if opts.ema_decay else None
        self.state.ema = self.ema
        self.r = Reference(self, opts)
        # The sampler is among the saved objects; prepare hands batches over advancing it, with a
        # private generator and workers that leave SIGTERM and the notice to this rank.
        self.loader = self.r.prepare(
            torch.utils.data.DataLoader(
                self.dataset, batch_sampler=self.sampler, num_workers=opts.num_workers, collate_fn=collate
            )
        )
        self.samples_file: LineAppender | None = None
        self.hold: HoldGate | None = None  # test-only: main sets it from TRAIN_REF_HOLD_FILE

    # ------------------------------------------------------------ resume sanity

    def check_schedule(self) -> None:
        step = self.state.step
        lr = self.optimizer.param_groups[0]["lr"]
        want = self.cfg.lr * self.schedule(step)
        if self.d.rank != 0 or step == 0:
            return
        if self.scheduler.last_epoch != step or not math.isclose(lr, want, rel_tol=1e-9):
            log.warning(
                "resume sanity: LR %.6g (scheduler at step %d) but the schedule says %.6g at step %d",
                lr,
                self.scheduler.last_epoch,
                want,
                step,
            )

    # ------------------------------------------------------------ loop

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
        if self.opts.parallel == "ddp":  # fsdp's collectives run inside forward and backward
            self.r.compute_done()  # this rank's own work ends here: the straggler verdict's measure
        sync_grads(self.model, self.opts.parallel)
        self.scaler.unscale_(self.optimizer)
        norm = torch.nn.utils.clip_grad_norm_(self.model.parameters(), self.cfg.grad_clip)
        lr = self.optimizer.param_groups[0]["lr"]
        self.scaler.step(self.optimizer)  # the Resumable's pre-step hook waits for staging first
        self.scaler.update()
        if self.ema:
            self.ema.update()
        self.scheduler.step()
        self.optimizer.zero_grad(set_to_none=True)
        # The loss all-reduce also carries the step boundary's flags (preemption, save in flight).
        mean_loss = self.r.reduce(loss.detach().float())  # carries the step's control flags
        return float(mean_loss) / self.d.world_size, float(full_tensor(norm)), lr

    def run(self) -> None:
        """Train to --steps; the sample log is closed on every way out (the exit skips teardown)."""
        with contextlib.ExitStack() as files:
            if self.opts.log_samples:
                samples = RunDir.of(self.opts.ckpt_root).samples(self.d.rank)
                self.samples_file = LineAppender(samples, self.opts.ckpt_root)
                files.callback(self.samples_file.close)
            self.loop()

    def loop(self) -> None:
        opts, st = self.opts, self.state
        batches = iter(self.loader)
        while st.step < opts.steps:
            t0 = time.perf_counter()
            x, y, ids = next(batches)
            loss, norm, lr = self.train_step(x, y)
            step = st.step + 1
            if self.samples_file:
                self.samples_file.append(json.dumps({"launch": self.r.launch, "step": step, "ids": ids}))
            step_s = round(time.perf_counter() - t0, 6)
            self.r.step_end(step, {"loss": loss, "lr": lr, "grad_norm": norm, "step_time": step_s})
            if self.hold is not None:
                hold_if_asked(
                    self.hold, st.step, self.r.beat, lambda: self.r.preemption_noticed, self.r.memory_every
                )


def hold_if_asked(
    gate: HoldGate, step: int, beat: Callable[[], object], noticed: Callable[[], bool], memory_every: int = 0
) -> bool:
    """Test-only gate (train_ref/hold.py): every rank holds after ``step`` when any rank's view of
    the hold file says so (one may have read it just before it was written). Agreed by an
    all-reduce, so no rank goes on into a collective with a held peer. Returns whether it held."""
    want = torch.tensor([int(gate.wanted(step))], dtype=torch.int64)
    dist.all_reduce(want, op=dist.ReduceOp.MAX)
    if want.item():
        gate.hold(step, beat, noticed, memory_every)
    return bool(want.item())


@record  # the exception that ends a rank goes to $TORCHELASTIC_ERROR_FILE: the watchdog's root cause
def main(argv: list[str] | None = None) -> int:
    opts = parse_args(argv)
    if opts.deterministic:  # before CUDA starts: cuBLAS reads its workspace setting once
        os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
        torch.use_deterministic_algorithms(True)
    signal_problem = install_signals()  # before the model is built: a notice is never lost
    d = init_distributed()
    logging.basicConfig(
        level=logging.INFO if d.rank == 0 else logging.WARNING,
        format=f"%(asctime)s [rank {d.rank}] %(levelname)s %(message)s",
    )
    redact_log_handlers()  # a --remote URL or a backend's error may carry credentials
    restrict_umask()  # nothing this run creates is world-writable (docs/security.md)
    corpus = Corpus.load(opts.corpus)
    cfg = with_overrides(get_config(opts.config, corpus.tokenizer.vocab_size), opts)
    key, key_problem = signing_key(opts)
    opts = replace(opts, resume=replace(opts.resume, sign_key=key))
    problem = d.problem or config_problem(opts, cfg, d.world_size) or key_problem or signal_problem
    if problem:  # before anything is built on it (a batch that does not split, no device...)
        return refuse_start(opts.ckpt_root, f"refused: bad config: {problem}")
    trainer = Trainer(opts, d, cfg, corpus)
    resume(trainer)
    if trainer.ema and trainer.state.step == 0:  # nothing restored it: a new run (--init-from too)
        trainer.ema.reset()
    trainer.hold = HoldGate.from_env(d.rank, trainer.r.launch)  # None unless TRAIN_REF_HOLD_FILE is set
    trainer.check_schedule()
    # What is built by now (imports, model, loaded state: ~300,000 objects in the bench config)
    # lives for the whole run. Out of the collector's view, a full collection in the loop takes
    # ~0 s instead of 0.07-0.14 s, wherever it lands (a step, an async save's call).
    gc.freeze()
    trainer.run()
    trainer.r.finish()
    dist.destroy_process_group()
    return int(Exit.OK)


def resume(trainer: Trainer) -> None:
    """``r.resume()``; with the test-only ``--ablate ITEM``, that item is skipped by the load, to
    prove it matters (``TrainState.ablate``), and restored to the saves right after."""
    ablate = frozenset(trainer.opts.ablate)
    trainer.state.ablate = ablate
    try:
        trainer.r.resume()
    finally:
        trainer.state.ablate = frozenset()
    if ablate and trainer.d.rank == 0 and trainer.state.step:
        log.warning("TEST-ONLY: resume skipped restoring %s", ", ".join(sorted(ablate)))


def signing_key(opts: TrainerOptions) -> tuple[bytes | None, str]:
    """--signing-key's key (None without it), and a one-line problem when it cannot be used."""
    if not opts.signing_key:
        return None, ""
    try:
        return load_key(opts.signing_key, outside=(opts.ckpt_root, opts.resume.remote.url)), ""
    except SigningKeyError as e:
        return None, str(e)


def with_overrides(cfg: TrainConfig, opts: TrainerOptions) -> TrainConfig:
    """The named config with --lr, --weight-decay, --decay-steps where given (part of the identity:
    a resume with other values is refused unless --allow-config-change, which applies them)."""
    given: dict[str, Any] = {
        "lr": opts.lr,
        "weight_decay": opts.weight_decay,
        "decay_steps": opts.decay_steps,
    }
    return replace(cfg, **{k: v for k, v in given.items() if v is not None})


def config_problem(opts: TrainerOptions, cfg: TrainConfig, world: int) -> str:
    """One line saying what is wrong with the command line, or ''."""
    if cfg.global_batch % world:
        return f"global batch {cfg.global_batch} of config '{cfg.name}' does not split over {world} ranks"
    if opts.steps < 0:
        return "--steps must be >= 0"
    load_step = opts.resume.load_step
    if load_step is not None and load_step < 0:
        return f"--load-step {load_step}: give a committed step (ckpt list shows them)"
    return opts.saves.problem()  # and the remote tier's options: Resumable refuses those (78) at resume


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
        rc = main() or 0  # @record returns None for a SystemExit(0)
    except SystemExit as e:  # a deliberate exit (preemption: 75) raised from inside the loop
        if not isinstance(e.code, int):
            raise
        rc = e.code
    exit_now(rc)
