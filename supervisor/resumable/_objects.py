"""The state ``Resumable`` saves, as DCP and the per-rank file see it: a plain loop's objects
(``Objects``), another run's weights for ``--init-from`` (``Weights``), and the per-rank items
(``RankItems``).
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from supervisor.format.statediff import RANK_LOADERS, RANK_OWN
from supervisor.resumable._canonical_names import CanonicalNames
from supervisor.resumable._checkpointer import Saveable

__all__ = ["Objects", "RankItems", "Weights"]


class Objects(Stateful):
    """A plain loop's state as DCP saves it: ``model`` and ``optimizer`` through
    ``get_state_dict``/``set_state_dict`` (keyed by parameter names, so DCP reshards them), every
    other entry by its own ``state_dict``/``load_state_dict`` (scheduler, scaler, sampler), and the
    step. The model's canonical names are worked out once (``CanonicalNames``: the model is wrapped
    before ``Resumable`` gets it): the memory tier takes this state dict every step."""

    def __init__(self, objects: Mapping[str, Any]):
        if "model" not in objects or "optimizer" not in objects:
            raise ValueError("Resumable: the objects to save need a 'model' and an 'optimizer'")
        self.model: torch.nn.Module = objects["model"]
        self.optimizer: torch.optim.Optimizer = objects["optimizer"]
        self.others = {k: v for k, v in objects.items() if k not in ("model", "optimizer")}
        self.step = 0
        self.names = CanonicalNames(self.model)

    def saving(self, rank: int, world_size: int) -> Stateful:
        return self

    def keep(self, name: str, obj: Stateful) -> None:
        """Save ``obj`` as ``name`` too (a loader's position)."""
        if name in self.others or name in ("model", "optimizer", "step"):
            raise ValueError(f"Resumable: '{name}' is saved already; give the loader another name=")
        self.others[name] = obj

    def saves(self, obj: object) -> bool:
        return any(v is obj for v in self.others.values())

    def state_dict(self) -> dict[str, Any]:
        with self.names.kept():
            model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {
            "model": model_sd,
            "optim": optim_sd,
            **{k: v.state_dict() for k, v in self.others.items()},
            "step": self.step,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        with self.names.kept():
            set_state_dict(
                self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
            )
        for k, v in self.others.items():
            v.load_state_dict(sd[k])
        self.step = int(sd["step"])


class Weights(Stateful):
    """The model (and with ``optimizer`` its optimizer) of a Saveable, as a DCP load of another
    run's checkpoint reads them: everything else of that run stays behind."""

    def __init__(self, state: Saveable, optimizer: bool):
        self.model: torch.nn.Module = getattr(state, "model")  # noqa: B009 - both Saveables have one
        self.optimizer: torch.optim.Optimizer | None = getattr(state, "optimizer") if optimizer else None  # noqa: B009

    def state_dict(self) -> dict[str, Any]:
        if self.optimizer is None:
            return {"model": get_model_state_dict(self.model)}
        model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        return {"model": model_sd, "optim": optim_sd}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if self.optimizer is None:
            set_model_state_dict(self.model, sd["model"])
        else:
            set_state_dict(
                self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
            )


class RankItems(Stateful):
    """The trainer's items in the per-rank file once a loader keeps its position per rank (a
    stream's, a ``StatefulDataLoader``'s): the user's ``rank_items`` and those positions."""

    def __init__(self, own: Stateful | None):
        self.own = own
        self.loaders: dict[str, Stateful] = {}

    def state_dict(self) -> dict[str, Any]:
        return {
            RANK_OWN: self.own.state_dict() if self.own is not None else {},
            RANK_LOADERS: {k: v.state_dict() for k, v in self.loaders.items()},
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        if self.own is not None:
            self.own.load_state_dict(sd[RANK_OWN])
        for k, v in self.loaders.items():
            v.load_state_dict(sd[RANK_LOADERS][k])
