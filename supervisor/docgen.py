"""Tables in the docs generated from the declarations they describe, so they cannot drift.

A generated table sits in a Markdown file between ``<!-- generated: NAME -->`` and
``<!-- end generated: NAME -->``; ``python -m supervisor.docgen`` rewrites every such block
from ``TABLES`` (tests/test_doctables.py fails when a committed file differs from what it would
write). To add one: a function returning the Markdown, an entry in ``TABLES``, the two markers.
"""

from __future__ import annotations

import dataclasses
import re
import sys
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import get_type_hints

from supervisor import options
from supervisor.cli.ckpt import OPTIONS as CKPT_OPTIONS
from supervisor.cli.status import StatusOptions
from supervisor.drill.runner import DrillConfig
from supervisor.format import eventtypes
from supervisor.format.exitcodes import MEANINGS
from supervisor.watch.config import WatchConfig

REPO = Path(__file__).resolve().parents[1]
FILES = ("README.md", "docs/watchdog.md", "docs/drill.md", "docs/cli.md")


def markdown_table(header: Iterable[str], rows: Iterable[Iterable[str]]) -> str:
    head = list(header)
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


def exit_codes() -> str:
    return markdown_table(("code", "who", "meaning"), ((m.code, m.who, m.text) for m in MEANINGS))


def events() -> str:
    """Every event of the logs: its name, when it is written, its fields (format/eventtypes.py)."""

    def fields(cls: type[eventtypes.Event]) -> str:
        hints = get_type_hints(cls)
        shown = [f"`{f.name}`: {_type(hints[f.name])}" for f in dataclasses.fields(cls)]
        return ", ".join(shown) or "-"

    rows = (
        (f"`{c.NAME.value}`", (c.__doc__ or "").strip().replace("\n", " "), fields(c))
        for c in eventtypes.BY_NAME.values()
    )
    return markdown_table(("event", "when", "fields"), rows)


def _type(hint: object) -> str:
    return str(hint).replace("typing.", "").replace("<class '", "").replace("'>", "").replace(" | ", " or ")


def options_of(cls: type) -> Callable[[], str]:
    """A command's options as its ``--help`` declares them (supervisor/options.py)."""

    def render() -> str:
        rows = (
            (
                f"`{flag}`",
                f"`{default}`" if default not in ("-", "required") else default,
                text.replace("|", "/"),
            )
            for flag, default, text in options.table(cls)
        )
        return markdown_table(("option", "default", "what"), rows)

    return render


TABLES: dict[str, Callable[[], str]] = {
    "exit-codes": exit_codes,
    "events": events,
    "watch-options": options_of(WatchConfig),
    "drill-options": options_of(DrillConfig),
    "status-options": options_of(StatusOptions),
    "ckpt-options": lambda: "\n\n".join(
        f"`ckpt {name}`:\n\n{options_of(cls)()}" for name, cls in CKPT_OPTIONS.items()
    ),
}


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
