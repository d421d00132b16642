"""The training state: what is saved, where, and how it comes back.

``TrainState`` (a DCP ``Stateful``) holds the state every rank shares or shards: model and optimizer
(through ``get_state_dict``/``set_state_dict``, so DCP reshards them), LR scheduler, grad scaler,
step, sampler position, the recent loss window and, where the trainer keeps one, the parameters'
moving average (``ema.py``). ``RankState`` is what differs per rank: python
``random``, numpy, torch CPU RNG and the CUDA RNG of this rank's own device (``devices.py``: keyed
by the device the rank uses, not by index over the visible devices); it goes to a small per-rank
file beside the shards, saved as plain tensors and numbers and loaded with
``torch.load(weights_only=True)`` (no arbitrary pickle).

``ablate`` (test-only) names items a resume deliberately skips, to prove each one matters.
"""

from __future__ import annotations

import io
import logging
import os
import random
from pathlib import Path
from typing import IO, Any, ClassVar

import numpy as np
import torch
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.checkpoint.stateful import Stateful

from supervisor.format import confined
from supervisor.format.statediff import NUMPY_RNG, PYTHON_RNG, RANK_USER_ITEMS, RNG_STREAMS, TORCH_RNG
from supervisor.resumable._canonical_names import CanonicalNames
from supervisor.resumable._devices import cuda_rng_record, cuda_rng_to_restore, current_cuda_device
from supervisor.resumable._progress_io import naming
from supervisor.resumable._resume import split_by_size
from supervisor.resumable._sampler import ResumableBatchSampler, mix_seed
from supervisor.resumable._workers import seed_all

SHARED_ITEMS = ("optimizer", "scheduler", "sampler", "ema")
RANK_ITEMS = RNG_STREAMS  # the per-rank file's entries (supervisor/format/statediff.py)
ABLATABLE = SHARED_ITEMS + RANK_ITEMS
USER_ITEMS = RANK_USER_ITEMS  # the per-rank file's entry for a trainer's own per-rank items

log = logging.getLogger(__name__)


class TrainState(Stateful):
    """A whole training job's shared state, ready for ``Resumable``: model, optimizer, scheduler,
    grad scaler, sampler, step, and where the trainer keeps one a moving average (``ema``)."""

    # Test-only: the items a resume may be told to skip (``ablate``), to prove each one matters.
    ABLATABLE: ClassVar[tuple[str, ...]] = ABLATABLE

    def __init__(
        self,
        model: torch.nn.Module,
        optimizer: torch.optim.Optimizer,
        scheduler: torch.optim.lr_scheduler.LRScheduler,
        scaler: torch.amp.GradScaler,
        sampler: ResumableBatchSampler,
        ablate: frozenset[str] = frozenset(),
        replicated: bool = False,
    ):
        """``replicated``: every rank holds the whole model and optimizer (ddp); a save then gives
        DCP only this rank's share of them (``saving``)."""
        self.model, self.optimizer, self.scheduler = model, optimizer, scheduler
        self.scaler, self.sampler = scaler, sampler
        self.step = 0  # steps completed
        self.ablate = ablate
        self.replicated = replicated
        self.ema: Stateful | None = None  # the parameters' moving average, where the trainer keeps one
        self.data: dict[str, Stateful] = {}  # loaders' positions (Resumable.loader/prepare), by name
        self.names = CanonicalNames(model)  # wrapped before it got here: its names stay

    def saving(self, rank: int, world_size: int) -> Stateful:
        """What this rank hands DCP to save. Replicated parameters and their optimizer state are
        split between the ranks (``replica_share``), so each is staged and written by one rank:
        DCP dedups replicated items only when it plans the writes, after an async save has
        already staged every rank's full copy (the whole model and optimizer per GPU, in pinned
        host memory). Loading always reads into the full state (``self``)."""
        if not self.replicated or world_size == 1:
            return self
        return _Share(self, rank, world_size)

    def keep(self, name: str, obj: Stateful) -> None:
        if name in self.data:
            raise ValueError(
                f"Resumable: a loader named '{name}' is saved already; give this one another name="
            )
        self.data[name] = obj

    def saves(self, obj: object) -> bool:
        return obj is self.sampler or any(v is obj for v in self.data.values())

    def state_dict(self) -> dict[str, Any]:
        with self.names.kept():
            if "optimizer" in self.ablate:
                model_sd, optim_sd = get_model_state_dict(self.model), None
            else:
                model_sd, optim_sd = get_state_dict(self.model, self.optimizer)
        sd: dict[str, Any] = {
            "model": model_sd,
            "optim": optim_sd,
            "scheduler": self.scheduler.state_dict(),
            "scaler": self.scaler.state_dict(),
            "sampler": self.sampler.state_dict(),
            "step": self.step,
            "ema": self.ema.state_dict() if self.ema else None,
            "data": {k: v.state_dict() for k, v in self.data.items()} or None,
        }
        return {k: v for k, v in sd.items() if v is not None and _item_of(k) not in self.ablate}

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        with self.names.kept():
            if "optim" in sd:
                set_state_dict(
                    self.model, self.optimizer, model_state_dict=sd["model"], optim_state_dict=sd["optim"]
                )
            else:
                set_model_state_dict(self.model, sd["model"])
        if "scheduler" in sd:
            self.scheduler.load_state_dict(sd["scheduler"])
        if sd["scaler"]:
            self.scaler.load_state_dict(sd["scaler"])
        if "sampler" in sd:
            self.sampler.load_state_dict(sd["sampler"])
        if self.ema and "ema" in sd:
            self.ema.load_state_dict(sd["ema"])
        for k, v in self.data.items():
            v.load_state_dict(sd["data"][k])
        self.step = int(sd["step"])


def _item_of(key: str) -> str:
    return {"optim": "optimizer"}.get(key, key)


def _nbytes(v: Any) -> int:
    return v.numel() * v.element_size() if isinstance(v, torch.Tensor) else 0


def replica_share(sd: dict[str, Any], rank: int, world_size: int) -> dict[str, Any]:
    """``sd`` (a TrainState dict of replicated model and optimizer) with only the parameters, and
    their optimizer state, that ``rank`` writes: parameters split by bytes (``split_by_size``, the
    same split on every rank, no message); the moving averages (``ema``) split the same way among
    themselves. The small items (scheduler, sampler, step, param groups...) stay on every rank;
    DCP keeps one copy of each."""
    model, optim = sd["model"], sd.get("optim")
    moments = optim["state"] if optim else {}
    sizes = {k: _nbytes(v) + sum(_nbytes(m) for m in moments.get(k, {}).values()) for k, v in model.items()}
    mine = set(split_by_size(sizes, world_size)[rank])
    out = dict(sd, model={k: v for k, v in model.items() if k in mine})
    if optim:
        out["optim"] = dict(optim, state={k: v for k, v in moments.items() if k in mine})
    if ema := sd.get("ema"):
        share = set(split_by_size({k: _nbytes(v) for k, v in ema.items()}, world_size)[rank])
        out["ema"] = {k: v for k, v in ema.items() if k in share}
    return out


class _Share(Stateful):
    """A TrainState as one rank of a replicated (ddp) save sees it: its share only (save only)."""

    def __init__(self, state: TrainState, rank: int, world_size: int):
        self.state, self.rank, self.world_size = state, rank, world_size

    def state_dict(self) -> dict[str, Any]:
        return replica_share(self.state.state_dict(), self.rank, self.world_size)

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        raise TypeError("a save share is not loaded into: load into the TrainState itself")


class RankState:
    """Per-rank RNG streams as a dict of tensors and numbers (safe to load with weights_only)."""

    @staticmethod
    def capture() -> dict[str, Any]:
        py_version, py_state, py_gauss = random.getstate()
        np_state = np.random.get_state(legacy=True)
        # a dict only when the global generator is not MT19937, which nothing here sets
        assert isinstance(np_state, tuple), "numpy's global generator is not MT19937"
        np_name, np_keys, np_pos, np_has_gauss, np_gauss = np_state
        sd: dict[str, Any] = {
            PYTHON_RNG: {
                "version": py_version,
                "state": torch.tensor(py_state, dtype=torch.int64),
                "gauss": py_gauss,
            },
            NUMPY_RNG: {
                "keys": torch.from_numpy(np_keys.astype(np.int64)),
                "pos": int(np_pos),
                "has_gauss": int(np_has_gauss),
                "gauss": float(np_gauss),
            },
            TORCH_RNG: {"cpu": torch.get_rng_state()},
        }
        dev = current_cuda_device()
        if dev is not None:
            sd[TORCH_RNG]["cuda"] = cuda_rng_record(torch.cuda.get_rng_state(dev.index), dev)
        assert np_name == "MT19937"
        return sd

    @staticmethod
    def restore(
        sd: dict[str, Any], skip: frozenset[str] = frozenset(), source: str = "per-rank state"
    ) -> None:
        """Raises DeviceError (one line naming ``source``) when the CUDA entry is not restorable."""
        if PYTHON_RNG not in skip:
            p = sd[PYTHON_RNG]
            random.setstate((p["version"], tuple(p["state"].tolist()), p["gauss"]))
        if NUMPY_RNG not in skip:
            n = sd[NUMPY_RNG]
            np.random.set_state(
                ("MT19937", n["keys"].numpy().astype(np.uint32), n["pos"], n["has_gauss"], n["gauss"])
            )
        if TORCH_RNG not in skip:
            t = sd[TORCH_RNG]
            torch.set_rng_state(t["cpu"])
            dev = current_cuda_device()
            cuda, note = cuda_rng_to_restore(t.get("cuda"), dev, source)
            if note:
                log.warning("%s", note)
            if cuda is not None and dev is not None:
                torch.cuda.set_rng_state(cuda, dev.index)

    @staticmethod
    def save(path: Path, extra: Stateful | None = None) -> None:
        RankState.write(path, RankState.serialize(extra))

    @staticmethod
    def serialize(extra: Stateful | None = None) -> bytes:
        """The streams as of now, as the file's bytes (an async save writes them later).
        ``extra``: the trainer's own per-rank items (tensors, numbers, strings: loaded with
        weights_only)."""
        sd = RankState.capture()
        if extra is not None:
            sd[USER_ITEMS] = extra.state_dict()
        buf = io.BytesIO()
        torch.save(sd, buf)
        return buf.getvalue()

    @staticmethod
    def write(path: Path, data: bytes) -> None:
        """Written by Python: a full disk is an OSError naming the file (torch.save's own writer
        reports a RuntimeError without the errno). Synced here, by its writer: the commit does not
        fsync every rank's files from rank 0."""
        with naming(path), open(path, "wb", opener=confined.no_follow) as f:  # never through a link
            f.write(data)
            f.flush()
            os.fsync(f.fileno())

    @staticmethod
    def load(
        source: Path | IO[bytes],
        skip: frozenset[str] = frozenset(),
        name: str = "",
        extra: Stateful | None = None,
    ) -> None:
        sd = torch.load(source, weights_only=True)
        RankState.restore(sd, skip, name or str(source))
        if extra is not None:
            if USER_ITEMS not in sd:
                raise KeyError(f"{name or source}: no per-rank items of the trainer ('{USER_ITEMS}') in it")
            extra.load_state_dict(sd[USER_ITEMS])


def seed_rank_rng(seed: int, rank: int, step: int) -> None:
    """Derive every RNG of one rank from (seed, rank, step): a fresh run (step 0), or a resume on
    a new world size where the saved per-rank streams do not map onto the new ranks."""
    seed_all(mix_seed(seed, rank, step))
