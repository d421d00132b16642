"""The data path of a resumable run: a DataLoader whose position, random streams and workers a
preemption and a resume keep (``Resumable.loader`` builds one, ``Resumable.prepare`` takes the
user's own).

What a plain DataLoader loses, and what this one does instead:

- ``iter(loader)`` draws its workers' base seed from the global torch RNG (and a ``RandomSampler``
  its permutation seed): after ``resume()`` restored that RNG, the draw shifts every later one,
  and the resumed run diverges at its first step. Here the loader has a private generator seeded
  from (seed, rank), and the order comes from the sampler's own seed.
- The position: ``DistributedSampler`` keeps only its epoch, and the workers fetch ahead of
  training, so what was consumed is not what was fetched. Here the position advances as each batch
  is handed to the loop (never as it is fetched) and is saved with every checkpoint: for a
  map-style dataset the (epoch, global batch) of ``ResumableBatchSampler``, world-size free and
  saved in the shared state; for an ``IterableDataset`` each worker's batches handed over and the
  worker whose batch comes next, saved in the per-rank file (a stream is per rank). A stream is
  resumed by replaying each worker's share up to its position inside the worker (nothing is
  collated or sent), which repeats its random draws too.
- Random draws in a worker: a map-style sample is fetched with python/numpy/torch seeded from
  (seed, epoch, sample), so its augmentation is the same with 0 or N workers, on any world size and
  after any resume; a stream's worker is seeded from (seed, rank, worker, epoch) and replayed. In
  the training process itself (0 workers) the loop's own streams are set back after each fetch.
- Signals: the workers leave SIGTERM and the notice to their rank (``_workers.calm``).
- torchdata's ``StatefulDataLoader`` keeps its own position: ``prepare`` gives it a private
  generator and calm workers, and saves its ``state_dict`` in the per-rank file.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, replace
from typing import Any, Protocol

import torch
from torch.utils.data import (
    DataLoader,
    Dataset,
    DistributedSampler,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
)
from torch.utils.data._utils import worker as torch_worker
from torch.utils.data.dataloader import default_collate, default_convert

from supervisor.resumable._sampler import ResumableBatchSampler, SampleKey, mix_seed
from supervisor.resumable._workers import (
    RngStates,
    WorkerInit,
    held_at_fork,
    in_worker,
    is_calm,
    isolated,
    rng_states,
    seed_all,
    set_rng_states,
)

# DataLoader options a Resumable's loader takes over; passing one is a TypeError naming the fix.
OWNED = ("sampler", "batch_sampler", "generator", "shuffle", "batch_size")
DOCS = "docs/adopting.md#data"


@dataclass(frozen=True)
class Rank:
    """Where a loader runs: this rank of ``world_size``, and the run's seed."""

    rank: int
    world_size: int
    seed: int

    def generator(self) -> torch.Generator:
        """The loader's private generator: ``iter()`` draws its workers' base seed from it, not
        from the global RNG the training loop owns."""
        return torch.Generator().manual_seed(mix_seed(self.seed, self.rank))


class Position(Protocol):
    """How a loader's position moves and is saved."""

    per_rank: bool  # saved in the per-rank file (a stream), or in the shared state (world-size free)

    def before_iter(self) -> None: ...
    def handed(self, item: Any) -> Any: ...  # one batch to the loop: its position moves; the batch
    def ended(self) -> None: ...  # the iteration ran out: the epoch is over
    def state_dict(self) -> dict[str, Any]: ...
    def load_state_dict(self, sd: dict[str, Any]) -> None: ...


class ResumableLoader(DataLoader[Any]):
    """A torch DataLoader whose position is saved with every checkpoint and restored by
    ``resume()`` (``Resumable.loader``/``prepare`` make them). Iterate it as any DataLoader: each
    ``iter()`` goes from the position to the end of its epoch (an endless ``ResumableBatchSampler``
    given to ``prepare``: forever)."""

    def __init__(self, dataset: Dataset[Any], position: Position, **kwargs: Any):
        super().__init__(dataset, **kwargs)
        self.position = position
        self.resumed = False  # set by Resumable.resume(), which restores the position

    @property
    def per_rank(self) -> bool:
        return self.position.per_rank

    def __iter__(self) -> Iterator[Any]:  # type: ignore[override]
        if not self.resumed:
            raise RuntimeError(
                "a Resumable's loader is iterated before r.resume(), which restores its position: "
                "make the iterator after it"
            )
        self.position.before_iter()
        with held_at_fork(self.num_workers > 0, is_calm(self.worker_init_fn)):
            inner = super().__iter__()
        return _Handed(inner, self.position)

    def state_dict(self) -> dict[str, Any]:
        return self.position.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.position.load_state_dict(sd)


class _Handed(Iterator[Any]):
    """The DataLoader's iterator, moving the position as each batch is handed to the loop."""

    def __init__(self, inner: Iterator[Any], position: Position):
        self.inner, self.position = inner, position

    def __next__(self) -> Any:
        try:
            item = next(self.inner)
        except StopIteration:
            self.position.ended()
            raise
        return self.position.handed(item)

    def __len__(self) -> int:
        return len(self.inner)  # type: ignore[arg-type]


# ---------------------------------------------------------------- map-style


class SamplerPosition:
    """A map-style loader's position: its ``ResumableBatchSampler``'s, one global batch per batch
    handed over."""

    per_rank = False

    def __init__(self, sampler: ResumableBatchSampler):
        self.sampler = sampler

    def before_iter(self) -> None:
        pass

    def handed(self, item: Any) -> Any:
        self.sampler.advance()
        return item

    def ended(self) -> None:
        pass  # the last batch's advance started the next epoch

    def state_dict(self) -> dict[str, Any]:
        return self.sampler.state_dict()

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.sampler.load_state_dict(sd)


class Keyed(Dataset[Any]):
    """A plain dataset (``dataset[i]``) read through ``ResumableBatchSampler``'s keys, each sample
    fetched with the global RNGs seeded from (seed, epoch, sample): its random augmentation does
    not depend on the worker that fetched it, on how many it fetched before, or on a resume."""

    def __init__(self, dataset: Dataset[Any], seed: int):
        self.dataset, self.seed = dataset, seed

    def __len__(self) -> int:
        return len(self.dataset)  # type: ignore[arg-type]

    def __getitem__(self, key: SampleKey) -> Any:
        return self.__getitems__([key])[0]

    def __getitems__(self, keys: Sequence[SampleKey]) -> list[Any]:
        with isolated(not in_worker()):
            out = []
            for k in keys:
                seed_all(mix_seed(self.seed, k.epoch, k.sample))
                out.append(self.dataset[k.sample])
            return out


# ---------------------------------------------------------------- streams


class Stream(IterableDataset[tuple[int, Any]]):
    """A user's ``IterableDataset`` as a resumable loader reads it: each item tagged with the
    worker that read it, each worker's share replayed up to its position, its random streams
    seeded from (seed, rank, worker, epoch). Worker identities are rotated so that the worker whose
    batch the loop takes next is torch's worker 0 (torch takes batches from its workers in turn);
    ``get_worker_info()`` tells the user's code the rotated identity."""

    def __init__(self, dataset: IterableDataset[Any], seed: int, rank: int, items_per_batch: int):
        self.dataset, self.seed, self.rank, self.items_per_batch = dataset, seed, rank, items_per_batch
        self.epoch, self.first = 0, 0
        self.skip: tuple[int, ...] = ()  # batches each worker already handed over this epoch

    def seed_of(self, worker: int) -> int:
        return mix_seed(self.seed, self.rank, worker, self.epoch)

    def setup(self, worker_id: int) -> None:
        """In a worker (``WorkerInit.setup``): its rotated identity, its seeds."""
        info = torch.utils.data.get_worker_info()
        assert info is not None, "setup runs in a DataLoader worker"
        me = (worker_id + self.first) % info.num_workers
        user = getattr(info.dataset, "dataset", self.dataset)  # this worker's copy of the user's dataset
        torch_worker._worker_info = replace(info, id=me, dataset=user)  # what the user's code sees
        seed_all(self.seed_of(me))

    def __iter__(self) -> Iterator[tuple[int, Any]]:
        info = torch.utils.data.get_worker_info()
        me = info.id if info is not None else 0
        own = None if info is not None else _OwnRng(self.seed_of(me))  # 0 workers: the loop's are not ours
        skip = (self.skip[me] if me < len(self.skip) else 0) * self.items_per_batch
        items = _Pull(self.dataset, own)
        for n, item in enumerate(items):
            if n >= skip:
                yield me, item


class _OwnRng:
    """A stream's random streams in the training process: swapped in around each item it reads."""

    def __init__(self, seed: int):
        with isolated():
            seed_all(seed)
            self.states: RngStates = rng_states()

    def __enter__(self) -> None:
        self.theirs = rng_states()
        set_rng_states(self.states)

    def __exit__(self, *_exc: object) -> None:
        self.states = rng_states()
        set_rng_states(self.theirs)


class _Pull(Iterator[Any]):
    """The user's dataset's items, each read under ``own`` random streams when given."""

    def __init__(self, dataset: IterableDataset[Any], own: _OwnRng | None):
        self.own = own
        self.it: Iterator[Any] | None = None
        self.dataset = dataset

    def __next__(self) -> Any:
        if self.own is None:
            if self.it is None:
                self.it = iter(self.dataset)
            return next(self.it)
        with self.own:
            if self.it is None:
                self.it = iter(self.dataset)
            return next(self.it)


@dataclass(frozen=True)
class Tagged:
    """The user's collate over a batch of (worker, item): (worker, collated batch). A batch is
    always read by one worker."""

    collate: Callable[[Any], Any]
    batched: bool

    def __call__(self, items: Any) -> tuple[int, Any]:
        if not self.batched:
            worker, item = items
            return worker, self.collate(item)
        (worker,) = {w for w, _ in items}
        return worker, self.collate([x for _, x in items])


class StreamPosition:
    """A stream's position on this rank: the epoch, the batches each worker handed over, and the
    worker whose batch comes next."""

    per_rank = True

    def __init__(self, stream: Stream, num_workers: int):
        self.stream, self.workers = stream, max(num_workers, 1)
        self.handed_over = [0] * self.workers
        self.next_worker = 0

    def before_iter(self) -> None:
        self.stream.skip, self.stream.first = tuple(self.handed_over), self.next_worker

    def handed(self, item: tuple[int, Any]) -> Any:
        worker, batch = item
        self.handed_over[worker] += 1
        self.next_worker = (worker + 1) % self.workers
        return batch

    def ended(self) -> None:
        self.stream.epoch += 1
        self.handed_over, self.next_worker = [0] * self.workers, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.stream.epoch,
            "handed_over": list(self.handed_over),
            "next_worker": self.next_worker,
            "workers": self.workers,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """The saved position; saved with another number of workers (each worker reads its own
        share of the stream), it cannot be mapped: the next epoch starts."""
        self.stream.epoch = int(sd["epoch"])
        if int(sd["workers"]) != self.workers:
            self.ended()
            return
        self.handed_over = [int(n) for n in sd["handed_over"]]
        self.next_worker = int(sd["next_worker"])


# ---------------------------------------------------------------- building


def build(
    dataset: Dataset[Any],
    batch_size: int | None,
    where: Rank,
    *,
    shuffle: bool = False,
    **kwargs: Any,
) -> ResumableLoader:
    """``Resumable.loader``: ``batch_size`` per rank (the global batch is ``batch_size`` x world
    size); a map-style dataset is cut into global batches of a seeded order (``shuffle``) or in
    order, the tail that does not fill one dropped, each epoch; an ``IterableDataset`` is read as
    it streams, ``drop_last`` as torch's. Other keyword arguments go to the DataLoader."""
    owned = sorted(set(kwargs) & set(OWNED))
    if owned:
        raise TypeError(f"Resumable.loader: {', '.join(owned)} is the loader's own to set; drop it ({DOCS})")
    workers = int(kwargs.get("num_workers", 0))
    if isinstance(dataset, IterableDataset):
        if kwargs.get("persistent_workers"):
            raise ValueError(
                "Resumable.loader: persistent_workers with an IterableDataset cannot be resumed "
                "exactly (each epoch rotates the workers); drop it"
            )
        batched = batch_size is not None
        stream = Stream(dataset, where.seed, where.rank, batch_size or 1)
        collate = kwargs.pop("collate_fn", None) or (default_collate if batched else default_convert)
        return ResumableLoader(
            stream,
            StreamPosition(stream, workers),
            batch_size=batch_size,
            collate_fn=Tagged(collate, batched),
            generator=where.generator(),
            **_with_calm_workers(kwargs, stream.setup),
        )
    if batch_size is None:
        raise TypeError("Resumable.loader: give a batch_size (per rank) for a map-style dataset")
    if kwargs.pop("drop_last", True) is False:
        raise ValueError(
            "Resumable.loader: a map-style epoch's tail that does not fill a global batch is dropped "
            "(drop_last=False cannot split it over the ranks the same way on any world size)"
        )
    sampler = ResumableBatchSampler(
        len(dataset),  # type: ignore[arg-type]
        batch_size * where.world_size,
        where.rank,
        where.world_size,
        where.seed,
        shuffle=shuffle,
        endless=False,
    )
    return ResumableLoader(
        Keyed(dataset, where.seed),
        SamplerPosition(sampler),
        batch_sampler=sampler,
        generator=where.generator(),
        **_with_calm_workers(kwargs),
    )


def _with_calm_workers(kwargs: dict[str, Any], setup: Callable[[int], Any] | None = None) -> dict[str, Any]:
    return {**kwargs, "worker_init_fn": WorkerInit(kwargs.get("worker_init_fn"), setup)}


# DataLoader settings ``prepare`` carries over to the loader it builds (the rest it owns).
_CARRIED = (
    "num_workers",
    "pin_memory",
    "timeout",
    "worker_init_fn",
    "multiprocessing_context",
    "prefetch_factor",
    "persistent_workers",
    "pin_memory_device",
    "in_order",
)


def settings(loader: DataLoader[Any]) -> dict[str, Any]:
    """The settings of ``loader`` a resumable loader built in its place carries over (workers,
    pinning, prefetch...); the order, batching and generator are its own."""
    carried = {k: getattr(loader, k) for k in _CARRIED}
    if not carried["num_workers"]:
        carried["prefetch_factor"] = None  # torch refuses one without workers
    return carried


def prepare(loader: DataLoader[Any], where: Rank) -> DataLoader[Any]:
    """``Resumable.prepare``: the resumable equivalent of a DataLoader the user built.

    - torchdata's ``StatefulDataLoader``: the same object, with private generators (its own and
      its ``RandomSampler``'s, where they have none) and calm workers; its own ``state_dict`` is its
      position (a worker's random streams restart at each resume there: torchdata's way).
    - a ``ResumableBatchSampler`` as its batch sampler: a loader over the same dataset and sampler
      (the dataset reads the sampler's keys), the position advanced as batches are handed over.
    - a map-style dataset through a ``RandomSampler``, ``SequentialSampler`` or
      ``DistributedSampler`` with a ``batch_size``, or an ``IterableDataset``: ``build`` with the
      loader's batch size (per rank), order and collate.

    Any other sampler has a position nobody can save: a TypeError naming the fix."""
    if isinstance(loader, ResumableLoader):
        return loader
    if is_stateful_dataloader(loader):
        if loader.generator is None:
            loader.generator = where.generator()
        if isinstance(loader.sampler, RandomSampler) and loader.sampler.generator is None:
            loader.sampler.generator = where.generator()  # its state_dict saves this one's state
        loader.worker_init_fn = WorkerInit(loader.worker_init_fn)
        return loader
    carried = settings(loader)
    if isinstance(loader.batch_sampler, ResumableBatchSampler):
        return ResumableLoader(
            loader.dataset,
            SamplerPosition(loader.batch_sampler),
            batch_sampler=loader.batch_sampler,
            collate_fn=loader.collate_fn,
            generator=where.generator(),
            **_with_calm_workers(carried),
        )
    if isinstance(loader.dataset, IterableDataset):
        return build(
            loader.dataset,
            loader.batch_size,
            where,
            collate_fn=loader.collate_fn,
            drop_last=loader.drop_last,
            **carried,
        )
    shuffle = shuffles(loader.sampler)
    if loader.batch_size is None or shuffle is None or type(loader.batch_sampler).__name__ != "BatchSampler":
        raise TypeError(
            f"Resumable.prepare: a DataLoader with {type(loader.batch_sampler or loader.sampler).__name__}: "
            "its position cannot be saved; build it with r.loader(dataset, batch_size=..., shuffle=...) "
            f"or give it a ResumableBatchSampler ({DOCS})"
        )
    return build(
        loader.dataset, loader.batch_size, where, shuffle=shuffle, collate_fn=loader.collate_fn, **carried
    )


def shuffles(sampler: object) -> bool | None:
    """Whether a torch sampler shuffles (None: not one this module can replace)."""
    if isinstance(sampler, RandomSampler):
        return True
    if isinstance(sampler, SequentialSampler):
        return False
    if isinstance(sampler, DistributedSampler):
        return bool(sampler.shuffle)
    return None


def is_stateful_dataloader(loader: DataLoader[Any]) -> bool:
    return any(
        c.__name__ == "StatefulDataLoader" and c.__module__.startswith("torchdata.")
        for c in type(loader).__mro__
    )


class Foreign:
    """A loader that keeps its own position (``StatefulDataLoader``), saved per rank."""

    per_rank = True

    def __init__(self, loader: Any):
        self.loader = loader

    def state_dict(self) -> dict[str, Any]:
        sd: dict[str, Any] = self.loader.state_dict()
        return sd

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        self.loader.load_state_dict(sd)


def saved_as(loader: DataLoader[Any]) -> ResumableLoader | Foreign:
    """What a checkpoint saves of a prepared loader."""
    return loader if isinstance(loader, ResumableLoader) else Foreign(loader)
