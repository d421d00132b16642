"""SLURM host lists (``n[1-3,5],gpu01``) to host names: expanded here, or by ``scontrol show
hostnames`` when it is there (pure expansion first; scontrol only for what the pure one cannot read)."""

from __future__ import annotations

import re
import subprocess

from supervisor.slurm.scontrol import SCONTROL_TIMEOUT_S, SlurmError, last_line, scontrol_path

_RANGE_RE = re.compile(r"^(\d+)(?:-(\d+))?$")


def expand_hostlist(expr: str) -> list[str]:
    """SLURM's compact host list (``gpu[01-03,7],login-a``) as names, in order. Used only where
    ``scontrol`` is missing; SLURM's own expansion is the reference."""
    hosts: list[str] = []
    for item in _split_top_level(expr):
        hosts.extend(_expand_item(item))
    return hosts


def _split_top_level(expr: str) -> list[str]:
    items, depth, cur = [], 0, ""
    for ch in expr.strip():
        depth += {"[": 1, "]": -1}.get(ch, 0)
        if depth < 0 or depth > 1:
            raise SlurmError(f"cannot parse host list {expr!r}: unbalanced brackets")
        if ch == "," and depth == 0:
            items.append(cur)
            cur = ""
        else:
            cur += ch
    if depth:
        raise SlurmError(f"cannot parse host list {expr!r}: unbalanced brackets")
    return [i for i in [*items, cur] if i]


def _expand_item(item: str) -> list[str]:
    m = re.match(r"^([^\[]*)\[([^\]]*)\](.*)$", item)
    if not m:
        return [item]
    prefix, ranges, rest = m.groups()
    out: list[str] = []
    for r in ranges.split(","):
        rm = _RANGE_RE.match(r)
        if not rm:
            raise SlurmError(f"cannot parse host list range {r!r} in {item!r}")
        lo, hi = rm.group(1), rm.group(2) or rm.group(1)
        width = len(lo)
        for n in range(int(lo), int(hi) + 1):
            out.extend(f"{prefix}{n:0{width}d}{tail}" for tail in _expand_item(rest))
    return out


def hostnames(nodelist: str) -> tuple[list[str], str]:
    """The allocation's hosts (``scontrol show hostnames``), and a note when SLURM's expansion was
    not available and the built-in one was used."""
    scontrol = scontrol_path()
    if scontrol is None:
        note = "scontrol not found on PATH; expanded the host list with the built-in parser"
        return expand_hostlist(nodelist), note
    out = subprocess.run(
        [scontrol, "show", "hostnames", nodelist],
        capture_output=True,
        text=True,
        timeout=SCONTROL_TIMEOUT_S,
        check=False,
    )
    if out.returncode != 0 or not out.stdout.split():
        raise SlurmError(f"`scontrol show hostnames {nodelist}` failed: {last_line(out.stderr)}")
    return out.stdout.split(), ""
