"""DCP's ``.metadata`` without running it: the allowlist of what it is made of, a torch-free check,
and the restricted loader the trainer reads it with.

DCP writes the checkpoint's index with ``pickle.dump`` and reads it back with a plain
``pickle.load`` (torch 2.13, ``torch/distributed/checkpoint/filesystem.py``): whoever can write a
checkpoint can make every rank run any code at the next resume. A pickle can only call what it
names: every callable comes from a *global reference* (``module.name``), which the unpickler
resolves through ``find_class``. So both readers here resolve only ``DCP_METADATA_GLOBALS``:

- ``check`` (torch-free, used by deep validation and ``ckpt verify --deep``) resolves each allowed
  name to an inert placeholder and refuses any other name: nothing in the file is ever called,
  and torch is never imported.
- ``load_restricted`` (the trainer's ``SafeFileSystemReader``) resolves the allowed names to the
  real classes and refuses any other, so the object DCP gets is the one ``pickle.load`` would have
  built, and a tampered file fails at the first foreign name, before anything of it runs.

The allowlist was read off the ``.metadata`` of real DDP, FSDP2 and resharded checkpoints of the
reference trainer (tests/test_security_pickle.py keeps it that way); every torch dtype is in it
(a checkpoint of another dtype names it).
"""

from __future__ import annotations

import io
import pickle
from typing import IO, Any

from supervisor.errors import IntegrityError

_DCP = "torch.distributed.checkpoint"
_TORCH_DTYPES = (  # every torch.dtype of torch 2.13, as it pickles: ("torch", "<name>")
    "bfloat16", "bits16", "bits1x8", "bits2x4", "bits4x2", "bits8", "bool", "complex128", "complex32",
    "complex64", "float16", "float32", "float4_e2m1fn_x2", "float64", "float8_e4m3fn",
    "float8_e4m3fnuz", "float8_e5m2", "float8_e5m2fnuz", "float8_e8m0fnu", "int1", "int16", "int2",
    "int3", "int32", "int4", "int5", "int6", "int64", "int7", "int8", "qint32", "qint8", "quint2x4",
    "quint4x2", "quint8", "uint1", "uint16", "uint2", "uint3", "uint32", "uint4", "uint5", "uint6",
    "uint64", "uint7", "uint8",
)  # fmt: skip

# (module, name) of every global DCP's metadata pickles through, and nothing else. None of them
# runs anything but constructors of plain records: no builtins, no copyreg, no getattr.
DCP_METADATA_GLOBALS: frozenset[tuple[str, str]] = frozenset(
    {
        (f"{_DCP}.metadata", "Metadata"),
        (f"{_DCP}.metadata", "MetadataIndex"),
        (f"{_DCP}.metadata", "StorageMeta"),
        (f"{_DCP}.metadata", "TensorStorageMetadata"),
        (f"{_DCP}.metadata", "BytesStorageMetadata"),
        (f"{_DCP}.metadata", "ChunkStorageMetadata"),
        (f"{_DCP}.metadata", "TensorProperties"),
        (f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"),  # TensorProperties' memory format, an Enum
        (f"{_DCP}.filesystem", "_StorageInfo"),  # FileSystemWriter's storage_data entries
        ("torch", "Size"),  # chunk offsets and sizes
        ("torch.serialization", "_get_layout"),  # torch.strided, looked up by its name
        ("pathlib", "PosixPath"),  # StorageMeta.checkpoint_id
        *(("torch", d) for d in _TORCH_DTYPES),
    }
)

WHY = "a tampered or foreign file, refused without running any of it"


class UnsafePickle(IntegrityError, ValueError):
    """A pickle names something DCP's metadata is not made of; ``str(e)`` is one line naming the
    file, the name and the fix. Nothing of the file was run."""


def refusal(label: str, module: str, name: str) -> UnsafePickle:
    return UnsafePickle(f"{label}: refers to {module}.{name}, which DCP's metadata is not made of ({WHY})")


# ---------------------------------------------------------------- torch-free check


class _Inert:
    """Stands for an allowed global: takes any arguments and any state, runs nothing; keeps them
    (``args``, ``state``) for a torch-free reader of the index (``read_inert``)."""

    args: tuple[Any, ...]
    state: Any

    def __new__(cls, *args: Any, **_kwargs: Any) -> _Inert:
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state


_PLACEHOLDERS = {g: type(f"Inert_{g[1]}", (_Inert,), {"__module__": __name__}) for g in DCP_METADATA_GLOBALS}


class _CheckingUnpickler(pickle.Unpickler):
    def __init__(self, f: IO[bytes], label: str):
        super().__init__(f)
        self.label = label
        self.first_global: tuple[str, str] | None = None

    def find_class(self, module: str, name: str) -> Any:
        placeholder = _PLACEHOLDERS.get((module, name))
        if placeholder is None:
            raise refusal(self.label, module, name)
        self.first_global = self.first_global or (module, name)
        return placeholder

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not part of DCP metadata")


def check(data: bytes, label: str) -> None:
    """Raise UnsafePickle when ``data`` names a global outside the allowlist, or fails after one
    was resolved (a placeholder may then have steered it away from what ``pickle.load`` would do,
    so what follows is unknown: refused). A file that fails before naming any global is harmless
    to ``pickle.load`` too (it fails at the same opcode, having called nothing): that is the
    checksums' business, not this check's. Never calls anything the file names."""
    u = _CheckingUnpickler(io.BytesIO(data), label)
    try:
        u.load()
    except UnsafePickle:
        raise
    except Exception as e:  # a broken pickle raises anything: UnpicklingError, EOFError, TypeError...
        if u.first_global is not None:
            module, name = u.first_global
            raise UnsafePickle(
                f"{label}: not a DCP metadata pickle ({e.__class__.__name__} after {module}.{name}; {WHY})"
            ) from None


def read_inert(data: bytes, label: str) -> Any:
    """``check``'s read, returning what it built: each allowed object as a placeholder that keeps
    its pickled ``args`` and ``state`` (DCP's records pickle their fields as a dict state), so a
    torch-free reader can walk the index (supervisor/store/foreign.py: which files it names, at
    which offsets). UnsafePickle at the first name outside the allowlist; any other failure of a
    broken pickle raises as the unpickler does. Never calls anything the file names."""
    return _CheckingUnpickler(io.BytesIO(data), label).load()


# ---------------------------------------------------------------- the trainer's loader


class _RestrictedUnpickler(pickle.Unpickler):
    def __init__(self, f: IO[bytes], label: str):
        super().__init__(f)
        self.label = label

    def find_class(self, module: str, name: str) -> Any:
        if (module, name) not in DCP_METADATA_GLOBALS:
            raise refusal(self.label, module, name)
        return super().find_class(module, name)

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError(f"{self.label}: persistent ids are not part of DCP metadata")


def load_restricted(f: IO[bytes], label: str) -> Any:
    """``pickle.load(f)`` that resolves only the allowlist (the real classes); UnsafePickle at the
    first other name, before anything the file names has run."""
    return _RestrictedUnpickler(f, label).load()
