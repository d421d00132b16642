"""A hostile checkpoint at the trainer's load (issue 39): its index, its records and its rank file
as an attacker without the key (or bad luck) leaves them, loaded by a real ``Resumable`` in a
1-rank gloo group, in this process.

Every case ends the same way: ``resume()`` raises SystemExit with the exit code the watchdog acts
on (never an Exception a caller swallows), one line naming the file, the checkpoint moved to
quarantine/ with that line; the Resumable then refuses every optimizer step, ``step_end`` and
``finish`` (its model holds part of the checkpoint); and the next launch walks back and ends with
the final digest of an uninterrupted run, bit for bit. The index and the records are also fuzzed
(hypothesis) through ``load_dcp``: a load reads what is there or refuses in one line; the peak
RSS of a load whose index says a record is 2 GiB is measured in a subprocess.
"""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import signal
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed as dist
from hypothesis import given, settings
from hypothesis import strategies as st
from security_helpers import KEY, tamper

from supervisor import store
from supervisor.format.exitcodes import Exit
from supervisor.format.layout import MANIFEST, SIGNATURE
from supervisor.resumable import Identity, Resumable, ResumeOptions, Saves
from supervisor.resumable._safe_load import CorruptRecord, load_dcp
from supervisor.safepickle import UnsafePickle

REPO = Path(__file__).resolve().parent.parent
STEPS = 6


@pytest.fixture
def group(tmp_path: Path) -> Iterator[None]:
    dist.init_process_group("gloo", init_method=f"file://{tmp_path / 'pg'}", rank=0, world_size=1)
    yield
    dist.destroy_process_group()


def _model() -> tuple[torch.nn.Module, torch.optim.Optimizer]:
    torch.manual_seed(123)
    model = torch.nn.Sequential(torch.nn.Linear(8, 16), torch.nn.ReLU(), torch.nn.Linear(16, 4))
    return model, torch.optim.AdamW(model.parameters(), lr=1e-2)


MADE: list[Resumable] = []  # this test's Resumables, left as a process that exits would leave them


@pytest.fixture(autouse=True)
def _stop_what_was_made() -> Iterator[None]:
    """A Resumable that resumed and never reached step_end watches every DataLoader iterated in
    the process (its loader check): stopped here, newest first, so no later test meets it."""
    yield
    while MADE:
        r = MADE.pop()
        r._loader_check.stop()
        r._ckpt.close()


def resumable(root: Path, key: bytes | None = None, verify: str = "deep") -> Resumable:
    model, opt = _model()
    r = Resumable(
        root,
        {"model": model, "optimizer": opt},
        steps=STEPS,
        identity=Identity({"width": 16}, seed=7, global_batch=4),
        saves=Saves(every_steps=2, async_save=False),
        options=ResumeOptions(verify=verify, sign_key=key, io_retry_s=0.0),
    )
    MADE.append(r)
    return r


def train(r: Resumable, until: int = STEPS) -> str | None:
    """The loop of a user's trainer: a step's batch depends on the step alone."""
    model, opt = r.state.model, r.state.optimizer  # type: ignore[attr-defined]
    for step in range(r.resume() + 1, until + 1):
        x = torch.randn(4, 8, generator=torch.Generator().manual_seed(step))
        loss = model(x).pow(2).mean()
        opt.zero_grad()
        loss.backward()
        opt.step()
        r.step_end(step, {"loss": float(loss)})
    return r.finish() if until == STEPS else None


@pytest.fixture(scope="module")
def golden(tmp_path_factory) -> str:
    """The final digest of an uninterrupted run (its own 1-rank group)."""
    tmp = tmp_path_factory.mktemp("golden")
    dist.init_process_group("gloo", init_method=f"file://{tmp / 'pg'}", rank=0, world_size=1)
    try:
        digest = train(resumable(tmp / "run"))
    finally:
        dist.destroy_process_group()
    assert digest
    return digest


def run_to(root: Path, step: int) -> Path:
    """A run stopped after the save of ``step`` (a kill -9 there: the checkpoint committed)."""
    r = resumable(root)
    train(r, until=step)
    r._ckpt.close()  # its background prune done, as a process that died after the commit leaves it
    return root / f"step_{step:08d}"


# ---------------------------------------------------------------- what an attacker does to a checkpoint


def _index(ckpt: Path) -> Any:
    with open(ckpt / ".metadata", "rb") as f:
        return pickle.load(f)  # the test's own checkpoint: trusted here


def _set_record(ckpt: Path, fqn: str, **fields: Any) -> None:
    """Point ``fqn``'s record elsewhere in the index (relative_path, offset, length), the manifest
    rewritten to agree (tamper)."""
    md = _index(ckpt)
    for index, info in md.storage_data.items():
        if index.fqn == fqn:
            for k, v in fields.items():
                setattr(info, k, v)
    tamper(ckpt, ".metadata", pickle.dumps(md))


def _record_file(ckpt: Path, fqn: str, data: bytes) -> None:
    """``fqn``'s record is ``data``, in a file of its own (listed: a second file of rank 0)."""
    tamper(ckpt, "__0_1.distcp", data)
    _set_record(ckpt, fqn, relative_path="__0_1.distcp", offset=0, length=len(data))


def _torch_bytes(obj: Any) -> bytes:
    buf = io.BytesIO()
    torch.save(obj, buf)
    return buf.getvalue()


WEIGHT = "app.model.2.weight"  # the last tensor: the ones before it load before it fails
CASES: dict[str, tuple[Callable[[Path], None], str]] = {
    # 2: records confined to their checkpoint (another checkpoint's file was loaded)
    "another checkpoint's file": (
        lambda c: _set_record(c, WEIGHT, relative_path="../step_00000002/__0_0.distcp"),
        "'../step_00000002/__0_0.distcp', not a file of this checkpoint",
    ),
    "a step read from /etc/passwd": (
        lambda c: _set_record(
            c, "app.step", relative_path="../../../../../../../../etc/passwd", offset=0, length=64
        ),
        "not a file of this checkpoint",
    ),
    # 3: a length read off the index, allocated before any check (+2 GB RSS a rank)
    "a record of 2 GiB": (lambda c: _set_record(c, WEIGHT, length=2**31), "bytes into the record"),
    # 6: what crashed the load with EINVAL, ValueError, AttributeError, IndexError
    "a negative offset": (lambda c: _set_record(c, WEIGHT, offset=-1), "not a place in a file"),
    "a negative length": (lambda c: _set_record(c, WEIGHT, length=-5), "not a place in a file"),
    "an index of 42": (lambda c: tamper(c, ".metadata", pickle.dumps(42)), "holds int, not DCP's Metadata"),
    "a record whose data.pkl is a dict": (
        lambda c: _record_file(c, WEIGHT, _torch_bytes({"a": 1})),
        "holds a dict, not a tensor",
    ),
    "a truncated zip": (
        lambda c: _record_file(c, WEIGHT, _torch_bytes(torch.zeros(4, 16))[:-40]),
        "not a readable tensor record",
    ),
    "a malformed RNG file": (
        lambda c: tamper(c, "rank_00000.state.pt", _torch_bytes({"python_rng": 5})),
        "rank_00000.state.pt: not a per-rank state file",
    ),
    # not a zip: torch.load(weights_only=True) refuses it as a pickle it may not run (77, a person looks)
    "an RNG file that is no zip": (
        lambda c: tamper(c, "rank_00000.state.pt", b"garbage" * 10),
        "rank_00000.state.pt: holds a pickle that torch.load(weights_only=True) refuses",
    ),
}
REFUSED = {"an RNG file that is no zip"}  # exit 77: not retried, nothing moved; a person quarantines it


@pytest.mark.parametrize("case", sorted(CASES))
def test_a_hostile_checkpoint_stops_the_load_and_the_next_launch_walks_back_bit_exact(
    tmp_path: Path, group: None, golden: str, case: str, capfd
) -> None:
    root = tmp_path / "run"
    run_to(root, 2)
    ckpt = run_to(root, 4)
    mutate, named = CASES[case]
    mutate(ckpt)
    r = resumable(root, verify="quick")  # a deep verify passes too: the manifest agrees (no key)
    with pytest.raises(SystemExit) as e:
        r.resume()
    err = capfd.readouterr().err
    if case in REFUSED:
        assert e.value.code == Exit.UNTRUSTED
        (line,) = [ln for ln in err.splitlines() if ln.startswith("resumable: refused:")]
        assert named in line and "ckpt quarantine" in line, line
        store.quarantine_step(root, 4, "inspected: " + line)  # what the person does
    else:
        assert e.value.code == 1  # retried: the relaunch walks back
        (line,) = [ln for ln in err.splitlines() if ln.startswith("resumable: cannot resume:")]
        assert named in line and "moved to quarantine/" in line, line
    (q,) = store.list_quarantined(root)
    assert q.name.startswith("step_00000004-") and named in q.reason
    # 5: a failed load leaves the state half read: nothing trains on it or saves it
    from supervisor.resumable._resumable import LoadFailed

    with pytest.raises(LoadFailed, match="nothing may train on them or save them"):
        r.state.optimizer.step()  # type: ignore[attr-defined]
    with pytest.raises(LoadFailed):
        r.step_end(5)
    with pytest.raises(LoadFailed):
        r.finish()
    assert train(resumable(root)) == golden


def test_f5_a_failed_load_cannot_be_caught_and_trained_on(tmp_path: Path, group: None) -> None:
    """One bad record, the last: the records before it were read into the live model (28 of 29
    parameters changed, on the rank that failed). ``resume()`` raises SystemExit, which ``except
    Exception`` does not catch, and the optimizer refuses to step on what the model holds."""
    root = tmp_path / "run"
    run_to(root, 2)
    ckpt = run_to(root, 4)
    _record_file(ckpt, WEIGHT, _torch_bytes({"a": 1}))  # read last, after the others went in
    r = resumable(root, verify="quick")
    before = [p.detach().clone() for p in r.state.model.parameters()]  # type: ignore[attr-defined]
    caught = False
    try:
        r.resume()
    except Exception:  # what a user's `try: r.resume() except Exception: start over` catches
        caught = True
    except SystemExit:
        pass
    assert not caught
    changed = sum(not torch.equal(a, b) for a, b in zip(before, r.state.model.parameters(), strict=True))  # type: ignore[attr-defined]
    assert changed  # what the issue found: the load's reads went into the model
    from supervisor.resumable._resumable import LoadFailed

    with pytest.raises(LoadFailed):
        r.state.optimizer.step()  # type: ignore[attr-defined]


@pytest.fixture
def notices() -> Iterator[None]:
    """The process's preemption flag cleared after the test, and its handlers armed again (an exit
    decided sets them to ignore further notices; Resumable installs them once per process)."""
    from supervisor.resumable import _resumable, install_signals

    install_signals()
    yield
    _resumable.PREEMPTION.signum = None
    _resumable.PREEMPTION.install()


@pytest.mark.parametrize("key", [None, KEY], ids=["spread verify", "signed deep pick"])
def test_f4_a_preemption_notice_stops_the_resume_verify(
    tmp_path: Path, group: None, notices: None, key: bytes | None
) -> None:
    """SIGTERM was recorded and ignored while a rank hashed its share (a verify of a link to
    /dev/zero went on for ever): the verify asks at every chunk, and the rank exits 75."""
    from supervisor.format.heartbeat import read_heartbeats

    root = tmp_path / "run"
    r = resumable(root, key=key)
    train(r, until=2)
    r._ckpt.close()
    r = resumable(root, key=key)  # its handlers installed: a notice is recorded, not acted on
    os.kill(os.getpid(), signal.SIGTERM)
    with pytest.raises(SystemExit) as e:
        r.resume()
    assert e.value.code == Exit.REQUEUE
    (snap,) = read_heartbeats(root)
    assert snap.heartbeat is not None and snap.heartbeat.exit_code == Exit.REQUEUE
    assert snap.heartbeat.phase.value == "verify"


def test_f6_a_manifest_with_a_global_batch_that_is_no_number_is_one_line(
    tmp_path: Path, group: None, capfd
) -> None:
    root = tmp_path / "run"
    ckpt = run_to(root, 2)
    m = json.loads((ckpt / MANIFEST).read_text())
    m["parallelism"]["global_batch"] = "eight"
    (ckpt / MANIFEST).write_text(json.dumps(m, indent=1, sort_keys=True) + "\n")
    with pytest.raises(SystemExit) as e:
        resumable(root, verify="quick").resume()
    assert e.value.code == Exit.BAD_CONFIG
    assert "global_batch is 'eight', not a number" in capfd.readouterr().err


def test_f7_the_trainer_says_which_checkpoint_it_skipped_as_untrusted(
    tmp_path: Path, group: None, caplog
) -> None:
    root = tmp_path / "run"
    r = resumable(root, key=KEY)
    train(r, until=4)
    r._ckpt.close()
    (root / "step_00000004" / SIGNATURE).unlink()  # no longer signed: skipped, never loaded
    with caplog.at_level(logging.WARNING, logger="resumable"):
        assert resumable(root, key=KEY).resume() == 2
    assert any("skipped step_00000004, not trusted: step_00000004: unsigned" in m for m in caplog.messages)


# ---------------------------------------------------------------- fuzz: the index and the records


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> Path:
    """A checkpoint as a plain DCP save of a few tensors and a value leaves it (no process group)."""
    import torch.distributed.checkpoint as dcp

    ckpt = tmp_path_factory.mktemp("tiny") / "step_00000001"
    dcp.save(_tiny_state(1.0), storage_writer=dcp.FileSystemWriter(ckpt), no_dist=True)
    return ckpt


def _tiny_state(v: float) -> dict[str, Any]:
    return {"w": torch.full((64, 64), v), "b": torch.full((300,), v), "step": int(v)}


def _listed(ckpt: Path) -> dict[str, int]:
    """What a manifest would list: the files as they were saved (before the fuzz changed them)."""
    return {p.name: p.stat().st_size for p in ckpt.iterdir()}


_HOSTILE_INTS = st.one_of(
    st.sampled_from([-(2**63), -1, 0, 1, 2**31, 2**62, 2**70]), st.integers(-100, 20_000)
)
_HOSTILE_PATHS = st.sampled_from(
    ["__0_0.distcp", "", ".", "..", "../x", "/etc/passwd", ".metadata", "missing.distcp", "a/b", "\x00"]
)


def _load_or_refuse(ckpt: Path, listed: dict[str, int] | None) -> None:
    out = _tiny_state(0.0)
    try:
        load_dcp(ckpt, out, None, listed=listed)
    except (CorruptRecord, UnsafePickle) as e:
        assert "\n" not in str(e), str(e)


@settings(max_examples=120)
@given(
    fqn=st.sampled_from(["w", "b", "step"]),
    field=st.sampled_from(["offset", "length", "relative_path"]),
    data=st.data(),
    manifest=st.booleans(),
)
def test_fuzz_an_index_entry_loads_or_is_refused_in_one_line(
    tiny: Path, tmp_path_factory, fqn: str, field: str, data: st.DataObject, manifest: bool
) -> None:
    ckpt = tmp_path_factory.mktemp("fz") / "step_00000001"
    import shutil

    shutil.copytree(tiny, ckpt)
    value = data.draw(_HOSTILE_PATHS if field == "relative_path" else _HOSTILE_INTS)
    md = _index(ckpt)
    for index, info in md.storage_data.items():
        if index.fqn == fqn:
            setattr(info, field, value)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    _load_or_refuse(ckpt, _listed(ckpt) if manifest else None)


@settings(max_examples=120)
@given(at=st.integers(0, 1 << 20), junk=st.binary(min_size=1, max_size=64), manifest=st.booleans())
def test_fuzz_a_shard_with_bytes_replaced_loads_or_is_refused_in_one_line(
    tiny: Path, tmp_path_factory, at: int, junk: bytes, manifest: bool
) -> None:
    ckpt = tmp_path_factory.mktemp("fz") / "step_00000001"
    import shutil

    shutil.copytree(tiny, ckpt)
    shard = ckpt / "__0_0.distcp"
    raw = bytearray(shard.read_bytes())
    at %= len(raw)
    raw[at : at + len(junk)] = junk
    shard.write_bytes(bytes(raw))
    _load_or_refuse(ckpt, _listed(ckpt) if manifest else None)


_RSS_SCRIPT = r"""
import os, pickle, resource, shutil, sys
from pathlib import Path
import torch
import torch.distributed.checkpoint as dcp
from supervisor.resumable._safe_load import CorruptRecord, load_dcp

tmp = Path(sys.argv[1])
state = lambda v: {"w": torch.full((256, 256), v), "b": torch.full((300,), v), "step": 1}
good = tmp / "good"
dcp.save(state(1.0), storage_writer=dcp.FileSystemWriter(good), no_dist=True)
# loaded as float64: no record is read in place, every one goes through DCP's path
into = lambda: {**state(0.0), "w": torch.zeros(256, 256, dtype=torch.float64)}
load_dcp(good, into(), None)  # a whole load first: what a load takes
base = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
out = []
for fqn in ("w", "step"):  # a tensor's record, and a value's
    for sparse in (False, True):  # the shard as saved; grown sparse to 3 GiB (its listing agrees)
        bad = tmp / f"bad_{fqn}_{sparse}"
        shutil.copytree(good, bad)
        md = pickle.load(open(bad / ".metadata", "rb"))
        for index, info in md.storage_data.items():
            if index.fqn == fqn:
                info.length = 2**31
        (bad / ".metadata").write_bytes(pickle.dumps(md))
        if sparse:
            os.truncate(bad / "__0_0.distcp", 3 << 30)
        try:
            load_dcp(bad, into(), None)  # no manifest: each file's own size bounds its records
            out.append("loaded")
        except CorruptRecord as e:
            out.append(str(e).split(": the checkpoint")[0])
print(resource.getrusage(resource.RUSAGE_SELF).ru_maxrss - base)
print("\n".join(out))
"""


def test_f3_a_record_length_of_2_gib_allocates_nothing_of_it(tmp_path: Path) -> None:
    """Measured in a process of its own (its peak RSS after a clean load, then after the hostile
    ones): a 2 GiB length in the index took +2 GB per rank on the DCP path."""
    p = subprocess.run(
        [sys.executable, "-c", _RSS_SCRIPT, str(tmp_path)],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert p.returncode == 0, p.stderr[-3000:]
    grown_kib, *lines = p.stdout.split("\n")
    assert int(grown_kib) < 48 << 10, f"{grown_kib} KiB more than a clean load's peak"
    assert len([ln for ln in lines if ln]) == 4 and not any(ln == "loaded" for ln in lines), lines
