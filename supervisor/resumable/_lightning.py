"""Lightning: a ``Callback`` that makes ``Trainer.fit`` resumable through a ``Resumable``.

    trainer = L.Trainer(max_steps=steps, use_distributed_sampler=False, enable_checkpointing=False,
                        callbacks=[ResumableCallback(root, steps=steps, identity=..., saves=...)])
    trainer.fit(model)

What it takes over from Lightning, and why:

- the checkpoint: the model, its optimizer and schedulers and Lightning's own loop counters
  (``fit_loop.state_dict()``: global step, epoch, batch in epoch) are saved through the store's
  commit protocol (DCP shards, manifest with checksums, atomic ``latest``) every
  ``Saves.every_steps`` optimizer steps, and loaded in ``on_fit_start``, where Lightning's own
  ``ckpt_path`` restore loads them, from the newest checkpoint that passes its checks (walking
  back past corrupt ones); per-rank RNG streams with them, so dropout after a resume is the same;
- the data position: the module's ``train_dataloader()`` is asked for once, in ``on_fit_start``,
  and made resumable (``Resumable.prepare``: its sampler's order and position, its workers' random
  streams); Lightning then iterates that loader. Lightning's ``DistributedSampler`` would replace
  it, hence ``use_distributed_sampler=False`` (checked: one line otherwise);
- the preemption notice: Lightning's SIGTERM handler broadcasts from inside the signal handler (a
  collective at an arbitrary point of the step) and stops without a checkpoint; from
  ``on_train_start`` on, SIGTERM/SIGUSR1 are the ``Resumable``'s again: the ranks agree on the
  notice at the next step end, save that step and exit 75 (requeue);
- the heartbeat: every optimizer step beats it (phase TRAIN), a validation run is a phase of its
  own (``validation``, held to ``validation_timeout_s``), the save and the load theirs.

Everything else stays Lightning's: the loop, precision, logging, gradient accumulation (a step
is an optimizer step). The Lightning internals this touches (``fit_loop._data_source``,
``_accelerator_connector``) are those of the pinned 2.6 series; tests/test_lightning.py runs the
real library.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import lightning.pytorch as pl
import torch

from supervisor.resumable._options import Identity, ResumeOptions, Saves
from supervisor.resumable._resumable import PREEMPTION, Resumable

__all__ = ["ResumableCallback"]


class _Loops:
    """Lightning's fit loop counters as a saved object: what its own checkpoint keeps under
    ``loops.fit_loop``, read at the same moment (``on_train_batch_end``, as ``ModelCheckpoint``'s
    ``every_n_train_steps``), so its restart logic sees what it expects. The loader's own entry
    (``combined_loader``) is left out: the ``Resumable`` saves the loader's position itself."""

    def __init__(self, trainer: pl.Trainer):
        self.trainer = trainer

    def state_dict(self) -> dict[str, Any]:
        sd = self.trainer.fit_loop.state_dict()
        own = sd.get("state_dict")
        if isinstance(own, dict):
            sd["state_dict"] = {k: v for k, v in own.items() if k != "combined_loader"}
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.trainer.fit_loop.load_state_dict(sd)


class ResumableCallback(pl.Callback):
    """Makes ``Trainer.fit`` resumable, bit-exactly on CPU: the callback owns a ``Resumable`` on
    every rank (docs/adopting.md#lightning). ``steps`` must be the Trainer's ``max_steps``;
    ``identity``, ``saves`` and ``options`` as for ``Resumable``. ``loss_key``: the entry of
    ``training_step``'s output logged as the step's loss (a tensor output is the loss itself).
    The ``Resumable`` is ``self.resumable`` from ``on_fit_start`` on (its ``reduce``, ``phase``)."""

    def __init__(
        self,
        root: str | Path,
        *,
        steps: int,
        identity: Identity | None = None,
        saves: Saves | None = None,
        options: ResumeOptions | None = None,
        validation_timeout_s: float = 0.0,
        loss_key: str = "loss",
    ):
        self.root = Path(root)
        self.steps = steps
        self.identity, self.saves, self.options = identity, saves, options
        self.validation_timeout_s = validation_timeout_s
        self.loss_key = loss_key
        self.resumable: Resumable | None = None
        self._phase = contextlib.ExitStack()  # the validation phase, while it runs
        self._progress: Callable[[], object] | None = None

    # ------------------------------------------------------------ before the loop

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        problem = _problem(trainer, self.steps)
        if problem:
            raise ValueError(f"ResumableCallback: {problem}")

    def on_fit_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The optimizers exist and the process group is up: build the ``Resumable``, make the
        train loader resumable, and load the newest valid checkpoint (Lightning's own restore
        would load its ``ckpt_path`` right after this hook)."""
        objects: dict[str, Any] = {"model": pl_module, "optimizer": _one_optimizer(trainer)}
        for i, cfg in enumerate(trainer.lr_scheduler_configs):
            objects[f"scheduler{i or ''}"] = cfg.scheduler
        objects["loops"] = _Loops(trainer)
        r = Resumable(
            self.root,
            objects,
            steps=self.steps,
            identity=self.identity,
            saves=self.saves,
            options=self.options,
        )
        self.resumable = r
        source = trainer.fit_loop._data_source
        source.instance = r.prepare(source.dataloader())  # Lightning iterates this one from now on
        source.name = "train_dataloader"
        r.resume()

    def on_train_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """Lightning installed its SIGTERM handler after ``on_fit_start``: the notice is the
        ``Resumable``'s again (the ranks agree on it at a step end, save, exit 75)."""
        PREEMPTION.install()

    # ------------------------------------------------------------ every step

    def on_train_batch_end(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, outputs: Any, batch: Any, batch_idx: int
    ) -> None:
        """After the optimizer step of this batch (not after an accumulation's inner batches):
        the ``Resumable``'s step end, with Lightning's global step as the step count."""
        if trainer.fit_loop.epoch_loop._should_accumulate():
            self._r.beat()
            return
        metrics: dict[str, float] = {}
        loss = outputs.get(self.loss_key) if isinstance(outputs, Mapping) else outputs
        if isinstance(loss, torch.Tensor):
            metrics["loss"] = float(loss.detach())
        if trainer.lr_scheduler_configs:
            metrics["lr"] = float(trainer.lr_scheduler_configs[0].scheduler.get_last_lr()[0])
        self._r.step_end(trainer.global_step, metrics)

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        if self.resumable is not None and trainer.state.fn == "fit":
            self._progress = self._phase.enter_context(
                self.resumable.phase("validation", self.validation_timeout_s)
            )

    def on_validation_batch_end(
        self,
        trainer: pl.Trainer,
        pl_module: pl.LightningModule,
        outputs: Any,
        batch: Any,
        batch_idx: int,
        dataloader_idx: int = 0,
    ) -> None:
        if self._progress is not None:
            self._progress()

    def on_validation_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._phase.close()
        self._progress = None

    # ------------------------------------------------------------ the end

    def on_train_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        """The final save, the digest and ``final.json``, the heartbeat's DONE."""
        self._r.finish()

    def on_exception(
        self, trainer: pl.Trainer, pl_module: pl.LightningModule, exception: BaseException
    ) -> None:
        self._phase.close()  # a deliberate exit (75, 74...) is already in the heartbeat
        self._progress = None

    @property
    def _r(self) -> Resumable:
        if self.resumable is None:
            raise RuntimeError("ResumableCallback: used outside Trainer.fit")
        return self.resumable


def _one_optimizer(trainer: pl.Trainer) -> torch.optim.Optimizer:
    if len(trainer.optimizers) != 1:
        raise ValueError(
            f"ResumableCallback: configure_optimizers returned {len(trainer.optimizers)} optimizers; "
            "one is supported (save the others as objects of a Resumable in your own loop)"
        )
    return trainer.optimizers[0]


def _problem(trainer: pl.Trainer, steps: int) -> str:
    """What in the Trainer's configuration keeps the callback from resuming exactly ('' if nothing)."""
    if trainer._accelerator_connector.use_distributed_sampler:
        return (
            "pass Trainer(use_distributed_sampler=False): the callback's loader shards and orders the "
            "data itself, and Lightning's DistributedSampler would replace it"
        )
    if trainer.max_steps != steps:
        return f"Trainer(max_steps={trainer.max_steps}) differs from steps={steps}: pass the same number"
    return ""
