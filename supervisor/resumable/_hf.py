"""Hugging Face Transformers: a ``TrainerCallback`` that makes ``Trainer.train`` resumable through a
``Resumable``.

    args = TrainingArguments(..., max_steps=steps, save_strategy="no")
    trainer = Trainer(model=model, args=args, train_dataset=data,
                      callbacks=[ResumableTrainerCallback(root, identity=..., saves=...)])
    trainer.train()                     # no resume_from_checkpoint: the callback resumes

What it takes over from the Trainer, and why:

- the checkpoint: the model, the optimizer and LR scheduler inside Accelerate's wrappers and the
  Trainer's counters (global step, FLOs, input tokens seen) are saved through the store's commit
  protocol every ``Saves.every_steps`` optimizer steps, and loaded in ``on_train_begin`` from the
  newest checkpoint that passes its checks (walking back past corrupt ones), per-rank RNG streams
  with them. The Trainer's own resume (``train(resume_from_checkpoint=...)``) is refused: it skips
  batches of its loader by count, with new worker seeds, and its checkpoint has no checksums;
- the data position: the Trainer builds its loader (Accelerate's shard of a ``RandomSampler``)
  before any callback runs and iterates that object. In ``on_train_begin`` the callback builds a
  ``Resumable.loader`` over the same dataset, batch size, collate and worker settings (its order,
  mid-epoch position and workers' random streams saved), and the Trainer's loader hands out its
  batches from then on: its type is given one whose ``iter()`` is the resumable loader's,
  epochs chained (the Trainer counts its epochs from 0 at every launch; the loader keeps the run's);
- the step's end: a step ends when the loop asks for the next batch, after the Trainer has logged,
  evaluated and saved it. An evaluation draws from the global RNG (its DataLoader's ``iter()``),
  so the checkpoint is taken after it, as the uninterrupted run goes on from there;
- the preemption notice: SIGTERM/SIGUSR1 are the ``Resumable``'s (the Trainer's own SIGTERM
  handler, ``enable_jit_checkpoint``, is refused): the ranks agree on it at the next step end,
  save that step and exit 75 (requeue);
- the heartbeat: every optimizer step and every accumulated micro-batch beat it (phase TRAIN), an
  evaluation is a phase of its own (``evaluation``, held to ``evaluation_timeout_s``).

Everything else stays the Trainer's: the loop, the loss, DDP, gradient clipping, logging. The loss
a step reports (``metrics.jsonl``, the resume's sanity step, the drill) is the model's own output
``loss`` (or the first element of a tuple), this rank's, averaged over an accumulation. The
Trainer internals this relies on (it iterates the object it hands ``on_train_begin`` as
``train_dataloader``; its epoch loop asks ``len()`` before and only ``iter()`` and ``set_epoch()``
after) are those of the pinned 5.x series; tests/test_adapters_drill.py runs the real library.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterator, Mapping
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, IterableDataset
from transformers import TrainerCallback, TrainerControl, TrainerState, TrainingArguments

from supervisor.resumable._accelerate import inside
from supervisor.resumable._loader import ResumableLoader, settings, shuffles
from supervisor.resumable._options import Identity, ResumeOptions, Saves
from supervisor.resumable._resumable import Resumable

__all__ = ["ResumableTrainerCallback"]


class _Counters:
    """The Trainer's own counters beside the step, as a saved object (what its ``trainer_state.json``
    keeps of them); the step itself is the ``Resumable``'s."""

    def __init__(self, state: TrainerState):
        self.state = state

    def state_dict(self) -> dict[str, Any]:
        return {
            "total_flos": float(self.state.total_flos),
            "num_input_tokens_seen": int(self.state.num_input_tokens_seen),
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.state.total_flos = float(sd["total_flos"])
        self.state.num_input_tokens_seen = int(sd["num_input_tokens_seen"])


class _Fed:
    """Put in front of the Trainer's loader's class once the callback feeds it: ``iter()`` is the
    callback's feed (everything else, ``len()`` included, stays the loader's)."""

    _feed: Callable[[], Iterator[Any]]

    def __iter__(self) -> Iterator[Any]:
        return self._feed()

    def set_epoch(self, epoch: int) -> None:
        """The Trainer's epoch counts from 0 at every launch; the resumable loader keeps the run's."""


# Accelerate's loader (``DataLoaderShard``) answers ``__class__`` with ``DataLoader``'s, through a
# property without a setter: its type is set through ``object``'s own descriptor, under the property.
_set_type = object.__dict__["__class__"].__set__


def _feed_through(loader: object, feed: Callable[[], Iterator[Any]]) -> None:
    """Make the Trainer's ``loader`` (the object its loop iterates) hand out ``feed``'s batches."""
    cls = type(loader)
    loader._feed = feed  # type: ignore[attr-defined]
    _set_type(loader, type(f"Fed{cls.__name__}", (_Fed, cls), {}))


class ResumableTrainerCallback(TrainerCallback):
    """Makes ``Trainer.train`` resumable, bit-exactly on CPU: the callback owns a ``Resumable`` on
    every rank (docs/adopting.md#hugging-face-trainer). The run ends at the Trainer's ``max_steps``
    (``state.max_steps``); ``identity``, ``saves`` and ``options`` as for ``Resumable``. The
    ``Resumable`` is ``self.resumable`` from ``on_train_begin`` on (its ``reduce``, ``phase``)."""

    def __init__(
        self,
        root: str | Path,
        *,
        identity: Identity | None = None,
        saves: Saves | None = None,
        options: ResumeOptions | None = None,
        evaluation_timeout_s: float = 0.0,
    ):
        self.root = Path(root)
        self.identity, self.saves, self.options = identity, saves, options
        self.evaluation_timeout_s = evaluation_timeout_s
        self.resumable: Resumable | None = None
        self._steps = 0
        self._pending: int | None = None  # the optimizer step done, whose end waits for the next batch
        self._losses: list[torch.Tensor] = []  # the model's losses of the step under way
        self._scheduler: Any = None
        self._hook: torch.utils.hooks.RemovableHandle | None = None
        self._phase = contextlib.ExitStack()  # the evaluation phase, while it runs
        self._progress: Callable[[], object] | None = None

    # ------------------------------------------------------------ before the loop

    def on_train_begin(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The model, optimizer, scheduler and loader exist and the process group is up: build the
        ``Resumable``, feed the Trainer's loader from a resumable one, load the newest valid
        checkpoint and set the Trainer's step to it."""
        loader: DataLoader[Any] = kwargs["train_dataloader"]
        problem = _problem(args, state, loader)
        if problem:
            raise ValueError(f"ResumableTrainerCallback: {problem}")
        model: torch.nn.Module = kwargs["model"]
        self._scheduler = inside(kwargs["lr_scheduler"])
        self._steps = state.max_steps
        objects = {
            "model": model,
            "optimizer": inside(kwargs["optimizer"]),
            "scheduler": self._scheduler,
            "trainer": _Counters(state),
        }
        r = Resumable(
            self.root,
            objects,
            steps=self._steps,
            identity=self.identity,
            saves=self.saves,
            options=self.options,
        )
        self.resumable = r
        data = r.loader(
            loader.dataset,
            state.train_batch_size,
            shuffle=bool(shuffles(_sampler(loader))),
            collate_fn=loader.collate_fn,
            **settings(loader),
        )
        _feed_through(loader, lambda: self._feed(data))
        state.global_step = r.resume()
        self._hook = model.register_forward_hook(self._heard)

    # ------------------------------------------------------------ every step

    def _heard(self, module: torch.nn.Module, inputs: Any, output: Any) -> None:
        """A forward of the model in training: its loss is the step's (the forward hook)."""
        loss = _loss_of(output) if module.training else None
        if loss is not None:
            self._losses.append(loss.detach())

    def on_substep_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._r.beat()  # a micro-batch of an accumulation: progress within the step

    def on_step_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """After the optimizer step: the step ends when the loop asks for the next batch (or the
        training ends), after the Trainer has logged, evaluated and saved it."""
        self._pending = state.global_step

    def _feed(self, loader: ResumableLoader) -> Iterator[Any]:
        """The batches the Trainer's loop takes: each after the previous step's end, epochs
        chained, until the run's last step."""
        batches = _epochs(loader)
        while not self._end_step():
            yield next(batches)

    def _end_step(self) -> bool:
        """The pending step's ``step_end`` (a save when due, the preemption notice: exit 75);
        returns whether the run is done."""
        r = self._r
        if self._pending is None:
            return r.state.step >= self._steps
        step, self._pending = self._pending, None
        metrics: dict[str, float] = {}
        if self._losses:
            metrics["loss"] = float(torch.stack(self._losses).mean())
            self._losses.clear()
        if hasattr(self._scheduler, "get_last_lr"):
            metrics["lr"] = float(self._scheduler.get_last_lr()[0])
        return r.step_end(step, metrics)

    def on_prediction_step(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """An evaluation batch during training: the evaluation is a phase of its own."""
        if self.resumable is None:
            return
        if self._progress is None:
            self._progress = self._phase.enter_context(
                self.resumable.phase("evaluation", self.evaluation_timeout_s)
            )
        self._progress()

    def on_evaluate(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        self._phase.close()
        self._progress = None

    # ------------------------------------------------------------ the end

    def on_train_end(
        self, args: TrainingArguments, state: TrainerState, control: TrainerControl, **kwargs: Any
    ) -> None:
        """The last step's end, the final save, the digest and ``final.json``, the heartbeat's DONE."""
        r = self._r
        self._end_step()
        if self._hook is not None:
            self._hook.remove()
            self._hook = None
        r.finish()
        self.resumable = None  # a later evaluate() or predict() is not the run's

    @property
    def _r(self) -> Resumable:
        if self.resumable is None:
            raise RuntimeError("ResumableTrainerCallback: used outside Trainer.train")
        return self.resumable


def _epochs(loader: ResumableLoader) -> Iterator[Any]:
    """The loader's batches, one epoch after another, without end."""
    while True:
        handed = False
        for batch in loader:
            handed = True
            yield batch
        if not handed:
            raise ValueError(
                "ResumableTrainerCallback: an epoch of the training data has no batch: the dataset is "
                "smaller than one global batch (per-device batch x world size)"
            )


def _loss_of(output: Any) -> torch.Tensor | None:
    """The loss in a model's output: its ``loss`` (a dict, a ``ModelOutput``), or the first element
    of a tuple, as the Trainer reads it."""
    loss = output.get("loss") if isinstance(output, Mapping) else None
    if loss is None and isinstance(output, tuple | list) and output:
        loss = output[0]
    return loss if isinstance(loss, torch.Tensor) and loss.dim() == 0 else None


def _sampler(loader: DataLoader[Any]) -> object:
    """The sampler under Accelerate's shard of the Trainer's loader (its ``BatchSamplerShard`` holds
    the ``BatchSampler`` that holds it)."""
    batches: Any = loader.batch_sampler
    while hasattr(batches, "batch_sampler"):
        batches = batches.batch_sampler
    return getattr(batches, "sampler", None)


def _problem(args: TrainingArguments, state: TrainerState, loader: DataLoader[Any]) -> str:
    """What in the Trainer's configuration keeps the callback from resuming exactly ('' if nothing)."""
    if state.global_step:
        return (
            f"the Trainer resumed from its own checkpoint (step {state.global_step}): call "
            "trainer.train() without resume_from_checkpoint; the callback resumes from its own"
        )
    if getattr(args, "enable_jit_checkpoint", False):
        return (
            "pass TrainingArguments(enable_jit_checkpoint=False): the callback takes the preemption "
            "notice itself (a checkpoint at the next step, then exit 75)"
        )
    if isinstance(loader.dataset, IterableDataset):
        return "an IterableDataset as train_dataset is not covered yet: give a map-style Dataset"
    if shuffles(_sampler(loader)) is None:
        return (
            f"train_sampling_strategy={args.train_sampling_strategy!r}: its sampler's position cannot be "
            "saved; use 'random' or 'sequential'"
        )
    accumulate = args.gradient_accumulation_steps
    if accumulate > 1 and len(loader) % accumulate:
        return (
            f"gradient_accumulation_steps={accumulate} does not divide the {len(loader)} batches of an "
            "epoch: the Trainer's short last accumulation would move after a resume; pick a divisor"
        )
    return ""
