"""The trainer's resume choice (rank 0's ``_choose``, no process group needed) on storage that
fails: an unreadable checkpoint is exit 74 (retryable, nothing moved), an all-quarantined run is
exit 66 unless --allow-fresh-start, never a silent start from step 0."""

from __future__ import annotations

from pathlib import Path

import pytest
from store_helpers import corrupt, make_ckpt, quarantine_dirs

from supervisor import store
from supervisor.exitcodes import NON_RETRYABLE, Exit
from train_ref.config import get_config
from train_ref.data import Corpus
from train_ref.resume import _choose
from train_ref.train import parse_args


@pytest.fixture(scope="module")
def cfg():
    return get_config("tiny", Corpus.load(None).tokenizer.vocab_size)


def choose(root: Path, cfg, *flags: str):
    args = parse_args(["--ckpt-root", str(root), "--steps", "1", "--verify", "quick", *flags])
    return _choose(args, store.Expectation(), cfg, "launch-1")


def test_an_all_quarantined_run_is_refused_with_66_unless_allowed(tmp_path: Path, cfg) -> None:
    make_ckpt(tmp_path, 10)
    corrupt(tmp_path / "step_00000010", "truncate")
    c = choose(tmp_path, cfg)
    assert c.code == Exit.NO_USABLE_CHECKPOINT == 66 and c.ckpt is None
    assert "1 checkpoint is quarantined" in c.error and "--allow-fresh-start" in c.error
    assert Exit.NO_USABLE_CHECKPOINT in NON_RETRYABLE and Exit.STORAGE not in NON_RETRYABLE
    c = choose(tmp_path, cfg, "--allow-fresh-start")
    assert (c.code, c.ckpt, c.error) == (Exit.OK, None, "")


def test_a_new_run_starts_fresh_without_the_flag(tmp_path: Path, cfg) -> None:
    c = choose(tmp_path, cfg)
    assert (c.code, c.ckpt, c.error) == (Exit.OK, None, "")


def test_an_unreadable_checkpoint_is_74_and_nothing_is_moved(faultfs, cfg) -> None:
    root = faultfs.mountpoint / "run"
    make_ckpt(root, 10)
    rid = faultfs.fail("/run/step_00000010/manifest.json", "EIO", ops=["read"])
    c = choose(root, cfg, "--io-retry", "0")
    assert faultfs.hits(rid) >= 1
    assert c.code == Exit.STORAGE == 74 and "step_00000010/manifest.json: EIO" in c.error
    assert "ckpt quarantine" in c.error and not quarantine_dirs(root)
    faultfs.clear(rid)
    assert choose(root, cfg).ckpt == root / "step_00000010"
