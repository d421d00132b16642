"""Several processes on one root: a writer commits (and prunes, as the trainer does) in a loop while
others list, verify, pick and prune. No reader may see a half state; no exception may escape."""

from __future__ import annotations

import json
import multiprocessing as mp
import traceback
from pathlib import Path

from store_helpers import latest_text, make_ckpt, quarantine_dirs
from waiting import processes

from supervisor import store
from supervisor.format.layout import step_dirname

COMMITS = 60
KEEP = 2


def _run(role: str, root: Path, out: Path) -> None:
    """Child entry: run one role, write {"iterations": n} or {"error": traceback} to ``out``."""
    try:
        n = {"writer": _writer, "lister": _lister, "picker": _picker}[role](root)
        out.write_text(json.dumps({"iterations": n}))
    except BaseException:
        out.write_text(json.dumps({"error": traceback.format_exc()}))


def _done(root: Path) -> bool:
    return (root.parent / "writer-done").exists()


def _writer(root: Path) -> int:
    for step in range(1, COMMITS + 1):
        make_ckpt(root, step)
        store.prune(root, keep=KEEP)
    (root.parent / "writer-done").touch()
    return COMMITS


def _lister(root: Path) -> int:
    n, seen_latest = 0, False
    while not _done(root) or n < 3:
        n += 1
        refs = store.list_checkpoints(root)
        for ref in refs:
            v = store.validate(ref, deep=n % 2 == 0)
            assert v.ok or v.gone, f"reader saw a half state: {v.reason}"
        name = store.read_latest(root)
        if seen_latest:
            assert name is not None, "latest disappeared"
        if name is not None:
            seen_latest = True
            ref = store.CheckpointRef(int(name.split("_")[1]), root / name)
            v = store.validate(ref)
            newest = store.list_checkpoints(root)
            # Either whole, or pruned after newer ones were committed: never a half checkpoint.
            assert v.ok or (v.gone and newest and newest[0].step > ref.step), f"latest: {v.reason}"
        assert not store.list_quarantined(root)
    return n


def _picker(root: Path) -> int:
    n = 0
    while not _done(root) or n < 3:
        n += 1
        res = store.pick(root, deep=n % 3 == 0)
        assert not res.quarantined, f"pick quarantined a good checkpoint: {res.quarantined}"
        assert res.chosen is None or res.chosen.ok
        pr = store.prune(root, keep=KEEP, dry_run=n % 2 == 0)
        assert not pr.quarantined, pr.quarantined
    return n


def test_writer_with_concurrent_listers_pickers_and_pruners(tmp_path: Path) -> None:
    root = tmp_path / "run"
    root.mkdir()
    ctx = mp.get_context("fork")
    roles = ["writer", "lister", "lister", "picker"]
    outs = [tmp_path / f"{i}-{r}.json" for i, r in enumerate(roles)]
    with processes(ctx, [(_run, (r, root, o)) for r, o in zip(roles, outs, strict=True)]):
        pass  # they run to their end together: joined on the way out, killed after PATIENCE_S (a hang)
    results = [json.loads(o.read_text()) if o.exists() else {"error": "no result (hung?)"} for o in outs]
    for role, res in zip(roles, results, strict=True):
        assert "error" not in res, f"{role}: {res['error']}"
        assert res["iterations"] >= 3, (role, res)
    final = store.pick(root, deep=True)
    assert final.chosen.ref.step == COMMITS and not final.quarantined
    assert latest_text(root) == step_dirname(COMMITS) + "\n"
    assert [r.step for r in store.list_checkpoints(root)] == [COMMITS - i for i in range(KEEP)]
    assert not quarantine_dirs(root)
    assert not store.list_tmp(root) and not store.list_deleting(root)
