"""The trainer's knobs on top of supervisor.resumable.Resumable, end to end with real torchrun (gloo, 2 ranks).
Exactness by final digests, as everywhere. The examples under the drill: tests/test_examples_drill.py."""

from __future__ import annotations

import subprocess
import sys
from dataclasses import replace

import pytest
from trainer_helpers import (
    EMA,
    REPO,
    SEED,
    committed,
    copy_run,
    digest,
    final,
    heartbeat_exit_codes,
    metrics,
    rewind,
    run,
    run_ok,
    train_args,
    trainer_env,
)

from supervisor.format.exitcodes import Exit
from supervisor.format.manifest import read_manifest
from train_ref.config import get_config
from train_ref.data import Corpus
from train_ref.schedule import WarmupCosine

pytestmark = pytest.mark.slow


def _refusal(output: str) -> str:
    return next(x for x in output.splitlines() if "refused" in x)


def test_load_step_resumes_from_that_step_and_moves_the_newer_ones_aside(goldens, tmp_path):
    golden = goldens.get("ddp", 2)
    root = copy_run(golden, tmp_path / "run")
    r = run_ok(root, 2, *train_args("ddp", "--load-step", "10"))
    assert "resumed from step_00000010, next step 11" in r.output
    # the sanity step: the first losses against those reported before the checkpoint
    assert "resume sanity: first losses" in r.output and "resume sanity: LR" not in r.output
    moved = sorted(p.name.split("-")[0] for p in (root / "quarantine").iterdir())
    assert moved == ["step_00000020", "step_00000030"]
    assert digest(root) == digest(golden)


def test_load_step_of_a_step_never_committed_is_a_one_line_refusal(goldens, tmp_path):
    root = copy_run(goldens.get("ddp", 2), tmp_path / "run")
    r = run(root, 2, *train_args("ddp", "--load-step", "15"))
    assert set(heartbeat_exit_codes(root).values()) == {Exit.BAD_CONFIG}
    line = _refusal(r.output)
    assert "--load-step 15" in line and "committed steps: 10, 20, 30" in line, line
    assert "train_ref/" not in r.output, "a worker traceback (torchrun's own one names no file of ours)"
    assert not (root / "quarantine").exists()


@pytest.mark.parametrize(
    ("extra", "named"),
    [(["--seed", str(SEED + 1)], f"seed {SEED} -> {SEED + 1}"), (["--amp", "bf16"], "amp 'off' -> 'bf16'")],
)
def test_a_changed_seed_or_precision_is_refused_naming_the_field_even_when_allowed(
    goldens, tmp_path, extra, named
):
    root = copy_run(goldens.get("ddp", 2), tmp_path / "run")
    # train_args puts --seed 7 first; a later --seed wins
    r = run(root, 2, *train_args("ddp", *extra, steps=40))
    assert set(heartbeat_exit_codes(root).values()) == {Exit.MISMATCH}
    assert named in _refusal(r.output), _refusal(r.output)
    r = run(root, 2, *train_args("ddp", *extra, "--allow-config-change", steps=40))
    assert set(heartbeat_exit_codes(root).values()) == {Exit.MISMATCH}
    line = _refusal(r.output)
    assert named in line and "--allow-config-change cannot apply" in line, line


def test_allow_config_change_applies_a_new_learning_rate_on_resume(goldens, tmp_path):
    golden = goldens.get("ddp", 2)
    root = rewind(golden, tmp_path / "run", 20)
    r = run(root, 2, *train_args("ddp", "--lr", "0.001"))
    assert set(heartbeat_exit_codes(root).values()) == {Exit.MISMATCH}
    assert "lr 0.003 -> 0.001" in _refusal(r.output)
    r = run_ok(root, 2, *train_args("ddp", "--lr", "0.001", "--allow-config-change"))
    assert "applying lr 0.003 -> 0.001" in r.output
    assert "resume sanity: LR" not in r.output  # the scheduler and the optimizer agree with it
    cfg = replace(
        get_config("tiny", Corpus.load(None).tokenizer.vocab_size), lr=0.001
    )  # floor: min_lr / 0.001
    lr21 = next(m.lr for m in reversed(metrics(root)) if m.step == 21)
    assert lr21 == pytest.approx(0.001 * WarmupCosine.of(cfg)(20), rel=1e-12)
    assert digest(root) != digest(golden)


def test_time_based_saves_are_decided_once_for_every_rank(tmp_path):
    root = tmp_path / "run"
    run_ok(root, 2, *train_args("ddp", "--save-every-s", "0.000001", "--keep", "10", steps=6, save_every=100))
    assert committed(root) == [f"step_{s:08d}" for s in range(1, 7)]


def test_the_metrics_of_the_saved_step_are_in_its_manifest(goldens):
    golden = goldens.get("ddp", 2)
    m = read_manifest(golden / "step_00000020")
    line = next(x for x in metrics(golden) if x.step == 20)
    assert m.metrics["loss"] == line.loss and m.metrics["lr"] == line.lr
    assert m.meta["identity"]["seed"] == SEED and m.meta["identity"]["amp"] == "off"


def test_a_plain_loop_says_where_it_resumed_from_without_any_logging_config(tmp_path):
    """examples/plain_loop.py configures no logging: rank 0 still says, once, that it starts at
    step 0, then where it resumed from and what was verified."""
    root = tmp_path / "run"
    loop = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    loop += ["examples/plain_loop.py", "--ckpt-root", str(root), "--save-every", "10"]
    env = trainer_env()
    first = subprocess.run(
        [*loop, "--steps", "20"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert first.returncode == 0, first.stderr[-3000:]
    said = [x for x in first.stderr.splitlines() if x.startswith("resumable: ")]
    assert said == [f"resumable: no checkpoint in {root}: starting at step 0"], first.stderr[-3000:]
    again = subprocess.run(
        [*loop, "--steps", "25"], cwd=REPO, env=env, capture_output=True, text=True, timeout=600
    )
    assert again.returncode == 0, again.stderr[-3000:]
    (line,) = [x for x in again.stderr.splitlines() if x.startswith("resumable: ")]
    files = len(read_manifest(root / "step_00000020").files)
    assert line.startswith(
        f"resumable: resumed from step_00000020, next step 21: {root / 'step_00000020'}, {files} files, "
    ), line
    assert line.endswith(
        "; every checksum verified (deep, over 2 ranks); identity, data and global batch match"
    )


def test_init_from_starts_a_new_run_from_another_runs_weights(goldens, tmp_path):
    golden = goldens.get("ddp", 2)
    root = tmp_path / "new"
    # --steps 0: nothing trained, so the final digest is that of the weights loaded; a moving
    # average of the parameters starts at them too
    run_ok(root, 2, *train_args("fsdp", "--init-from", str(golden), "--seed", "99", *EMA, steps=0))
    f = final(root)
    assert f["params_sha256"] == digest(golden) == f["ema_sha256"]
    run_ok(
        root,
        2,
        *train_args("fsdp", "--init-from", f"{golden}:20", "--init-optimizer", "--seed", "99", steps=3),
    )
    m = read_manifest(root / "step_00000003")
    assert m.meta["init_from"] == str(golden / "step_00000020") and m.meta["identity"]["seed"] == 99
    r = run(tmp_path / "other", 2, *train_args("fsdp", "--init-from", f"{golden}:15", steps=3))
    assert set(heartbeat_exit_codes(tmp_path / "other").values()) == {Exit.BAD_CONFIG}
    assert "--init-from" in _refusal(r.output) and "no committed step 15" in _refusal(r.output)
