"""Every code block of docs/adopting.md is what runs: its diff is examples/plain_loop.py's, each
python block is a run of lines of an example (which the drill and the preemption tests run), each
shell command parses, names a file that exists, and is run by tests/test_examples_drill.py."""

from __future__ import annotations

from adopting_doc import EXAMPLES, blocks, code_line, code_lines, drill_commands

from supervisor.cli.main import build_parser


def test_every_block_is_of_a_checked_kind() -> None:
    kinds = [b.lang for b in blocks()]
    assert set(kinds) <= {"diff", "python", "sh"} and "diff" in kinds and "sh" in kinds, kinds


def _in_order(wanted: list[str], lines: list[str]) -> list[str]:
    """Those of ``wanted`` not found in ``lines`` in this order ([] when all are)."""
    at, missing = 0, []
    for w in wanted:
        try:
            at = lines.index(w, at) + 1
        except ValueError:
            missing.append(w)
    return missing


def test_the_diff_is_the_example_plain_loop() -> None:
    (diff,) = [b for b in blocks() if b.lang == "diff"]
    lines = code_lines(EXAMPLES / "plain_loop.py")
    kept, removed = [], []
    for line in diff.text.splitlines():
        sign, code = line[:1], code_line(line[1:])
        if code and code != "...":
            (removed if sign == "-" else kept).append(code)
    assert not _in_order(kept, lines), _in_order(kept, lines)
    assert removed and not set(removed) & set(lines), set(removed) & set(lines)


def test_each_python_block_is_a_run_of_lines_of_an_example() -> None:
    examples = {p.name: code_lines(p) for p in EXAMPLES.glob("*.py")}
    python = [b for b in blocks() if b.lang == "python"]
    assert python
    for b in python:
        want = [c for line in b.text.splitlines() if (c := code_line(line))]
        found = [
            name
            for name, lines in examples.items()
            if any(lines[i : i + len(want)] == want for i in range(len(lines)))
        ]
        assert found, f"not in any example:\n{b.text}"


def test_each_shell_command_parses_and_names_an_example() -> None:
    commands = drill_commands()
    assert commands
    for argv in commands:
        args = build_parser(argv[0]).parse_args(argv)
        assert (EXAMPLES.parent / args.trainer).is_file(), argv
