"""The built wheel, pip-installed into a fresh virtual environment as a user would: the login-node
commands run without torch (`status`, `ckpt`, the console script), and an adapter's example runs
from it with its extra's framework (lent from the test's environment through a .pth file, so the
test does not download torch)."""

from __future__ import annotations

import os
import subprocess
import sys
import sysconfig
from pathlib import Path

import pytest
from commands import REPO

pytestmark = pytest.mark.slow


def _run(argv: list[str], **kw: object) -> subprocess.CompletedProcess[str]:
    p = subprocess.run(argv, capture_output=True, text=True, timeout=600, **kw)  # type: ignore[call-overload]
    assert p.returncode == 0, (argv, p.stdout[-2000:], p.stderr[-3000:])
    return p


def test_the_wheel_installs_and_runs_without_torch_and_with_an_extra(tmp_path: Path) -> None:
    dist = tmp_path / "dist"
    _run(
        [
            sys.executable,
            "-m",
            "pip",
            "wheel",
            "--no-deps",
            "--no-build-isolation",
            "-w",
            str(dist),
            str(REPO),
        ]
    )
    (wheel,) = dist.glob("resumable_training-*.whl")
    venv = tmp_path / "venv"
    _run([sys.executable, "-m", "venv", str(venv)])
    py, bin_ = venv / "bin" / "python", venv / "bin"
    _run([str(py), "-m", "pip", "install", "-q", str(wheel)])
    assert subprocess.run([str(py), "-c", "import torch"], capture_output=True).returncode == 1
    run_dir = tmp_path / "run"
    (run_dir / "step-10").mkdir(parents=True)  # a torchtitan folder left half written
    status = _run([str(bin_ / "resumable-supervisor"), "status", "--ckpt-root", str(run_dir)], cwd=tmp_path)
    assert "step-10" in status.stdout and "INVALID: no .metadata" in status.stdout
    _run([str(py), "-m", "supervisor", "status", "--ckpt-root", str(run_dir), "--prometheus"], cwd=tmp_path)
    lib = subprocess.run([str(py), "-c", "import supervisor.resumable"], capture_output=True, text=True)
    assert "pip install 'resumable-training[train]'" in lib.stderr.splitlines()[-1]

    # With the extra's packages (torch, lightning) importable, the example runs from the wheel.
    site = Path(
        _run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"]).stdout.strip()
    )
    (site / "lent.pth").write_text(sysconfig.get_paths()["purelib"] + "\n")
    example = tmp_path / "lightning_points.py"
    example.write_text((REPO / "examples" / "lightning_points.py").read_text())
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    env.pop("PYTHONPATH", None)
    where = _run([str(py), "-c", "import supervisor; print(supervisor.__file__)"], cwd=tmp_path, env=env)
    assert where.stdout.startswith(str(site)), where.stdout  # the wheel's copy, not the checkout
    _run(
        [str(py), "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=1", str(example),
         "--ckpt-root", str(tmp_path / "lt"), "--steps", "4", "--save-every", "2", "--num-workers", "0"],
        cwd=tmp_path,
        env=env,
    )  # fmt: skip
    assert (tmp_path / "lt" / "final.json").is_file() and (tmp_path / "lt" / "step_00000002").is_dir()
