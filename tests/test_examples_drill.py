"""Each example under the fault drill, with docs/adopting.md's own command: every scenario of the
default set (kill -9, real hangs, a kill during a save, corrupt checkpoints, a preemption as SLURM
sends it, chaos), 2 DataLoader workers per rank, and each scenario's run must end bit-identical to
the example's own uninterrupted run (its moving average too, where it keeps one)."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from adopting_doc import drill_commands
from commands import REPO, supervisor_cmd

from supervisor.cli.drill import DEFAULT_SCENARIOS

pytestmark = pytest.mark.slow


@pytest.mark.parametrize("example", ["plain_loop", "stream", "accumulate"])
def test_the_example_passes_every_scenario_of_the_drill(example: str, tmp_path: Path) -> None:
    (argv,) = [a for a in drill_commands() if a[0] == "drill"]
    argv = [f"examples/{example}.py" if a.startswith("examples/") else a for a in argv]
    cmd = supervisor_cmd(*argv, "--workdir", str(tmp_path / "drill"), "--json")
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert p.stdout, p.stderr[-4000:]
    doc = json.loads(p.stdout)
    results = {s["scenario"]: s["result"] for s in doc["scenarios"]}
    failed = {
        s["scenario"]: [c for c in s["checks"] if not c["ok"]]
        for s in doc["scenarios"]
        if s["result"] != "PASS"
    }
    # A string, so pytest shows all of it (a tuple's repr is cut short).
    assert results == dict.fromkeys(DEFAULT_SCENARIOS, "PASS"), (
        json.dumps(failed, indent=1) + p.stderr[-3000:]
    )
    assert p.returncode == 0 and doc["settings"]["ranks"] == 2
    digests = {s["digest"] for s in doc["scenarios"]}
    assert digests == {doc["golden_digest"]}, digests
    if example == "accumulate":
        assert " ema " in doc["golden_digest"], "its AveragedModel's digest is compared too"
