"""Other trainers' checkpoints, as their libraries write them: torchtitan's ``step-N/`` folders
(plain ``dcp.save``: a global ``.metadata``, no manifest of ours) and Lightning's ``.ckpt`` files
(a real ``Trainer`` with ``ModelCheckpoint``). `ckpt list|verify|pick|seal`, `status` and the
watchdog's progress test read them torch-free (supervisor/store/foreign.py)."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path

import pytest
from commands import REPO, supervisor_cmd
from watch_helpers import events, finish, of, start_watchdog

from supervisor.format.exitcodes import Exit
from supervisor.format.layout import REASON, seal_filename

HOUR = 3600.0


def ckpt(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        supervisor_cmd("ckpt", *args), cwd=REPO, capture_output=True, text=True, timeout=120
    )


def ckpt_json(*args: str) -> tuple[int, dict]:
    p = ckpt(*args, "--json")
    assert p.stdout, p.stderr
    return p.returncode, json.loads(p.stdout)


def dcp_save(folder: Path, step: int) -> None:
    """What torchtitan's CheckpointManager writes for one step: ``dcp.save`` of the state into
    ``step-N`` (one process, no process group)."""
    import torch
    import torch.distributed.checkpoint as dcp

    g = torch.Generator().manual_seed(step)
    state = {"model": {"w": torch.randn(64, 64, generator=g), "b": torch.randn(64, generator=g)}}
    dcp.save({**state, "train_state": {"step": step}}, checkpoint_id=str(folder))


def age(path: Path, seconds: float) -> None:
    """Make a checkpoint look ``seconds`` old (a crashed save left behind, not one in flight)."""
    t = time.time() - seconds
    for p in [path, *path.rglob("*")]:
        os.utime(p, (t, t))


@pytest.fixture(scope="module")
def titan_template(tmp_path_factory: pytest.TempPathFactory) -> Path:
    folder = tmp_path_factory.mktemp("titan") / "step-10"
    dcp_save(folder, 10)
    return folder


@pytest.fixture(scope="module")
def lightning_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Lightning's own checkpoints: ModelCheckpoint every 3 steps, and last.ckpt."""
    out = tmp_path_factory.mktemp("lightning")
    script = f"""
import torch, lightning.pytorch as pl
from torch import nn
from torch.utils.data import DataLoader, TensorDataset
class M(pl.LightningModule):
    def __init__(self):
        super().__init__(); self.net = nn.Linear(8, 1)
    def training_step(self, b, i): return ((self.net(b[0]) - b[1]) ** 2).mean()
    def configure_optimizers(self): return torch.optim.AdamW(self.parameters(), lr=0.01)
data = TensorDataset(torch.randn(64, 8), torch.randn(64, 1))
cb = pl.callbacks.ModelCheckpoint(dirpath={str(out)!r}, every_n_train_steps=3, save_last=True, save_top_k=-1)
pl.Trainer(max_steps=6, logger=False, enable_progress_bar=False, enable_model_summary=False,
           accelerator="cpu", callbacks=[cb]).fit(M(), DataLoader(data, batch_size=8))
"""
    p = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=300)
    assert p.returncode == 0, p.stderr[-3000:]
    assert sorted(os.listdir(out)) == ["epoch=0-step=3.ckpt", "epoch=0-step=6.ckpt", "last.ckpt"]
    return out


def titan_run(tmp_path: Path, template: Path, steps: list[int]) -> Path:
    root = tmp_path / "outputs" / "checkpoint"
    root.mkdir(parents=True)
    for s in steps:
        shutil.copytree(template, root / f"step-{s}")
    return root


def record_offset(path: Path, member: str) -> int:
    """Where a zip record's bytes start (its local header's own extra field: torch pads it)."""
    with zipfile.ZipFile(path) as z:
        info = z.getinfo(member)
    with open(path, "rb") as f:
        f.seek(info.header_offset + 26)
        n, extra = int.from_bytes(f.read(2), "little"), int.from_bytes(f.read(2), "little")
    return info.header_offset + 30 + n + extra


def flip(path: Path, offset: int) -> None:
    """Flip one bit in place, keeping the file's size and mtime (what bit rot looks like)."""
    st = path.stat()
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x10]))
    os.utime(path, ns=(st.st_atime_ns, st.st_mtime_ns))


# ---------------------------------------------------------------- torchtitan's DCP folders


def test_verify_reports_a_titan_folder_by_structure_and_marks_it_unverified(tmp_path, titan_template):
    root = titan_run(tmp_path, titan_template, [10, 20, 30])
    (root / "step-30" / ".metadata").unlink()  # a save that never finished
    shard = next((root / "step-20").glob("*.distcp"))
    os.truncate(shard, shard.stat().st_size // 2)
    rc, doc = ckpt_json("verify", "--ckpt-root", str(root))
    assert rc == Exit.FOUND_PROBLEM
    rows = {r["name"]: r for r in doc["foreign"]}
    assert [r["step"] for r in doc["foreign"]] == [30, 20, 10] and not doc["checkpoints"]
    assert rows["step-30"]["evidence"] == "corrupt" and "no .metadata" in rows["step-30"]["reason"]
    assert rows["step-20"]["evidence"] == "corrupt"
    assert f"{shard.name} is {shard.stat().st_size} bytes, .metadata needs" in rows["step-20"]["reason"]
    ok = rows["step-10"]
    assert ok["ok"] and ok["kind"] == "dcp" and not ok["sealed"]
    assert ok["mark"].startswith("unverified: no checksums")
    human = ckpt("verify", "--ckpt-root", str(root)).stdout
    assert (
        "1 of 3 other trainers' checkpoints complete (structure); 0 sealed; 1 unverified: no checksums"
        in human
    )


def test_a_tampered_metadata_is_refused_without_running_it(tmp_path, titan_template):
    import pickle

    root = titan_run(tmp_path, titan_template, [10])
    (root / "step-10" / ".metadata").write_bytes(pickle.dumps(os.system))
    rc, doc = ckpt_json("verify", "--ckpt-root", str(root))
    (row,) = doc["foreign"]
    assert rc == Exit.FOUND_PROBLEM and "refers to posix.system" in row["reason"], row


def test_pick_walks_back_past_a_partial_folder_and_leaves_one_in_flight(tmp_path, titan_template):
    """torchtitan#1729: the newest folder is a partial save and wins ``max()``. An old partial one
    goes to quarantine/ (so torchtitan's own ``max()`` cannot pick it), one changed within the hour
    may be a save in flight and stays."""
    root = titan_run(tmp_path, titan_template, [10, 20, 30])
    for s in (20, 30):
        (root / f"step-{s}" / ".metadata").unlink()
    age(root / "step-20", 2 * HOUR)
    rc, doc = ckpt_json("pick", "--ckpt-root", str(root))
    assert rc == 0 and doc["chosen"]["name"] == "step-10" and doc["chosen"]["kind"] == "dcp"
    assert [q["name"] for q in doc["quarantined"]] == ["step-20"]
    assert [q["name"] for q in doc["left_alone"]] == ["step-30"]
    assert sorted(os.listdir(root)) == [".lock", "quarantine", "step-10", "step-30"]
    (moved,) = (root / "quarantine").iterdir()
    assert moved.name.startswith("step-20-") and "no .metadata" in (moved / REASON).read_text()


def test_seal_adds_checksums_that_catch_a_flipped_bit(tmp_path, titan_template):
    root = titan_run(tmp_path, titan_template, [10, 20])
    rc, doc = ckpt_json("seal", "--ckpt-root", str(root))
    assert rc == 0 and [d["result"] for d in doc["sealed"]] == ["sealed 2 files"] * 2
    assert (root / seal_filename("step-20")).is_file()
    rc, doc = ckpt_json("verify", "--deep", "--ckpt-root", str(root))
    assert rc == 0 and {r["mark"] for r in doc["foreign"]} == {"sealed: every checksum verified"}
    shard = next((root / "step-20").glob("*.distcp"))
    flip(shard, 100)  # same size, same mtime: the structure cannot see it
    assert ckpt_json("verify", "--ckpt-root", str(root))[0] == 0
    rc, doc = ckpt_json("verify", "--deep", "--ckpt-root", str(root))
    bad = next(r for r in doc["foreign"] if r["name"] == "step-20")
    assert rc == Exit.FOUND_PROBLEM and f"{shard.name} checksum" in bad["reason"] and "seal" in bad["reason"]


def test_a_folder_rewritten_after_its_seal_is_unverified_not_corrupt(tmp_path, titan_template):
    root = titan_run(tmp_path, titan_template, [10])
    assert ckpt("seal", "--ckpt-root", str(root)).returncode == 0
    shutil.rmtree(root / "step-10")
    dcp_save(root / "step-10", 11)  # the same step written again (a rerun)
    rc, doc = ckpt_json("verify", "--deep", "--ckpt-root", str(root))
    (row,) = doc["foreign"]
    assert rc == 0 and row["ok"] and not row["sealed"] and "changed after `ckpt seal`" in row["mark"]


def test_status_lists_them(tmp_path, titan_template):
    root = titan_run(tmp_path, titan_template, [10, 20])
    (root / "step-20" / ".metadata").unlink()
    p = subprocess.run(
        supervisor_cmd("status", "--ckpt-root", str(root)),
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=60,
    )
    assert "checkpoints:\n  none" not in p.stdout
    assert "ok (DCP folder (torchtitan); unverified: no checksums" in p.stdout, p.stdout
    assert "INVALID: no .metadata: the save did not finish" in p.stdout


# A torchtitan-like job: each launch saves the next step (a copy of a real DCP folder), then crashes.
TITAN_JOB = """
import os, shutil, sys
root, template, partial = sys.argv[1], sys.argv[2], sys.argv[3] == "partial"
steps = [int(n[5:]) for n in os.listdir(root) if n.startswith("step-")]
dst = os.path.join(root, f"step-{max(steps, default=0) + 10}")
shutil.copytree(template, dst)
if partial:
    os.remove(os.path.join(dst, ".metadata"))
sys.exit(1)
"""


@pytest.mark.parametrize("partial", [False, True])
def test_watch_counts_a_titan_jobs_new_step_folders_as_progress(tmp_path, titan_template, partial):
    """Each launch writes step-10, 20, 30... then crashes: progress, so the restart budget ends it
    (not `no progress` after 3 launches); a partial folder each time is no progress."""
    root = tmp_path / "checkpoint"
    root.mkdir()
    job = tmp_path / "titan_job.py"
    job.write_text(TITAN_JOB)
    args = ["--no-progress", "3", "--max-restarts", "4", "--backoff-initial", "0.05", "--backoff-jitter", "0"]
    mode = "partial" if partial else "full"
    rc, out = finish(
        start_watchdog(root, args, [sys.executable, str(job), str(root), str(titan_template), mode])
    )
    ends = of(events(root), "launch_end")
    if partial:
        assert rc == Exit.NO_PROGRESS and len(ends) == 3, out
        assert {e["newest_checkpoint"] for e in ends} == {None}
    else:
        assert rc == Exit.BUDGET_EXHAUSTED and len(ends) == 5, out
        assert [e["newest_checkpoint"] for e in ends] == [10, 20, 30, 40, 50]
        assert [e["resumed_from"] for e in of(events(root), "launch")] == [None, 10, 20, 30, 40]


# ---------------------------------------------------------------- Lightning's .ckpt files


def test_verify_reads_lightnings_files_and_their_steps(tmp_path, lightning_dir):
    root = tmp_path / "lt"
    shutil.copytree(lightning_dir, root)
    rc, doc = ckpt_json("verify", "--deep", "--ckpt-root", str(root))
    assert rc == 0, doc
    steps = {r["name"]: r["step"] for r in doc["foreign"]}
    assert steps == {
        "epoch=0-step=6.ckpt": 6,
        "last.ckpt": 6,
        "epoch=0-step=3.ckpt": 3,
    }  # last's from its pickle
    assert {r["kind"] for r in doc["foreign"]} == {"lightning"}
    assert all(r["mark"].startswith("unverified: no checksums") for r in doc["foreign"])


def test_a_truncated_or_bitflipped_ckpt_is_invalid(tmp_path, lightning_dir):
    root = tmp_path / "lt"
    shutil.copytree(lightning_dir, root)
    os.truncate(root / "epoch=0-step=6.ckpt", (root / "epoch=0-step=6.ckpt").stat().st_size // 2)
    last = root / "last.ckpt"
    with zipfile.ZipFile(last) as z:
        member = next(n for n in z.namelist() if "/data/" in n)
    flip(last, record_offset(last, member))
    rc, doc = ckpt_json("verify", "--ckpt-root", str(root))
    rows = {r["name"]: r for r in doc["foreign"]}
    assert rc == Exit.FOUND_PROBLEM and "not a complete zip" in rows["epoch=0-step=6.ckpt"]["reason"]
    assert rows["last.ckpt"]["ok"]  # the quick check reads the structure only
    rc, doc = ckpt_json("verify", "--deep", "--ckpt-root", str(root))
    rows = {r["name"]: r for r in doc["foreign"]}
    assert rows["last.ckpt"]["reason"] == f"last.ckpt: {member}: CRC32 differs"
    rc, doc = ckpt_json("seal", "--ckpt-root", str(root))
    results = {d["name"]: d["result"] for d in doc["sealed"]}
    assert rc == Exit.FOUND_PROBLEM and results["epoch=0-step=3.ckpt"] == "sealed 1 file"
    assert results["last.ckpt"].startswith("not sealed")  # never vouch for a broken file


def test_a_folder_of_nothing_of_ours_or_theirs_is_still_refused(tmp_path):
    (tmp_path / "notes.txt").write_text("x")
    p = ckpt("list", "--ckpt-root", str(tmp_path))
    assert p.returncode == Exit.USAGE and "not a run directory" in p.stderr
