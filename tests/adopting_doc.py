"""docs/adopting.md's code blocks, read for the tests that check each against what runs: the
``diff`` and ``python`` blocks against the example files (which the drill and the preemption tests
run), the ``sh`` blocks by running them (tests/test_examples_drill.py)."""

from __future__ import annotations

import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from commands import REPO

DOC = REPO / "docs" / "adopting.md"
EXAMPLES = REPO / "examples"
_FENCE = re.compile(r"^```(\w+)\n(.*?)^```$", re.MULTILINE | re.DOTALL)
_MARK = re.compile(r"\s+# resumable.*$")


@dataclass(frozen=True)
class Block:
    lang: str
    text: str


def blocks() -> list[Block]:
    return [Block(m.group(1), m.group(2)) for m in _FENCE.finditer(DOC.read_text())]


def code_line(line: str) -> str:
    """A line as code: without its ``# resumable`` mark and its indentation ('' for a comment)."""
    text = _MARK.sub("", line).strip()
    return "" if text.startswith("#") else text


def code_lines(path: Path) -> list[str]:
    return [c for line in path.read_text().splitlines() if (c := code_line(line))]


def drill_commands() -> list[list[str]]:
    """The ``sh`` blocks' commands, as argv after ``python -m supervisor``."""
    out = []
    for b in blocks():
        if b.lang == "sh":
            for line in b.text.splitlines():
                argv = shlex.split(line)
                assert argv[:3] == ["python", "-m", "supervisor"], line
                out.append(argv[3:])
    return out
