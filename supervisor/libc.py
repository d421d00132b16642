"""A libc function by name, for the Linux calls Python's os module lacks (prctl,
sync_file_range): one lookup that says None where the platform has no such call."""

from __future__ import annotations

import ctypes
from typing import Any


def libc_function(name: str, argtypes: list[Any], restype: Any = ctypes.c_int) -> Any:
    """libc's ``name`` with its C signature, errno kept for ``ctypes.get_errno``; None where this
    platform's libc has no such function."""
    try:
        fn = getattr(ctypes.CDLL(None, use_errno=True), name)
    except (OSError, AttributeError):
        return None
    fn.argtypes = argtypes
    fn.restype = restype
    return fn
