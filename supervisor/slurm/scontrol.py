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
    records = scontrol_records(kind, name)
    return None if records is None else {k: v for r in records for k, v in r.items()}


def scontrol_records(
    kind: str, names: str, timeout_s: float = SCONTROL_TIMEOUT_S
) -> list[dict[str, str]] | None:
    """``scontrol show KIND -o NAMES``: one record of KEY=VALUE fields per line (``show node -o
    n1,n3``: one per node); None when scontrol is missing or fails."""
    scontrol = scontrol_path()
    if scontrol is None or not names:
        return None
    try:
        out = subprocess.run(
            [scontrol, "show", kind, "-o", names],
            capture_output=True,
            text=True,
            timeout=timeout_s,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired):
        return None
    if out.returncode != 0:
        return None
    return [dict(re.findall(r"(\w+)=(\S*)", line)) for line in out.stdout.splitlines() if line.strip()]


def scontrol_update(*fields: str) -> str:
    """``scontrol update FIELD=VALUE ...``; "" when it worked, else why not (one line)."""
    scontrol = scontrol_path()
    if scontrol is None:
        return "scontrol not found on PATH"
    try:
        out = subprocess.run(
            [scontrol, "update", *fields],
            capture_output=True,
            text=True,
            timeout=SCONTROL_TIMEOUT_S,
            check=False,
        )
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"`scontrol update` did not run ({e})"
    if out.returncode != 0:
        return f"`scontrol update {' '.join(fields)}` failed (exit {out.returncode}): {last_line(out.stderr)}"
    return ""


def last_line(text: str) -> str:
    lines = [ln.strip() for ln in text.splitlines() if ln.strip()]
    return lines[-1] if lines else "no output"
