"""The quarantine's own retention (oldest first, by count and bytes, never the last copy of a step
newer than every valid checkpoint) as a pure plan and on disk, and the `ckpt` commands for it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from hypothesis import given
from hypothesis import strategies as st
from store_helpers import committed_names, latest_text, make_ckpt, quarantine_dirs

from supervisor import store
from supervisor.cli.main import main
from supervisor.drill.corruption import Corruption, corrupt
from supervisor.format.confined import MAX_DEPTH
from supervisor.format.exitcodes import Exit
from supervisor.format.layout import QUARANTINE_DELETING_PREFIX, REASON, RunDir
from supervisor.store import QuarantineEntry, plan_quarantine

# ---------------------------------------------------------------- the plan, pure


@st.composite
def quarantines(draw):
    n = draw(st.integers(0, 12))
    steps = draw(st.lists(st.integers(1, 8), min_size=n, max_size=n))
    sizes = draw(st.lists(st.integers(0, 100), min_size=n, max_size=n))
    orders = draw(st.lists(st.integers(0, 5), min_size=n, max_size=n))
    return [
        QuarantineEntry(f"q{i}", step, (f"2026{o:04d}", i), size)
        for i, (step, size, o) in enumerate(zip(steps, sizes, orders, strict=True))
    ]


@given(
    entries=quarantines(),
    keep=st.none() | st.integers(0, 6),
    max_bytes=st.none() | st.integers(0, 400),
    newest_valid=st.none() | st.integers(0, 9),
)
def test_quarantine_plan_invariants(entries, keep, max_bytes, newest_valid) -> None:
    doomed = plan_quarantine(entries, keep, max_bytes, newest_valid)
    left = [e for e in entries if e.name not in doomed]
    assert doomed <= {e.name for e in entries}
    # never the last copy of a step newer than every valid one (every step when none is valid)
    at_risk = {e.step for e in entries if newest_valid is None or e.step > newest_valid}
    assert at_risk <= {e.step for e in left}
    # and of those, the newest copy is the one kept
    for step in at_risk:
        newest = max((e for e in entries if e.step == step), key=lambda e: e.order)
        assert newest.name not in doomed
    # oldest first: nothing deletable that was kept is older than something deleted
    deletable_left = [
        e for e in left if e.step not in at_risk or e.name not in _newest_names(entries, at_risk)
    ]
    if doomed:
        newest_doomed = max(e.order for e in entries if e.name in doomed)
        assert all(e.order >= newest_doomed for e in deletable_left)
    # the limits hold unless only protected entries are left to delete; nothing more than needed goes
    protected = len(at_risk)
    if keep is not None:
        assert len(left) <= max(keep, protected) or not deletable_left
    if max_bytes is not None:
        assert sum(e.bytes for e in left) <= max_bytes or not deletable_left
    if keep is None and max_bytes is None:
        assert not doomed


def _newest_names(entries, steps) -> set[str]:
    return {max((e for e in entries if e.step == s), key=lambda e: e.order).name for s in steps}


def test_quarantine_plan_examples() -> None:
    e = [
        QuarantineEntry("a", 10, ("1", 1), 100),
        QuarantineEntry("b", 20, ("2", 1), 100),
        QuarantineEntry("c", 70, ("3", 1), 100),  # newer than every valid (50): protected
        QuarantineEntry("d", 30, ("4", 1), 100),
    ]
    assert plan_quarantine(e, 2, None, 50) == {"a", "b"}
    assert plan_quarantine(e, 0, None, 50) == {"a", "b", "d"}
    assert plan_quarantine(e, None, 250, 50) == {"a", "b"}
    assert plan_quarantine(e, None, None, 50) == set()
    assert plan_quarantine(e, 0, None, None) == set()  # nothing valid: every step's last copy stays


# ---------------------------------------------------------------- on disk


def _quarantined_steps(root: Path) -> list[int]:
    return sorted(int(p.name[5:13]) for p in quarantine_dirs(root))


@pytest.fixture
def run(tmp_path: Path) -> Path:
    """Valid 40, 50, 60; quarantined (oldest first) 10, 20, 30 and a newer-than-valid 70."""
    root = tmp_path / "run"
    for s in (10, 20, 30, 40, 50, 60, 70):
        make_ckpt(root, s)
    for s in (10, 20, 30, 70):
        store.quarantine(root, store.CheckpointRef(s, root / f"step_{s:08d}"), f"step_{s:08d}: test")
    return root


def test_prune_removes_the_oldest_quarantined_beyond_the_count(run: Path) -> None:
    res = store.prune(run, keep=3, quarantine_keep=1, dry_run=True)
    assert [n[:13] for n in res.quarantine_removed] == ["step_00000010", "step_00000020", "step_00000030"]
    assert _quarantined_steps(run) == [10, 20, 30, 70]  # dry run
    res = store.prune(run, keep=3, quarantine_keep=2)
    assert [n[:13] for n in res.quarantine_removed] == ["step_00000010", "step_00000020"]
    assert _quarantined_steps(run) == [30, 70]
    assert not [n for n in (RunDir.of(run).quarantine).iterdir() if n.name.startswith(".")]
    assert committed_names(run) == {"step_00000040", "step_00000050", "step_00000060"}


def test_the_only_copy_of_a_step_newer_than_every_valid_one_stays(run: Path) -> None:
    store.prune(run, keep=3, quarantine_keep=0)
    assert _quarantined_steps(run) == [70]
    store.prune(run, keep=3, quarantine_max_bytes=0)
    assert _quarantined_steps(run) == [70]


def test_prune_by_bytes_oldest_first(run: Path) -> None:
    one = store.disk_usage(quarantine_dirs(run)[0])
    store.prune(run, keep=3, quarantine_keep=None, quarantine_max_bytes=2 * one + one // 2)
    assert _quarantined_steps(run) == [30, 70]


def test_quarantine_retention_defaults_and_leftovers(run: Path) -> None:
    assert store.QUARANTINE_KEEP == 5
    store.prune(run, keep=3)  # 4 quarantined: within the default
    assert _quarantined_steps(run) == [10, 20, 30, 70]
    (RunDir.of(run).quarantine / "by-hand").mkdir()  # not a name the store made: never touched
    crashed = RunDir.of(run).quarantine / f"{QUARANTINE_DELETING_PREFIX}step_00000005-x.abc"
    (crashed / "sub").mkdir(parents=True)  # a prune that died mid-removal
    assert QUARANTINE_DELETING_PREFIX not in {q.name[:10] for q in store.list_quarantined(run)}
    store.prune(run, keep=3, quarantine_keep=0)
    assert not crashed.exists() and (RunDir.of(run).quarantine / "by-hand").is_dir()


@pytest.mark.parametrize("flag", ["quarantine_keep", "quarantine_max_bytes"])
def test_negative_limits_are_refused(run: Path, flag: str) -> None:
    with pytest.raises(store.StoreError, match="refused"):
        store.prune(run, **{flag: -1})


# ---------------------------------------------------------------- the commands


def test_ckpt_prune_quarantine_flags(run: Path, capsys) -> None:
    argv = ["ckpt", "prune", "--ckpt-root", str(run), "--keep", "3"]
    assert main([*argv, "--quarantine-keep", "all", "--json"]) == Exit.OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["quarantine_removed"] == [] and doc["quarantine_keep"] is None and doc["unknown"] == []
    assert main([*argv, "--quarantine-max-bytes", "0", "--dry-run"]) == Exit.OK
    out = capsys.readouterr().out
    assert out.count("would remove quarantined step_000000") == 3 and "step_00000070-" not in out
    assert main([*argv, "--quarantine-keep", "2"]) == Exit.OK
    assert _quarantined_steps(run) == [30, 70]
    with pytest.raises(SystemExit) as e:  # argparse's usage error
        main([*argv, "--quarantine-max-bytes", "lots"])
    assert e.value.code == Exit.USAGE and "'lots' is not a size" in capsys.readouterr().err


def test_ckpt_quarantine_moves_one_aside_by_hand(tmp_path: Path, capsys) -> None:
    root = tmp_path / "run"
    make_ckpt(root, 10)
    make_ckpt(root, 20)
    argv = ["ckpt", "quarantine", "--ckpt-root", str(root)]
    assert main([*argv, "20", "--reason", "manifest.json stays unreadable (EIO)"]) == Exit.OK
    assert "quarantined step_00000020 to " in capsys.readouterr().out
    (q,) = quarantine_dirs(root)
    assert (q / REASON).read_text() == (
        "step_00000020: moved aside by hand (`ckpt quarantine`): manifest.json stays unreadable (EIO)\n"
    )
    assert latest_text(root) is None  # it named the moved one; the next pick repoints it
    assert store.pick(root).chosen.ref.step == 10 and latest_text(root) == "step_00000010\n"
    assert main([*argv, "30"]) == Exit.USAGE
    assert "no such committed checkpoint" in capsys.readouterr().err
    assert main([*argv, "10", "--json"]) == Exit.OK
    doc = json.loads(capsys.readouterr().out)
    assert doc["name"] == "step_00000010" and doc["moved_to"].startswith(str(root / "quarantine"))


def test_pick_after_everything_was_moved_aside_by_hand_refuses_a_fresh_start(tmp_path: Path) -> None:
    root = tmp_path / "run"
    make_ckpt(root, 10)
    corrupt(root / "step_00000010", Corruption.TRUNCATE)
    store.quarantine_step(root, 10, "step_00000010: by hand")
    with pytest.raises(store.NoUsableCheckpoint, match=r"newest step_00000010-.*: by hand"):
        store.pick(root)


def test_disk_usage_counts_what_the_toolkit_writes_and_stops_below_its_depth(tmp_path: Path) -> None:
    """A nest deeper than anything the toolkit writes is not walked (each level of it would walk
    every level above it again on a mount without an entry cache): its files are not counted."""
    (tmp_path / "quarantine" / "step_00000010").mkdir(parents=True)
    (tmp_path / "quarantine" / "step_00000010" / "shard").write_bytes(b"x" * 100)
    deep = tmp_path / "step_99.tmp.1.elsewhere"
    for _ in range(MAX_DEPTH + 2):
        deep /= "d"
    deep.mkdir(parents=True)
    (deep / "far").write_bytes(b"y" * 1000)
    (deep.parents[2] / "near").write_bytes(b"z" * 10)  # in the deepest folder walked
    (deep.parents[1] / "below").write_bytes(b"w" * 10_000)  # one folder further: not walked
    assert store.disk_usage(tmp_path) == 110
