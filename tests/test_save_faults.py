"""ENOSPC at every point of a save, one rank's or both ranks' (issue 44: a failed save once left the
ranks in different collectives for good, beating all along). One trial per point here, and 20
random points; ``make save-fault-sweep`` runs 20 per point and prints the counts (tests/save_faults.py
says what a point, a trial and a pass are)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
from save_faults import sweep

pytestmark = pytest.mark.slow

TRIALS = int(os.environ.get("SAVE_FAULT_TRIALS", "1"))


def test_enospc_at_every_point_of_a_save_ends_agreed_on_every_rank_and_digest_equal(
    tmp_path: Path, need_fuse: None
) -> None:
    s = sweep(tmp_path, TRIALS, random_trials=20 * TRIALS)
    print(f"\n{s.report()}")
    points = {t.point.name for r in s.runs for t in r.trials}
    assert len(points) >= 40, f"only {len(points)} points: the reference run's counts were {s.counts}"
    assert not s.failures(), "\n".join(s.failures())
