"""Tables in the docs generated from the declarations they describe, so they cannot drift.

A generated table sits in a Markdown file between ``<!-- generated: NAME -->`` and
``<!-- end generated: NAME -->``; ``python -m supervisor.format.doctables`` rewrites every such block
from ``TABLES`` (tests/test_doctables.py fails when a committed file differs from what it would
write). To add one: a function returning the Markdown, an entry in ``TABLES``, the two markers.
"""

from __future__ import annotations

import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path

from supervisor.format.exitcodes import MEANINGS

REPO = Path(__file__).resolve().parents[2]
FILES = ("README.md",)


def markdown_table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    head = list(header)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def exit_codes() -> str:
    return markdown_table(("code", "who", "meaning"), ((m.code, m.who, m.text) for m in MEANINGS))


TABLES: dict[str, Callable[[], str]] = {"exit-codes": exit_codes}


def rewrite(text: str) -> str:
    """``text`` with every generated block replaced by what its declaration renders now."""

    def block(mo: re.Match[str]) -> str:
        name = mo.group(1)
        if name not in TABLES:
            raise KeyError(f"unknown generated table {name!r}; known: {', '.join(TABLES)}")
        return f"<!-- generated: {name} -->\n{TABLES[name]()}\n<!-- end generated: {name} -->"

    return re.sub(r"<!-- generated: ([\w-]+) -->\n.*?<!-- end generated: \1 -->", block, text, flags=re.S)


def main() -> int:
    for name in FILES:
        path = REPO / name
        old = path.read_text()
        new = rewrite(old)
        if new != old:
            path.write_text(new)
            print(f"rewrote {name}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
