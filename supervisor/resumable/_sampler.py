"""Resumable distributed batch sampler: a position in a world-size-free global stream.

The stream is epochs of a seeded permutation cut into global batches of ``global_batch`` samples
(the tail that does not fill a batch is dropped). The position is (epoch, batch index) of the next
global batch to consume; rank r of W takes slice r of that batch (``global_batch / W`` samples).
So the global batch stays constant when W changes, and a checkpoint from W ranks resumes on W'
ranks at the same global position: no sample skipped or seen twice. Resuming jumps straight to the
position; nothing is replayed.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any, Generic, TypeVar

import torch
from torch.utils.data import Dataset, Sampler

T_co = TypeVar("T_co", covariant=True)
_MIX = 0x9E3779B97F4A7C15


def mix_seed(*parts: int) -> int:
    """A 63-bit seed from integers; order matters. Pure, so any process derives the same seed."""
    h = 0
    for p in parts:
        h = ((h ^ (p & (2**64 - 1))) * _MIX + 0x632BE59BD9B4E019) % 2**64
        h ^= h >> 29
    return h & (2**63 - 1)


@dataclass(frozen=True)
class SampleKey:
    """What the sampler hands a worker: enough to rebuild the sample and its augmentation."""

    epoch: int
    batch: int  # global batch index within the epoch
    sample: int  # sample id


def epoch_permutation(num_samples: int, seed: int, epoch: int) -> list[int]:
    g = torch.Generator().manual_seed(mix_seed(seed, epoch))
    return torch.randperm(num_samples, generator=g).tolist()


class ResumableBatchSampler(Sampler[list[SampleKey]]):
    """Yields this rank's share of each global batch from the position at ``iter``: forever
    (``endless``, the default), or to the end of the position's epoch (``Resumable.loader``'s,
    so a loop over epochs sees each one end; ``len`` is the batches of one epoch).

    The DataLoader runs ahead of training (prefetch), so the consumed position is advanced once a
    batch has been used, not by iteration: by ``Resumable.loader``/``prepare``'s loader as it
    hands each batch over, or by the trainer (``advance``) around a plain DataLoader.
    ``shuffle=False`` takes the samples in order every epoch.
    """

    def __init__(
        self,
        num_samples: int,
        global_batch: int,
        rank: int,
        world_size: int,
        seed: int,
        *,
        shuffle: bool = True,
        endless: bool = True,
    ):
        if global_batch % world_size:
            raise ValueError(f"global batch {global_batch} does not split over {world_size} ranks")
        if num_samples < global_batch:
            raise ValueError(f"{num_samples} samples cannot fill one global batch of {global_batch}")
        self.num_samples, self.global_batch = num_samples, global_batch
        self.rank, self.world_size, self.seed = rank, world_size, seed
        self.shuffle, self.endless = shuffle, endless
        self.per_rank = global_batch // world_size
        self.batches_per_epoch = num_samples // global_batch
        self.epoch, self.batch = 0, 0

    def __len__(self) -> int:
        return self.batches_per_epoch

    def order(self, epoch: int) -> list[int]:
        """The samples of ``epoch`` in the order the global batches take them."""
        if not self.shuffle:
            return list(range(self.num_samples))
        return epoch_permutation(self.num_samples, self.seed, epoch)

    def __iter__(self) -> Iterator[list[SampleKey]]:
        epoch, batch = self.epoch, self.batch
        while True:
            perm = self.order(epoch)
            while batch < self.batches_per_epoch:
                lo = batch * self.global_batch + self.rank * self.per_rank
                yield [SampleKey(epoch, batch, s) for s in perm[lo : lo + self.per_rank]]
                batch += 1
            if not self.endless:
                return
            epoch, batch = epoch + 1, 0

    def advance(self) -> None:
        """One global batch consumed."""
        self.batch += 1
        if self.batch == self.batches_per_epoch:
            self.epoch, self.batch = self.epoch + 1, 0

    def state_dict(self) -> dict[str, Any]:
        return {
            "epoch": self.epoch,
            "batch": self.batch,
            "num_samples": self.num_samples,
            "global_batch": self.global_batch,
            "seed": self.seed,
        }

    def load_state_dict(self, sd: dict[str, Any]) -> None:
        """Restore the position. A different dataset size (an allowed data change) cannot map a
        mid-epoch position, so it starts the next epoch; a different global batch is refused."""
        if int(sd["global_batch"]) != self.global_batch:
            raise ValueError(
                f"checkpoint global batch {sd['global_batch']} != this run's {self.global_batch}"
            )
        if int(sd["num_samples"]) != self.num_samples:
            self.epoch, self.batch = int(sd["epoch"]) + 1, 0
            return
        self.epoch, self.batch = int(sd["epoch"]), int(sd["batch"])


class ByIndex(Dataset[T_co], Generic[T_co]):
    """A dataset indexed by sample number, as most are (``dataset[i]``), read through
    ``ResumableBatchSampler``'s keys: ``DataLoader(ByIndex(ds), batch_sampler=sampler)`` is the
    resumable replacement of ``DataLoader(ds, sampler=DistributedSampler(ds), batch_size=b)``
    (docs/adopting.md). A dataset that draws augmentation noise can read the whole key instead
    (epoch, batch, sample) and seed from it, as the reference trainer's ``WindowDataset`` does."""

    def __init__(self, dataset: Dataset[T_co]):
        self.dataset = dataset

    def __getitem__(self, key: SampleKey) -> T_co:
        return self.dataset[key.sample]
