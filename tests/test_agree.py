"""The control exchanges of a commit and of a step boundary, on real gloo process groups."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from trainer_helpers import REPO, trainer_env
from waiting import PATIENCE_S

from supervisor.format.commitstep import CommitStep
from supervisor.format.layout import rank_state_filename

pytestmark = pytest.mark.slow


def test_gather_reaches_rank_0_only_flags_reach_every_rank_and_an_async_commit_runs_unattended(tmp_path):
    nproc = 3
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}",
           str(REPO / "tests" / "agree_worker.py"), str(tmp_path)]  # fmt: skip
    r = subprocess.run(cmd, cwd=REPO, env=trainer_env(), capture_output=True, text=True, timeout=PATIENCE_S)
    assert r.returncode == 0, r.stdout[-3000:] + r.stderr[-3000:]
    results = {rank: json.loads((tmp_path / f"result_{rank}.json").read_text()) for rank in range(nproc)}
    want = [{f"__{r}_{i}.distcp": i for i in range(r + 1)} for r in range(nproc)]
    assert results[0]["gathered"] == want
    assert all(results[r]["gathered"] is None for r in range(1, nproc))
    for d in results.values():
        assert d["total"] == [float(sum(range(nproc))), float(nproc)]
        # piggybacked notice of rank 1; the last rank's notice through step_boundary's own
        # all-reduce; then nothing pending
        assert d["flags"] == [True, True, False]
        # no commit before every rank agreed its writes done; then the ranks' background work
        # committed alone, and the next boundary took the outcome
        a = d["async"]
        assert a["early"] and set(a["early"]) == {None}, a
        assert a["before_taken"] == "step_00000005" and a["taken"], a
    for rank, d in results.items():
        assert d["failures"] == [None, [1, "rank 1's problem"]]
        clean, untrusted, corrupt, missing = d["loads"]
        assert clean == [None, "", True, [float(rank)] * 4]
        # rank 1's record refused, then found broken: the same one line on every rank, naming
        # its file; nothing applied anywhere, though the other ranks read their parts
        for case, kind in ((untrusted, "UnsafePickle"), (corrupt, "CorruptRecord")):
            assert case[0] == kind and "__1_0.distcp (item app.r1)" in case[1] and not case[2], case
            assert case[3] == ([float(rank)] * 4 if rank != 1 else [0.0] * 4)
        # an item the last rank lacks: its own error there, PeerLoadFailed naming it elsewhere
        kind, line, applied, _ = missing
        last = nproc - 1
        assert not applied and (kind != "PeerLoadFailed") == (rank == last), missing
        assert rank == last or line.startswith(f"rank {last} could not load its part: "), line
    for case in (1, 2):
        assert len({d["loads"][case][1] for d in results.values()}) == 1
    last = f"__{nproc - 1}_index.metadata"
    for rank, d in results.items():
        own, another, gap, untrusted = d["per_rank_loads"]
        mine = f"__{rank}_index.metadata"
        assert own == [None, "", True, [float(rank)] * 4, [mine]], own
        # each rank's own index first (it lacks the next rank's item), then every index merged:
        # rank r read index r, the only one of its share of 3; not all 3 on every rank
        assert another == [None, "", True, [float((rank + 1) % nproc)] * 4, [mine, mine]], another
        # rank 1's index gone: every rank says so alike (its own first, where it has one)
        assert gap[:4] == ["CorruptRecord", gap[1], False, [0.0] * 4], gap
        assert "per_rank: no __1_index.metadata, yet rank 2's is there" in gap[1] and "ckpt verify" in gap[1]
        assert gap[4] == ([] if rank == 1 else [mine, mine])
        # the last rank's index a foreign pickle: refused where it is read, on every rank alike
        assert untrusted[:3] == ["UnsafePickle", untrusted[1], False] and last in untrusted[1], untrusted
        assert untrusted[4] == [mine, mine], untrusted
    for case in (2, 3):
        assert len({d["per_rank_loads"][case][1] for d in results.values()}) == 1
    for rank, d in results.items():
        # DCP's files hashed as they were written: a commit reads back only the rank's state
        # file, sync or async, and the manifest holds what is on disk
        # signed too: every file's SHA-256 taken as it was written, none read back by rank 0
        for save in ("sync", "async", "signed"):
            assert d[save]["read_back"] == [rank_state_filename(rank)] and d[save]["as_on_disk"], (
                rank,
                d[save],
            )
        # counted for a loop that waits on it: the upload's writes (DCP's index is rank 0's),
        # then the state file read back to hash it, then rank 0's commit steps; never over 100%
        sizes = d["async"]["sizes"]
        shard, rank_file, index = sizes.values()
        written = shard + (index if rank == 0 else 0)
        steps = len(CommitStep) if rank == 0 else 0
        assert d["async"]["counted"] == [written + rank_file + steps] * 2, (rank, d["async"])
