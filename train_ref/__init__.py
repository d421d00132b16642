"""Resumable training: ``from train_ref import Resumable`` (the class: train_ref/resumable.py).

Imported lazily (PEP 562): torch-free modules of this package (``hold``, used by the fake trainer
and the watchdog's tests) must not pull torch in through the package."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from train_ref.resumable import Identity, Objects, RemoteOptions, Resumable, ResumeOptions, Saves

__all__ = ["Identity", "Objects", "RemoteOptions", "Resumable", "ResumeOptions", "Saves"]


def __getattr__(name: str) -> Any:
    if name in __all__:
        from train_ref import resumable

        return getattr(resumable, name)
    raise AttributeError(f"module 'train_ref' has no attribute {name!r}")
