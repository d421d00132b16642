"""The reference trainer's flags, declared once on TrainerOptions, Saves, ResumeOptions and
RemoteOptions (supervisor/options.py): no flag gives the dataclasses' defaults, every flag lands in
its typed field, and --help lists each flag with its help once."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from supervisor.resumable import RemoteOptions, ResumeOptions, Saves
from supervisor.store.retention_policy import RetentionPolicy
from train_ref.train import TrainerOptions, parse_args, parser

BASE = ["--ckpt-root", "/r", "--steps", "7"]


def test_no_flags_give_the_dataclass_defaults() -> None:
    assert parse_args(BASE) == TrainerOptions(ckpt_root=Path("/r"), steps=7)


def test_every_flag_lands_in_its_typed_field() -> None:
    argv = [
        *BASE, "--seed", "3", "--parallel", "ddp", "--config", "bench", "--lr", "0.5", "--weight-decay", "0.2",
        "--decay-steps", "9", "--corpus", "c.txt", "--num-workers", "2", "--log-samples", "--amp", "bf16",
        "--deterministic", "--save-every", "4", "--save-every-s", "1.5", "--sync-save", "--max-failed-saves", "5",
        "--max-unsaved-s", "60", "--verify", "quick", "--io-retry", "0", "--allow-fresh-start",
        "--allow-config-change", "--allow-data-change", "--load-step", "8", "--init-from", "/other:4",
        "--init-optimizer", "--remote", "/remote", "--remote-endpoint", "http://s3", "--remote-keep", "6",
        "--milestone-every", "10", "--remote-busy", "wait", "--remote-wait-timeout", "2",
        "--remote-flush-timeout", "3", "--remote-attempts", "1", "--keep", "4", "--keep-best", "loss:min",
        "--signing-key", "env:K", "--ablate", "python_rng", "--ablate", "sampler",
    ]  # fmt: skip
    retention = RetentionPolicy(keep=4, best_metric="loss", best_mode="min", best_k=1)
    remote = RemoteOptions("/remote", "http://s3", 6, 10, "wait", 2.0, 3.0, 1)
    assert parse_args(argv) == TrainerOptions(
        ckpt_root=Path("/r"), steps=7, seed=3, parallel="ddp", config="bench", lr=0.5, weight_decay=0.2,
        decay_steps=9, corpus="c.txt", num_workers=2, log_samples=True, amp="bf16", deterministic=True,
        saves=Saves(every_steps=4, every_s=1.5, async_save=False, keep=4, max_failed_saves=5,
                    max_unsaved_s=60.0, retention=retention),
        resume=ResumeOptions(verify="quick", io_retry_s=0.0, allow_fresh_start=True, allow_config_change=True,
                             allow_data_change=True, load_step=8, init_from="/other:4", init_optimizer=True,
                             remote=remote),
        signing_key="env:K", ablate=("python_rng", "sampler"),
    )  # fmt: skip


def test_async_save_is_accepted_and_exclusive_with_sync_save(capsys: pytest.CaptureFixture[str]) -> None:
    assert parse_args([*BASE, "--async-save"]).saves.async_save
    with pytest.raises(SystemExit) as e:
        parse_args([*BASE, "--async-save", "--sync-save"])
    assert e.value.code == 2
    assert "argument --sync-save: not allowed with argument --async-save" in capsys.readouterr().err


def test_help_lists_each_flag_once_with_its_help() -> None:
    p = parser()
    flags = [a for a in p._actions if a.option_strings and a.dest != "help"]
    shown = [a for a in flags if a.help != argparse.SUPPRESS]
    assert all(a.help for a in shown), [a.option_strings for a in shown if not a.help]
    names = [s for a in flags for s in a.option_strings]
    assert len(names) == len(set(names)) > 40
    assert [a.option_strings for a in flags if a.help == argparse.SUPPRESS] == [["--ablate"]]
    text = p.format_help()
    assert "--ablate" not in text and "remote tier (docs/tiers.md):" in text


@pytest.mark.slow  # a real trainer process: torch and a process group
def test_a_run_dir_that_cannot_be_used_is_one_line_and_exit_78(tmp_path: Path) -> None:
    import subprocess
    import sys

    blocker = tmp_path / "a-file"
    blocker.write_text("not a directory")
    p = subprocess.run(
        [sys.executable, "-m", "train_ref.train", "--ckpt-root", str(blocker), "--steps", "1"],
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 78, p.stderr[-2000:]
    lines = [ln for ln in p.stderr.splitlines() if ln.startswith("resumable:")]
    assert lines == [
        f"resumable: {blocker}: cannot use it as the run directory (EEXIST (File exists)); "
        "give --ckpt-root a directory this rank can create and write"
    ]
    assert "Traceback" not in p.stderr
