"""The real trainer under the real watchdog with a signing key and a directory remote, and the file
modes of a run: signed checkpoints on both tiers; a resume after node loss with the right key
downloads and verifies; the wrong key, or checkpoints without signatures, are refused (66) with one
line, nothing loaded, nothing quarantined, never a silent fresh start; nothing a run creates is
world-writable, whatever the umask, and a private umask stays private.
"""

from __future__ import annotations

import os
import shutil
import stat
import subprocess
import sys
from pathlib import Path

import pytest
from commands import supervisor_cmd
from security_helpers import KEY, OTHER_KEY
from trainer_helpers import (
    REPO,
    committed,
    heartbeat_exit_codes,
    metrics,
    run,
    run_ok,
    torchrun_cmd,
    train_args,
    trainer_env,
)

from supervisor import store
from supervisor.format.exitcodes import Exit
from supervisor.format.layout import SIGNATURE, RunDir

pytestmark = pytest.mark.slow

ENV = "RT_E2E_SIGNING_KEY"
SIGN = ("--signing-key", f"env:{ENV}")
STEPS, SAVE_EVERY = 4, 2


def env(key: bytes) -> dict[str, str]:
    return trainer_env(**{ENV: key.decode()})


def args(*extra: str, steps: int = STEPS) -> list[str]:
    return train_args("ddp", *SIGN, *extra, steps=steps, save_every=SAVE_EVERY)


def modes(*roots: Path) -> dict[str, int]:
    """Permission bits of every file and directory under ``roots`` (the roots included)."""
    out = {}
    for root in roots:
        for dirpath, dirs, files in os.walk(root):
            for name in [".", *dirs, *files]:
                p = os.path.normpath(os.path.join(dirpath, name))
                out[p] = stat.S_IMODE(os.lstat(p).st_mode)
    return out


@pytest.fixture(scope="module")
def signed_run(tmp_path_factory) -> tuple[Path, Path]:
    """A signed run with a directory remote, under the watchdog, started with umask 000."""
    base = tmp_path_factory.mktemp("signed")
    root, remote = base / "run", base / "shared"
    trainer = torchrun_cmd(root, 2, *args("--remote", str(remote)))
    cmd = supervisor_cmd("watch", "--ckpt-root", str(root), *SIGN)
    cmd += ["--remote", str(remote), "--max-restarts", "0", "--", *trainer]
    p = subprocess.run(cmd, cwd=REPO, env=env(KEY), capture_output=True, text=True, timeout=600, umask=0)
    assert p.returncode == 0, p.stderr[-4000:]
    return root, remote


def test_a_signed_run_signs_both_tiers_and_nothing_is_world_writable(signed_run) -> None:
    root, remote = signed_run
    for tier in (root, remote):
        steps = [r.step for r in store.list_checkpoints(tier)]
        assert steps and steps[0] == STEPS, (tier, steps)
        for r in store.list_checkpoints(tier):
            assert (r.path / SIGNATURE).is_file()
            assert store.validate(r, deep=True, key=KEY).signature == "ok"
    found = modes(root, remote)
    assert len(found) > 20  # checkpoints, heartbeats, the watchdog's and uploader's files, locks
    kinds = {"events.jsonl", "state.json", "remote.json", ".lock", "manifest.sig", ".metadata", "latest"}
    assert kinds <= {Path(p).name for p in found}
    writable = {p: oct(m) for p, m in found.items() if m & stat.S_IWOTH}
    assert writable == {}, writable  # umask 000 asked for 0666/0777


def test_node_loss_resumes_from_the_remote_with_the_right_key(signed_run, tmp_path: Path) -> None:
    _, remote = signed_run
    shared = shutil.copytree(remote, tmp_path / "shared")
    root = tmp_path / "node" / "run"  # nothing local
    r = run_ok(root, 2, *args("--remote", str(shared), steps=STEPS + 2), env=env(KEY))
    assert f"resumed from step_{STEPS:08d}" in r.output
    assert metrics(root)[0].step == STEPS + 1  # nothing redone, nothing skipped
    local = store.validate(store.CheckpointRef(STEPS, root / f"step_{STEPS:08d}"), deep=True, key=KEY)
    assert local.signature == "ok"  # the downloaded copy, verified and signed again


@pytest.mark.parametrize("case", ["wrong key", "no signatures"])
def test_untrusted_checkpoints_are_refused_and_nothing_moves(signed_run, tmp_path: Path, case: str) -> None:
    local, remote = signed_run
    if case == "wrong key":  # node loss, and this launch has another key: the remote is not trusted
        shared = shutil.copytree(remote, tmp_path / "shared")
        root, key, extra = tmp_path / "node" / "run", OTHER_KEY, ("--remote", str(shared))
        says = "bad signature: signed with another key"
    else:  # the local checkpoints lost their signatures (or never had them): the key requires them
        root = shutil.copytree(local, tmp_path / "run", ignore=shutil.ignore_patterns("heartbeats", ".lock"))
        for sig in root.glob(f"step_*/{SIGNATURE}"):
            sig.unlink()
        key, extra, says = KEY, (), "unsigned: no manifest.sig"
    before, trained = committed(root), len(metrics(root))
    r = run(root, 2, *args(*extra, steps=STEPS + 2), env=env(key))
    assert set(heartbeat_exit_codes(root).values()) == {Exit.NO_USABLE_CHECKPOINT}, r.output[-3000:]
    (line,) = [ln for ln in r.output.splitlines() if "resumable: refused:" in ln]
    assert "no trusted checkpoint" in line and says in line and "--allow-fresh-start" in line
    assert committed(root) == before  # nothing downloaded, nothing quarantined or moved
    assert not RunDir.of(root).quarantine.exists()
    assert len(metrics(root)) == trained  # not a step trained: nothing loaded, no fresh start


def test_a_private_umask_stays_private(tmp_path: Path) -> None:
    """umask 077 (fake trainer, torch-free): the watchdog, commits, heartbeats, locks, a prune."""
    root = tmp_path / "run"
    fake = [sys.executable, str(REPO / "tests" / "fake_trainer.py"), "--root", str(root), "--steps", "6"]
    cmd = supervisor_cmd("watch", "--ckpt-root", str(root), "--max-restarts", "0")
    p = subprocess.run(
        [*cmd, "--", *fake, "--ckpt-every", "2"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
        umask=0o077,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    q = subprocess.run(
        supervisor_cmd("ckpt", "prune", "--keep", "2", "--ckpt-root", str(root)),
        cwd=REPO, capture_output=True, text=True, timeout=60, umask=0o077,
    )  # fmt: skip
    assert q.returncode == 0, q.stderr
    found = modes(root)
    assert {"events.jsonl", "state.json", "manifest.json", ".lock", "latest"} <= {Path(f).name for f in found}
    shared = {f: oct(m) for f, m in found.items() if m & 0o077}
    assert shared == {}, shared
