"""Fast checks of the trainer's pure building blocks (no processes, no process group)."""

from __future__ import annotations

import os
import random
import signal

import numpy as np
import pytest
import torch

from supervisor.resumable._sampler import ByIndex, ResumableBatchSampler
from supervisor.resumable._signals import PREEMPT_SIGNALS, PreemptionFlag
from supervisor.resumable._train_state import RankState, seed_rank_rng
from train_ref.config import config_hash, get_config
from train_ref.data import Corpus, SampleKey, WindowDataset, collate
from train_ref.schedule import WarmupCosine


def consumed(world: int, n_batches: int, start: dict | None = None) -> tuple[list[list[int]], dict]:
    """Global batches (sample ids over all ranks) consumed by ``world`` ranks from ``start``."""
    samplers = [ResumableBatchSampler(100, 8, r, world, seed=3) for r in range(world)]
    if start:
        for s in samplers:
            s.load_state_dict(start)
    iters = [iter(s) for s in samplers]
    out = []
    for _ in range(n_batches):
        out.append([k.sample for it in iters for k in next(it)])
        for s in samplers:
            s.advance()
    return out, samplers[0].state_dict()


@pytest.mark.parametrize(("before", "after"), [(4, 2), (2, 4), (1, 8), (8, 1), (2, 2)])
def test_world_size_change_continues_the_same_global_stream(before, after):
    whole, _ = consumed(1, 30)
    first, pos = consumed(before, 17)  # crosses the epoch boundary (12 batches of 8 in 100)
    rest, _ = consumed(after, 13, pos)
    assert [sorted(b) for b in first + rest] == [sorted(b) for b in whole]


def test_epoch_has_no_repeats_and_sampler_refuses_uneven_split():
    batches, pos = consumed(2, 12)
    flat = [i for b in batches for i in b]
    assert len(flat) == len(set(flat)) == 96
    assert (pos["epoch"], pos["batch"]) == (1, 0)
    with pytest.raises(ValueError, match="does not split"):
        ResumableBatchSampler(100, 8, 0, 3, seed=3)


def test_a_plain_dataset_resumes_mid_epoch_through_a_prefetching_dataloader():
    """DistributedSampler's replacement for a dataset indexed by int: the DataLoader's workers
    run ahead of training (prefetch), yet the position saved is what the loop consumed
    (``advance``), so a fresh loader from that state yields exactly the rest of the epoch."""
    data = [10 * i for i in range(40)]  # any map-style dataset of 40 samples
    world, global_batch = 2, 8

    def loaders(state: dict | None) -> list[tuple[ResumableBatchSampler, object]]:
        out = []
        for rank in range(world):
            sampler = ResumableBatchSampler(len(data), global_batch, rank, world, seed=7)
            if state:
                sampler.load_state_dict(state)
            loader = torch.utils.data.DataLoader(
                ByIndex(data), batch_sampler=sampler, num_workers=1, prefetch_factor=4
            )
            out.append((sampler, iter(loader)))
        return out

    def take(pairs, n_batches: int) -> list[int]:
        seen = []
        for _ in range(n_batches):
            for sampler, it in pairs:
                seen += next(it).tolist()
                sampler.advance()
        return seen

    first = loaders(None)
    before = take(first, 3)  # 3 of the epoch's 5 global batches; the workers fetched more
    state = first[0][0].state_dict()
    after = take(loaders(state), 2)
    assert (state["epoch"], state["batch"]) == (0, 3)
    assert sorted(before + after) == data  # the whole epoch, each sample once


def test_augmentation_depends_only_on_the_key():
    corpus = Corpus.load(None)
    tok = corpus.tokenizer
    ds = WindowDataset(tok.encode(corpus.text), 32, 8, 0.2, tok.mask_id, seed=5)
    key = SampleKey(epoch=2, batch=7, sample=11)
    torch.manual_seed(0)
    a = ds[key]
    torch.manual_seed(1)  # the global RNG (what differs between workers) does not matter
    b = ds[key]
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])
    other = ds[SampleKey(epoch=3, batch=7, sample=11)]
    assert not torch.equal(a[0], other[0])  # but the epoch does: augmentation is not frozen
    x, _y, ids = collate([a, other])
    assert x.shape == (2, 32) and ids == [11, 11]


def test_rank_state_round_trip_restores_every_stream(tmp_path):
    seed_rank_rng(1, 0, 0)
    path = tmp_path / "rank.pt"
    RankState.save(path)
    want = (random.random(), np.random.random(), torch.rand(1).item())
    seed_rank_rng(2, 0, 0)
    RankState.load(path)
    assert (random.random(), np.random.random(), torch.rand(1).item()) == want
    seed_rank_rng(2, 0, 0)
    RankState.load(path, skip=frozenset({"numpy_rng"}))
    got = (random.random(), np.random.random(), torch.rand(1).item())
    assert got[0] == want[0] and got[2] == want[2] and got[1] != want[1]


def test_config_hash_and_fingerprint_are_stable_and_sensitive():
    vocab = Corpus.load(None).tokenizer.vocab_size
    assert config_hash(get_config("tiny", vocab)) == config_hash(get_config("tiny", vocab))
    assert config_hash(get_config("tiny", vocab)) != config_hash(get_config("bench", vocab))
    assert Corpus.load(None).fingerprint != Corpus("other text", "x").fingerprint
    with pytest.raises(KeyError, match="unknown config"):
        get_config("huge", vocab)


def test_schedule_warms_up_then_decays_to_the_floor():
    s = WarmupCosine(warmup=5, decay=105, floor=0.1)
    assert s(0) == pytest.approx(0.2) and s(4) == 1.0 and s(5) == 1.0
    assert s(55) == pytest.approx(0.55) and s(105) == pytest.approx(0.1) and s(500) == pytest.approx(0.1)


def test_requeue_signal_is_a_notice_too_and_a_bad_one_is_a_config_problem():
    """sbatch/job.sh's REQUEUE_SIGNAL reaches the ranks straight from srun: it sets the flag."""
    saved = {s: signal.getsignal(s) for s in (*PREEMPT_SIGNALS, signal.SIGURG)}
    try:
        flag = PreemptionFlag()
        assert flag.install({"REQUEUE_SIGNAL": "URG"}) == ""
        os.kill(os.getpid(), signal.SIGURG)
        assert flag.signum == signal.SIGURG
        flag.ignore_further()
        assert signal.getsignal(signal.SIGURG) == signal.SIG_IGN
        assert "REQUEUE_SIGNAL='HUP': use USR1 or URG" in PreemptionFlag().install({"REQUEUE_SIGNAL": "HUP"})
    finally:
        for s, h in saved.items():
            signal.signal(s, h)


def test_after_the_exit_is_decided_a_repeated_notice_is_ignored():
    saved = {s: signal.getsignal(s) for s in PREEMPT_SIGNALS}
    try:
        flag = PreemptionFlag()
        assert flag.install({}) == ""
        os.kill(os.getpid(), signal.SIGUSR1)
        assert flag.set
        flag.signum = None
        flag.ignore_further()
        for s in PREEMPT_SIGNALS:
            os.kill(os.getpid(), s)  # would kill the process with the default action
        assert not flag.set
    finally:
        for s, h in saved.items():
            signal.signal(s, h)
