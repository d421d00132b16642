"""A DCP tensor record in the plain layout: decoded without ``torch.load``, written without
``torch.save``.

DCP stores each tensor chunk as its own ``torch.save`` zip (torch 2.13, ``_write_item``), and a
load parses every one with ``torch.load(weights_only=True)``: a zip reader, a restricted
pure-Python unpickler and fake-mode checks, ~1 ms of CPU per record, which made a load CPU-bound
at a fraction of a raw read of the same files (bench/checkpoint.py). DCP stages a chunk as a
contiguous CPU tensor on a storage of exactly its elements (``_SerialCpuLoader`` clones anything
else), so the record is nearly always: a ``data.pkl`` that rebuilds a contiguous tensor from
storage ``0`` at offset 0, and ``data/0`` holding ``numel * itemsize`` little-endian bytes.

``plain_tensor`` recognises that layout by comparing the record's ``data.pkl`` byte for byte with
the pickle this torch writes for a contiguous tensor of the chunk's dtype and sizes (both from
DCP's metadata, itself loaded through the allowlist), finds ``data/0`` through the zip's central
directory, and returns a tensor over those bytes. Nothing of the record is unpickled; any other
layout (a view, a strided tensor, another entry, big-endian, compression, zip64, a torch that
pickles differently) returns None and goes through ``torch.load(weights_only=True)`` as before.

``read_in_place`` does the same checks on a record's head and tail alone, then reads the chunk's
bytes from the file straight into the tensor that receives them: a large record is neither
buffered nor copied (the load's two memory passes over every byte, besides the read itself).

``write_plain`` writes that record for a contiguous tensor: the same bytes ``torch.save`` writes
(but for ``.data/serialization_id``, an id nothing reads back; torch.save computes one from the
record's names and checksums, here it is zeros), at ~12 us a record where ``torch.save``'s Python
took ~65 us (its pickler class built anew per call, its zip writer's per-call setup): 40-50 ms
of a rank's save of the bench model's ~800 records. It is checked byte for byte against
``torch.save`` (tests/test_tensor_record.py), so ``torch.load``, DCP's own load and the readers
above read it as before. Any other tensor (a view, a strided or empty one, a dtype outside
``_STORAGE``, 4 GiB or more, big-endian) goes through ``torch.save``. All it writes around the
tensor's bytes depends on the dtype and sizes alone (``plain_frame``, kept per shape), so a load
on the saved layout checks a record by comparing those bytes (supervisor/resumable/_direct_read.py).
"""

from __future__ import annotations

import functools
import io
import math
import pickle
import struct
import sys
from collections import OrderedDict
from collections.abc import Callable
from typing import Any

import torch
import torch._utils

# The dtypes whose storage class torch.save names and whose bytes torch.frombuffer reads as-is.
_STORAGE = {
    torch.float64: "DoubleStorage",
    torch.float32: "FloatStorage",
    torch.float16: "HalfStorage",
    torch.bfloat16: "BFloat16Storage",
    torch.int64: "LongStorage",
    torch.int32: "IntStorage",
    torch.int16: "ShortStorage",
    torch.int8: "CharStorage",
    torch.uint8: "ByteStorage",
    torch.bool: "BoolStorage",
    torch.complex128: "ComplexDoubleStorage",
    torch.complex64: "ComplexFloatStorage",
}
# The entries torch.save writes beside data.pkl and data/0; none changes how the bytes are read
# except byteorder, which must say little.
_ENTRIES = frozenset(
    {
        "data.pkl",
        "data/0",
        "byteorder",
        "version",
        ".format_version",
        ".storage_alignment",
        ".data/serialization_id",
    }
)
# What a read in place fetches of a record before its data: torch.save puts data.pkl, byteorder and
# data/0's header in the first few hundred bytes and the central directory (~70 bytes an entry) last.
IN_PLACE_HEAD = 4096
IN_PLACE_TAIL = 4096
_EOCD = struct.Struct("<IHHHHIIH")  # end of central directory, no comment
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory file header
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header
_EOCD_SIG, _CENTRAL_SIG, _LOCAL_SIG = 0x06054B50, 0x02014B50, 0x04034B50
# What torch.save writes besides (caffe2's PyTorchStreamWriter, torch 2.13): each entry stored,
# its bytes aligned to 64 by an "FB" extra field of "Z"s, its sizes in a data descriptor after it
# (CRC32 0: the shard writer turns it off, _shard_writer.ShardWriter); then the central directory,
# zip64's end record and locator, and the end record.
_ALIGN = 64
_FLAGS = 0x0808  # sizes in a data descriptor; UTF-8 names
_DESCRIPTOR = struct.Struct("<IIII")
_Z64_EOCD = struct.Struct("<IQHHIIQQQQ")
_Z64_LOCATOR = struct.Struct("<IIQI")
_DESCRIPTOR_SIG, _Z64_EOCD_SIG, _Z64_LOCATOR_SIG = 0x08074B50, 0x06064B50, 0x07064B50
_Z64_MADE_BY, _Z64_NEEDED = 0x031E, 0x2D
_ARCHIVE = "archive/"
# The entries after data.pkl, in torch.save's order; data/0 (None here) holds the tensor's bytes.
_AFTER_PICKLE: tuple[tuple[str, bytes | None], ...] = (
    (".format_version", b"1"),
    (".storage_alignment", b"64"),
    ("byteorder", b"little"),
    ("data/0", None),
    ("version", b"3\n"),
    (".data/serialization_id", b"0" * 40),
)
# Records this size or larger need zip64 fields in their headers: torch.save writes those.
_ZIP64_FROM = 0xFFFFFFFF - (1 << 20)


class _Storage:
    """Stands for the tensor's storage; pickled as torch.save's persistent id for it."""


class _ContiguousTensor:
    """Reduces as torch 2.13 reduces a contiguous CPU tensor with no grad, hooks or attributes
    (``Tensor._reduce_ex_internal``), over a ``_Storage``."""

    def __init__(self, sizes: tuple[int, ...], stride: tuple[int, ...]):
        self.storage, self.sizes, self.stride = _Storage(), sizes, stride

    def __reduce_ex__(self, protocol: Any) -> tuple[Any, ...]:
        return (
            torch._utils._rebuild_tensor_v2,
            (self.storage, 0, self.sizes, self.stride, False, OrderedDict()),
        )


@functools.lru_cache(maxsize=4096)
def contiguous_pickle(dtype: torch.dtype, sizes: tuple[int, ...]) -> bytes | None:
    """The ``data.pkl`` torch.save writes for a contiguous ``dtype`` tensor of ``sizes`` (its
    pickler, protocol 2, storage key "0" on "cpu"); None for a dtype outside ``_STORAGE``."""
    name = _STORAGE.get(dtype)
    if name is None:
        return None
    storage_id = ("storage", getattr(torch, name), "0", "cpu", math.prod(sizes))

    class Pickler(pickle.Pickler):
        def persistent_id(self, obj: Any) -> Any:
            return storage_id if isinstance(obj, _Storage) else None

    stride = tuple(torch.empty(sizes, dtype=dtype, device="meta").stride())
    buf = io.BytesIO()
    Pickler(buf, protocol=2).dump(_ContiguousTensor(sizes, stride))
    return buf.getvalue()


class _Known:
    """A record's bytes where they are known: all of them, or the head and the tail a read in
    place fetches first (the zip's headers are at both ends, the chunk's bytes in between).
    ``at`` is None for a range outside what is known, as for one outside the record."""

    def __init__(self, length: int, head: memoryview, tail: memoryview | None = None):
        self.length, self.head = length, head
        self.tail = tail if tail is not None else memoryview(b"")
        self.tail_start = length - len(self.tail)

    def at(self, start: int, n: int) -> memoryview | None:
        if start < 0 or n < 0 or start + n > self.length:
            return None
        if start + n <= len(self.head):
            return self.head[start : start + n]
        if start >= self.tail_start:
            return self.tail[start - self.tail_start : start - self.tail_start + n]
        return None

    def unpack(self, form: struct.Struct, start: int) -> tuple[Any, ...] | None:
        got = self.at(start, form.size)
        return form.unpack(got) if got is not None else None


def _entries(rec: _Known) -> dict[str, tuple[int, int, int]] | None:
    """The record's zip entries as name -> (local header offset, method, size), from its central
    directory; None when it is not a plain zip (a comment, zip64, a multi-disk archive)."""
    eocd = rec.unpack(_EOCD, rec.length - _EOCD.size)
    if eocd is None:
        return None
    sig, disk, cd_disk, _, n, cd_size, cd_off, comment = eocd
    if sig != _EOCD_SIG or disk or cd_disk or comment or n > 16 or cd_off + cd_size > rec.length - _EOCD.size:
        return None
    out, p = {}, cd_off
    for _ in range(n):
        f = rec.unpack(_CENTRAL, p) if p + _CENTRAL.size <= cd_off + cd_size else None
        if f is None:
            return None
        sig, method, csize, usize, nlen, xlen, clen, lho = f[0], f[4], f[8], f[9], f[10], f[11], f[12], f[16]
        name = rec.at(p + _CENTRAL.size, nlen)
        if sig != _CENTRAL_SIG or csize != usize or name is None:
            return None
        out[bytes(name).decode("utf-8", "replace")] = (lho, method, usize)
        p += _CENTRAL.size + nlen + xlen + clen
    return out if len(out) == n else None  # a name twice: which one torch.load reads is its business


def _body(rec: _Known, entry: tuple[int, int, int], name: str, end: int) -> int | None:
    """Where a stored (uncompressed) entry's bytes start, checked against its local header."""
    lho, method, size = entry
    f = rec.unpack(_LOCAL, lho) if method == 0 and lho + _LOCAL.size <= end else None
    if f is None:
        return None
    nlen, xlen = f[9], f[10]
    start = lho + _LOCAL.size + nlen + xlen
    local_name = rec.at(lho + _LOCAL.size, nlen)
    if f[0] != _LOCAL_SIG or local_name is None or bytes(local_name) != name.encode() or start + size > end:
        return None
    return start


def _spans(rec: _Known) -> list[tuple[int, int]] | None:
    """(start, size) of data.pkl, byteorder and data/0, when every entry is one torch.save writes
    under one archive prefix, stored uncompressed; None otherwise."""
    entries = _entries(rec)
    if not entries:
        return None
    prefix = next(iter(entries)).split("/", 1)[0] + "/"
    if any(not n.startswith(prefix) or n[len(prefix) :] not in _ENTRIES for n in entries):
        return None
    out = []
    for key in ("data.pkl", "byteorder", "data/0"):
        entry = entries.get(prefix + key)
        start = _body(rec, entry, prefix + key, rec.length - _EOCD.size) if entry is not None else None
        if entry is None or start is None:
            return None
        out.append((start, entry[2]))
    return out


def plain_data_start(rec: _Known, dtype: torch.dtype, sizes: tuple[int, ...]) -> int | None:
    """Where the chunk's bytes start in the record, when it is the plain layout described above
    and its ``data.pkl`` and byte order lie in what is known of it; None otherwise."""
    expected = contiguous_pickle(dtype, sizes)
    spans = _spans(rec) if expected is not None and sys.byteorder == "little" else None
    if spans is None:
        return None
    (pkl, pkl_n), (order, order_n), (data, data_n) = spans
    pickled, byteorder = rec.at(pkl, pkl_n), rec.at(order, order_n)
    if (
        pickled is None
        or bytes(pickled) != expected
        or byteorder is None
        or bytes(byteorder) != b"little"
        or data_n != math.prod(sizes) * dtype.itemsize
        or data % dtype.itemsize
    ):
        return None
    return data


def bytes_as_shown(t: torch.Tensor) -> bool:
    """Whether ``t``'s memory holds its elements, in order, as it shows them: on the CPU,
    contiguous, not empty, and not a lazy view (conjugate, negative) whose memory holds other
    values than it shows. Such a tensor's bytes can be read into or written out as they are."""
    return (
        t.device.type == "cpu" and t.is_contiguous() and t.numel() > 0 and not t.is_conj() and not t.is_neg()
    )


def read_in_place(stream: io.BufferedIOBase, offset: int, length: int, target: torch.Tensor) -> bool | str:
    """Read the plain record at ``offset`` (``length`` bytes) of ``stream`` straight into
    ``target``'s memory: its head and tail first (the zip's headers), then the chunk's bytes,
    with no buffer and no copy between. False, with nothing of ``target`` written, when the
    record or the target is not one this reads (the caller reads the record whole); a string
    saying how the file fell short when it ends inside the record."""
    if not bytes_as_shown(target):
        return False
    head_n = min(length, IN_PLACE_HEAD)
    tail_n = min(length - head_n, IN_PLACE_TAIL)
    stream.seek(offset)
    head = stream.read(head_n)
    stream.seek(offset + length - tail_n)
    tail = stream.read(tail_n)
    if len(head) != head_n or len(tail) != tail_n:
        return f"the file ends inside the record at offset {offset} ({length} bytes)"
    start = plain_data_start(
        _Known(length, memoryview(head), memoryview(tail)), target.dtype, tuple(target.size())
    )
    if start is None:
        return False
    stream.seek(offset + start)
    into = target.view(-1).view(torch.uint8).numpy().data  # the tensor's own memory
    got = stream.readinto(into)
    if got != into.nbytes:
        return f"the file ends {start + got} of {length} bytes into the record at offset {offset}"
    return True


def plain_tensor(rec: bytearray, dtype: torch.dtype, sizes: tuple[int, ...]) -> torch.Tensor | None:
    """The chunk ``rec`` holds, as a tensor over ``rec``'s bytes (no copy), when the record is the
    plain layout described above; None otherwise (the caller falls back to ``torch.load``)."""
    data = plain_data_start(_Known(len(rec), memoryview(rec)), dtype, sizes)
    if data is None:
        return None
    numel = math.prod(sizes)
    if numel == 0:
        return torch.empty(sizes, dtype=dtype)
    return torch.frombuffer(rec, dtype=dtype, count=numel, offset=data).view(sizes)


@functools.lru_cache(maxsize=4096)
def plain_frame(dtype: torch.dtype, sizes: tuple[int, ...]) -> tuple[bytes, bytes] | None:
    """The bytes of a plain record of a contiguous ``dtype`` tensor of ``sizes`` around its
    data: all before (the zip's headers, ``data.pkl``, up to ``data/0``'s bytes) and all after
    (the rest of the entries and the central directory). They depend on nothing else, so a save
    writes them and a load checks them (supervisor/resumable/_direct_read.py) by one comparison each. None
    for a dtype outside ``_STORAGE``, no elements, 4 GiB or more, or a big-endian machine."""
    pickled = contiguous_pickle(dtype, sizes)
    nbytes = math.prod(sizes) * dtype.itemsize
    if pickled is None or sys.byteorder != "little" or not nbytes or nbytes >= _ZIP64_FROM:
        return None
    before: list[bytes] = []  # the headers up to data/0's bytes, then the rest
    after: list[bytes] = []
    parts, central, at = before, [], 0
    for name, body in (("data.pkl", pickled), *_AFTER_PICKLE):
        encoded = (_ARCHIVE + name).encode()
        size = nbytes if body is None else len(body)
        pad = -(at + _LOCAL.size + len(encoded) + 4) % _ALIGN
        head = _LOCAL.pack(_LOCAL_SIG, 0, _FLAGS, 0, 0, 0, 0, 0, 0, len(encoded), pad + 4)
        parts += [head, encoded, b"FB", struct.pack("<H", pad), b"Z" * pad]
        if body is None:
            parts = after
        else:
            parts.append(body)
        parts.append(_DESCRIPTOR.pack(_DESCRIPTOR_SIG, 0, size, size))
        central.append((encoded, size, at))
        at += _LOCAL.size + len(encoded) + 4 + pad + size + _DESCRIPTOR.size
    cd = b"".join(
        _CENTRAL.pack(_CENTRAL_SIG, 0, 0, _FLAGS, 0, 0, 0, 0, size, size, len(n), 0, 0, 0, 0, 0, off) + n
        for n, size, off in central
    )
    n = len(central)
    z64 = _Z64_EOCD.size - 12  # its size field counts what follows that field
    after += [
        cd,
        _Z64_EOCD.pack(_Z64_EOCD_SIG, z64, _Z64_MADE_BY, _Z64_NEEDED, 0, 0, n, n, len(cd), at),
        _Z64_LOCATOR.pack(_Z64_LOCATOR_SIG, 0, at + len(cd), 1),
        _EOCD.pack(_EOCD_SIG, 0, 0, n, n, len(cd), at, 0),
    ]
    return b"".join(before), b"".join(after)


def write_plain(write: Callable[[Any], object], tensor: torch.Tensor) -> int | None:
    """Write ``tensor``'s plain record (module docstring) through ``write`` in three calls: the
    headers before its bytes (``plain_frame``), its bytes (from its own memory: no copy), the
    rest. Returns the record's length; None, with nothing written, for a tensor this does not
    write."""
    frame = plain_frame(tensor.dtype, tuple(tensor.size())) if type(tensor) is torch.Tensor else None
    if (
        frame is None
        or not bytes_as_shown(tensor)
        or tensor.requires_grad
        or tensor.storage_offset()
        or tensor.untyped_storage().nbytes() != tensor.nbytes
    ):
        return None
    before, after = frame
    write(before)
    write(tensor.view(-1).view(torch.uint8).numpy().data)
    write(after)
    return len(before) + tensor.nbytes + len(after)
