"""The resume's sanity step (supervisor/resumable/_sanity.py): the verdicts, and what ResumeSanity logs."""

from __future__ import annotations

import logging

import pytest

from supervisor.resumable._sanity import ResumeSanity, loss_verdict, lr_verdict

WINDOW = [2.10, 2.05, 2.12, 2.08, 2.06, 2.11]


def test_losses_in_line_with_the_saved_window_pass_and_a_jump_is_named() -> None:
    bad, line = loss_verdict(WINDOW, [2.07, 2.09, 2.04])
    assert not bad and line.startswith("resume sanity: first losses 2.0700, 2.0900, 2.0400 within")
    bad, line = loss_verdict(WINDOW, [2.07, 3.90, 2.04])  # a model from another step, say
    assert bad and "loss 3.9000 after resume vs saved window mean 2.0867" in line
    # a flat window still leaves the absolute slack
    assert not loss_verdict([1.0, 1.0], [1.04])[0] and loss_verdict([1.0, 1.0], [1.06])[0]
    assert loss_verdict([1.0], [5.0]) == (False, "")  # one loss: nothing to judge


@pytest.mark.parametrize(
    ("before", "now", "warned"),
    [
        (3e-3, 2.99e-3, False),  # a cosine step
        (1.2e-3, 2.4e-3, False),  # a linear warmup's step 1 -> 2: exactly 2x
        (3e-3, 6e-4, True),  # the warmup started again: LR at its step 1 of 5
        (3e-4, 3e-3, True),
        (3e-3, 0.0, True),
        (0.0, 1e-3, False),  # nothing to compare with
    ],
)
def test_an_lr_is_compared_with_the_step_before(before, now, warned) -> None:
    line = lr_verdict(before, now, 12)
    assert (line is not None) == warned
    assert line is None or f"LR {now:.6g} at step 12, {before:.6g} the step before" in line


def test_resume_sanity_catches_a_schedule_that_restarts_one_step_late(caplog) -> None:
    """A scheduler that was not restored: the optimizer's saved LR serves the first step, then
    the scheduler's first step puts its warmup's LR in. One warning, naming that step; then the
    losses are judged once the first 3 are in."""
    caplog.set_level(logging.INFO, logger="resumable")
    s = ResumeSanity(WINDOW, 3e-3, steps_left=100)
    s.observe(11, {"loss": 2.07, "lr": 3e-3})
    assert caplog.records == []
    s.observe(12, {"loss": float("nan"), "lr": 6e-4})  # a NaN is no loss to judge
    (warning,) = caplog.records
    assert warning.levelname == "WARNING" and "LR 0.0006 at step 12, 0.003 the step before" in warning.message
    s.observe(13, {"loss": 2.09, "lr": 1.2e-3})  # the warmup goes on: warned once is enough
    assert s.done and "first losses 2.0700, 2.0900 within" in caplog.records[-1].message
    s.observe(14, {"loss": 9.0})  # done: nothing more is logged
    assert len(caplog.records) == 2


def test_a_resume_one_step_before_the_end_is_judged_on_that_step(caplog) -> None:
    caplog.set_level(logging.INFO, logger="resumable")
    s = ResumeSanity(WINDOW, None, steps_left=1)  # and no LR was saved
    s.observe(30, {"loss": 7.5, "lr": 1.0})
    assert s.done and [r.levelname for r in caplog.records] == ["WARNING"] and "loss 7.5000" in caplog.text
