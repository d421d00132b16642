"""Whether torchrun may restart its ranks itself (supervisor/watch/torchrun_cmd.py), which decides
whether the watchdog sets TORCH_DISABLE_SHARE_RDZV_TCP_STORE=1 for a launch."""

from __future__ import annotations

import pytest

from supervisor.watch.torchrun_cmd import restarts_inside

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
