"""The tier's pure decisions: the remote commit marker, what to upload, what to prune, the lag."""

from __future__ import annotations

from hypothesis import given
from hypothesis import strategies as st

from supervisor.format.manifest import FileEntry, Manifest
from supervisor.tiers.plan import (
    RemoteState,
    RemoteVerdict,
    judge_listing,
    plan_remote_prune,
    plan_uploads,
    upload_lag,
)

NAME = "step_00000010"


def manifest(step: int = 10) -> bytes:
    entries = {"a": FileEntry(3, "0" * 32), "b": FileEntry(5, "1" * 32)}
    return Manifest(step=step, world_size=1, files=entries).to_json().encode()


def test_the_commit_marker():
    sizes = {"a": 3, "b": 5, "manifest.json": 100}
    assert judge_listing(NAME, 10, sizes, manifest()).state is RemoteState.COMPLETE
    no_manifest = judge_listing(NAME, 10, {"a": 3}, None)
    assert no_manifest.state is RemoteState.INCOMPLETE and not no_manifest.ok
    cases = {
        "b is missing": ({"a": 3}, manifest()),
        "b is 4 bytes, manifest says 5": ({"a": 3, "b": 4}, manifest()),
        "c is not listed": ({"a": 3, "b": 5, "c": 1}, manifest()),
        "for step 20, not 10": ({"a": 3, "b": 5}, manifest(step=20)),
        "not valid JSON": ({"a": 3}, b"{half"),
    }
    for why, (listing, raw) in cases.items():
        v = judge_listing(NAME, 10, listing, raw)
        assert v.state is RemoteState.CORRUPT and why in v.reason and v.reason.startswith(NAME), why


def test_upload_plan_newest_first_then_missing_milestones():
    p = plan_uploads([10, 20, 30, 40, 50], [10], milestone_every=20)
    assert p.todo == (50, 40, 20) and p.skipped == (30,)
    assert plan_uploads([10, 20], [10, 20], 0).todo == ()
    assert plan_uploads([], [10], 0).todo == ()
    # an older local step than the remote's newest is neither uploaded nor "skipped"
    p = plan_uploads([5, 30], [10, 30], 0)
    assert p.todo == () and p.skipped == ()


@given(
    st.sets(st.integers(0, 60), max_size=12),
    st.sets(st.integers(0, 60), max_size=12),
    st.integers(0, 7),
)
def test_upload_plan_properties(local, remote, every):
    p = plan_uploads(local, remote, every)
    assert set(p.todo) <= local - remote
    assert not set(p.todo) & set(p.skipped)
    assert list(p.todo[1:]) == sorted(p.todo[1:], reverse=True)
    if local:
        assert (p.todo[:1] == (max(local),)) == (max(local) not in remote)


def v(step: int, state: RemoteState) -> RemoteVerdict:
    return RemoteVerdict(f"step_{step:08d}", step, state)


def test_remote_prune_plan():
    verdicts = [v(s, RemoteState.COMPLETE) for s in range(10, 80, 10)]
    verdicts += [v(65, RemoteState.INCOMPLETE), v(85, RemoteState.INCOMPLETE), v(5, RemoteState.CORRUPT)]
    plan = plan_remote_prune(verdicts, keep=2, milestone_every=30)
    assert plan.delete == ("step_00000050", "step_00000040", "step_00000020", "step_00000010")
    # 85 may be an upload in flight (newer than every complete one): left alone; corrupt: never deleted
    assert plan.clean == ("step_00000065",)


def test_lag():
    in_sync = upload_lag({10: 100.0, 20: 200.0}, 20, now=300.0)
    assert (in_sync.steps, in_sync.seconds) == (0, 0.0)
    lag = upload_lag({10: 100.0, 20: 200.0, 30: 250.0}, 10, now=300.0)
    assert (lag.steps, lag.seconds) == (20, 100.0)
    lag = upload_lag({10: 100.0}, None, now=130.0)
    assert (lag.steps, lag.seconds) == (10, 30.0)
