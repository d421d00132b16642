"""The resume's sanity step: are the loss and the learning rate continuous across the resume?

A resume that restored the wrong thing often still runs: a scheduler that was not saved starts its
warmup again, a model loaded from an older checkpoint than the optimizer shows a loss jump. Both
show in the first steps after a resume, against what the run reported just before its checkpoint.
So each manifest records the last ``LOSS_WINDOW`` losses the loop reported
(``META_RECENT_LOSSES``) beside the last step's metrics (its ``lr``), and after a resume rank 0
compares the first ``SANITY_STEPS`` losses with them, and each of those steps' learning rate with
the step's before. A warning, never a stop: a loss may legitimately move (a new data shard), a
schedule may step (a step decay at exactly that step).

Pure functions for the verdicts; ``ResumeSanity`` feeds them from the metrics the loop reports.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Mapping, Sequence

log = logging.getLogger("resumable")

LOSS_WINDOW = 16  # losses a manifest records
SANITY_STEPS = 3  # losses after a resume compared with them
# A loss after the resume is out of line beyond this many standard deviations of the saved window,
# plus a small absolute slack for a flat window.
LOSS_JUMP_SIGMAS = 4.0
LOSS_JUMP_SLACK = 0.05
# A learning rate in the first steps after the resume against the step's before (the first: the
# saved step's): more than this factor either way is a schedule that restarted (a warmup starting
# again: 5-1000x). A linear warmup's own steps are at most 2x (its step 1 -> 2).
LR_JUMP = 2.0


def loss_verdict(window: Sequence[float], first: Sequence[float]) -> tuple[bool, str]:
    """(out of line?, the line to log) for the first losses after a resume against the saved
    window (at least two losses; fewer: nothing to judge, (False, ""))."""
    if len(window) < 2 or not first:
        return False, ""
    mean = sum(window) / len(window)
    std = math.sqrt(sum((x - mean) ** 2 for x in window) / (len(window) - 1))
    limit = LOSS_JUMP_SIGMAS * std + LOSS_JUMP_SLACK
    worst = max(first, key=lambda x: abs(x - mean))
    if abs(worst - mean) > limit:
        return True, (
            f"resume sanity: loss {worst:.4f} after resume vs saved window mean {mean:.4f} "
            f"(std {std:.4f}, limit ±{limit:.4f})"
        )
    shown = ", ".join(f"{x:.4f}" for x in first)
    return (
        False,
        f"resume sanity: first losses {shown} within ±{limit:.4f} of the saved window mean {mean:.4f}",
    )


def lr_verdict(before: float, now: float, step: int) -> str | None:
    """The warning when the learning rate of ``step`` is more than ``LR_JUMP`` times off the
    step's before (either way), else None. An LR of 0 before (a schedule at its start or end)
    gives nothing to compare with."""
    if before <= 0 or not math.isfinite(before) or not math.isfinite(now):
        return None
    if now <= 0 or max(now / before, before / now) > LR_JUMP:
        return (
            f"resume sanity: LR {now:.6g} at step {step}, {before:.6g} the step before: did the LR "
            f"scheduler's state come back?"
        )
    return None


class ResumeSanity:
    """Rank 0, after a resume: hears the metrics of each of the first ``SANITY_STEPS`` steps
    (``observe``), compares each step's LR with the step's before (the first with the saved
    step's: a scheduler that was not restored may keep the saved LR for a step, then start its
    warmup again), and the losses with the saved window once it has them; logs each verdict once."""

    def __init__(self, window: Sequence[float], saved_lr: float | None, steps_left: int):
        self.window, self.lr = list(window), saved_lr
        self.wanted = min(SANITY_STEPS, steps_left)
        self.seen = 0
        self.first: list[float] = []
        self.lr_warned = False

    @property
    def done(self) -> bool:
        return self.seen >= self.wanted

    def observe(self, step: int, metrics: Mapping[str, float]) -> None:
        if self.done:
            return
        self.seen += 1
        lr = metrics.get("lr")
        if lr is not None and self.lr is not None and not self.lr_warned:
            warning = lr_verdict(self.lr, float(lr), step)
            if warning:
                self.lr_warned = True
                log.warning("%s", warning)
        self.lr = None if lr is None else float(lr)
        loss = metrics.get("loss")
        if loss is not None and math.isfinite(loss):
            self.first.append(float(loss))
        if self.done and self.first:
            bad, line = loss_verdict(self.window, self.first)
            if line:
                (log.warning if bad else log.info)("%s", line)
