"""The fault filesystem's rules, pure: what a rule is, which operation it hits, when its window ends,
how long a bandwidth cap holds an operation back. No I/O here, so every decision is tested without
a mount (tests/test_faultfs.py); supervisor/drill/faultfs.py applies them to real operations.

A rule is a plain dict on the control socket and in ``faultfs ctl add``; :func:`parse_rule` is the
one place that validates it, with one-line errors naming the bad field.
"""

from __future__ import annotations

import errno as errno_mod
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from fnmatch import fnmatchcase
from typing import Any

# Every operation the passthrough forwards, by its FUSE name. close() reaches the filesystem as
# `flush` (its errors are close()'s errors); `release` follows asynchronously and fails no caller.
OPS = frozenset(
    {
        "access", "chmod", "chown", "create", "flush", "fsync", "fsyncdir", "getattr", "link",
        "mkdir", "open", "opendir", "read", "readdir", "readlink", "release", "releasedir",
        "rename", "rmdir", "statfs", "symlink", "truncate", "unlink", "utimens", "write",
    }
)  # fmt: skip
SIZED_OPS = frozenset({"read", "write"})  # the ones a bandwidth cap can meter
# A hidden path is missing from a process's view: lookups say ENOENT, listings leave it out.
HIDE_OPS = frozenset({"access", "getattr", "open", "opendir", "readlink"})
ACTIONS = ("error", "delay", "throttle", "block", "hide")


class RuleError(ValueError):
    """A rule that cannot be applied; the message is one line naming the field and the fix."""


@dataclass(frozen=True)
class Rule:
    """One fault: ``action`` on operations in ``ops`` whose path matches ``pattern``.

    pattern: an fnmatch glob on the path inside the mount ("/run/step_10/*"; ``*`` also matches
    "/"); a rename matches on either name. ops: None means every operation (for ``throttle``: read
    and write; ``hide`` always covers lookups and listings). Window: the first ``count`` matching
    operations, or ``seconds`` from when the rule was set, or (neither) until cleared; ``skip``
    lets that many matching operations through before the window opens (a fault at the Nth write
    of a file, chosen by the rule rather than by timing). pids: only operations by these
    processes or their descendants (None: every process).
    """

    action: str
    pattern: str = "*"
    ops: frozenset[str] | None = None
    errno: int | None = None  # error
    delay_s: float | None = None  # delay
    bytes_per_s: float | None = None  # throttle
    count: int | None = None
    seconds: float | None = None
    pids: frozenset[int] | None = None
    skip: int | None = None

    def covers(self, op: str) -> bool:
        if self.action == "hide":
            return op in HIDE_OPS
        return self.ops is None or op in self.ops

    def matches(self, op: str, paths: Iterable[str]) -> bool:
        return self.covers(op) and any(fnmatchcase(p, self.pattern) for p in paths)

    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {"action": self.action, "pattern": self.pattern}
        if self.ops is not None:
            d["ops"] = sorted(self.ops)
        if self.errno is not None:
            d["errno"] = errno_mod.errorcode.get(self.errno, self.errno)
        for key in ("delay_s", "bytes_per_s", "count", "seconds", "skip"):
            if getattr(self, key) is not None:
                d[key] = getattr(self, key)
        if self.pids is not None:
            d["pids"] = sorted(self.pids)
        return d


def parse_errno(value: int | str) -> int:
    """An errno from its name ("EIO", "ESTALE") or number."""
    if isinstance(value, int) and not isinstance(value, bool) and value > 0:
        return value
    if isinstance(value, str) and isinstance(getattr(errno_mod, value.upper(), None), int):
        return getattr(errno_mod, value.upper())
    raise RuleError(f"errno {value!r} is not an errno name or number: use e.g. 'EIO', 'ESTALE', 'ENOSPC'")


def _positive(d: Mapping[str, Any], key: str, kind: type) -> Any:
    value = d.get(key)
    if value is None:
        return None
    ok = isinstance(value, (int, float) if kind is float else int) and not isinstance(value, bool)
    if not ok or value <= 0:
        raise RuleError(f"{key}={value!r} must be a positive {kind.__name__}")
    return kind(value)


def _parse_ops(given: str | Iterable[str] | None) -> frozenset[str] | None:
    if given is None:
        return None
    ops = frozenset([given] if isinstance(given, str) else given)
    if not ops or not ops <= OPS:
        raise RuleError(f"ops {sorted(ops - OPS) or '[]'} unknown: choose from {', '.join(sorted(OPS))}")
    return ops


def _skip(d: Mapping[str, Any]) -> int | None:
    """``skip``: a count >= 0 (0 is the same as none)."""
    value = d.get("skip")
    if value is None:
        return None
    if not isinstance(value, int) or isinstance(value, bool) or value < 0:
        raise RuleError(f"skip={value!r} must be a whole number >= 0 (matching operations let through first)")
    return value or None


def parse_rule(d: Mapping[str, Any]) -> Rule:
    """Validate a rule dict (the control socket's and the CLI's form) into a :class:`Rule`."""
    known = {
        "action",
        "pattern",
        "ops",
        "errno",
        "delay_s",
        "bytes_per_s",
        "count",
        "seconds",
        "pids",
        "skip",
    }
    if unknown := sorted(set(d) - known):
        raise RuleError(f"unknown rule field(s) {', '.join(unknown)}: known are {', '.join(sorted(known))}")
    action = d.get("action")
    if action not in ACTIONS:
        raise RuleError(f"action {action!r} is not one of {', '.join(ACTIONS)}")
    pattern = d.get("pattern", "*")
    if not isinstance(pattern, str) or not pattern.startswith(("/", "*")):
        raise RuleError(
            f"pattern {pattern!r} must be a glob on the path inside the mount, starting with / or *"
        )
    rule = Rule(
        action=action,
        pattern=pattern,
        ops=_parse_ops(d.get("ops")),
        errno=parse_errno(d["errno"]) if d.get("errno") is not None else None,
        delay_s=_positive(d, "delay_s", float),
        bytes_per_s=_positive(d, "bytes_per_s", float),
        count=_positive(d, "count", int),
        seconds=_positive(d, "seconds", float),
        pids=frozenset(int(p) for p in d["pids"]) if d.get("pids") is not None else None,
        skip=_skip(d),
    )
    needs = {"error": "errno", "delay": "delay_s", "throttle": "bytes_per_s"}
    for act, key in needs.items():
        if (act == action) != (getattr(rule, key) is not None):
            raise RuleError(f"{key} is {'required' if act == action else 'not allowed'} for action {action}")
    if rule.count is not None and rule.seconds is not None:
        raise RuleError("give a window as count or seconds, not both")
    if rule.skip and rule.seconds is not None:
        raise RuleError("skip counts operations: give the window after it as count (or none), not seconds")
    if action == "throttle":
        if rule.ops is None:
            rule = Rule(**{**rule.__dict__, "ops": SIZED_OPS})
        elif not rule.ops <= SIZED_OPS:
            raise RuleError(f"throttle meters bytes: ops must be among read, write (got {sorted(rule.ops)})")
    if action == "hide" and rule.ops is not None:
        raise RuleError("hide takes no ops: it covers lookups (ENOENT) and listings (left out)")
    return rule


@dataclass
class RuleState:
    """A rule as set on a running filesystem: its id, when it was set, and how often it fired."""

    id: str
    rule: Rule
    set_at: float  # monotonic seconds
    hits: int = 0
    passed: int = 0  # matching operations let through under ``skip``
    free_at: float = 0.0  # throttle: when the cap lets the next byte through (monotonic)
    blocked: list[dict[str, Any]] = field(default_factory=list)

    def active(self, now: float) -> bool:
        if self.rule.count is not None:
            return self.hits < self.rule.count
        if self.rule.seconds is not None:
            return now < self.set_at + self.rule.seconds
        return True

    def applies(self, op: str, paths: Iterable[str], now: float, lineage: frozenset[int] | None) -> bool:
        """Whether this operation is hit: active, matching, and by one of the rule's processes
        (``lineage``: the caller and its ancestors; None when the rule has no pids)."""
        if not (self.active(now) and self.rule.matches(op, paths)):
            return False
        return self.rule.pids is None or bool(lineage and self.rule.pids & lineage)

    def fire(self, op: str, paths: Iterable[str], now: float, lineage: frozenset[int] | None) -> bool:
        """``applies``, counted: a hit, or one of the first ``skip`` matching operations, let
        through. Caller holds the filesystem's lock."""
        if not self.applies(op, paths, now, lineage):
            return False
        if self.passed < (self.rule.skip or 0):
            self.passed += 1
            return False
        self.hits += 1
        return True

    def status(self, now: float) -> dict[str, Any]:
        return {
            "id": self.id, **self.rule.to_dict(), "hits": self.hits, "passed": self.passed,
            "active": self.active(now),
        }  # fmt: skip


def throttle(free_at: float, now: float, nbytes: int, bytes_per_s: float) -> tuple[float, float]:
    """A bandwidth cap shared by every operation under one rule: returns (seconds this one waits,
    when the cap is free again). Operations queue behind each other, so N threads together still
    move at most ``bytes_per_s``."""
    done = max(free_at, now) + nbytes / bytes_per_s
    return done - now, done
