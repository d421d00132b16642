"""DCP tensor records read off their bytes and written without ``torch.save``
(supervisor/resumable/_tensor_record.py), and the reader and writer around them (supervisor/resumable/_safe_load.py,
_shard_writer.ShardWriter): the plain layout decodes bit-exact to what ``torch.load`` gives and is
written byte for byte as ``torch.save`` writes it, any other layout goes through
``torch.load(weights_only=True)`` or ``torch.save``, and a truncated, broken or tampered record is
one line naming the file and the item."""

from __future__ import annotations

import errno
import io
import os
import pickle
import re
import struct
import zipfile
from pathlib import Path
from typing import Any

import pytest
import torch
import torch.distributed.checkpoint as dcp
from security_helpers import RunsCommand, evil_pickle
from torch.distributed.checkpoint import FileSystemWriter

from supervisor.resumable import _safe_load
from supervisor.resumable._safe_load import CorruptRecord, load_dcp
from supervisor.resumable._shard_writer import shard_writer
from supervisor.resumable._tensor_record import plain_tensor, read_in_place, write_plain
from supervisor.safepickle import UnsafePickle

DTYPES = [torch.float32, torch.bfloat16, torch.float16, torch.float64, torch.int64, torch.int8, torch.uint8]
DTYPES += [torch.bool, torch.complex64]
SHAPES = [(), (0,), (3, 0, 2), (7,), (256, 129), (3, 4, 5), (1, 1)]


def record(t: torch.Tensor, crc: bool = True) -> bytearray:
    """What DCP writes for a tensor: its ``torch.save`` (the trainer's writer has the CRC off)."""
    before = torch.serialization.get_crc32_options()
    torch.serialization.set_crc32_options(crc)
    try:
        buf = io.BytesIO()
        torch.save(t, buf)
    finally:
        torch.serialization.set_crc32_options(before)
    return bytearray(buf.getvalue())


def masked(data: bytes) -> bytes:
    """``data`` with every record's ``.data/serialization_id`` zeros: an id torch.save makes up
    per record and nothing reads back; ``write_plain`` writes zeros."""
    return re.sub(
        rb"(archive/\.data/serialization_idFB..Z*)[0-9]{40}", rb"\g<1>" + b"0" * 40, data, flags=re.S
    )


def sample(dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor:
    return (torch.randn(shape, generator=torch.Generator().manual_seed(len(shape))) * 100).to(dtype)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("crc", [True, False])
def test_plain_records_decode_bit_exact(dtype: torch.dtype, crc: bool) -> None:
    """The template pickle is torch.save's own for every shape: each record decodes, to the same
    bits ``torch.load`` gives, over the record's own bytes."""
    for shape in SHAPES:
        t = sample(dtype, shape)
        rec = record(t, crc)
        got = plain_tensor(rec, dtype, shape)
        assert got is not None, (dtype, shape)
        want = torch.load(io.BytesIO(rec), weights_only=True)
        assert got.dtype == dtype and got.shape == t.shape and got.is_contiguous()
        assert (
            got.view(torch.uint8).tolist() == want.view(torch.uint8).tolist()
            if t.dim()
            else got.item() == t.item()
        )


@pytest.mark.parametrize(
    ("tensor", "dtype", "shape"),
    [
        (torch.arange(12.0).reshape(4, 3).t(), torch.float32, (3, 4)),  # strided over a full storage
        (torch.arange(10.0)[2:6], torch.float32, (4,)),  # a view of a larger storage
        (torch.arange(4.0).requires_grad_(), torch.float32, (4,)),  # another pickle
        (torch.arange(4.0), torch.int32, (4,)),  # not the dtype the index says
        (torch.arange(4.0), torch.float32, (2, 2)),  # not the sizes the index says
        (torch.arange(4.0).to(torch.float8_e4m3fn), torch.float8_e4m3fn, (4,)),  # no legacy storage class
    ],
)
def test_other_layouts_are_left_to_torch_load(
    tensor: torch.Tensor, dtype: torch.dtype, shape: tuple[int, ...]
) -> None:
    rec = record(tensor)
    assert plain_tensor(rec, dtype, shape) is None
    assert torch.equal(
        torch.load(io.BytesIO(rec), weights_only=True), tensor.detach()
    )  # the fallback reads it


def entries(rec: bytearray) -> dict[str, bytes]:
    with zipfile.ZipFile(io.BytesIO(bytes(rec))) as z:
        return {i.filename: z.open(i).read() if i.CRC else _stored(rec, i) for i in z.infolist()}


def _stored(rec: bytearray, info: zipfile.ZipInfo) -> bytes:
    nlen, xlen = struct.unpack_from("<HH", rec, info.header_offset + 26)
    start = info.header_offset + 30 + nlen + xlen
    return bytes(rec[start : start + info.file_size])


def rezip(files: dict[str, bytes], method: int = zipfile.ZIP_STORED) -> bytearray:
    """Another zip writer's archive of ``files``, each body 64-byte aligned like torch's (padding
    in an 'FB' extra field, as torch pads)."""
    out = io.BytesIO()
    with zipfile.ZipFile(out, "w", compression=method) as z:
        for name, data in files.items():
            info = zipfile.ZipInfo(name)
            info.compress_type = method
            pad = (-(out.tell() + 30 + len(name.encode()) + 4)) % 64
            info.extra = b"FB" + struct.pack("<H", pad) + b"Z" * pad
            z.writestr(info, data)
    return bytearray(out.getvalue())


def test_the_zip_is_read_by_its_directory_not_by_position() -> None:
    """Another writer's plain archive decodes too; an extra entry, a big-endian byte order, a
    storage of the wrong size or a compressed one does not."""
    t = sample(torch.float32, (5, 7))
    files = entries(record(t, crc=False))
    prefix = next(iter(files)).split("/")[0]
    rebuilt = rezip(files)
    got = plain_tensor(rebuilt, torch.float32, (5, 7))
    assert got is not None and torch.equal(got, t) and torch.equal(torch.load(io.BytesIO(rebuilt)), t)
    assert plain_tensor(rezip({**files, f"{prefix}/data/1": b"\0" * 64}), torch.float32, (5, 7)) is None
    assert plain_tensor(rezip({**files, f"{prefix}/byteorder": b"big"}), torch.float32, (5, 7)) is None
    short = {**files, f"{prefix}/data/0": files[f"{prefix}/data/0"][:-4]}
    assert plain_tensor(rezip(short), torch.float32, (5, 7)) is None
    assert plain_tensor(rezip(files, zipfile.ZIP_DEFLATED), torch.float32, (5, 7)) is None
    assert plain_tensor(bytearray(b"PK" * 10), torch.float32, (5, 7)) is None


# ---------------------------------------------------------------- through the reader


def saved(tmp_path: Path) -> tuple[Path, dict[str, Any]]:
    """A checkpoint of the trainer's writer: plain records, a strided one, bf16, a 0-dim and an
    empty tensor, a view (DCP clones it: plain), and a non-tensor item."""
    state = {
        "w": sample(torch.float32, (300, 200)),
        "t": sample(torch.float32, (6, 9)).t(),
        "bf": sample(torch.bfloat16, (33,)),
        "scalar": torch.tensor(3.5),
        "empty": torch.zeros(0, 4),
        "view": torch.arange(20, dtype=torch.int64)[5:15],
        "step": 7,
    }
    ckpt = tmp_path / "step_00000001"
    dcp.save(state, storage_writer=shard_writer(ckpt, tmp_path))
    return ckpt, state


@pytest.mark.parametrize("dtype", DTYPES)
def test_plain_records_are_written_byte_for_byte_as_torch_save_writes_them(dtype: torch.dtype) -> None:
    """So torch.load, DCP's own load and the readers here read them as they read torch.save's."""
    for shape in SHAPES:
        t = sample(dtype, shape)
        buf = io.BytesIO()
        n = write_plain(buf.write, t)
        if t.numel() == 0:  # torch.save writes no data/0 for an empty storage: left to it
            assert n is None and not buf.getvalue(), shape
            continue
        assert n == len(buf.getvalue()) and buf.getvalue() == masked(bytes(record(t, crc=False))), shape
        assert torch.equal(torch.load(io.BytesIO(buf.getvalue()), weights_only=True), t)


def test_what_is_not_plain_is_left_to_torch_save_with_nothing_written() -> None:
    base = sample(torch.float32, (6, 9))
    for t in (
        base.t(),  # strided
        base[2:],  # a view: its storage holds more than its elements
        base.clone().requires_grad_(),
        torch.nn.Parameter(base.clone()),  # a subclass: torch.save pickles its class
        torch.zeros(3, dtype=torch.int32).to(torch.uint16),  # a dtype outside torch.save's storages
    ):
        buf = io.BytesIO()
        assert write_plain(buf.write, t) is None and not buf.getvalue()


def test_the_trainer_writes_the_shard_dcp_writes(tmp_path: Path) -> None:
    """The same file, records and index as DCP's own writer (the CRC off, as the trainer's)."""
    _, state = saved(tmp_path / "ours")
    theirs = tmp_path / "theirs"
    torch.serialization.set_crc32_options(False)
    try:
        dcp.save(state, storage_writer=FileSystemWriter(theirs))
    finally:
        torch.serialization.set_crc32_options(True)
    ours = tmp_path / "ours" / "step_00000001"
    assert sorted(os.listdir(ours)) == sorted(os.listdir(theirs))
    shard = "__0_0.distcp"
    assert masked((ours / shard).read_bytes()) == masked((theirs / shard).read_bytes())
    index = dcp.FileSystemReader(ours).read_metadata()
    assert index.storage_data == dcp.FileSystemReader(theirs).read_metadata().storage_data


def blank(state: dict[str, Any]) -> dict[str, Any]:
    return {
        k: torch.zeros_like(v.contiguous()) if isinstance(v, torch.Tensor) else 0 for k, v in state.items()
    }


def test_a_load_reads_plain_records_off_their_bytes_and_the_rest_with_torch_load(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    ckpt, state = saved(tmp_path)
    plain: dict[tuple[int, ...], bool] = {}

    def spy(rec: bytearray, dtype: torch.dtype, sizes: tuple[int, ...]) -> torch.Tensor | None:
        got = plain_tensor(rec, dtype, sizes)
        plain[sizes] = got is not None
        return got

    in_place: dict[tuple[int, ...], bool | str] = {}

    def spy_in_place(stream: Any, offset: int, length: int, target: torch.Tensor) -> bool | str:
        in_place[tuple(target.size())] = got = read_in_place(stream, offset, length, target)
        return got

    monkeypatch.setattr(_safe_load, "plain_tensor", spy)
    monkeypatch.setattr(_safe_load, "read_in_place", spy_in_place)
    out = blank(state)
    load_dcp(ckpt, out, None)
    for k, v in state.items():
        assert torch.equal(out[k], v) if isinstance(v, torch.Tensor) else out[k] == v, k
    # the one record of 64 KiB or more was read into its tensor; of the rest, the strided one alone
    # went through torch.load: DCP clones a view, not a transposed tensor (and reads nothing for
    # the empty one)
    assert in_place == {(300, 200): True}
    assert plain == {(9, 6): False, (33,): True, (): True, (10,): True}


@pytest.mark.parametrize("dtype", DTYPES)
def test_a_record_read_in_place_is_bit_exact_and_anything_else_leaves_the_target_alone(
    dtype: torch.dtype,
) -> None:
    """Head, tail, then the data straight into the target: the same bits as ``torch.load``; a
    layout it does not read (compressed, an extra entry) or a target that is not one contiguous
    block is False, with the target untouched, and the caller reads the record whole."""
    t = sample(dtype, (300, 70))
    rec = bytes(record(t, crc=False))
    pad = b"x" * 1000  # the record sits inside a shard, at an offset
    target = torch.zeros_like(t)
    assert read_in_place(io.BytesIO(pad + rec + pad), len(pad), len(rec), target) is True
    assert target.view(torch.uint8).tolist() == torch.load(io.BytesIO(rec)).view(torch.uint8).tolist()
    files = entries(bytearray(rec))
    prefix = next(iter(files)).split("/")[0]
    others = [bytes(rezip(files, zipfile.ZIP_DEFLATED)), bytes(rezip({**files, f"{prefix}/data/1": b"\0"}))]
    for other in others:
        untouched = torch.zeros_like(t)
        assert read_in_place(io.BytesIO(other), 0, len(other), untouched) is False
        assert not untouched.view(torch.uint8).any()
    strided = torch.zeros(70, 300, dtype=dtype).t()
    assert read_in_place(io.BytesIO(rec), 0, len(rec), strided) is False
    if dtype.is_complex:  # a lazy conjugate: its memory holds other values than it shows
        conj = torch.zeros_like(t).conj()
        assert read_in_place(io.BytesIO(rec), 0, len(rec), conj) is False and not conj.resolve_conj().any()
    assert not strided.contiguous().view(torch.uint8).any()


def test_an_io_error_in_a_read_in_place_is_an_io_error_not_corruption() -> None:
    """EIO while the data streams in leaves as the OSError it is (the caller's storage handling
    retries it), never as a record found short or corrupt."""

    class FailingData(io.BytesIO):
        def readinto(self, b: Any) -> int:
            if len(memoryview(b)) > 8192:  # the chunk's bytes, after head and tail
                raise OSError(errno.EIO, "Input/output error")
            return super().readinto(b)

    t = sample(torch.float32, (300, 70))
    rec = bytes(record(t, crc=False))
    with pytest.raises(OSError) as e:
        read_in_place(FailingData(rec), 0, len(rec), torch.zeros_like(t))
    assert e.value.errno == errno.EIO


def test_a_shard_that_ends_inside_a_record_read_in_place_is_one_line(tmp_path: Path) -> None:
    """Cut in the middle of the large record's data: the file is shorter than the index says it
    holds, found before anything is read (its size against the index's records), said naming the
    file and the item."""
    ckpt, state = saved(tmp_path)
    rec = bytes(record(state["w"], crc=False))
    shard = rewrite_record(ckpt, "w", rec)
    os.truncate(shard, os.path.getsize(shard) - len(rec) // 2)
    with pytest.raises(CorruptRecord) as e:
        load_dcp(ckpt, blank(state), None)
    msg = str(e.value)
    assert "\n" not in msg and f"{shard} (item w): the file ends" in msg and "into the record" in msg
    assert "verify" in msg


def rewrite_record(ckpt: Path, fqn: str, new: bytes) -> Path:
    """The shard with ``fqn``'s record replaced by ``new`` (appended, the index pointed at it)."""
    md = pickle.loads((ckpt / ".metadata").read_bytes())  # the test's own file: trusted
    index = next(i for i in md.storage_data if i.fqn == fqn)
    info = md.storage_data[index]
    shard = ckpt / info.relative_path
    info.offset, info.length = os.path.getsize(shard), len(new)
    with open(shard, "ab") as f:
        f.write(new)
    (ckpt / ".metadata").write_bytes(pickle.dumps(md))
    return shard


def test_a_truncated_shard_is_one_line_naming_file_and_item(tmp_path: Path) -> None:
    ckpt, state = saved(tmp_path)
    shard = ckpt / "__0_0.distcp"
    os.truncate(shard, os.path.getsize(shard) - 100)  # the last record loses its central directory
    with pytest.raises(CorruptRecord) as e:
        load_dcp(ckpt, blank(state), None)
    msg = str(e.value)
    assert "\n" not in msg and str(shard) in msg and "bytes into the record" in msg and "verify" in msg


def test_a_broken_zip_is_one_line_naming_file_and_item(tmp_path: Path) -> None:
    ckpt, state = saved(tmp_path)
    shard = rewrite_record(ckpt, "w", bytes(record(state["w"]))[:-22] + b"\0" * 22)  # no end record
    with pytest.raises(CorruptRecord) as e:
        load_dcp(ckpt, blank(state), None)
    msg = str(e.value)
    assert "\n" not in msg and f"{shard} (item w): not a readable tensor record" in msg


def test_a_pickle_in_a_tensor_record_is_refused_without_running(tmp_path: Path) -> None:
    marker = tmp_path / "MARKER"
    evil_pickle(marker)  # the payload is real
    ckpt, state = saved(tmp_path)
    buf = io.BytesIO()
    torch.save(RunsCommand(marker), buf)
    shard = rewrite_record(ckpt, "w", buf.getvalue())
    with pytest.raises(UnsafePickle) as e:
        load_dcp(ckpt, blank(state), None)
    assert f"{shard} (item w): refers to posix.system" in str(e.value) and "\n" not in str(e.value)
    assert not marker.exists()
