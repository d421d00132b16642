"""The drill says why a resumed run is not the same run: its checkpoints are compared with golden's
step by step (supervisor/resumable/_compare.py), and the verdict names the first step and state item
that differ and the likely cause (supervisor/drill/diverge.py). End to end on a user's trainer with
the DataLoader-without-generator bug (tests/generator_bug_trainer.py)."""

from __future__ import annotations

import json
import math
import os
import subprocess

import pytest
import torch
from commands import REPO, supervisor_cmd

from supervisor.drill.diverge import diagnose
from supervisor.drill.rank_faults import keep_committed
from supervisor.drill.switch import Keep
from supervisor.format.layout import step_dirname
from supervisor.format.statediff import Comparison, ItemDiff, StepDiff
from supervisor.resumable._compare import how_differ, item_diff


def _cmp(*steps: tuple[int, tuple[ItemDiff, ...]]) -> Comparison:
    return Comparison(tuple(StepDiff(s, d) for s, d in steps))


MODEL = ItemDiff("model", None, "0.weight", "values differ", learned=True)
OPTIM = ItemDiff("optimizer", None, "state.0.weight.exp_avg", "values differ", learned=True)


def test_a_draw_from_the_global_torch_rng_is_named_with_its_step_and_fix():
    rng = [ItemDiff("torch_rng", r, "cpu", "values differ") for r in (1, 0)]
    line = diagnose(_cmp((10, ()), (20, ()), (30, (MODEL, OPTIM, *rng))), [20])
    assert line.startswith("the global torch RNG of ranks 0, 1 differs from golden's at step 30"), line
    assert "the first checkpoint compared after the resume from step 20 (which equals golden's)" in line
    assert "between resume() and step 21" in line and "DataLoader without generator=" in line
    assert line.endswith("docs/adopting.md#data")


def test_each_stream_and_the_bookkeeping_come_before_learned_state():
    numpy_rng = ItemDiff("numpy_rng", 1, "keys", "values differ")
    sampler = ItemDiff("sampler", None, "batch", "3 vs 2")
    sched = ItemDiff("scheduler", None, "last_epoch", "30 vs 29")
    counter = ItemDiff("tokens_seen", None, "n", "90 vs 80")
    ema = ItemDiff("ema", None, "module.0.weight", "values differ", learned=True)
    assert "numpy's global RNG of rank 1" in diagnose(_cmp((30, (MODEL, sampler, numpy_rng))), [20])
    assert "the sampler's state differs (batch: 3 vs 2)" in diagnose(_cmp((30, (sched, sampler))), [20])
    assert "LR scheduler" in diagnose(_cmp((30, (MODEL, sched, counter))), [20])
    assert "your item 'tokens_seen' differs" in diagnose(_cmp((30, (ema, OPTIM, counter))), [20])
    loader = ItemDiff("user", 0, "loaders.data.batch", "3 vs 2")
    assert "the position of the loader 'data' of rank 0 differs (batch: 3 vs 2)" in diagnose(
        _cmp((30, (MODEL, loader))), [20]
    )
    only = diagnose(_cmp((20, ()), (30, (MODEL, ema, OPTIM))), [20])
    assert only.startswith("only learned state differs (first: ema module.0.weight)"), only
    assert "the batches after the resume differ" in only


def test_a_difference_before_any_resume_is_no_resume_fault():
    line = diagnose(_cmp((10, (ItemDiff("torch_rng", 0, "cpu", "values differ"), MODEL))), [20])
    assert "at step 10, before any resume" in line and "not deterministic" in line
    assert "DataLoader" not in line


def test_a_later_checkpoint_is_named_as_such_when_the_first_was_not_compared():
    line = diagnose(_cmp((60, (MODEL,))), [20, 40])
    assert "at step 60, the first checkpoint compared after the resume from step 40;" not in line
    assert "at step 60, the first checkpoint compared after the resume from step 40:" in line
    assert "which equals golden's" not in line


def test_nothing_to_tell_is_said_as_such():
    assert "every checkpoint both runs hold is equal (steps 10, 20)" in diagnose(
        _cmp((10, ()), (20, ())), [10]
    )
    assert "nothing to compare" in diagnose(Comparison(), [10])
    assert diagnose(Comparison((), ("step 10: boom",)), [10]) == "checkpoints not compared: step 10: boom"
    assert diagnose(None, [10]) == "the checkpoints were not compared"


def test_the_comparison_record_round_trips_and_garbage_is_refused():
    c = _cmp((10, ()), (20, (MODEL, ItemDiff("torch_rng", 3, "cpu", "values differ"))))
    assert Comparison.from_json(c.to_json()) == c
    assert c.first is not None and c.first.step == 20
    for bad in ("", "[]", '{"steps": [{"step": "x"}]}'):
        with pytest.raises(ValueError, match="not a checkpoint comparison"):
            Comparison.from_json(bad)


def test_entries_compare_bit_for_bit():
    nan = torch.tensor([math.nan, 1.0])
    assert how_differ(nan, nan.clone()) == ""  # the same bits: equal, though NaN != NaN
    assert how_differ(torch.tensor([0.0]), torch.tensor([-0.0])) == "values differ"
    assert how_differ(torch.zeros(2), torch.zeros(2, dtype=torch.float64)).startswith("dtype")
    assert how_differ(torch.zeros(2), torch.zeros(3)) == "shape (2,) vs (3,)"
    assert how_differ(math.nan, math.nan) == "" and how_differ(1, 1.0) == "int vs float"
    got = item_diff("scheduler", None, {"last_epoch": 3, "lrs": [0.1]}, {"last_epoch": 3, "lrs": [0.2]})
    assert got == ItemDiff("scheduler", None, "lrs.0", "0.1 vs 0.2")
    assert item_diff("user", 1, {"a": 1}, {"a": 1, "b": torch.ones(1)}) == ItemDiff(
        "user", 1, "b", "only in the resumed run", learned=True
    )
    assert item_diff("model", None, {"w": torch.ones(2)}, {"w": torch.ones(2)}) is None


def test_keep_links_each_committed_checkpoint_once(tmp_path):
    root, into = tmp_path / "golden", tmp_path / "kept"
    for step in (10, 20):
        (root / step_dirname(step)).mkdir(parents=True)
        (root / step_dirname(step) / "a.distcp").write_bytes(b"x" * step)
    (root / "step_00000030.tmp.1.host").mkdir()  # being written: not a checkpoint yet
    keep = Keep(root, into)
    assert Keep.decode(keep.encode()) == keep
    kept = keep_committed(keep, set())
    assert kept == {step_dirname(10), step_dirname(20)}
    assert {p.name for p in into.iterdir()} == kept
    linked = into / step_dirname(20) / "a.distcp"
    assert os.stat(linked).st_ino == os.stat(root / step_dirname(20) / "a.distcp").st_ino
    os.rename(root / step_dirname(10), root / "step_00000010.deleting.1.host")  # pruned since
    assert keep_committed(keep, kept) == {step_dirname(20)}
    assert (into / step_dirname(10) / "a.distcp").read_bytes() == b"x" * 10  # kept all the same


@pytest.mark.slow
def test_the_drill_names_the_global_rng_a_dataloader_without_generator_drew_from(tmp_path):
    """kill -9 of a rank of a trainer whose DataLoader, made after resume(), has no generator=:
    the digest differs, and the verdict says the global torch RNG differs at the first checkpoint
    after the resume, while the one it resumed from equals golden's (or was a memory snapshot:
    no checkpoint of golden's at its step) (30 steps: the run's retention,
    3, holds every checkpoint, wherever the kill lands). Golden's are linked aside as it commits them."""
    work = tmp_path / "drill"
    cmd = supervisor_cmd("drill", "--trainer", "tests/generator_bug_trainer.py", "--scenario", "kill9")
    cmd += ["--ranks", "2", "--steps", "30", "--save-every", "10", "--workdir", str(work), "--json"]
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=600)
    assert p.returncode == 1, p.stdout + p.stderr[-3000:]
    (scenario,) = json.loads(p.stdout)["scenarios"]
    checks = {c["name"]: c for c in scenario["checks"]}
    assert checks["run completed"]["ok"] and not checks["final digest equals golden"]["ok"]
    (resume,) = scenario["resumes"]
    at = resume["ckpt_step"]
    # From a checkpoint, compared equal to golden's; from the memory tier (on by default), a state
    # the faulted run has no checkpoint of (a step golden kept none of, or one whose save the kill
    # cut short), so none compared: the next periodic checkpoint is the first compared after it.
    why = checks["first state that differs from golden"]
    assert not why["ok"]
    held = " (which equals golden's)"
    said = why["detail"].replace(held, "", 1) if at % 10 == 0 else why["detail"]
    assert said.startswith(
        f"the global torch RNG of ranks 0, 1 differs from golden's at step {at // 10 * 10 + 10}, the first "
        f"checkpoint compared after the resume from step {at}: something drew "
        f"from it between resume() and step {at + 1}"
    ), why["detail"]
    assert "DataLoader without generator=" in why["detail"] and "docs/adopting.md#data" in why["detail"]
    # linked at the step boundary after its commit (the final save has none: its run dir holds it)
    assert os.stat(work / "golden-kept" / step_dirname(10) / "manifest.json").st_nlink == 2
