"""A model's canonical parameter names, worked out once: torch's state-dict API without its walks.

torch 2.13's ``get_state_dict`` and ``set_state_dict`` find each parameter's canonical name (the
name without DDP's, FSDP's or torch.compile's wrappers: ``state_dict._get_fqns``) by walking the
module tree from the root, three times per parameter per call. For the bench model (197
parameters) that is 591 walks and most of a ``get_state_dict``: 10.9 ms, 4.2 ms with the walks'
answers kept. An async save's call pays it inside the training loop, where it was two thirds of the
call (bench/checkpoint.py: the call against 0.05 of a sync save).

An answer depends only on how the model is wrapped, which the trainer does before it builds its
``TrainState`` and never after; so ``CanonicalNames`` keeps the answers for its own model while the
model lives (torch's own code still copies each answer "as _get_fqns is lru_cached": it was
cached in earlier releases). A walk for any other model goes through as it would.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.distributed.checkpoint.state_dict as torch_state_dict


class CanonicalNames:
    """The answers of torch's ``_get_fqns`` for ``model``, kept while ``kept`` is entered."""

    def __init__(self, model: torch.nn.Module) -> None:
        self.model = model
        self._known: dict[tuple[Any, ...], frozenset[str]] = {}

    @contextmanager
    def kept(self) -> Iterator[None]:
        """torch's state-dict calls inside the block find ``model``'s names here after the first
        walk of each. Not for a block that runs alongside another thread's state-dict calls. A
        torch without ``_get_fqns`` (the trainer accepts torch>=2.9; tested on 2.13) walks as
        it would."""
        real = getattr(torch_state_dict, "_get_fqns", None)
        if real is None:
            yield
            return

        def fqns(model: torch.nn.Module, name: str, *args: Any, **kwargs: Any) -> set[str]:
            if model is not self.model:
                return real(model, name, *args, **kwargs)
            key = (name, args, tuple(sorted(kwargs.items())))
            known = self._known.get(key)
            if known is None:
                known = self._known[key] = frozenset(real(model, name, *args, **kwargs))
            return set(known)  # a set of its own: torch's callers may add to it

        torch_state_dict._get_fqns = fqns
        try:
            yield
        finally:
            torch_state_dict._get_fqns = real
