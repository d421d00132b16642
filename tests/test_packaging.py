"""Installation problems are one line naming the fix: supervisord's package (``pip install
supervisor``) sharing the ``supervisor/`` folder, and torch missing for the training side.

The clash is rebuilt offline as pip leaves it: this toolkit's package copied as a regular install
would place it, supervisord's files written over it (its ``supervisord.py``, and its ``options.py``
replacing ours). Measured once with the real thing (supervisor 4.3.0's wheel pip-installed over a
non-editable install of this toolkit in a fresh venv): the same one line from `python -m supervisor`
and `resumable-supervisor`, and the fix it names works."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

from commands import REPO

SUPERVISORD_OPTIONS = '"""supervisord\'s options module (stand-in)."""\n\n\nclass ServerOptions:\n    pass\n'
TORCH_EXTRA = "pip install 'resumable-training[train]' (or bring your own torch, e.g. a CUDA build)"


def _python(code_or_args: list[str], cwd: Path, pythonpath: Path) -> subprocess.CompletedProcess[str]:
    env = {**os.environ, "PYTHONPATH": str(pythonpath)}
    return subprocess.run(
        [sys.executable, *code_or_args], cwd=cwd, env=env, capture_output=True, text=True, timeout=120
    )


def test_supervisords_files_over_ours_are_one_line_naming_the_clash_and_the_fix(tmp_path):
    site = tmp_path / "site-packages"
    shutil.copytree(REPO / "supervisor", site / "supervisor", ignore=shutil.ignore_patterns("__pycache__"))
    (site / "supervisor" / "supervisord.py").write_text("# supervisord's main module (stand-in)\n")
    (site / "supervisor" / "options.py").write_text(SUPERVISORD_OPTIONS)
    (site / "supervisor" / "__init__.py").write_text("# this is a package\n")
    p = _python(["-m", "supervisor", "status", "--ckpt-root", str(tmp_path)], tmp_path, site)
    assert p.returncode == 2, p.stderr
    (line,) = p.stderr.splitlines()
    assert line.startswith("error: another package named 'supervisor' is installed in the same place")
    assert str(site / "supervisor" / "supervisord.py") in line and "`pip uninstall -y supervisor`" in line
    assert "pip install --force-reinstall --no-deps resumable-training" in line
    lib = _python(["-c", "import supervisor.resumable"], tmp_path, site)
    assert lib.returncode == 1
    assert lib.stderr.splitlines()[-1].startswith("ImportError: another package named 'supervisor'")
    (site / "supervisor" / "supervisord.py").unlink()  # our own files alone: no false alarm
    (site / "supervisor" / "supervisorctl.py").write_text("")
    assert "another package" in _python(["-m", "supervisor", "status"], tmp_path, site).stderr


def test_without_torch_the_training_side_says_which_extra_to_install(tmp_path):
    """torch cannot be imported (a sitecustomize makes ``import torch`` fail, as in an install
    without the ``train`` extra): the library and the reference trainer say so in one line, and
    the login-node commands work."""
    (tmp_path / "sitecustomize.py").write_text("import sys\nsys.modules['torch'] = None\n")
    path = Path(f"{tmp_path}{os.pathsep}{REPO}")
    lib = _python(["-c", "import supervisor.resumable"], tmp_path, path)
    assert lib.returncode == 1
    assert lib.stderr.splitlines()[-1] == f"ImportError: supervisor.resumable needs torch: {TORCH_EXTRA}"
    assert "No module named" not in lib.stderr and "direct cause" not in lib.stderr
    trainer = _python(["-m", "train_ref.train", "--help"], tmp_path, path)
    assert trainer.returncode == 1
    assert trainer.stderr.splitlines() == [f"train_ref needs torch: {TORCH_EXTRA}"], trainer.stderr
    (tmp_path / "run").mkdir()
    status = _python(["-m", "supervisor", "status", "--ckpt-root", str(tmp_path / "run")], tmp_path, path)
    assert status.returncode == 0 and "no watchdog state" in status.stdout, status.stderr
