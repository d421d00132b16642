"""A DCP tensor record decoded without ``torch.load`` when it is the plain layout DCP writes.

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
"""

from __future__ import annotations

import functools
import io
import math
import pickle
import struct
import sys
from collections import OrderedDict
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
_EOCD = struct.Struct("<IHHHHIIH")  # end of central directory, no comment
_CENTRAL = struct.Struct("<IHHHHHHIIIHHHHHII")  # central directory file header
_LOCAL = struct.Struct("<IHHHHHIIIHH")  # local file header
_EOCD_SIG, _CENTRAL_SIG, _LOCAL_SIG = 0x06054B50, 0x02014B50, 0x04034B50


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


def _entries(rec: memoryview) -> dict[str, tuple[int, int, int]] | None:
    """The record's zip entries as name -> (local header offset, method, size), from its central
    directory; None when it is not a plain zip (a comment, zip64, a multi-disk archive)."""
    if len(rec) < _EOCD.size:
        return None
    sig, disk, cd_disk, _, n, cd_size, cd_off, comment = _EOCD.unpack_from(rec, len(rec) - _EOCD.size)
    if sig != _EOCD_SIG or disk or cd_disk or comment or n > 16 or cd_off + cd_size > len(rec) - _EOCD.size:
        return None
    out, p = {}, cd_off
    for _ in range(n):
        if p + _CENTRAL.size > cd_off + cd_size:
            return None
        f = _CENTRAL.unpack_from(rec, p)
        sig, method, csize, usize, nlen, xlen, clen, lho = f[0], f[4], f[8], f[9], f[10], f[11], f[12], f[16]
        if sig != _CENTRAL_SIG or csize != usize:
            return None
        out[bytes(rec[p + _CENTRAL.size : p + _CENTRAL.size + nlen]).decode("utf-8", "replace")] = (
            lho,
            method,
            usize,
        )
        p += _CENTRAL.size + nlen + xlen + clen
    return out if len(out) == n else None  # a name twice: which one torch.load reads is its business


def _body(rec: memoryview, entry: tuple[int, int, int], name: str, end: int) -> int | None:
    """Where a stored (uncompressed) entry's bytes start, checked against its local header."""
    lho, method, size = entry
    if method != 0 or lho + _LOCAL.size > end:
        return None
    f = _LOCAL.unpack_from(rec, lho)
    nlen, xlen = f[9], f[10]
    start = lho + _LOCAL.size + nlen + xlen
    if (
        f[0] != _LOCAL_SIG
        or bytes(rec[lho + _LOCAL.size : lho + _LOCAL.size + nlen]) != name.encode()
        or start + size > end
    ):
        return None
    return start


def _spans(view: memoryview) -> list[tuple[int, int]] | None:
    """(start, size) of data.pkl, byteorder and data/0, when every entry is one torch.save writes
    under one archive prefix, stored uncompressed; None otherwise."""
    entries = _entries(view)
    if not entries:
        return None
    prefix = next(iter(entries)).split("/", 1)[0] + "/"
    if any(not n.startswith(prefix) or n[len(prefix) :] not in _ENTRIES for n in entries):
        return None
    out = []
    for key in ("data.pkl", "byteorder", "data/0"):
        entry = entries.get(prefix + key)
        start = _body(view, entry, prefix + key, len(view) - _EOCD.size) if entry is not None else None
        if entry is None or start is None:
            return None
        out.append((start, entry[2]))
    return out


def plain_tensor(rec: bytearray, dtype: torch.dtype, sizes: tuple[int, ...]) -> torch.Tensor | None:
    """The chunk ``rec`` holds, as a tensor over ``rec``'s bytes (no copy), when the record is the
    plain layout described above; None otherwise (the caller falls back to ``torch.load``)."""
    expected = contiguous_pickle(dtype, sizes)
    view = memoryview(rec)
    spans = _spans(view) if expected is not None and sys.byteorder == "little" else None
    if spans is None:
        return None
    (pkl, pkl_n), (order, order_n), (data, data_n) = spans
    numel = math.prod(sizes)
    if (
        bytes(view[pkl : pkl + pkl_n]) != expected
        or bytes(view[order : order + order_n]) != b"little"
        or data_n != numel * dtype.itemsize
        or data % dtype.itemsize
    ):
        return None
    if numel == 0:
        return torch.empty(sizes, dtype=dtype)
    return torch.frombuffer(rec, dtype=dtype, count=numel, offset=data).view(sizes)
