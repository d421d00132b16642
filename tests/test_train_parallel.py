"""fsdp's meta-device build: the same initial parameters as a whole build, on any world size."""

from __future__ import annotations

import subprocess
import sys

import pytest
from commands import REPO
from trainer_helpers import trainer_env
from waiting import PATIENCE_S

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("nproc", [1, 3])
def test_fsdp_meta_build_equals_the_whole_build(nproc):
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(REPO / "tests" / "parallel_worker.py")]  # fmt: skip
    r = subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=PATIENCE_S)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    line = next(ln for ln in r.stdout.splitlines() if ln.startswith("sharded "))
    _, got, _, want, _, never_whole = line.split()
    assert got == want
    assert never_whole == "True" or nproc == 1
