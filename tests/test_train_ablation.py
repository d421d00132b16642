"""Every state item matters: a resume that skips restoring one of them ends with other parameters.

This is what makes the bit-exact tests meaningful: if an item could be dropped without changing
the result, a test that compares digests would not notice it missing. The control (nothing
skipped) must still match, so a difference comes from the skipped item alone.

Not ablated: the loss window (only read by the resume sanity check, it never changes an update);
the grad scaler (enabled only for fp16 on CUDA; on CPU it is disabled and its state is empty);
DataLoader worker RNG (derived from (seed, epoch, batch, sample), not state).
"""

from __future__ import annotations

import pytest
from trainer_helpers import copy_run, digest, run_ok, train_args

from train_ref.state import ABLATABLE

pytestmark = pytest.mark.slow

RESUME_AT, END = 15, 18


@pytest.fixture(scope="module")
def half_run(tmp_path_factory):
    root = tmp_path_factory.mktemp("ablation") / "half"
    run_ok(root, 2, *train_args("ddp", steps=RESUME_AT))
    return root


@pytest.fixture(scope="module")
def control(half_run, tmp_path_factory):
    root = copy_run(half_run, tmp_path_factory.mktemp("ablation_control") / "run")
    run_ok(root, 2, *train_args("ddp", steps=END))
    return digest(root)


@pytest.mark.parametrize("item", ABLATABLE)
def test_skipping_one_item_changes_the_result(half_run, control, tmp_path, item):
    root = copy_run(half_run, tmp_path / "run")
    r = run_ok(root, 2, *train_args("ddp", "--ablate", item, steps=END))
    assert f"resume skipped restoring {item}" in r.output
    assert digest(root) != control, f"skipping {item} on resume changed nothing: is it really state?"
