"""The retention policy as a pure plan (supervisor/store/retention_policy.py): every kept step with its
reasons, property-based, plus the flags that build a policy and prune applying it on disk."""

from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from store_helpers import committed_names, make_ckpt

from supervisor import store
from supervisor.cli.main import main
from supervisor.report import build_report
from supervisor.store import StoreError
from supervisor.store.retention_policy import (
    Candidate,
    KeepReason,
    RetentionPolicy,
    add_retention_args,
    plan_retention,
    policy_from_args,
)

HOUR = 3600.0


@st.composite
def candidates(draw):
    steps = draw(st.lists(st.integers(1, 200), unique=True, max_size=25))
    out = []
    for s in steps:
        metric = draw(st.none() | st.floats(-5, 5) | st.just(math.nan))
        out.append(
            Candidate(
                s, wall_time=draw(st.floats(0, 10 * HOUR)), metrics={} if metric is None else {"loss": metric}
            )
        )
    return out


policies = st.builds(
    RetentionPolicy,
    keep=st.integers(2, 6),
    milestone_every=st.integers(0, 50),
    keep_every_s=st.sampled_from([0.0, 600.0, HOUR]),
    best_metric=st.sampled_from(["", "loss"]),
    best_mode=st.sampled_from(["min", "max"]),
    best_k=st.integers(1, 3),
    keep_all=st.booleans(),
)


@given(cands=candidates(), policy=policies)
def test_plan_keeps_exactly_what_each_rule_asks_with_its_reason(cands, policy) -> None:
    kept = plan_retention(cands, policy)
    steps = {c.step for c in cands}
    assert set(kept) <= steps and all(kept.values())
    if not cands:
        assert kept == {}
        return
    assert max(steps) in kept  # the newest, always
    if policy.keep_all:
        assert kept == {s: (KeepReason.ALL,) for s in steps}
        return
    by_reason = {r: {s for s, why in kept.items() if r in why} for r in KeepReason}
    assert by_reason[KeepReason.NEWEST] == set(sorted(steps, reverse=True)[: policy.keep])
    m = policy.milestone_every
    assert by_reason[KeepReason.MILESTONE] == ({s for s in steps if s % m == 0} if m else set())
    if policy.keep_every_s:
        periods = {math.floor(c.wall_time / policy.keep_every_s) for c in cands}
        assert len(by_reason[KeepReason.PERIOD]) == len(periods)  # one per period
        for c in cands:  # ... and it is the oldest of its period
            if c.step in by_reason[KeepReason.PERIOD]:
                p = math.floor(c.wall_time / policy.keep_every_s)
                assert all(
                    o.wall_time >= c.wall_time
                    for o in cands
                    if math.floor(o.wall_time / policy.keep_every_s) == p
                )
    else:
        assert not by_reason[KeepReason.PERIOD]
    scored = [c for c in cands if math.isfinite(c.metrics.get("loss", math.nan))]
    if policy.best_metric:
        best = by_reason[KeepReason.BEST]
        assert len(best) == min(policy.best_k, len(scored))
        sign = 1 if policy.best_mode == "min" else -1
        worst_kept = max((sign * c.metrics["loss"] for c in scored if c.step in best), default=None)
        assert all(sign * c.metrics["loss"] >= worst_kept for c in scored if c.step not in best)
    else:
        assert not by_reason[KeepReason.BEST]
    # nothing kept without a reason of the policy
    assert set(kept) == set().union(*by_reason.values())


def test_plan_examples() -> None:
    cands = [
        Candidate(10, 0.5 * HOUR, {"loss": 3.0}),
        Candidate(20, 0.9 * HOUR, {"loss": 1.0}),  # best
        Candidate(30, 1.2 * HOUR, {"loss": 2.0}),  # oldest of hour 1
        Candidate(40, 1.5 * HOUR, {"loss": 2.5}),
        Candidate(50, 1.8 * HOUR),  # no metric
        Candidate(60, 2.1 * HOUR, {"loss": math.nan}),
    ]
    policy = RetentionPolicy(keep=2, milestone_every=40, keep_every_s=HOUR, best_metric="loss")
    assert plan_retention(cands, policy) == {
        60: (KeepReason.NEWEST, KeepReason.PERIOD),
        50: (KeepReason.NEWEST,),
        40: (KeepReason.MILESTONE,),
        30: (KeepReason.PERIOD,),
        20: (KeepReason.BEST,),
        10: (KeepReason.PERIOD,),
    }
    # ties go to the older step (the one already kept); max mode ranks the other way
    tie = [Candidate(1, 0, {"acc": 0.9}), Candidate(2, 0, {"acc": 0.9}), Candidate(3, 0, {"acc": 0.1})]
    best = RetentionPolicy(keep=2, best_metric="acc", best_mode="max")
    assert plan_retention(tie, best)[1] == (KeepReason.BEST,)
    assert 1 not in plan_retention(tie, RetentionPolicy(keep=2, best_metric="acc", best_mode="min"))


@pytest.mark.parametrize(
    ("kwargs", "flag"),
    [
        ({"keep": 1}, "--keep 1"),
        ({"milestone_every": -1}, "--milestone-every -1"),
        ({"keep_every_s": -5.0}, "--keep-every-s -5.0"),
        ({"keep_every_s": math.inf}, "--keep-every-s inf"),
        ({"best_metric": "loss", "best_mode": "avg"}, "--keep-best mode 'avg'"),
        ({"best_metric": "loss", "best_k": 0}, "--keep-best K 0"),
    ],
)
def test_policy_refuses_values_out_of_range_naming_the_flag(kwargs, flag) -> None:
    with pytest.raises(StoreError, match="refused") as e:
        RetentionPolicy(**kwargs)
    assert str(e.value).startswith(flag) and "\n" not in str(e.value)


def _parse(*argv: str) -> RetentionPolicy | None:
    p = argparse.ArgumentParser()
    add_retention_args(p)
    return policy_from_args(p.parse_args(argv))


def test_flags_make_one_policy() -> None:
    assert _parse() is None
    assert _parse("--keep", "5") == RetentionPolicy(keep=5)
    assert _parse("--keep-best", "val:loss:min:3", "--keep-every-s", "60", "--milestone-every", "100") == (
        RetentionPolicy(milestone_every=100, keep_every_s=60.0, best_metric="val:loss", best_k=3)
    )
    assert _parse("--keep-best", "acc:max") == RetentionPolicy(best_metric="acc", best_mode="max")
    assert _parse("--keep-all") == RetentionPolicy(keep_all=True)
    for bad in ("loss", "loss:avg", ":min", "loss:min:x"):
        with pytest.raises(SystemExit):
            _parse("--keep-best", bad)


def test_policy_round_trips_and_bad_records_are_refused() -> None:
    p = RetentionPolicy(keep=4, keep_every_s=HOUR, best_metric="loss", best_k=2)
    assert RetentionPolicy.from_dict(p.to_dict()) == p
    assert p.describe() == "newest 4, one per 3600s, best 2 by loss (min)"
    for bad in ({"keep": "3"}, {"keep_all": 1}, {"color": "red"}):
        with pytest.raises(StoreError):
            RetentionPolicy.from_dict(bad)


# ---------------------------------------------------------------- on disk


def test_prune_applies_best_and_period_by_manifest(tmp_path: Path) -> None:
    losses = {10: 0.5, 20: 0.9, 30: 0.7, 40: 0.8, 50: 0.95, 60: 0.99}
    for s, loss in losses.items():
        make_ckpt(tmp_path, s, metrics={"loss": loss})
    res = store.prune(tmp_path, policy=RetentionPolicy(keep=2, best_metric="loss", best_k=2))
    assert sorted(committed_names(tmp_path)) == [
        "step_00000010",
        "step_00000030",
        "step_00000050",
        "step_00000060",
    ]
    assert res.why_kept["step_00000010"] == (KeepReason.BEST,)
    assert res.why_kept["step_00000060"] == (KeepReason.NEWEST,)
    # one period of ~31 years holds every commit: its oldest survivor is kept
    res = store.prune(tmp_path, policy=RetentionPolicy(keep=2, keep_every_s=1e9))
    assert res.why_kept.get("step_00000010") == (KeepReason.PERIOD,)
    res = store.prune(tmp_path, policy=RetentionPolicy(keep_all=True))
    assert not res.deleted and set(res.why_kept.values()) == {(KeepReason.ALL,)}


def test_prune_old_keywords_still_work_but_not_with_a_policy(tmp_path: Path) -> None:
    for s in (10, 20, 30):
        make_ckpt(tmp_path, s)
    assert store.prune(tmp_path, keep=2).policy == RetentionPolicy(keep=2)
    with pytest.raises(TypeError):
        store.prune(tmp_path, keep=2, policy=RetentionPolicy())


def test_recorded_policy_is_read_back_and_a_bad_record_is_one_line(tmp_path: Path) -> None:
    make_ckpt(tmp_path, 10)
    assert store.read_policy(tmp_path) is None
    p = RetentionPolicy(keep=5, best_metric="loss")
    store.record_policy(tmp_path, p)
    assert store.read_policy(tmp_path) == p
    path = tmp_path / "supervisor" / "retention.json"
    mtime = path.stat().st_mtime_ns
    store.record_policy(tmp_path, p)  # unchanged: not rewritten
    assert path.stat().st_mtime_ns == mtime
    path.write_text('{"schema": 1, "policy": {"keep": 1}}')
    with pytest.raises(StoreError, match=r"retention.json: --keep 1 refused.*remove it"):
        store.read_policy(tmp_path)


# ---------------------------------------------------------------- commands


def _cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def test_list_explains_kept_by_flags_else_the_recorded_policy_and_status_shows_it(
    tmp_path: Path, capsys
) -> None:
    for s, loss in ((10, 0.1), (20, 0.9), (30, 0.8), (40, 0.7)):
        make_ckpt(tmp_path, s, metrics={"loss": loss})
    rc, out, _ = _cli(capsys, "ckpt", "list", "--ckpt-root", str(tmp_path), "--json")
    doc = json.loads(out)
    assert rc == 0 and doc["retention"]["source"] == "the default; none recorded"
    assert {c["step"]: c["kept"] for c in doc["checkpoints"]} == {
        40: ["newest"],
        30: ["newest"],
        20: ["newest"],
        10: [],
    }
    store.record_policy(tmp_path, RetentionPolicy(keep=2, best_metric="loss"))
    rc, out, _ = _cli(capsys, "ckpt", "list", "--ckpt-root", str(tmp_path))
    row = {line.split()[0]: line for line in out.splitlines()[1:5]}
    assert "best" in row["10"] and "prunable" in row["20"] and "recorded in" in out
    rc, out, _ = _cli(capsys, "ckpt", "list", "--ckpt-root", str(tmp_path), "--keep-all")
    assert [line.split()[-1] for line in out.splitlines()[1:5]] == ["all"] * 4 and "from the flags" in out
    rc, out, _ = _cli(capsys, "status", "--ckpt-root", str(tmp_path))
    assert "retention: keeps newest 2, best 1 by loss (min)" in out
    assert build_report(tmp_path).retention == "keeps newest 2, best 1 by loss (min)"


def test_prune_flags(tmp_path: Path, capsys) -> None:
    for s, loss in ((10, 0.1), (20, 0.9), (30, 0.8), (40, 0.7)):
        make_ckpt(tmp_path, s, metrics={"loss": loss})
    argv = ["ckpt", "prune", "--ckpt-root", str(tmp_path), "--keep", "2", "--keep-best", "loss:min", "--json"]
    rc, out, _ = _cli(capsys, *argv)
    doc = json.loads(out)
    assert rc == 0 and doc["deleted"] == ["step_00000020"]
    assert doc["why_kept"] == {
        "step_00000040": ["newest"],
        "step_00000030": ["newest"],
        "step_00000010": ["best"],
    }
    assert doc["policy"]["best_metric"] == "loss" and (doc["keep"], doc["milestone_every"]) == (2, 0)
    assert doc["policy_source"] == "from the flags"
    # without flags: the policy the trainer recorded, so its best one is not deleted by hand
    make_ckpt(tmp_path, 50, metrics={"loss": 0.6})
    make_ckpt(tmp_path, 60, metrics={"loss": 0.5})
    store.record_policy(tmp_path, RetentionPolicy(keep=2, best_metric="loss"))
    rc, out, _ = _cli(capsys, "ckpt", "prune", "--ckpt-root", str(tmp_path))
    assert rc == 0 and "recorded in" in out
    assert committed_names(tmp_path) == {"step_00000060", "step_00000050", "step_00000010"}
    rc, out, err = _cli(capsys, "ckpt", "prune", "--ckpt-root", str(tmp_path), "--keep-every-s", "-1")
    assert rc == 2 and out == "" and "--keep-every-s -1.0 refused" in err
    with pytest.raises(SystemExit) as e:  # argparse's usage error
        main(["ckpt", "prune", "--ckpt-root", str(tmp_path), "--keep-best", "loss"])
    assert e.value.code == 2 and "give METRIC:min or METRIC:max" in capsys.readouterr().err
