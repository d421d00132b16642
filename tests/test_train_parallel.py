"""fsdp's meta-device build: the same initial parameters as a whole build, on any world size; and
an fsdp checkpoint's records read in place, its AdamW state allocated, loaded back bit for bit,
from DCP's one index and from an index per rank."""

from __future__ import annotations

import subprocess
import sys

import pytest
from commands import REPO
from trainer_helpers import trainer_env
from waiting import PATIENCE_S

from supervisor.format.layout import dcp_index_filename

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


@pytest.mark.parametrize("nproc", [2, 3])
def test_fsdp_records_read_in_place_and_allocated_adamw_state_load_bit_exact(nproc):
    """3 ranks: shards of uneven sizes. Every rank reads some records in place (the model's
    larger shards are 64 KiB and more) and ends with exactly the saved shards and state."""
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(REPO / "tests" / "inplace_load_worker.py")]  # fmt: skip
    r = subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=PATIENCE_S)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    lines = sorted(ln.split() for ln in r.stdout.splitlines() if ln.startswith("rank "))
    assert [ln[1] for ln in lines] == [str(i) for i in range(nproc)], r.stdout[-3000:]
    for _, rank, _, in_place, _, primed, _, equal, _, per_rank_equal, _, read, _, direct in lines:
        assert int(in_place) > 0 and primed == "True" and equal == "True", (rank, in_place, primed, equal)
        # an index per rank: each rank read its own alone, and loaded the same state from it
        assert per_rank_equal == "True" and read == dcp_index_filename(int(rank)), (
            rank,
            per_rank_equal,
            read,
        )
        # ... read straight into its tensors (direct_read.py), where DCP's one index (a chunk of
        # every rank per tensor) went through DCP's plan
        assert direct == "01", (rank, direct)
