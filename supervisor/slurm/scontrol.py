"""SLURM's client, run from the job (``scontrol``), and the error every part of the SLURM glue raises
for a problem the operator must fix (``SlurmError``)."""

from __future__ import annotations

import re
import shutil
import subprocess

from supervisor.errors import UserError

SCONTROL_TIMEOUT_S = 60.0


class SlurmError(UserError):
    """A problem the operator must fix; ``str(e)`` is one line saying what and how."""


def scontrol_path() -> str | None:
    return shutil.which("scontrol")


def scontrol_show(kind: str, name: str) -> dict[str, str] | None:
    """``scontrol show KIND -o NAME``'s KEY=VALUE fields; None when scontrol is missing or fails
    (the caller then acts as if SLURM had said nothing)."""
    scontrol = scontrol_path()
    if scontrol is None or not name:
        return None
    try:
        out = subprocess.run(
            [scontrol, "show", kind, "-o", name],
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return dict(re.findall(r"(\w+)=(\S*)", out.stdout))


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"
