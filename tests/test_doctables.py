"""The docs' generated tables match the declarations they come from (supervisor/docgen.py):
edit the declaration, run ``python -m supervisor.docgen``, commit both."""

from __future__ import annotations

import pytest

from supervisor import docgen as doctables
from supervisor.format.exitcodes import MEANINGS, Exit


@pytest.mark.parametrize("name", doctables.FILES)
def test_committed_docs_hold_the_tables_their_declarations_render(name: str) -> None:
    text = (doctables.REPO / name).read_text()
    assert "<!-- generated:" in text
    assert doctables.rewrite(text) == text, f"{name} is stale: run python -m supervisor.docgen"


def test_every_exit_code_has_a_meaning_and_the_table_says_each() -> None:
    described = {m.code for m in MEANINGS}
    assert {str(int(code)) for code in Exit} <= described
    table = doctables.exit_codes()
    assert all(f"| {m.code} | {m.who} |" in table for m in MEANINGS)


def test_a_stale_block_is_rewritten_and_an_unknown_one_named() -> None:
    stale = "x\n<!-- generated: exit-codes -->\nold\n<!-- end generated: exit-codes -->\ny\n"
    assert (
        doctables.rewrite(stale)
        == f"x\n<!-- generated: exit-codes -->\n{doctables.exit_codes()}\n<!-- end generated: exit-codes -->\ny\n"
    )
    with pytest.raises(KeyError, match="nope"):
        doctables.rewrite("<!-- generated: nope -->\n<!-- end generated: nope -->")


def test_the_events_table_lists_every_event_with_its_fields() -> None:
    from supervisor.format import eventtypes

    table = doctables.events()
    for cls in eventtypes.BY_NAME.values():
        assert f"| `{cls.NAME.value}` |" in table
    assert "`checkpoint`: str or None" in table  # Pick's, its union spelled without a table pipe


def test_an_options_table_is_what_help_declares() -> None:
    from supervisor.watch.config import WatchConfig

    table = doctables.options_of(WatchConfig)()
    assert "| `--hang-timeout` | `120.0` |" in table
    assert "| `--ckpt-root` | required |" in table
    assert "--help" not in table and "| `--share-store-fix`" not in table  # only declared flags
