"""Options more than one program takes, declared once: the same flag, default, parsing and bound
wherever they appear (the watchdog, the trainer's ``Resumable``, the login-node commands). What
differs is what the program does when the option runs out, which the caller says in ``then``."""

from __future__ import annotations

from pathlib import Path
from typing import Any

from supervisor.options import NOT_NEGATIVE, option
from supervisor.store.ioerrors import IO_RETRY_S


def ckpt_root(**kw: Any) -> Path:
    result: Path = option("the run's checkpoint root", flag="--ckpt-root", **kw)
    return result


def io_retry(then: str, **kw: Any) -> float:
    result: float = option(
        f"retry unreadable checkpoints (EIO, ESTALE...) this long, then {then}",
        IO_RETRY_S,
        flag="--io-retry",
        metavar="SECONDS",
        check=NOT_NEGATIVE,
        **kw,
    )
    return result


def allow_fresh_start(what: str, **kw: Any) -> bool:
    result: bool = option(
        f"with no usable checkpoint but some quarantined, {what} (not a silent restart from step 0)",
        False,
        **kw,
    )
    return result


def remote_endpoint(**kw: Any) -> str | None:
    result: str | None = option(
        "S3 endpoint URL (default: AWS_ENDPOINT_URL or AWS)",
        None,
        flag="--remote-endpoint",
        metavar="URL",
        **kw,
    )
    return result


def as_json(what: str = "print stable JSON (docs/cli.md)") -> bool:
    result: bool = option(what, False, flag="--json")
    return result
