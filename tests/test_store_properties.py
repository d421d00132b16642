"""Property tests: random sequences of commits, crashes at every point of the commit protocol,
corruptions, picks and prunes, checked against a model that knows which checkpoints are whole.

Invariants: pick never returns an incomplete or corrupt checkpoint; no valid committed checkpoint
is deleted or quarantined by pick; after pick ``latest`` names the newest valid one (absent when
none); with nothing valid, pick refuses a fresh start exactly when something is quarantined; every
quarantined checkpoint has a reason; prune keeps the newest valid one, deletes only valid ones
beyond retention, and its quarantine retention never removes the last copy of a step newer than
every valid one. A second test kills a real writer with SIGKILL at each phase; a third checks the
quarantine retention's plan on its own.
"""

from __future__ import annotations

import shutil
import signal
import subprocess
import sys
import tempfile
import textwrap
from pathlib import Path

import pytest
from commands import REPO
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule
from store_helpers import (
    assert_quarantine_explained,
    committed_names,
    latest_text,
    quarantine_dirs,
    write_tmp,
)

from supervisor import store
from supervisor.drill.corruption import Corruption, corrupt
from supervisor.format.layout import MANIFEST, RunDir, step_dirname
from supervisor.format.manifest import CheckpointInfo

PHASES = ("fsync", "manifest", "rename", "latest")
# A crash at these phases happens before the rename: the checkpoint never becomes visible.
BEFORE_RENAME = frozenset({"fsync", "manifest", "rename"})


class Crash(Exception):
    """Raised from on_phase: the writer dies at that point of the protocol."""


def _crash_at(phase: str | None):
    def hook(p: str) -> None:
        if p == phase:
            raise Crash(p)

    return hook


class StoreMachine(RuleBasedStateMachine):
    """A trainer that commits, crashes and resumes from pick, while storage rots underneath it."""

    def __init__(self) -> None:
        super().__init__()
        self.root = Path(tempfile.mkdtemp(prefix="store-prop-"))
        self.valid: set[str] = set()  # committed and untouched, per the model
        self.invalid: set[str] = set()  # committed, then damaged
        self.step = 0  # where the trainer is

    def teardown(self) -> None:
        shutil.rmtree(self.root, ignore_errors=True)

    # ------------------------------------------------------------ actions

    @rule(inc=st.integers(1, 3), crash=st.sampled_from((None, *PHASES)), half_manifest=st.booleans())
    def commit(self, inc: int, crash: str | None, half_manifest: bool) -> None:
        step = self.step + inc
        tmp = write_tmp(self.root, step)
        try:
            store.commit(self.root, tmp, CheckpointInfo(step, 2), on_phase=_crash_at(crash))
        except Crash:
            if crash == "rename" and half_manifest:  # died halfway through writing the manifest
                (tmp / MANIFEST).write_bytes((tmp / MANIFEST).read_bytes()[:40])
            if crash not in BEFORE_RENAME:
                self.valid.add(step_dirname(step))
            else:
                assert step_dirname(step) not in committed_names(self.root)
            self.restart()
            return
        self.valid.add(step_dirname(step))
        self.step = step

    @precondition(lambda self: self.valid)
    @rule(data=st.data(), kind=st.sampled_from(tuple(Corruption)))
    def rot(self, data: st.DataObject, kind: str) -> None:
        name = data.draw(st.sampled_from(sorted(self.valid)))
        corrupt(self.root / name, kind)
        self.valid.discard(name)
        self.invalid.add(name)

    @precondition(lambda self: self.valid)
    @rule(data=st.data(), kind=st.sampled_from(tuple(Corruption)))
    def rot_then_restart(self, data: st.DataObject, kind: str) -> None:
        """Rot found by the next resume: fills the quarantine that prune's retention works on."""
        self.rot(data, kind)
        self.restart()

    @rule(kind=st.sampled_from(("garbage", "dangling", "empty", "missing", "symlink_to_old")))
    def rot_latest(self, kind: str) -> None:
        latest = RunDir.of(self.root).latest
        latest.unlink(missing_ok=True)
        if kind == "garbage":
            latest.write_bytes(b"\x00\xffstep_garbage")
        elif kind == "dangling":
            latest.write_text("step_99999999\n")
        elif kind == "empty":
            latest.write_text("")
        elif kind == "symlink_to_old":
            latest.symlink_to("step_00000000")

    @rule()
    def stray_root_file(self) -> None:
        (self.root / "notes.txt").write_text("someone's notes")

    @rule()
    def restart(self) -> None:
        """The trainer resumes from what pick chooses."""
        chosen = self.pick()
        self.step = chosen.ref.step if chosen else 0

    @rule(
        keep=st.integers(2, 4),
        milestone=st.sampled_from((0, 2, 5)),
        q_keep=st.sampled_from((None, 0, 1, 3)),
        q_bytes=st.sampled_from((None, 0, 600)),
    )
    def prune(self, keep: int, milestone: int, q_keep: int | None, q_bytes: int | None) -> None:
        valid_before = _steps(self.valid)
        q_before = {p.name for p in quarantine_dirs(self.root)}
        # prune's check is quick: a bit-flipped checkpoint counts as valid there
        floor = max((r.step for r in store.list_checkpoints(self.root) if store.validate(r).ok), default=-1)
        res = store.prune(
            self.root,
            policy=store.RetentionPolicy(keep=keep, milestone_every=milestone),
            quarantine_keep=q_keep,
            quarantine_max_bytes=q_bytes,
        )
        q_after = {p.name for p in quarantine_dirs(self.root)}
        assert set(res.quarantine_removed) <= q_before and not set(res.quarantine_removed) & q_after
        must_stay = {_step(n) for n in q_before if _step(n) > floor}
        assert must_stay <= {_step(n) for n in q_after}, (
            "removed the last copy of a step newer than every valid"
        )
        if q_keep is not None:
            assert len(q_before - set(res.quarantine_removed)) <= max(q_keep, len(must_stay))
        deleted, quarantined = set(res.deleted), {n for n, _ in res.quarantined}
        assert deleted <= self.valid, "prune deleted a damaged checkpoint instead of quarantining it"
        assert quarantined <= self.invalid, "prune quarantined a valid checkpoint"
        if valid_before:
            assert step_dirname(max(valid_before)) not in deleted, "prune deleted the newest valid"
            assert len(self.valid - deleted) >= min(keep, len(self.valid))
        for n in deleted:
            assert milestone == 0 or int(n.split("_")[1]) % milestone != 0
        self.valid -= deleted
        self.invalid -= quarantined
        assert_quarantine_explained(self.root)

    # ------------------------------------------------------------ checks

    def pick(self) -> store.Verdict | None:
        newest_valid = max(_steps(self.valid), default=None)
        try:
            res = store.pick(self.root, deep=True)
        except store.NoUsableCheckpoint as e:
            assert newest_valid is None, "refused a resume while a valid checkpoint exists"
            assert quarantine_dirs(self.root), "refused a fresh start with nothing quarantined"
            res = e.result
        else:
            assert newest_valid is not None or not quarantine_dirs(self.root), "silent fresh start"
        quarantined = {n for n, _ in res.quarantined}
        assert not quarantined & self.valid, f"pick quarantined valid {quarantined & self.valid}"
        if newest_valid is None:
            assert res.chosen is None
            assert latest_text(self.root) is None
        else:
            assert res.chosen is not None and res.chosen.ref.step == newest_valid
            assert latest_text(self.root) == step_dirname(newest_valid) + "\n"
            assert all(_step(n) < newest_valid for n in self.invalid - quarantined)
        self.invalid -= quarantined
        assert_quarantine_explained(self.root)
        return res.chosen

    @invariant()
    def model_matches_disk(self) -> None:
        assert committed_names(self.root) == self.valid | self.invalid
        for name in self.valid:
            assert store.validate(store.CheckpointRef(_step(name), self.root / name), deep=True).ok


def _step(name: str) -> int:
    """step_00000010, or a quarantined step_00000010-<utc>."""
    return int(name[5:13])


def _steps(names: set[str]) -> list[int]:
    return [_step(n) for n in names]


StoreMachine.TestCase.settings = settings(
    max_examples=40,
    stateful_step_count=20,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
test_store_machine = StoreMachine.TestCase


# ---------------------------------------------------------------- real SIGKILL at each phase

_WRITER = textwrap.dedent(
    """
    import os, signal, sys
    sys.path.insert(0, sys.argv[3])
    from store_helpers import make_ckpt, write_tmp
    from supervisor import store
    from supervisor.format.manifest import CheckpointInfo
    root, phase = sys.argv[1], sys.argv[2]
    make_ckpt(root, 10)
    tmp = write_tmp(root, 20)
    def die(p):
        if p == phase:
            os.kill(os.getpid(), signal.SIGKILL)
    store.commit(root, tmp, CheckpointInfo(20, 2), on_phase=die)
    """
)


@pytest.mark.parametrize("phase", PHASES)
def test_sigkill_at_each_phase_leaves_old_or_new_state(tmp_path: Path, phase: str) -> None:
    root = tmp_path / "run"
    p = subprocess.run(
        [sys.executable, "-c", _WRITER, str(root), phase, str(Path(__file__).parent)],
        cwd=REPO,
        timeout=60,
        capture_output=True,
    )
    assert p.returncode == -signal.SIGKILL, p.stderr.decode()
    pointed = store.read_latest(root)
    assert pointed is not None
    assert store.validate(store.CheckpointRef(_step(pointed), root / pointed), deep=True).ok
    expected = 10 if phase in BEFORE_RENAME else 20
    assert pointed == "step_00000010"  # latest moves only after the rename is durable
    res = store.pick(root, deep=True)
    assert res.chosen.ref.step == expected and not res.quarantined
    assert latest_text(root) == step_dirname(expected) + "\n"
    assert len(store.list_tmp(root)) == (1 if phase in BEFORE_RENAME else 0)
