"""``make gpu-check`` on this CPU machine: the skip line, and the pure parts of the real run (the
plan per GPU count, the goldens it needs, the table and the exit code). The checks themselves need
a CUDA device (train_ref/gpu_check.py)."""

from __future__ import annotations

import signal
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from commands import REPO
from trainer_helpers import trainer_env

from supervisor.resumable._safe_load import load_dcp
from train_ref.gpu_check import (
    SAVE_EVERY,
    SKIP_LINE,
    STEPS,
    Result,
    Runner,
    Spec,
    Status,
    check_interrupted,
    exit_code,
    golden_keys,
    plan,
    slug,
    table,
)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA: the check would run")
def test_without_cuda_it_says_so_in_one_line_and_exits_0():
    r = subprocess.run(
        [sys.executable, "-m", "train_ref.gpu_check"],
        cwd=REPO,
        env=trainer_env(),
        capture_output=True,
        text=True,
    )
    assert (r.returncode, r.stdout, r.stderr) == (0, SKIP_LINE + "\n", "")


def test_one_gpu_runs_everything_on_one_rank_and_says_why_nccl_is_skipped():
    specs = plan(1)
    assert {s.nproc for s in specs} == {1}
    kinds = [s.kind for s in specs]
    assert kinds.count("kill9") == 2 and "preempt" in kinds and "staging" in kinds and "remap" in kinds
    (skip,) = [s for s in specs if s.kind == "skip"]
    assert "NCCL" in skip.name and "one GPU" in skip.why
    assert {s.args for s in specs} >= {(), ("--amp", "bf16", "--ema-decay", "0.99"), ("--amp", "fp16")}


@pytest.mark.parametrize("n", [2, 8])
def test_with_several_gpus_nccl_uses_all_and_the_remap_two(n):
    specs = plan(n)
    assert not [s for s in specs if s.kind == "skip"]
    (nccl,) = [s for s in specs if "NCCL" in s.name]
    assert nccl.nproc == n and nccl.kind == "kill9"
    (remap,) = [s for s in specs if s.kind == "remap"]
    assert remap.nproc == 2
    # one uninterrupted run per (ranks, args); on 2 GPUs the remap and NCCL checks share one
    keys = golden_keys(specs)
    assert len(keys) == len(set(keys)) == (4 if n == 2 else 5)


def test_the_table_has_a_row_per_check_and_any_fail_makes_it_fail():
    ok = [
        Result("kill -9 + resume, fp32", Status.PASS, "digest equal", 12.0),
        Result("NCCL", Status.SKIP, "one GPU"),
    ]
    text = table(ok, "1x NVIDIA H200", 95.0)
    lines = text.splitlines()
    assert lines[-1].startswith("gpu-check: PASS (0 failed) on 1x NVIDIA H200 in 95 s")
    assert any("kill -9 + resume, fp32" in ln and "PASS" in ln for ln in lines)
    assert any(ln.startswith("NCCL") and "SKIP" in ln and "one GPU" in ln for ln in lines)
    assert exit_code(ok) == 0
    bad = [*ok, Result("async staging", Status.FAIL, "torn", 3.0)]
    assert table(bad, "x", 1.0).splitlines()[-1].startswith("gpu-check: FAIL (1 failed)")
    assert exit_code(bad) == 1


def scaler_state(ckpt: Path) -> dict:
    """The GradScaler's saved state (an FSDP checkpoint: every rank's index, merged)."""
    sd = {"app": {"scaler": {"scale": 0.0, "_growth_tracker": 0}}}
    load_dcp(ckpt, sd, None)
    return sd["app"]["scaler"]


@pytest.mark.slow
@pytest.mark.filterwarnings("ignore:torch.distributed is disabled")
def test_the_checks_run_for_real_on_cpu_fp16_preemption_and_a_bound_relaunch(tmp_path, monkeypatch):
    """The run's own procedures on CPU (torchrun, hold gate, SIGUSR1, kill -9, relaunch, digests):
    fp16 + GradScaler preempted and resumed bit-exactly, its scaler state restored (its growth
    tracker counts every step, so a skipped restore would show); then a kill -9 whose relaunch
    goes through the per-process binding worker."""
    monkeypatch.setenv("PYTHONPATH", str(REPO))
    fp16 = Spec("preemption fp16", "preempt", nproc=2, args=("--amp", "fp16"))
    fp32 = Spec("kill9 bound", "kill9", nproc=2)
    runner = Runner(tmp_path, {})
    runner.make_goldens(golden_keys([fp16, fp32]))
    assert "== uninterrupted" in check_interrupted(runner, fp16, signal.SIGUSR1)
    final = f"step_{STEPS:08d}"
    resumed, golden = (
        scaler_state(tmp_path / slug(fp16.name) / final),
        scaler_state(tmp_path / "golden_2_amp_fp16" / final),
    )
    assert resumed == golden and golden["_growth_tracker"] > STEPS - SAVE_EVERY
    assert "== uninterrupted" in check_interrupted(runner, fp32, signal.SIGKILL, bind="0,0")
