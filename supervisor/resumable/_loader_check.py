"""One warning, naming the fix, for a DataLoader a resumable run iterates without
``Resumable.loader``/``prepare``.

Watched from the end of ``resume()`` to the first ``step_end``, where a loop makes its iterators:
every DataLoader iterator made then is looked at as it is made (torch's ``_BaseDataLoaderIter``,
which every DataLoader's iterator is, torchdata's too). What is wrong with it is read off the
loader, not guessed from its effects: no generator of its own (``iter()`` draws from the global
torch RNG that ``resume()`` just restored, and so does a ``RandomSampler`` without one), workers
without ``_workers.calm`` (SIGTERM to every process of the job kills them, and the rank with
them, before it checkpoints), a position nothing saves.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from torch.utils.data import DataLoader, RandomSampler
from torch.utils.data import dataloader as torch_dataloader

from supervisor.resumable._loader import DOCS, ResumableLoader, is_stateful_dataloader
from supervisor.resumable._sampler import ResumableBatchSampler
from supervisor.resumable._workers import WorkerInit

_Iter = torch_dataloader._BaseDataLoaderIter


def problems(loader: DataLoader[Any]) -> list[str]:
    """What a resume loses through ``loader`` ([] for one this package made or prepared)."""
    if isinstance(loader, ResumableLoader):
        return []
    out = []
    sampler = loader.sampler
    if loader.generator is None or (isinstance(sampler, RandomSampler) and sampler.generator is None):
        out.append(
            "iter() draws from the global torch RNG that resume() restored, so the resumed run "
            "diverges from its first step"
        )
    if loader.num_workers and not isinstance(loader.worker_init_fn, WorkerInit):
        out.append(
            f"its {loader.num_workers} workers die of the SIGTERM a preemption sends every process "
            "of the job, and the rank with them, before it checkpoints"
        )
    if not is_stateful_dataloader(loader) and not isinstance(loader.batch_sampler, ResumableBatchSampler):
        out.append("its position is not saved, so a resume starts its epoch again")
    return out


def warning(loader: DataLoader[Any], found: list[str]) -> str:
    what = f"{type(loader.dataset).__name__}, {loader.num_workers} workers"
    return (
        f"a DataLoader ({what}) is iterated without r.prepare: {'; '.join(found)}. Fix: "
        f"loader = r.prepare(loader), or build it with r.loader(dataset, batch_size=..., ...) ({DOCS})"
    )


class LoaderCheck:
    """Watches the DataLoader iterators made while it is on; ``say`` gets one warning, the first."""

    def __init__(self, say: Callable[[str], object]):
        self.say = say
        self.warned = False
        self._original: Any = None

    def start(self) -> None:
        if self._original is not None:
            return
        original = self._original = _Iter.__init__
        check = self

        def made(it: Any, loader: DataLoader[Any], *args: Any, **kwargs: Any) -> None:
            check.seen(loader)
            original(it, loader, *args, **kwargs)

        _Iter.__init__ = made  # type: ignore[method-assign,assignment]

    def seen(self, loader: DataLoader[Any]) -> None:
        found = [] if self.warned else problems(loader)
        if found:
            self.warned = True
            self.say(warning(loader, found))

    def stop(self) -> None:
        if self._original is not None:
            _Iter.__init__ = self._original  # type: ignore[method-assign]
            self._original = None
