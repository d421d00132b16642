"""The data path (supervisor/resumable/_loader.py, _workers.py, _loader_check.py) in this process:
a loader stopped after any batch and rebuilt from its state goes on with exactly the batches of an
uninterrupted one (map-style and streams, 0/1/2 workers, random augmentation in the workers), never
draws from the global RNG, and its workers outlive a SIGTERM or notice that their rank did not send.
The ranks end to end: tests/test_preempt_all.py and the examples' drills."""

from __future__ import annotations

import gc
import logging
import os
import random
import signal
import subprocess
from datetime import timedelta
from typing import Any

import numpy as np
import pytest
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Dataset, IterableDataset, RandomSampler, get_worker_info
from waiting import EVENT_TIMEOUT_S, wait_for

from supervisor.resumable._loader import Rank, ResumableLoader, build, prepare
from supervisor.resumable._loader_check import LoaderCheck, problems
from supervisor.resumable._sampler import ResumableBatchSampler
from supervisor.resumable._workers import WorkerInit, calm, held_at_fork

WHERE = Rank(rank=0, world_size=1, seed=3)


class Augmented(Dataset[torch.Tensor]):
    """Each read draws from all three global RNGs, as augmentations do."""

    def __len__(self) -> int:
        return 40

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor(
            [i, int(torch.randint(0, 10**6, ())), random.randrange(10**6), np.random.randint(10**6)]
        )


class Shards(IterableDataset[torch.Tensor]):
    """Worker w of n reads items w, w+n, ...: worker 0 reads more (its share ends later)."""

    def __iter__(self) -> Any:
        info = get_worker_info()
        w, n = (info.id, info.num_workers) if info else (0, 1)
        for i in range(w, 37 + 8 * (w == 0), n):
            yield torch.tensor([w, i, int(torch.randint(0, 10**6, ())), random.randrange(10**6)])


def _opened(loader: ResumableLoader) -> ResumableLoader:
    loader.resumed = True  # what Resumable.resume() does once it restored the position
    return loader


def _two_epochs(ds: Dataset[Any], workers: int, cut: int) -> list[torch.Tensor]:
    """Two epochs' batches, the loader rebuilt from its state after ``cut`` batches."""
    first = _opened(build(ds, 4, WHERE, shuffle=True, num_workers=workers))
    it = iter(first)
    got = [next(it) for _ in range(cut)]
    state = first.state_dict()
    del it
    again = _opened(build(ds, 4, WHERE, shuffle=True, num_workers=workers))
    again.load_state_dict(state)
    for _ in range(2):
        got += list(again)
    return got


@pytest.mark.parametrize("workers", [0, 1, 2])
@pytest.mark.parametrize("ds", [Augmented(), Shards()], ids=["map-style", "stream"])
def test_a_loader_rebuilt_from_its_state_goes_on_with_the_same_batches(
    ds: Dataset[Any], workers: int
) -> None:
    want = _two_epochs(ds, workers, 0)
    epoch = len(want) // 2
    for cut in (1, 3, epoch - 3, epoch - 1, epoch):  # the stream's workers run dry at its end
        torch.manual_seed(0)
        before = torch.get_rng_state(), random.getstate(), np.random.get_state()[1].copy()
        got = _two_epochs(ds, workers, cut)
        assert [t.tolist() for t in got[: len(want)]] == [t.tolist() for t in want], f"cut after {cut}"
        after = torch.get_rng_state(), random.getstate(), np.random.get_state()[1]
        assert torch.equal(before[0], after[0]) and before[1] == after[1] and (before[2] == after[2]).all(), (
            "iterating moved the training process's own random streams"
        )


def test_a_map_style_sample_is_the_same_with_any_number_of_workers() -> None:
    runs = [
        [t.tolist() for t in _opened(build(Augmented(), 4, WHERE, shuffle=True, num_workers=w))]
        for w in (0, 2)
    ]
    assert runs[0] == runs[1]


def test_a_loader_is_not_iterated_before_resume() -> None:
    with pytest.raises(RuntimeError, match=r"before r\.resume"):
        iter(build(Augmented(), 4, WHERE))


def _kill_from_elsewhere(pid: int, sig: signal.Signals) -> None:
    """``sig`` sent by a process that is not the worker's parent, as SLURM or torchrun send it."""
    subprocess.run(["kill", f"-{sig.name.removeprefix('SIG')}", str(pid)], check=True)


def test_workers_outlive_sigterm_and_the_notice_from_others_and_exit_on_their_parents() -> None:
    loader = _opened(build(Augmented(), 4, WHERE, num_workers=2))
    it = iter(loader)
    first = next(it)
    workers = [w.pid for w in it.inner._workers]  # type: ignore[attr-defined]
    for pid in workers:
        for sig in (signal.SIGTERM, signal.SIGUSR1, signal.SIGINT):
            _kill_from_elsewhere(pid, sig)
    rest = list(it)  # a dead worker would raise "DataLoader worker ... is killed by signal"
    assert len(rest) == len(loader) - 1 and first is not None
    it = iter(loader)  # the next epoch's workers
    next(it)
    pid = it.inner._workers[0].pid  # type: ignore[attr-defined]
    os.kill(pid, signal.SIGTERM)  # from its parent, as multiprocessing's exit and torch's shutdown send it
    it.inner._workers[0].join(EVENT_TIMEOUT_S)  # type: ignore[attr-defined]
    assert it.inner._workers[0].exitcode == 0  # type: ignore[attr-defined]


class Collecting(Dataset[torch.Tensor]):
    """Each read runs the garbage collector in the worker, as any allocation may."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int) -> torch.Tensor:
        gc.collect()
        return torch.tensor([i])


def test_a_worker_never_collects_a_process_group_its_rank_dropped() -> None:
    """A gloo group that is garbage in a cycle when the workers fork: collected in a worker, its
    destructor, which deals with threads that are not in the worker, aborts it (without the
    frozen collector: "DataLoader worker ... is killed by signal: Aborted") or, for a group whose
    threads were waiting, hangs it (the loader's ``timeout`` makes that a failure here)."""
    loader = _opened(build(Collecting(), 4, WHERE, num_workers=2, timeout=EVENT_TIMEOUT_S))
    automatic = gc.isenabled()
    gc.disable()  # the cycle stays garbage until the fork, as it can in a rank
    try:
        cycle: list[Any] = [dist.ProcessGroupGloo(dist.HashStore(), 0, 1, timedelta(seconds=60))]
        cycle.append(cycle)
        del cycle
        got = [t.tolist() for t in loader]
    finally:
        if automatic:
            gc.enable()
    assert sorted(i for batch in got for i in batch) == [[i] for i in range(8)]
    assert gc.get_freeze_count() == 0  # the rank's own collector takes the garbage again


def _stateful_dataloader() -> Any:
    return pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader


def test_prepare_gives_each_kind_of_loader_a_position_and_calm_workers() -> None:
    data = Augmented()
    made = prepare(DataLoader(data, batch_size=4, sampler=RandomSampler(data), num_workers=2), WHERE)
    assert (
        isinstance(made, ResumableLoader)
        and made.num_workers == 2
        and isinstance(made.worker_init_fn, WorkerInit)
    )
    assert isinstance(made.batch_sampler, ResumableBatchSampler) and made.batch_sampler.shuffle
    stream = prepare(DataLoader(Shards(), batch_size=4), WHERE)
    assert isinstance(stream, ResumableLoader) and stream.per_rank
    with pytest.raises(TypeError, match="position cannot be saved"):
        prepare(DataLoader(data, batch_sampler=[[0, 1], [2, 3]]), WHERE)
    sdl = _stateful_dataloader()
    theirs = sdl(data, batch_size=4, shuffle=True, num_workers=1)
    assert prepare(theirs, WHERE) is theirs and theirs.generator is not None
    assert isinstance(theirs.worker_init_fn, WorkerInit) and not problems(theirs)


def test_a_stateful_dataloader_prepared_resumes_without_a_global_draw() -> None:
    sdl = _stateful_dataloader()
    data = Augmented()

    def loader() -> Any:
        torch.manual_seed(0)  # a script's start: torchdata's sampler seeds itself from the global RNG
        return prepare(sdl(data, batch_size=4, shuffle=True, num_workers=2), WHERE)

    want = [t.tolist() for t in loader()]
    first = loader()
    it = iter(first)
    got = [next(it).tolist() for _ in range(3)]
    state = first.state_dict()
    del it
    again = loader()
    again.load_state_dict(state)
    before = torch.get_rng_state()
    got += [t.tolist() for t in again]
    assert torch.equal(before, torch.get_rng_state())
    assert [b[:, 0].tolist() for b in map(torch.tensor, got)] == [
        b[:, 0].tolist() for b in map(torch.tensor, want)
    ]


def test_one_warning_names_what_an_unprepared_loader_loses_and_the_fix(
    caplog: pytest.LogCaptureFixture,
) -> None:
    said: list[str] = []
    check = LoaderCheck(said.append)
    check.start()
    try:
        iter(_opened(build(Augmented(), 4, WHERE)))
        assert not said
        data = Augmented()
        plain = DataLoader(data, batch_size=4, shuffle=True, num_workers=1)
        next(iter(plain))
        next(iter(plain))
    finally:
        check.stop()
    next(iter(DataLoader(data, batch_size=4)))  # after the first step_end: not looked at
    assert len(said) == 1, said
    line = said[0]
    assert (
        "global torch RNG" in line
        and "1 workers die of the SIGTERM" in line
        and "position is not saved" in line
    )
    assert "r.prepare(loader)" in line and "docs/adopting.md#data" in line
    assert not caplog.records or all(r.levelno < logging.WARNING for r in caplog.records)


def test_workers_of_a_prepared_loader_block_sigterm_in_every_thread() -> None:
    """The worker's threads (its queue's feeder among them) inherit the blocked SIGTERM, so none
    runs torch's re-raising handler; one thread waits for it (sigwaitinfo unblocks what it waits
    for while it sleeps)."""
    loader = _opened(build(Augmented(), 4, WHERE, num_workers=1))
    it = iter(loader)
    next(it)
    pid = it.inner._workers[0].pid  # type: ignore[attr-defined]
    bit = 1 << (signal.SIGTERM - 1)

    def threads() -> dict[str, tuple[int, str]]:
        out = {}
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/status") as f:
                mask = next(int(line.split()[1], 16) for line in f if line.startswith("SigBlk:"))
            with open(f"/proc/{pid}/task/{tid}/wchan") as f:
                out[tid] = (mask, f.read())
        return out

    got = wait_for(
        lambda: (t := threads()) and len(t) >= 3 and t, "the worker's threads", timeout=EVENT_TIMEOUT_S
    )
    waiting = [tid for tid, (_, wchan) in got.items() if "sigtimedwait" in wchan]
    assert len(waiting) == 1, got
    assert all(mask & bit for tid, (mask, _) in got.items() if tid not in waiting), got


def _forked_before_calm(hold: bool) -> int:
    """A child forked as a loader forks a worker (under ``held_at_fork`` or not), sent SIGTERM by
    another process before it reaches ``calm`` (it waits for the go on a pipe), then calmed; how
    it ended (its wait status)."""
    go_r, go_w = os.pipe()
    # the child starts as a worker does: SIGTERM's default action, unblocked (a test runner's
    # process may have set its own)
    handler = signal.signal(signal.SIGTERM, signal.SIG_DFL)
    mask = signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})
    try:
        with held_at_fork(hold):
            pid = os.fork()
            if pid == 0:  # the worker: it never leaves the block (a DataLoader worker's loop ends in exit)
                os.read(go_r, 1)
                calm()
                os.read(go_r, 1)  # the parent's second byte: the pending SIGTERM had its chance
                os._exit(0)
    finally:
        signal.signal(signal.SIGTERM, handler)
        signal.pthread_sigmask(signal.SIG_SETMASK, mask)
    _kill_from_elsewhere(pid, signal.SIGTERM)
    os.write(go_w, b"gg")
    _, status = os.waitpid(pid, 0)
    os.close(go_r)
    os.close(go_w)
    return status


def test_a_sigterm_before_a_worker_is_calmed_waits_for_it_when_the_fork_held_it() -> None:
    """The window between a worker's fork and its worker_init_fn: a SIGTERM to every process of
    the job landing there killed the worker (a chaos drill under load lost its preemption
    checkpoint); forked under ``held_at_fork`` the worker keeps it pending and calm's thread
    takes it, and the parent's own mask is as it was."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    assert os.WIFSIGNALED(status := _forked_before_calm(hold=False)) and os.WTERMSIG(status) == signal.SIGTERM
    status = _forked_before_calm(hold=True)
    assert os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0, status
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before


@pytest.mark.parametrize("calmed", [True, False])
def test_the_fork_freezes_the_collector_whatever_the_worker_init(calmed: bool) -> None:
    """The collector is frozen while workers fork (garbage a worker collects can hold the rank's
    gloo threads) whether or not the worker_init is ours; the signals are held only for ours (it
    unblocks them: a user's own would leave its worker deaf to SIGTERM)."""
    before = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    with held_at_fork(True, calmed):
        assert gc.get_freeze_count() > 0
        held = signal.pthread_sigmask(signal.SIG_BLOCK, set())
    assert (signal.SIGTERM in held) == calmed, held
    assert gc.get_freeze_count() == 0
    assert signal.pthread_sigmask(signal.SIG_BLOCK, set()) == before
