"""Whether torchrun may restart its ranks itself (supervisor/watch/torchrun_cmd.py), which decides
whether the watchdog sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for a launch; whether it rendezvouses
with other nodes, where `watch --standby` refuses it."""

from __future__ import annotations

import subprocess
import sys

import pytest
from commands import REPO

from supervisor.watch.torchrun_cmd import joins_other_nodes, restarts_inside

PY = ["/venv/bin/python", "-m", "torch.distributed.run"]


@pytest.mark.parametrize(
    "cmd",
    [
        ["torchrun", "--standalone", "--nproc-per-node=2", "-m", "train_ref.train", "--nnodes", "4"],
        [*PY, "--standalone", "--nproc-per-node", "2", "train.py", "--max-restarts=3"],
        ["/opt/bin/torchrun", "--nnodes=1", "--nproc_per_node=8", "train.py"],
        ["torchrun", "--nnodes", "1:1", "--max_restarts", "0", "train.py"],
        ["torchrun", "train.py"],  # torchrun's defaults: one node, no restarts
    ],
)
def test_a_single_node_torchrun_without_restarts_of_its_own_keeps_torchs_store(cmd) -> None:
    assert not restarts_inside(cmd)


@pytest.mark.parametrize(
    "cmd",
    [
        ["torchrun", "--nnodes=2", "--nproc-per-node=8", "train.py"],
        ["torchrun", "--nnodes", "1:4", "--rdzv-backend=c10d", "train.py"],  # a node may join
        [*PY, "--standalone", "--max-restarts=1", "train.py"],
        ["torchrun", "--standalone", "--max_restarts", "2", "train.py"],
        ["torchrun", "--nnodes=$NNODES", "train.py"],  # unreadable: keep the setting
        ["bash", "sbatch/job.sh"],  # not torchrun: keep the setting
        ["python", "train.py"],
    ],
)
def test_otherwise_the_setting_stays(cmd) -> None:
    assert restarts_inside(cmd)


@pytest.mark.parametrize(
    ("cmd", "joins"),
    [
        (["torchrun", "--nnodes=2", "--rdzv-backend=c10d", "train.py"], True),
        (["torchrun", "--nnodes", "1:4", "train.py"], True),  # a node may join
        (["torchrun", "--nnodes=$NNODES", "train.py"], True),  # unreadable: it may
        (["torchrun", "--standalone", "--nnodes=2", "train.py"], False),  # --standalone wins, as in torchrun
        ([*PY, "--nnodes", "1", "train.py"], False),
        (["python", "train.py", "--nnodes=4"], False),  # not a torchrun: its group is its own
    ],
)
def test_a_torchrun_that_rendezvouses_with_other_nodes_is_told_apart(cmd, joins) -> None:
    assert joins_other_nodes(cmd) is joins


def test_watch_standby_refuses_a_multi_node_rendezvous_in_one_line(tmp_path) -> None:
    """Its standby's agent would join the running launch's rendezvous (torchrun restarts the group
    on a join): a usage error before anything starts, naming the fix."""
    cmd = [sys.executable, "-m", "supervisor", "watch", "--ckpt-root", str(tmp_path), "--standby", "--"]
    done = subprocess.run(
        [*cmd, "torchrun", "--nnodes=2", "--rdzv-backend=c10d", "train.py"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert done.returncode == 2, done
    last = done.stderr.strip().splitlines()[-1]
    assert "--standby with a torchrun of more than one node" in last and "SPARE_NODES" in last, last
    assert "Traceback" not in done.stderr and not (tmp_path / "supervisor").exists()
