"""A load on its saved layout read straight into the tensors (supervisor/resumable/_direct_read.py): when it
applies, what it reads, when it leaves the load to DCP, and how it fails."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter
from torch.distributed.checkpoint._nested_dict import flatten_state_dict
from torch.distributed.checkpoint.filesystem import FileSystem

from supervisor.format.layout import dcp_index_filename, dcp_shard_filename
from supervisor.resumable import _direct_read, _safe_load
from supervisor.resumable._progress_io import PROGRESS_CHUNK, ProgressFileSystem
from supervisor.resumable._safe_load import CorruptRecord, load_dcp, read_index
from supervisor.resumable._shard_writer import shard_writer
from supervisor.safepickle import UnsafePickle


def _saved() -> dict[str, object]:
    g = torch.Generator().manual_seed(3)
    return {
        "w": torch.randn(300_000, generator=g),  # several counted reads
        "b": torch.arange(10),
        "h": torch.randn(4, 6, generator=g).to(torch.bfloat16),
        "meta": {"lr": 0.1, "name": "x"},  # a non-tensor item
    }


def _fresh() -> dict[str, object]:
    return {
        "w": torch.zeros(300_000),
        "b": torch.zeros(10, dtype=torch.int64),
        "h": torch.zeros(4, 6, dtype=torch.bfloat16),
        "meta": {"lr": 0.0, "name": ""},  # the items to load (DCP loads what the state dict holds)
    }


def _equal(got: dict[str, object], want: dict[str, object]) -> bool:
    return all(
        torch.equal(got[k], v) if isinstance(v, torch.Tensor) else got[k] == v  # type: ignore[arg-type]
        for k, v in want.items()
    )


@pytest.fixture
def ckpt(tmp_path: Path) -> Path:
    path = tmp_path / "step_00000001"
    dcp.save(_saved(), storage_writer=shard_writer(path, tmp_path))
    return path


@pytest.fixture
def spied(monkeypatch: pytest.MonkeyPatch) -> dict[str, list[object]]:
    """What ``plan`` and ``read`` returned during a load, and each ``dcp.load`` (DCP's own path)."""
    seen: dict[str, list[object]] = {"plan": [], "read": [], "dcp": []}
    for name in ("plan", "read"):
        real = getattr(_direct_read, name)

        def spy(*args: object, _real: object = real, _name: str = name) -> object:
            got = _real(*args)  # type: ignore[operator]
            seen[_name].append(got)
            return got

        monkeypatch.setattr(_direct_read, name, spy)
    real_load = dcp.load
    monkeypatch.setattr(_safe_load.dcp, "load", lambda *a, **k: seen["dcp"].append(1) or real_load(*a, **k))
    return seen


def test_a_load_on_its_saved_layout_reads_every_record_in_place_without_dcp(ckpt, spied):
    loaded = _fresh()
    w = loaded["w"] = loaded["w"].requires_grad_()  # as a parameter given as it is (keep_vars)
    load_dcp(ckpt, loaded, None)
    assert _equal(loaded, _saved()) and loaded["w"] is w  # the bytes went into the tensor given
    assert spied["dcp"] == [] and [sorted(r) for r in spied["read"]] == [["meta.lr", "meta.name"]]  # type: ignore[call-overload]


@pytest.mark.parametrize(
    "change",
    [
        pytest.param(lambda d: d.update(w=torch.zeros(300_000, dtype=torch.float64)), id="another-dtype"),
        pytest.param(lambda d: d.update(w=torch.zeros(600_000)[::2]), id="a-strided-view"),
        pytest.param(lambda d: d.update(h=torch.zeros(6, 4, dtype=torch.bfloat16)), id="another-size"),
        pytest.param(lambda d: d.update(b={"x": 1}), id="a-tensor-asked-as-an-object"),
        pytest.param(lambda d: d.update(extra=torch.zeros(3)), id="an-item-the-index-lacks"),
    ],
)
def test_anything_but_one_whole_plain_chunk_per_tensor_is_left_to_dcp(ckpt, change):
    """``plan`` reads nothing and says None: the load goes through DCP, which converts, copies
    into a view, or refuses as before."""
    loaded = _fresh()
    change(loaded)
    index = read_index(FileSystem(), ckpt / dcp_index_filename())
    assert _direct_read.plan(flatten_state_dict(loaded)[0], index) is None
    assert _direct_read.plan(flatten_state_dict(_fresh())[0], index)  # unchanged, it plans


def test_dcp_loads_what_the_direct_read_leaves_to_it(ckpt, spied):
    loaded = _fresh()
    loaded["w"] = torch.zeros(300_000, dtype=torch.float64)
    load_dcp(ckpt, loaded, None)
    assert spied["plan"] == [None] and spied["dcp"] == [1]
    assert torch.equal(loaded["w"], _saved()["w"].double())  # type: ignore[union-attr]


def test_a_file_another_writer_wrote_is_left_to_dcp_whole_and_read_once(tmp_path, spied, tracker):
    """torch.save's own records differ from the plain frame (a serialization id): the file's
    first record tells, before anything of it is read in place, and DCP reads it, once."""
    ckpt = tmp_path / "stock"
    dcp.save(_saved(), storage_writer=FileSystemWriter(ckpt))
    loaded = _fresh()
    load_dcp(ckpt, loaded, None, fs=ProgressFileSystem(tmp_path, tracker))
    assert spied["plan"][0] is not None and spied["read"] == [None] and spied["dcp"] == [1]
    assert _equal(loaded, _saved())
    shard = (ckpt / dcp_shard_filename(0)).stat().st_size
    assert shard <= sum(tracker.units) < shard * 1.2  # the index and a frame besides, not it twice


def test_a_damaged_first_tensor_record_leaves_every_tensor_as_it_was(ckpt):
    index = read_index(FileSystem(), ckpt / dcp_index_filename())
    first = min(i.offset for k, i in index.storage_data.items() if k.offset is not None)  # a tensor's
    with open(ckpt / dcp_shard_filename(0), "r+b") as f:
        f.seek(first)
        f.write(b"JUNK")  # over its zip header
    loaded = _fresh()
    with pytest.raises((CorruptRecord, UnsafePickle)):
        load_dcp(ckpt, loaded, None)
    assert not any(t.any() for t in (loaded["w"], loaded["b"], loaded["h"]))  # type: ignore[union-attr]


def test_a_shard_cut_short_is_one_line_naming_the_file_and_the_item(ckpt):
    shard = ckpt / dcp_shard_filename(0)
    os.truncate(shard, shard.stat().st_size - 1000)
    with pytest.raises(CorruptRecord) as e:
        load_dcp(ckpt, _fresh(), None)
    line = str(e.value)
    assert "\n" not in line and str(shard) in line and "(item " in line and "the file ends" in line


def test_a_run_reads_any_number_of_buffers_in_calls_of_at_most_iov_max_the_first_a_counted_chunk(
    tmp_path, monkeypatch
):
    """3,000 buffers (above Linux's 1,024 a preadv): every byte lands in order, no call takes
    more buffers than the limit, and the first reads no more than a counted chunk."""
    data = os.urandom(3_000 * 100 + (1 << 20))
    path = tmp_path / "f"
    path.write_bytes(data)
    buffers = [bytearray(100) for _ in range(3_000)] + [bytearray(1 << 20)]
    calls: list[tuple[int, int]] = []
    real = _direct_read.read_at

    def counting(stream: object, batch: list[memoryview], offset: int) -> int:
        calls.append((len(batch), sum(b.nbytes for b in batch)))
        return real(stream, batch, offset)  # type: ignore[arg-type]

    monkeypatch.setattr(_direct_read, "read_at", counting)
    with open(path, "rb") as f:
        _direct_read._read_run(f, [memoryview(b) for b in buffers], 0, path, CorruptRecord)
    assert b"".join(buffers) == data
    assert max(n for n, _ in calls) <= _direct_read.IOV_MAX and calls[0][1] <= PROGRESS_CHUNK
