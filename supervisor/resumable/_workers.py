"""Inside a DataLoader worker: signals the rank decides, and random streams a resume repeats.

SLURM signals every process of a job step (a preemption, a time limit, ``scancel``, the notice of
``--signal`` without ``B:``), and ``watch``/torchrun signal a rank's whole process group: the
DataLoader workers get SIGTERM and the notice too. torch's worker handler re-raises a SIGTERM
that its parent did not send, so the worker dies, the rank's next fetch raises "DataLoader worker
is killed by signal" and the preemption checkpoint is lost. A worker set up here (``calm``, the
first thing its ``worker_init_fn`` does) leaves the decision to its rank: SIGINT and the notice
signals are ignored; SIGTERM is blocked and taken by a thread that ends the worker only when its
parent sent it (the parent's shutdown, ``multiprocessing``'s exit, torch's ``_shutdown_workers``),
exactly where torch's own handler exits. A worker whose rank dies notices within torch's check
interval (its ``ManagerWatchdog``) and exits; the watchdog reaps the tree anyway.

A sample's augmentation is exact across a resume when its random draws depend on the sample,
not on which worker fetched it or how many samples that worker fetched before (``seeded``): the
global RNGs (python ``random``, numpy, torch) are seeded from the sample's key around each fetch,
and in the training process itself (0 workers) the training loop's own streams are put back after
it (``isolated``), so fetching a batch never moves them.
"""

from __future__ import annotations

import contextlib
import gc
import os
import random
import signal
import threading
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from supervisor.format.notice import NoticeSignalError, notice_signal
from supervisor.resumable._hooks import run_worker_hook

CALM_THREAD = "resumable-worker-sigterm"


def notice_signals(env: Mapping[str, str] = os.environ) -> set[int]:
    """The preemption notice's signals: SIGUSR1 and $REQUEUE_SIGNAL's (sbatch/job.sh)."""
    out = {int(signal.SIGUSR1)}
    with contextlib.suppress(NoticeSignalError):  # a bad one: the rank refuses to start (install_signals)
        out.add(int(notice_signal(env.get("REQUEUE_SIGNAL", ""))))
    return out


def _held() -> set[int]:
    return {int(signal.SIGTERM), int(signal.SIGINT), *notice_signals()}


def calm() -> None:
    """In a DataLoader worker, before anything else: ignore SIGINT and the notice, and take
    SIGTERM on a thread that exits only when the parent sent it. Threads started later inherit the
    blocked SIGTERM, so no thread of the worker runs torch's re-raising handler. A worker forked
    under ``held_at_fork`` starts with all of them blocked: an ignored one is dropped, a SIGTERM
    that came before this waits for the thread."""
    ignored = _held() - {int(signal.SIGTERM)}
    for s in ignored:
        signal.signal(s, signal.SIG_IGN)
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
    signal.pthread_sigmask(signal.SIG_UNBLOCK, ignored)
    threading.Thread(
        target=_exit_on_parents_sigterm, args=(os.getppid(),), name=CALM_THREAD, daemon=True
    ).start()


@contextmanager
def held_at_fork(workers: bool = True, calm: bool = True) -> Iterator[None]:
    """While a loader forks its ``workers`` (``iter()``; nothing without them): with a ``calm``
    worker_init (``WorkerInit``, which unblocks them), SIGTERM, SIGINT and the notice blocked in
    this thread, so each worker starts with them blocked (a fork copies the mask) until ``calm``.
    Without it a SIGTERM to every process of the job that lands between a worker's fork and its
    ``worker_init_fn`` kills it (the default action, or torch's handler) and the rank loses the
    preemption checkpoint (seen under load in the drill's chaos). The rank takes a signal that
    came meanwhile when its mask is put back.

    And the garbage collector frozen (``gc.freeze``), so a worker never collects garbage it
    inherited: a process group the rank dropped (destroyed, made again, its holder replaced) can
    still be garbage in a cycle at the fork; collected in a worker, gloo's destructor deals with
    threads that exist only in the rank: it aborts the worker (the loop fails), or waits forever
    on a condition variable they were waiting on (the worker hangs, and the loop with it: seen in
    the test suite, a loader's second epoch after an in-process test's process groups). The
    rank's own collector takes the garbage once the workers are forked. A rank that froze objects
    itself keeps them frozen. The freeze does not depend on ``calm``: a worker whose init is the
    user's own inherits the same garbage."""
    if not workers:
        yield
        return
    old = signal.pthread_sigmask(signal.SIG_BLOCK, _held()) if calm else None
    frozen_before = gc.get_freeze_count()
    gc.freeze()
    try:
        yield
    finally:
        if not frozen_before:
            gc.unfreeze()
        if old is not None:
            signal.pthread_sigmask(signal.SIG_SETMASK, old)


def _exit_on_parents_sigterm(parent: int) -> None:
    while True:
        info = signal.sigwaitinfo({signal.SIGTERM})
        if info.si_pid == parent:  # the rank shuts its workers down: as torch's handler does
            os._exit(0)


@dataclass(frozen=True)
class WorkerInit:
    """A DataLoader's ``worker_init_fn``: ``calm``, then ``setup`` (the loader's own, e.g. a
    stream's worker identity), then the user's. Picklable, for workers that are spawned."""

    user: Callable[[int], Any] | None = None
    setup: Callable[[int], Any] | None = None

    def __call__(self, worker_id: int) -> None:
        calm()
        run_worker_hook(worker_id)  # injected (the drill's deadlocking worker); nothing when unset
        if self.setup is not None:
            self.setup(worker_id)
        if self.user is not None:
            self.user(worker_id)


def is_calm(fn: object) -> bool:
    return isinstance(fn, WorkerInit)


def seed_all(seed: int) -> None:
    """Seed python ``random``, numpy and torch's CPU generator from one 63-bit seed."""
    random.seed(seed)
    np.random.seed(seed % 2**32)
    torch.manual_seed(seed)


RngStates = tuple[Any, Any, torch.Tensor]


def rng_states() -> RngStates:
    return random.getstate(), np.random.get_state(), torch.get_rng_state()


def set_rng_states(states: RngStates) -> None:
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.set_rng_state(states[2])


def in_worker() -> bool:
    return torch.utils.data.get_worker_info() is not None


@contextmanager
def isolated(active: bool = True) -> Iterator[None]:
    """The global RNG streams as they were before, afterwards (when ``active``): a fetch in the
    training process must not move the training loop's own draws."""
    if not active:
        yield
        return
    saved = rng_states()
    try:
        yield
    finally:
        set_rng_states(saved)
