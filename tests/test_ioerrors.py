"""supervisor/store/ioerrors.py as pure functions: which errors are evidence, which are only the storage
not answering, and the bounded retry (an injected clock and sleep: nothing waits for real)."""

from __future__ import annotations

import errno
import random

import pytest
from hypothesis import given
from hypothesis import strategies as st

from supervisor.store.ioerrors import (
    RETRY_MAX_S,
    STORAGE_BACKOFF,
    STRUCTURAL_ERRNOS,
    Evidence,
    StorageUnavailable,
    describe,
    evidence_of,
    is_transient,
    retry_transient,
)

# What a cluster's storage says when it is slow, full, flaky or away: never proof of corruption.
CLUSTER_ERRNOS = [
    "EIO",
    "ESTALE",
    "EACCES",
    "EPERM",
    "EMFILE",
    "ENFILE",
    "ETIMEDOUT",
    "EAGAIN",
    "EINTR",
    "ENOSPC",
    "EDQUOT",
    "ENOMEM",
    "EBUSY",
    "ENOLCK",
    "EREMOTEIO",
    "ENOTCONN",
    "ECONNRESET",
    "EHOSTDOWN",
    "ENETDOWN",
    "ECONNREFUSED",
    "ENXIO",
]


@pytest.mark.parametrize("name", CLUSTER_ERRNOS)
def test_storage_errors_are_unknown_and_transient(name: str) -> None:
    e = OSError(getattr(errno, name), "x", "/run/step_00000010/manifest.json")
    assert evidence_of(e) is Evidence.UNKNOWN
    assert is_transient(e)


@pytest.mark.parametrize("name", ["ENOENT", "ENOTDIR", "EISDIR", "ELOOP", "ENAMETOOLONG"])
def test_structural_errors_are_evidence_and_not_retried(name: str) -> None:
    e = OSError(getattr(errno, name), "x")
    assert evidence_of(e) is Evidence.CORRUPT
    assert not is_transient(e)


def test_every_errno_is_one_or_the_other() -> None:
    """An errno nobody listed (there are ~130) counts as unknown: in doubt, keep the checkpoint."""
    for code in errno.errorcode:
        e = OSError(code, "x")
        assert (evidence_of(e) is Evidence.CORRUPT) is (code in STRUCTURAL_ERRNOS)
        assert is_transient(e) is (code not in STRUCTURAL_ERRNOS)


def test_subclasses_and_non_os_errors() -> None:
    assert is_transient(TimeoutError(errno.ETIMEDOUT, "timed out"))  # the class Python makes for it
    assert is_transient(PermissionError(errno.EACCES, "denied"))
    assert not is_transient(TimeoutError("lock held"))  # filelock's Timeout: no errno, not storage
    assert not is_transient(ValueError("bad json"))
    assert not is_transient(FileNotFoundError(errno.ENOENT, "gone"))


def test_describe_names_the_errno() -> None:
    assert describe(OSError(errno.EIO, "Input/output error")) == "EIO (Input/output error)"
    assert describe(OSError(errno.ESTALE, "Stale file handle")).startswith("ESTALE (")


@given(attempt=st.integers(1, 60), seed=st.integers(0, 2**32))
def test_backoff_grows_is_capped_and_jittered(attempt: int, seed: int) -> None:
    w = STORAGE_BACKOFF.wait_s(attempt, random.Random(seed))
    cap = min(RETRY_MAX_S, 0.5 * 2 ** (attempt - 1))
    assert cap / 2 <= w <= cap


class FakeTime:
    """A clock that only moves when the code under test sleeps."""

    def __init__(self) -> None:
        self.now = 1000.0
        self.sleeps: list[float] = []

    def clock(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        assert s >= 0
        self.sleeps.append(s)
        self.now += s


def _flaky(failures: int, err: OSError):
    calls = []

    def fn() -> str:
        calls.append(1)
        if len(calls) <= failures:
            raise err
        return "done"

    return fn, calls


EIO = OSError(errno.EIO, "Input/output error", "/run/step_00000120/manifest.json")


def test_retries_transient_errors_until_they_pass_and_says_so_each_time() -> None:
    t, said = FakeTime(), []
    fn, calls = _flaky(3, EIO)
    out = retry_transient(
        fn,
        deadline_s=120,
        what="the pick",
        fix=lambda e: "fix it",
        on_retry=said.append,
        clock=t.clock,
        sleep=t.sleep,
        rng=random.Random(1),
    )
    assert out == "done" and len(calls) == 4 and len(t.sleeps) == 3 and len(said) == 3
    assert all("/run/step_00000120/manifest.json: EIO (Input/output error)" in m for m in said)
    assert all("not proof of corruption; retrying the pick in" in m for m in said)
    for i, slept in enumerate(t.sleeps):  # exponential from 0.5 s, jittered within [cap/2, cap]
        assert 0.25 * 2**i <= slept <= 0.5 * 2**i


def test_the_deadline_bounds_the_retries_then_storage_unavailable() -> None:
    t, said = FakeTime(), []
    fn, calls = _flaky(10**6, EIO)
    with pytest.raises(StorageUnavailable) as e:
        retry_transient(
            fn,
            deadline_s=60,
            what="the pick",
            fix=lambda err: f"check {err.filename}",
            on_retry=said.append,
            clock=t.clock,
            sleep=t.sleep,
            rng=random.Random(2),
        )
    assert t.now - 1000.0 == pytest.approx(60)  # never slept past the deadline
    assert len(calls) == len(t.sleeps) + 1 and len(said) == len(t.sleeps) > 5
    msg = str(e.value)
    assert "\n" not in msg
    assert msg.startswith("/run/step_00000120/manifest.json: EIO (Input/output error) for 60s of retries")
    assert msg.endswith("check /run/step_00000120/manifest.json")
    assert e.value.error is EIO and e.value.retried_s == pytest.approx(60)


def test_a_zero_deadline_tries_once() -> None:
    t = FakeTime()
    fn, calls = _flaky(1, EIO)
    with pytest.raises(StorageUnavailable, match="for 0s of retries"):
        retry_transient(fn, deadline_s=0, what="x", fix=lambda e: "", clock=t.clock, sleep=t.sleep)
    assert len(calls) == 1 and not t.sleeps


@pytest.mark.parametrize(
    "err", [FileNotFoundError(errno.ENOENT, "gone"), ValueError("not storage"), TimeoutError("lock")]
)
def test_other_errors_propagate_at_once(err: Exception) -> None:
    t = FakeTime()
    fn, calls = _flaky(1, err)  # type: ignore[arg-type]
    with pytest.raises(type(err)):
        retry_transient(fn, deadline_s=60, what="x", fix=lambda e: "", clock=t.clock, sleep=t.sleep)
    assert len(calls) == 1 and not t.sleeps


def test_the_retry_draws_nothing_from_the_global_random() -> None:
    """The trainer's exactness depends on the global random (docs/tiers.md)."""
    t = FakeTime()
    fn, _ = _flaky(5, EIO)
    before = random.getstate()
    retry_transient(fn, deadline_s=60, what="x", fix=lambda e: "", clock=t.clock, sleep=t.sleep)
    assert random.getstate() == before
