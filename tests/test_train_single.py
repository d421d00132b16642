"""``python -m train_ref.train`` without torchrun: one process (world size 1) with one line saying
so, no traceback; it resumes its own checkpoints and ends digest-equal to the same run under
``torchrun --nproc-per-node=1``."""

from __future__ import annotations

import subprocess
import sys

from commands import REPO
from trainer_helpers import SEED, digest, rewind, run_ok, train_args, trainer_env

from supervisor.format.layout import FINAL


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
