"""Pure: where a resumed run left the golden one, and the likely cause, in one line.

Input: the two runs' checkpoints compared step by step (``statediff.Comparison``, made by
``python -m supervisor.resumable._compare``) and the steps the run resumed from. The first step
whose checkpoints differ is the one named; of its items, the first in ``cause_order``:
what a step only counts or draws (each RNG stream draws as often whatever the data; the sampler
and the scheduler advance once a step) is a cause when it differs, while what training computes
(the model, the optimizer's moments, an average of the weights) differs whenever anything
upstream did, so it is named only when nothing else differs.
"""

from __future__ import annotations

from collections.abc import Sequence

from supervisor.format.statediff import (
    MODEL,
    NUMPY_RNG,
    OPTIMIZER,
    PYTHON_RNG,
    RANK_LOADERS,
    RANK_USER_ITEMS,
    STEP,
    TORCH_RNG,
    Comparison,
    ItemDiff,
)

DATA_DOC = "docs/adopting.md#data"
DETERMINISM_DOC = "docs/trainer.md"
SAMPLER = "sampler"
SCHEDULER = "scheduler"
_FIRST = (STEP, TORCH_RNG, PYTHON_RNG, NUMPY_RNG, SAMPLER, SCHEDULER)


def cause_order(d: ItemDiff) -> tuple[int, int]:
    """Causes first: the step counter, the RNG streams, the sampler, the scheduler, the trainer's
    own counters, then learned state (its own items, the optimizer, the model last)."""
    if d.item in _FIRST:
        at = _FIRST.index(d.item)
    elif d.item == OPTIMIZER:
        at = len(_FIRST) + 2
    elif d.item == MODEL:
        at = len(_FIRST) + 3
    else:
        at = len(_FIRST) + (1 if d.learned else 0)
    return at, -1 if d.rank is None else d.rank


def _ranks(ranks: Sequence[int]) -> str:
    return f"rank {ranks[0]}" if len(ranks) == 1 else f"ranks {', '.join(map(str, ranks))}"


def _rng_line(d: ItemDiff, ranks: Sequence[int], first_step: str) -> tuple[str, str]:
    """Which stream, what draws from it, and the fix."""
    if d.item == TORCH_RNG:
        stream = "the global torch RNG" if d.key != "cuda" else "the CUDA RNG"
        how = (
            f"something drew from it between resume() and {first_step} that the uninterrupted run did not "
            f"draw there; a DataLoader without generator= does that when its iterator is made: {DATA_DOC}"
        )
    else:
        stream = "Python's random module" if d.item == PYTHON_RNG else "numpy's global RNG"
        call = "random.*" if d.item == PYTHON_RNG else "np.random.*"
        how = (
            f"something called {call} between resume() and {first_step} that the uninterrupted run did not "
            f"call there (setup code every launch runs: draw before resume(), or from a generator of your own): {DATA_DOC}"
        )
    return f"{stream} of {_ranks(ranks)} differs from golden's", how


def _line(d: ItemDiff, ranks: Sequence[int], first_step: str) -> tuple[str, str]:
    """(what differs, the likely cause) for the item named (``ranks``: each rank whose file holds
    it differing, for a per-rank item; ``first_step``: the first step after the resume)."""
    if d.item in (TORCH_RNG, PYTHON_RNG, NUMPY_RNG):
        return _rng_line(d, ranks, first_step)
    if d.item == STEP:
        return "the step counter differs", "the loop's step is not the one Resumable saved"
    if d.item == SAMPLER:
        return (
            f"the sampler's state differs ({d.key}: {d.what})",
            f"its position after the resume is not the uninterrupted run's: advance it once per batch used, "
            f"and give it to Resumable: {DATA_DOC}",
        )
    if d.item == SCHEDULER:
        return (
            f"the LR scheduler's state differs ({d.key}: {d.what})",
            "is it among Resumable's objects, and stepped once per step, resumed or not?",
        )
    if d.item == RANK_USER_ITEMS and d.key.startswith(f"{RANK_LOADERS}."):
        name, _, rest = d.key[len(RANK_LOADERS) + 1 :].partition(".")
        return (
            f"the position of the loader '{name}' of {_ranks(ranks)} differs ({rest or name}: {d.what})",
            f"its position after the resume is not the uninterrupted run's: make it before resume(), "
            f"which restores it, and iterate it once per step: {DATA_DOC}",
        )
    if d.item == RANK_USER_ITEMS:
        return (
            f"your per-rank items (rank_items=) of {_ranks(ranks)} differ ({d.key}: {d.what})",
            "their state_dict does not hold all their state, or they change after resume() in a way the "
            "uninterrupted run does not",
        )
    if d.learned or d.item in (MODEL, OPTIMIZER):
        return (
            f"only learned state differs (first: {d.item} {d.key}); every RNG stream, the sampler and the "
            "scheduler equal golden's",
            "the batches after the resume differ (a data order or augmentation drawn neither from "
            f"(seed, step) nor from a saved position: {DATA_DOC}), or a step is not deterministic "
            f"({DETERMINISM_DOC})",
        )
    return (
        f"your item '{d.item}' differs ({d.key}: {d.what})",
        "its state_dict does not hold all its state, or it changes after resume() in a way the "
        "uninterrupted run does not",
    )


def where(step: int, compared: Sequence[int], resumed: int) -> str:
    """The step named, placed after the resume before it: the first checkpoint compared after it
    or not, and whether the one it resumed from was compared (so equal: the walk stops at the
    first difference)."""
    first = not [s for s in compared if resumed < s < step]
    held = " (which equals golden's)" if resumed in compared else ""
    return f"at step {step}, the {'first ' if first else ''}checkpoint compared after the resume from step {resumed}{held}"


def diagnose(comparison: Comparison | None, resumed_from: Sequence[int]) -> str:
    """One line: the first step and item where the run left golden, and the likely cause; or why
    the checkpoints could not tell."""
    if comparison is None:
        return "the checkpoints were not compared"
    first = comparison.first
    compared = [s.step for s in comparison.steps]
    if first is None:
        if comparison.problems and not compared:
            return f"checkpoints not compared: {comparison.problems[0]}"
        if not compared:
            return "no checkpoint of this run is at a step golden kept: nothing to compare"
        steps = ", ".join(map(str, compared))
        return (
            f"every checkpoint both runs hold is equal (steps {steps}): the difference arose after the last "
            "of them, or lies in what a checkpoint does not hold (state kept outside Resumable's objects)"
        )
    d = min(first.differs, key=cause_order)
    ranks = sorted({x.rank for x in first.differs if x.item == d.item and x.rank is not None})
    before = [r for r in resumed_from if r < first.step]
    if not before:
        what, _ = _line(d, ranks, "")
        return (
            f"{what} at step {first.step}, before any resume: the uninterrupted runs already differ there, "
            f"so a step is not deterministic run to run ({DETERMINISM_DOC}), whatever the resume does"
        )
    what, cause = _line(d, ranks, f"step {before[-1] + 1}")
    return f"{what} {where(first.step, [s for s in compared if s != first.step], before[-1])}: {cause}"
