"""The trainers users already run, each made resumable by its adapter, under the fault drill: kill -9,
a real hang, a preemption as SLURM sends it and corrupt checkpoints, 2 ranks with 2 DataLoader
workers each; every scenario must end bit-identical to the example's own uninterrupted run.
Measured here (2 busy cores): Lightning ~3 min, Accelerate ~3-7 min, the Hugging Face Trainer 1.5-4 min."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from commands import REPO, supervisor_cmd

pytestmark = pytest.mark.slow

SCENARIOS = ("kill9", "hang", "preempt", "corrupt-latest")


@pytest.mark.parametrize("example", ["lightning_points", "accelerate_points", "hf_points"])
def test_the_adapters_example_passes_the_drill_bit_identical(example: str, tmp_path: Path) -> None:
    argv = [
        "drill",
        "--trainer",
        f"examples/{example}.py",
        "--ranks",
        "2",
        "--steps",
        "40",
        "--save-every",
        "5",
    ]
    argv += [a for s in SCENARIOS for a in ("--scenario", s)]
    cmd = supervisor_cmd(*argv, "--workdir", str(tmp_path / "drill"), "--json")
    p = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=1800)
    assert p.stdout, p.stderr[-4000:]
    doc = json.loads(p.stdout)
    failed = {
        s["scenario"]: [c for c in s["checks"] if not c["ok"]]
        for s in doc["scenarios"]
        if s["result"] != "PASS"
    }
    assert {s["scenario"]: s["result"] for s in doc["scenarios"]} == dict.fromkeys(SCENARIOS, "PASS"), failed
    assert p.returncode == 0 and doc["settings"]["ranks"] == 2
    assert {s["digest"] for s in doc["scenarios"]} == {doc["golden_digest"]}
