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
- ``load_restricted`` (the trainer's ``SafeFileSystemReader``) runs ``check`` on the bytes it
  then loads, resolving the allowed names to the real classes: the object DCP gets is the one
  ``pickle.load`` would have built, and a tampered file fails before anything of it runs.

Naming only allowed globals is not enough: pickle's BUILD sets attributes on whatever is on its
stack, and a global *is* the real class (or function) there. A ``.metadata`` that builds state
onto ``pathlib.PosixPath`` replaces its ``__truediv__`` for the whole process. So ``check`` lets a
pickle set state only on an instance it built itself: never on a class or function it named, nor
on what an Enum or ``_get_layout`` returns (a member, a layout: objects the process shares).

The allowlist was read off the ``.metadata`` of real DDP, FSDP2 and resharded checkpoints of the
reference trainer (tests/test_security_pickle.py keeps it that way); every torch dtype is in it
(a checkpoint of another dtype names it).
"""

from __future__ import annotations

import io
import pickle
from typing import IO, Any, cast

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

# Allowed callables whose call returns an object the whole process shares, not a new one: an
# Enum's member, a torch layout. A pickle may set state only on what it built itself.
_SHARED_RESULTS = frozenset(
    {(f"{_DCP}.metadata", "_MEM_FORMAT_ENCODING"), ("torch.serialization", "_get_layout")}
)


# Allowed classes whose own ``__setstate__`` takes what BUILD gives it (TensorProperties pickles its
# fields as a tuple): their placeholder takes any state too.
_OWN_SETSTATE = frozenset({(f"{_DCP}.metadata", "TensorProperties")})


class _SharedState(Exception):
    """A pickle sets state (BUILD) on a class, function or shared object, not on an instance of
    its own making: in the real load that would change it for the whole process."""

    def __init__(self, what: str):
        super().__init__(what)
        self.what = what


class _Fixed(type):
    """The placeholders' metaclass: no attribute of a placeholder class can be set. BUILD with a
    slot state sets attributes of whatever it is given, and in the real load that is the real
    class (``PosixPath.__truediv__``); a dict state on a class fails by itself (its ``__dict__``
    cannot be written)."""

    real = ""  # module.name of the global a placeholder stands for

    def __setattr__(cls, name: str, value: Any) -> None:
        raise _SharedState(cls.real)


class _Inert(metaclass=_Fixed):
    """Stands for an allowed global: takes any arguments, and any state on an instance of its own
    making (pickle's BUILD fills the instance's ``__dict__`` in C: no Python runs per object, so
    the check costs about what the real load does), runs nothing."""

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass


def _takes_any_state(self: _Inert, _state: Any) -> None:
    """A placeholder's ``__setstate__`` where the real class has its own: any state, on an
    instance (on the class, called with the state alone, it fails: refused)."""


def _shared(self: _Inert, _state: Any = None) -> None:
    """The ``__setstate__`` of what a call of a ``_SHARED_RESULTS`` global returns: refused."""
    raise _SharedState(f"what {getattr(type(self), 'real', 'an allowed global')}() returns")


def _placeholder(g: tuple[str, str]) -> type[_Inert]:
    body: dict[str, Any] = {"__module__": __name__, "real": f"{g[0]}.{g[1]}"}
    if g in _SHARED_RESULTS:
        body["__setstate__"] = _shared
    elif g in _OWN_SETSTATE:
        body["__setstate__"] = _takes_any_state
    return cast("type[_Inert]", _Fixed(f"Inert_{g[1]}", (_Inert,), body))


_PLACEHOLDERS = {g: _placeholder(g) for g in DCP_METADATA_GLOBALS}


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
    """Raise UnsafePickle when ``data`` names a global outside the allowlist, sets state on
    anything but an instance it built (a class, a function, a shared object: pickle's BUILD would
    change it for the whole process), or fails after a global was resolved (a placeholder may
    then have steered it away from what ``pickle.load`` would do, so what follows is unknown:
    refused). A file that fails before naming any global is harmless to ``pickle.load`` too (it
    fails at the same opcode, having called nothing): that is the checksums' business, not this
    check's. Never calls anything the file names."""
    u = _CheckingUnpickler(io.BytesIO(data), label)
    try:
        u.load()
    except UnsafePickle:
        raise
    except _SharedState as e:
        raise UnsafePickle(
            f"{label}: sets attributes of {e.what}, which the whole process shares ({WHY})"
        ) from None
    except Exception as e:  # a broken pickle raises anything: UnpicklingError, EOFError, TypeError...
        if u.first_global is not None:
            module, name = u.first_global
            raise UnsafePickle(
                f"{label}: not a DCP metadata pickle ({e.__class__.__name__} after {module}.{name}; {WHY})"
            ) from None


def read_inert(data: bytes, label: str) -> Any:
    """What a checked index says, torch-free: ``check``ed first (the same refusals as the trainer's
    load), then read again with stand-ins that keep each allowed object's pickled ``args`` and
    ``state`` (DCP's records pickle their fields as a dict state), so a login-node reader can walk
    the index (supervisor/store/foreign.py: which files it names, at which offsets). Never calls
    anything the file names; a broken pickle raises as the unpickler does."""
    check(data, label)
    return _RecordingUnpickler(io.BytesIO(data), label).load()


class _Recorded:
    """``read_inert``'s stand-in for an allowed global: keeps what the pickle gives it. A fresh
    class per read (``_RecordingUnpickler``), so nothing a file sets on one outlives the read."""

    args: tuple[Any, ...]
    state: Any

    def __new__(cls, *args: Any, **_kwargs: Any) -> _Recorded:
        obj = object.__new__(cls)
        obj.args, obj.state = args, None
        return obj

    def __init__(self, *_args: Any, **_kwargs: Any) -> None:
        pass

    def __setstate__(self, state: Any) -> None:
        self.state = state


class _RecordingUnpickler(pickle.Unpickler):
    def __init__(self, f: IO[bytes], label: str):
        super().__init__(f)
        self.label = label
        self.kinds = {
            g: type(f"Read_{g[1]}", (_Recorded,), {"__module__": __name__}) for g in DCP_METADATA_GLOBALS
        }

    def find_class(self, module: str, name: str) -> Any:
        kind = self.kinds.get((module, name))
        if kind is None:
            raise refusal(self.label, module, name)
        return kind

    def persistent_load(self, pid: Any) -> Any:
        raise pickle.UnpicklingError("persistent ids are not part of DCP metadata")


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


def load_restricted(data: bytes, label: str) -> Any:
    """``pickle.loads(data)`` that resolves only the allowlist (the real classes): ``check``ed
    first, on these same bytes, so UnsafePickle before anything the file names has run, and
    before a BUILD could set attributes of a real class (``PosixPath.__truediv__``), function
    or shared object for the whole process; then loaded. A file that fails to parse raises what
    ``pickle.loads`` raises (the caller names it)."""
    check(data, label)
    return _RestrictedUnpickler(io.BytesIO(data), label).load()
