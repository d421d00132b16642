"""Every state item matters: a resume that skips restoring one of them ends with other parameters.

This is what makes the bit-exact tests meaningful: if an item could be dropped without changing
the result, a test that compares digests would not notice it missing.

Not ablated: the losses the resume's sanity step compares with (in the manifest, not the state);
the grad scaler (enabled only for fp16 on CUDA; on CPU it is disabled and its state is empty);
DataLoader worker RNG (derived from (seed, epoch, batch, sample), not state).
"""

from __future__ import annotations

import pytest
from trainer_helpers import EMA, SAVE_EVERY, digest, rewind, run_ok, train_args

from supervisor.resumable._train_state import ABLATABLE

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("item", ABLATABLE)
def test_skipping_one_item_changes_the_result(goldens, tmp_path, item):
    """Resume the uninterrupted run from its first checkpoint, skipping ``item``. The same resume
    without skipping anything is test_train_resume's kill -9 case: digest equal to the golden."""
    parallel, extra = ("fsdp", EMA) if item == "ema" else ("ddp", ())  # a run that keeps one
    golden = goldens.get(parallel, 2, *extra)
    root = rewind(golden, tmp_path / "run", SAVE_EVERY)
    r = run_ok(root, 2, *train_args(parallel, *extra, "--ablate", item))
    assert f"resume skipped restoring {item}" in r.output
    if item == "scheduler":  # the resume's sanity step must notice a schedule that restarted
        assert "resume sanity: LR" in r.output  # the trainer's, against its own schedule
        assert "did the LR scheduler's state come back?" in r.output  # any loop's, against the manifest
    assert digest(root) != digest(golden), f"skipping {item} on resume changed nothing: is it really state?"
