"""The command-line end the fault sweeps share (tests/save_faults.py, tests/hang_faults.py): run
the sweep in the given folder or a temporary one (removed after), print its table and one
``FAIL`` line per failed trial, exit 1 on any."""

from __future__ import annotations

import shutil
import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Protocol


class Report(Protocol):
    def report(self) -> str: ...

    def failures(self) -> list[str]: ...


def run_and_report(workdir: Path | None, prefix: str, sweep: Callable[[Path], Report]) -> int:
    work = workdir or Path(tempfile.mkdtemp(prefix=prefix))
    try:
        s = sweep(work.resolve())
    finally:
        if workdir is None:
            shutil.rmtree(work, ignore_errors=True)
    print(s.report())
    bad = s.failures()
    for line in bad:
        print(f"FAIL {line}")
    return 1 if bad else 0
