"""Nothing loaded from a checkpoint runs code (supervisor/safepickle.py, supervisor/resumable/_safe_load.py).

The allowlist of DCP's ``.metadata`` is held against the metadata of real checkpoints of the
reference trainer (torchrun, 2 ranks: DDP, FSDP2, and an FSDP2 checkpoint resharded to 1 rank);
a tampered ``.metadata`` (a pickle that runs ``touch MARKER``, its manifest entry rewritten to
match) is refused by ``ckpt verify --deep`` and by the trainer's load, one line naming the file,
and the marker never appears. DCP's other pickle, the non-tensor state items, is loaded with
``weights_only=True``.
"""

from __future__ import annotations

import io
import pickle
import subprocess
from pathlib import Path
from typing import ClassVar

import pytest
import torch
import torch.distributed.checkpoint as dcp
from commands import REPO, supervisor_cmd
from security_helpers import RunsCommand, evil_pickle, tamper
from trainer_helpers import (
    EMA,
    digest,
    heartbeat_exit_codes,
    metrics,
    rewind,
    run,
    run_ok,
    train_args,
)

from supervisor import safepickle
from supervisor.format.exitcodes import Exit
from supervisor.format.layout import REASON, RunDir, dcp_index_filename, is_dcp_index
from supervisor.resumable._safe_load import load_dcp, weights_only_refusal
from supervisor.resumable._train_state import RankState

METADATA = ".metadata"


@pytest.fixture(scope="module")
def real_runs(goldens, tmp_path_factory) -> dict[str, Path]:
    """Run directories of the reference trainer: DDP and FSDP2 on 2 ranks (the shared goldens;
    the FSDP2 one keeps a moving average of its parameters, EMA), and the FSDP2 one resumed on 1
    rank from step 20, which reshards and saves step 30 again."""
    fsdp = goldens.get("fsdp", 2, *EMA)
    resharded = rewind(fsdp, tmp_path_factory.mktemp("resharded") / "run", 20)
    run_ok(resharded, 1, *train_args("fsdp", *EMA))
    return {"ddp": goldens.get("ddp", 2), "fsdp": fsdp, "resharded": resharded}


def metadata_files(runs: dict[str, Path]) -> list[Path]:
    files = sorted(p for root in runs.values() for p in root.glob("step_*/*") if is_dcp_index(p.name))
    assert len(files) >= 7, files
    return files


class Recording(pickle.Unpickler):
    """A plain unpickler that notes every global it resolves (for trusted, real files only)."""

    seen: ClassVar[set[tuple[str, str]]] = set()

    def find_class(self, module: str, name: str):  # type: ignore[no-untyped-def]
        Recording.seen.add((module, name))
        return super().find_class(module, name)


@pytest.mark.slow
def test_the_allowlist_is_what_real_checkpoints_are_made_of(real_runs) -> None:
    files = metadata_files(real_runs)
    assert any('"world_size": 1' in (p.parent / "manifest.json").read_text() for p in files)  # resharded
    for p in files:
        data = p.read_bytes()
        safepickle.check(data, str(p))  # the torch-free check passes them
        restricted = safepickle.load_restricted(data, str(p))
        assert restricted == pickle.loads(data)  # the trainer's reader builds the same object
        Recording(io.BytesIO(data)).load()
    dtypes = {g for g in safepickle.DCP_METADATA_GLOBALS if g[0] == "torch" and g[1] != "Size"}
    assert Recording.seen <= safepickle.DCP_METADATA_GLOBALS
    # Minimal: every name but the other dtypes is used by these checkpoints.
    assert safepickle.DCP_METADATA_GLOBALS - Recording.seen <= dtypes


def test_the_allowlist_names_every_torch_dtype_as_it_pickles() -> None:
    Recording.seen = set()
    for d in {v for v in vars(torch).values() if isinstance(v, torch.dtype)}:
        Recording(io.BytesIO(pickle.dumps(d))).load()
    have = {g for g in safepickle.DCP_METADATA_GLOBALS if g[0] == "torch" and g[1] != "Size"}
    assert have == Recording.seen


def test_a_pickle_that_fails_before_naming_anything_is_left_to_the_checksums() -> None:
    safepickle.check(b"meta\x00\x01", "x/.metadata")  # pickle.load fails at once too: harmless
    safepickle.check(pickle.dumps({"plain": [1, 2.0, "data"]}), "x/.metadata")  # no global: data
    # An allowed name, then a turn a placeholder cannot follow: what follows is unknown, refused.
    steered = b"\x80\x04\x8c\x05torch\x8c\x04Size\x93)\x81\x94(K\x01K\x02e."
    with pytest.raises(safepickle.UnsafePickle, match=r"not a DCP metadata pickle \(.* after torch.Size"):
        safepickle.check(steered, "x/.metadata")


def test_a_tampered_metadata_is_refused_without_running_it(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    payload = evil_pickle(marker)
    for protocol_0 in (False, True):
        data = pickle.dumps(RunsCommand(marker), protocol=0) if protocol_0 else payload
        with pytest.raises(safepickle.UnsafePickle, match=r"^x/.metadata: refers to posix.system, which"):
            safepickle.check(data, "x/.metadata")
        with pytest.raises(safepickle.UnsafePickle, match=r"refers to posix.system"):
            safepickle.load_restricted(data, "x/.metadata")
    assert not marker.exists()


# ---------------------------------------------------------------- the trainer's load, in one process


def save_plain(path: Path, state: dict) -> None:
    dcp.save(state, storage_writer=dcp.FileSystemWriter(path), no_dist=True)


def test_dcp_load_refuses_both_pickles_dcp_reads(tmp_path: Path) -> None:
    """Without a process group: DCP's index and a pickled non-tensor item, each tampered, refused
    before anything runs; an untouched checkpoint loads as it was saved."""
    marker = tmp_path / "MARKER"
    payload = evil_pickle(marker)
    good = tmp_path / "good"
    save_plain(good, {"w": torch.arange(4.0), "step": 7, "sched": {"lr": [0.1], "epoch": 3}})
    out = {"w": torch.zeros(4), "step": 0, "sched": {"lr": [0.0], "epoch": 0}}
    load_dcp(good, out, None)
    assert (
        torch.equal(out["w"], torch.arange(4.0))
        and out["step"] == 7
        and out["sched"] == {"lr": [0.1], "epoch": 3}
    )

    bad_index = tmp_path / "bad_index"
    save_plain(bad_index, {"w": torch.arange(4.0)})
    (bad_index / METADATA).write_bytes(payload)
    with pytest.raises(safepickle.UnsafePickle) as e:
        load_dcp(bad_index, {"w": torch.zeros(4)}, None)
    assert str(e.value).startswith(f"{bad_index / METADATA}: refers to posix.system") and "\n" not in str(
        e.value
    )

    bad_item = tmp_path / "bad_item"  # what an attacker writes: a state item that is a pickle
    save_plain(bad_item, {"w": torch.arange(4.0), "step": RunsCommand(marker)})
    with pytest.raises(safepickle.UnsafePickle) as e:
        load_dcp(bad_item, {"w": torch.zeros(4), "step": 0}, None)
    assert "__0_0.distcp (item step): refers to posix.system" in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists()


def test_a_tampered_rank_state_file_is_refused(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    path = tmp_path / "rank_00000.state.pt"
    torch.save(RunsCommand(marker), path)
    with pytest.raises(pickle.UnpicklingError) as e:
        RankState.load(path)
    line = str(weights_only_refusal(str(path), e.value))
    assert line.startswith(f"{path}: refers to posix.system") and "\n" not in line
    assert not marker.exists()


# ---------------------------------------------------------------- real runs


def tampered_copy(src: Path, dst: Path, step: int, marker: Path, index: str = METADATA) -> Path:
    """A copy of a finished run as of ``step``, whose newest DCP ``index`` runs a command."""
    root = rewind(src, dst, step)
    tamper(root / f"step_{step:08d}", index, evil_pickle(marker))
    return root


@pytest.mark.slow
@pytest.mark.parametrize(("parallel", "index"), [("ddp", METADATA), ("fsdp", dcp_index_filename(1))])
def test_ckpt_verify_deep_refuses_a_tampered_metadata(goldens, tmp_path: Path, parallel, index) -> None:
    marker = tmp_path / "MARKER"
    root = tampered_copy(goldens.get(parallel, 2), tmp_path / "run", 20, marker, index)
    quick = subprocess.run(
        supervisor_cmd("ckpt", "verify", "--ckpt-root", str(root)),
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert quick.returncode == Exit.OK, quick.stdout  # sizes only: the manifest was made to agree
    p = subprocess.run(
        supervisor_cmd("ckpt", "verify", "--deep", "--ckpt-root", str(root)),
        cwd=REPO, capture_output=True, text=True, timeout=60,
    )  # fmt: skip
    assert p.returncode == Exit.FOUND_PROBLEM, p.stdout + p.stderr
    (row,) = [line for line in p.stdout.splitlines() if "INVALID" in line]
    assert "20" in row and f"{index}: refers to posix.system" in row
    assert not marker.exists()


@pytest.mark.slow
@pytest.mark.parametrize(("parallel", "index"), [("ddp", METADATA), ("fsdp", dcp_index_filename(1))])
def test_the_trainer_refuses_a_tampered_metadata_at_load(goldens, tmp_path: Path, parallel, index) -> None:
    """--verify quick, so the store's deep check does not catch it first: the load itself does.
    Every rank refuses with 77 (not retryable), the line names the file, nothing of it ran. Under
    FSDP each rank reads its own index: rank 1 refuses its own, rank 0 the same line from it."""
    marker = tmp_path / "MARKER"
    golden = goldens.get(parallel, 2)
    root = tampered_copy(golden, tmp_path / "run", 20, marker, index)
    steps_before = len(metrics(root))
    r = run(root, 2, *train_args(parallel, "--verify", "quick"))
    assert r.rc != 0
    assert set(heartbeat_exit_codes(root).values()) == {Exit.UNTRUSTED}
    (line,) = {ln.split("resumable: ", 1)[1] for ln in r.output.splitlines() if "resumable: refused:" in ln}
    assert f"{root / 'step_00000020' / index}: refers to posix.system" in line
    assert f"ckpt quarantine --ckpt-root {root} 20" in line
    assert not marker.exists()
    assert len(metrics(root)) == steps_before and not (root / "final.json").exists()


@pytest.mark.slow
def test_deep_verify_quarantines_a_tampered_metadata_and_resumes_bit_exact(goldens, tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    golden = goldens.get("ddp", 2)
    root = tampered_copy(golden, tmp_path / "run", 20, marker)
    run_ok(root, 2, *train_args("ddp"))  # --verify deep is the default
    (q,) = RunDir.of(root).quarantine.iterdir()
    assert q.name.startswith("step_00000020-")
    assert ".metadata: refers to posix.system" in (q / REASON).read_text()
    assert digest(root) == digest(golden)  # walked back to step 10 and redid 11-30 exactly
    assert not marker.exists()
