"""torchelastic's error files, read without torch (supervisor/watch/rootcause.py): files written
by torch's own ErrorHandler, torchrun's layout of the workers' files, and garbage."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from torch.distributed.elastic.multiprocessing.errors import ErrorHandler

from supervisor.watch.rootcause import (
    MAX_ERROR_FILE_BYTES,
    RootCause,
    errored_local_ranks,
    find_root_cause,
    parse_error_file,
)


def raise_here(msg: str) -> None:
    raise KeyError(msg)


def torch_writes(path: Path, monkeypatch, msg: str = "no such key") -> int:
    """torch's ErrorHandler records an exception raised here into ``path``; the raising line."""
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    path.parent.mkdir(parents=True, exist_ok=True)
    try:
        raise_here(msg)
    except KeyError as e:
        ErrorHandler().record_exception(e)
    return raise_here.__code__.co_firstlineno + 1


def test_a_file_torch_wrote_names_type_message_and_the_raising_line(tmp_path, monkeypatch):
    line = torch_writes(tmp_path / "error.json", monkeypatch)
    rc = parse_error_file((tmp_path / "error.json").read_bytes())
    assert (rc.type, rc.message) == ("KeyError", "'no such key'")
    assert (rc.file, rc.line) == (__file__, line)
    assert rc.timestamp > 0
    assert rc.describe() == f"KeyError: 'no such key' ({__file__}:{line})"


def test_torchruns_copy_and_the_older_string_format():
    """torchrun's own file adds errorCode; older torch wrote message as a string, timestamp at the
    top; a message naming no exception class is kept whole."""
    copy = {"message": {"message": "RuntimeError: x", "extraInfo": {"timestamp": "7"}, "errorCode": 1}}
    assert parse_error_file(json.dumps(copy)) == RootCause("RuntimeError", "x", timestamp=7)
    old = {"message": "Signal 9 (SIGKILL) received by PID 5", "timestamp": 8}
    assert parse_error_file(json.dumps(old)) == RootCause(
        "", "Signal 9 (SIGKILL) received by PID 5", timestamp=8
    )


@pytest.mark.parametrize(
    ("text", "why"),
    [
        (b"", "not valid JSON"),
        (b"[" * 100_000, "not valid JSON"),
        (b"[1]", "not a torchelastic error file"),
        (b'{"msg": 1}', "not a torchelastic error file"),
        (b'{"message": 5}', "neither text nor"),
        # a pickle-looking payload is only text to a JSON parser: nothing in it runs
        (b"\x80\x04\x95cos\nsystem\n", "not valid JSON"),
    ],
)
def test_garbage_is_a_short_reason(text, why):
    with pytest.raises(ValueError, match=why):
        parse_error_file(text)


def test_workers_files_first_earliest_wins_with_its_global_rank(tmp_path, monkeypatch):
    """torchrun's layout <logs>/<run>/attempt_0/<local rank>/error.json: the earliest failure is
    the root cause (torchrun's rule), its global rank from this host's heartbeats."""
    logs = tmp_path / "elastic"
    for local, stamp in ((0, "20"), (1, "10")):
        path = logs / "run_x" / "attempt_0" / str(local) / "error.json"
        path.parent.mkdir(parents=True)
        msg = {"message": f"ValueError: rank {local}", "extraInfo": {"timestamp": stamp}}
        path.write_text(json.dumps({"message": msg}))
    cause, problems = find_root_cause(tmp_path / "error.json", logs, {0: 4, 1: 5})
    assert problems == [] and errored_local_ranks(logs) == {0, 1}
    assert errored_local_ranks(tmp_path / "missing") == set()
    assert cause is not None and (cause.rank, cause.local_rank, cause.message) == (5, 1, "rank 1")
    assert cause.describe().startswith("rank 5: ValueError: rank 1")
    unknown, _ = find_root_cause(tmp_path / "error.json", logs, {})
    assert unknown is not None and unknown.rank is None and unknown.describe().startswith("local rank 1: ")


def test_the_commands_own_file_when_no_worker_wrote_one(tmp_path, monkeypatch):
    line = torch_writes(tmp_path / "error.json", monkeypatch, "plain script")
    cause, problems = find_root_cause(tmp_path / "error.json", tmp_path / "missing", {})
    assert problems == [] and cause is not None
    assert (cause.type, cause.line, cause.rank, cause.source) == (
        "KeyError",
        line,
        None,
        str(tmp_path / "error.json"),
    )
    assert find_root_cause(tmp_path / "nothing.json", tmp_path / "missing", {}) == (None, [])


def test_unusable_files_are_named_never_guessed(tmp_path):
    logs = tmp_path / "elastic"
    bad = logs / "r" / "attempt_0" / "0" / "error.json"
    bad.parent.mkdir(parents=True)
    bad.write_text("{not json")
    big = tmp_path / "error.json"
    big.write_bytes(b" " * (MAX_ERROR_FILE_BYTES + 1))
    cause, problems = find_root_cause(big, logs, {})
    assert cause is None
    assert problems == [f"{bad}: not valid JSON", f"{big}: larger than {MAX_ERROR_FILE_BYTES} bytes"]
