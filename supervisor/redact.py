"""Secrets out of what the toolkit prints and logs: URL user info and query-string credentials.

A remote URL or an S3 endpoint may carry credentials (``s3://KEY:SECRET@bucket/run``, a presigned
``...?X-Amz-Credential=..&X-Amz-Signature=..``, ``?sig=..``, ``?token=..``). Every sink that writes a
URL, an endpoint or a message that may contain one (the event logs, ``state.json``,
``remote.json``, the job log's lines, the trainer's log, the drill report, the errors of the
remote backends) passes it through ``redact``; ``redact`` is pure and idempotent.

What is redacted, in any ``scheme://`` URL found in a text: everything before the ``@`` of the
authority (user and password), and the value of every query or fragment parameter whose name says
it is a credential (``_SECRET_NAME``: sig, signature, token, password, secret, credential, auth,
key...); outside a URL, a ``user:password@host``. Plain ``key=value`` outside a URL is left
alone: a command line's other flags stay readable.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Mapping
from typing import Any

REDACTED = "REDACTED"

# scheme://then anything up to whitespace, a quote or an angle bracket (a URL inside a repr or a
# JSON string ends at its quote).
_URL = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]*://[^\s'\"<>`]+")
# user:password@ without a scheme before it: a name, a colon, then no space, quote, slash or @;
# then a host, never a bare number (SLURM's --signal=B:USR1@120 is no credential).
_BARE_USERINFO = re.compile(r"(?<![\w/@])[\w.%+~-]+:[^\s'\"/@<>`]+@(?=[\w\[])(?!\d+(?![\w.:\[-]))")
# A parameter name that carries a credential, matched anywhere in the name, case-insensitively:
# X-Amz-Signature, X-Amz-Credential, X-Amz-Security-Token, sig (Azure SAS), access_token, api_key,
# AWSAccessKeyId, password, client_secret, Authorization...
_SECRET_NAME = re.compile(
    r"sig|token|passw|pwd|secret|credential|auth|api[-_]?key|access[-_]?key|session|private|^key$",
    re.IGNORECASE,
)


def redact_url(url: str) -> str:
    """``url`` without its user info and credential parameters; anything else unchanged."""
    scheme, sep, rest = url.partition("://")
    if not sep:
        return url
    end = min((i for i in (rest.find("/"), rest.find("?"), rest.find("#")) if i >= 0), default=len(rest))
    authority, tail = rest[:end], rest[end:]
    if "@" in authority:
        authority = REDACTED + authority[authority.rindex("@") :]
    return f"{scheme}://{authority}{_redact_params(tail)}"


def _redact_params(tail: str) -> str:
    """The path, then the query and fragment with credential values replaced."""
    path, q, query = tail.partition("?")
    if not q:
        path, h, frag = tail.partition("#")
        return path + (h + _redact_pairs(frag) if h else "")
    query, h, frag = query.partition("#")
    return path + "?" + _redact_pairs(query) + (h + _redact_pairs(frag) if h else "")


def _redact_pairs(s: str) -> str:
    out = []
    for pair in s.split("&"):
        name, eq, _value = pair.partition("=")
        out.append(f"{name}={REDACTED}" if eq and _SECRET_NAME.search(name) else pair)
    return "&".join(out)


def redact(text: str) -> str:
    """``text`` with every URL in it redacted (``redact_url``), and any ``user:password@`` left
    outside one (botocore quotes ``KEY:SECRET@bucket`` as an invalid bucket name, without scheme)."""
    if "://" not in text and "@" not in text:  # the common case, and the cheap one
        return text
    return _BARE_USERINFO.sub(REDACTED + "@", _URL.sub(lambda m: redact_url(m.group()), text))


def redact_obj(obj: Any) -> Any:
    """Every string in a JSON-like value (dicts, lists, tuples) redacted; other values unchanged."""
    if isinstance(obj, str):
        return redact(obj)
    if isinstance(obj, Mapping):
        return {k: redact_obj(v) for k, v in obj.items()}
    if isinstance(obj, list | tuple):
        return type(obj)(redact_obj(v) for v in obj)
    return obj


class RedactFilter(logging.Filter):
    """Redacts a log record's final message (its arguments included) before any handler writes it."""

    def filter(self, record: logging.LogRecord) -> bool:
        msg = record.getMessage()
        clean = redact(msg)
        if clean != msg:
            record.msg, record.args = clean, None
        if record.exc_info and not record.exc_text:  # a traceback's messages may hold a URL too
            record.exc_text = redact(logging.Formatter().formatException(record.exc_info))
        return True


def redact_log_handlers(logger: logging.Logger | None = None) -> None:
    """Put ``RedactFilter`` on every handler of ``logger`` (the root logger by default): a handler
    filter sees every record that reaches it, those of child loggers included."""
    for h in (logger or logging.getLogger()).handlers:
        if not any(isinstance(f, RedactFilter) for f in h.filters):
            h.addFilter(RedactFilter())
