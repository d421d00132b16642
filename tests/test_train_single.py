"""``python -m train_ref.train`` without torchrun: one process (world size 1) with one line saying
so, no traceback; it resumes its own checkpoints and ends digest-equal to the same run under
``torchrun --nproc-per-node=1``."""

from __future__ import annotations

import json
import subprocess
import sys

from commands import REPO, supervisor_cmd
from trainer_helpers import SEED, digest, rewind, run_ok, train_args, trainer_env

from supervisor import store
from supervisor.format.layout import FINAL, RunDir, step_dirname
from supervisor.format.manifest import read_manifest
from supervisor.format.metrics import read_metrics


def alone(root, *args: str) -> subprocess.CompletedProcess[str]:
    env = {k: v for k, v in trainer_env().items() if k not in ("RANK", "WORLD_SIZE", "LOCAL_RANK")}
    cmd = [sys.executable, "-m", "train_ref.train", "--ckpt-root", str(root), "--seed", str(SEED), *args]
    return subprocess.run(cmd, cwd=REPO, env=env, capture_output=True, text=True, timeout=600)


def test_without_torchrun_it_runs_as_one_process_and_resumes_exactly(tmp_path):
    args = train_args("ddp", steps=12, save_every=4)
    golden = tmp_path / "golden"
    run_ok(golden, 1, *args)

    p = alone(tmp_path / "alone", *args)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "not started by torchrun: running as one process" in p.stderr
    assert "Traceback" not in p.stderr
    assert digest(tmp_path / "alone") == digest(golden)

    resumed = rewind(tmp_path / "alone", tmp_path / "resumed", 8)
    (resumed / FINAL).unlink(missing_ok=True)
    p = alone(resumed, *args)
    assert p.returncode == 0, p.stderr[-3000:]
    assert "resumed from step_00000008" in p.stderr
    assert digest(resumed) == digest(golden)


def test_retention_flags_keep_the_best_by_loss_and_status_shows_the_policy(tmp_path):
    """--keep 2 --keep-best loss:max: the newest two and the saved step of the largest loss (an
    early one: the loss falls, so only the metric can keep it) survive the trainer's own prunes
    (the manifest carries each step's metrics); the policy is recorded for `status`. A policy out
    of range is one usage line, before anything runs."""
    root = tmp_path / "run"
    args = train_args("ddp", steps=16, save_every=2)
    p = alone(root, *args, "--keep", "2", "--keep-best", "loss:max")
    assert p.returncode == 0, p.stderr[-3000:]
    loss = {m.step: m.loss for m in read_metrics(RunDir.of(root).metrics)}
    best = max(range(2, 17, 2), key=lambda s: (loss[s], -s))
    assert best < 14, loss  # not among the newest two
    kept = {c.step for c in store.list_checkpoints(root)}
    assert kept == {14, 16, best}, (kept, best, loss)
    assert read_manifest(root / step_dirname(best)).metrics["loss"] == loss[best]
    status = subprocess.run(
        supervisor_cmd("status", "--ckpt-root", str(root), "--json"), capture_output=True, text=True
    )
    assert "best 1 by loss (max)" in json.loads(status.stdout)["retention"], status.stdout

    bad = alone(tmp_path / "bad", *args, "--keep", "1")
    assert bad.returncode == 2 and "--keep 1" in bad.stderr and "Traceback" not in bad.stderr, bad.stderr
