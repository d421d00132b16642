"""Accelerate: a ``Resumable`` for a loop whose model, optimizer and scheduler went through
``accelerator.prepare``.

    model, opt, sched = accelerator.prepare(model, opt, sched)    # not the DataLoader
    r = AccelerateResumable(accelerator, root, {"model": model, "optimizer": opt, "scheduler": sched}, steps=...)
    loader = r.loader(dataset, batch_size=..., shuffle=True, num_workers=...)
    step = r.resume()                                    # was: accelerator.load_state(dir)
    ...  accelerator.backward(loss); opt.step(); sched.step(); opt.zero_grad()
    if r.step_end(step, {"loss": loss.item()}): break    # was: accelerator.save_state(dir) every N steps
    r.finish()

``accelerator.prepare`` wraps what it is given (DDP around the model, ``AcceleratedOptimizer``,
``AcceleratedScheduler``): the checkpoint holds the objects inside, by their parameter names, so
it loads into a run prepared again on any world size (DCP reshards), and into a plain loop. The
DataLoader stays out of ``prepare``: Accelerate's shard of it restarts its epoch at a resume (or
skips batches through ``skip_first_batches``, drawing the workers' seeds anew), where
``r.loader`` resumes mid-epoch with the same samples, noise and order. ``save_state`` and
``load_state`` are not needed; they still work beside it for exports, unverified.
"""

from __future__ import annotations

from collections.abc import Mapping
from pathlib import Path
from typing import Any

from accelerate import Accelerator
from accelerate.optimizer import AcceleratedOptimizer
from accelerate.scheduler import AcceleratedScheduler

from supervisor.resumable._resumable import Resumable

__all__ = ["AccelerateResumable"]


class AccelerateResumable(Resumable):
    """A ``Resumable`` over objects prepared by ``accelerator``: each saved as what Accelerate
    wraps (``accelerator.unwrap_model``, the optimizer and scheduler inside theirs). Every other
    argument as ``Resumable``'s; build it after ``accelerator.prepare`` (the process group is up)."""

    def __init__(self, accelerator: Accelerator, root: str | Path, objects: Mapping[str, Any], **kwargs: Any):
        super().__init__(root, {k: _unwrapped(accelerator, v) for k, v in objects.items()}, **kwargs)


def _unwrapped(accelerator: Accelerator, obj: Any) -> Any:
    obj = inside(obj)
    return accelerator.unwrap_model(obj) if hasattr(obj, "parameters") else obj


def inside(obj: Any) -> Any:
    """The optimizer or scheduler inside Accelerate's wrapper of it (anything else as it is): the
    object whose ``state_dict`` a checkpoint saves, and whose ``step`` the staging wait hooks."""
    if isinstance(obj, AcceleratedOptimizer):
        return obj.optimizer
    if isinstance(obj, AcceleratedScheduler):
        return obj.scheduler
    return obj
