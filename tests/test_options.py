"""Options declared once, on config fields (supervisor/options.py): the flags argparse gets, the
config built back from them, and the watch and drill commands' flags matching their configs."""

from __future__ import annotations

import argparse
import dataclasses
import signal
from pathlib import Path

import pytest

from supervisor import options
from supervisor.cli.main import build_parser
from supervisor.drill.runner import DrillConfig
from supervisor.options import NOT_NEGATIVE, POSITIVE, nested, option
from supervisor.watch.config import WatchConfig
from supervisor.watch.liveness import PhaseTimeouts


@dataclasses.dataclass(frozen=True)
class Inner:
    limit_s: float = option("a bound", 2.0, flag="--limit", check=POSITIVE)


@dataclasses.dataclass(frozen=True)
class Toy:
    root: Path = option("required: no default")
    name: str = "code only"  # not an option
    mode: bool = option("a word for a bool", False, choices={"fast": False, "slow": True})
    count: int = option("how many", 3, check=NOT_NEGATIVE, metavar="N", group="counts")
    factor: float | None = option("optional", None, group="counts")
    on: bool = option("a switch", False)
    keep: bool = option("cleared by its --no- flag", True, flag="--no-keep")
    node: int = option("from the environment", 0, env="TOY_NODE")
    inner: Inner = nested(Inner, "inner group")


def parser_for(cls: type) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser()
    options.add_options(p, cls)
    return p


def test_no_flags_build_the_dataclass_defaults() -> None:
    args = parser_for(Toy).parse_args(["--root", "/r"])
    assert options.build(Toy, args) == Toy(root=Path("/r"))


def test_every_kind_of_option_round_trips() -> None:
    argv = ["--root", "/r", "--mode", "slow", "--count", "0", "--factor", "1.5", "--on", "--no-keep"]
    argv += ["--limit", "7"]
    built = options.build(Toy, parser_for(Toy).parse_args(argv), name="given")
    assert built == Toy(
        root=Path("/r"), name="given", mode=True, count=0, factor=1.5, on=True, keep=False, inner=Inner(7.0)
    )


def test_env_sets_the_flag_default_not_the_field_default(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TOY_NODE", "5")
    assert options.build(Toy, parser_for(Toy).parse_args(["--root", "/r"])).node == 5
    assert Toy(root=Path("/r")).node == 0


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--count", "-1"], "argument --count: must not be negative, not -1"),
        (["--limit", "0"], "argument --limit: must be positive, not 0"),
        (["--limit", "x"], "argument --limit: invalid float value: 'x'"),
        (["--mode", "medium"], "argument --mode: invalid choice: 'medium'"),
        ([], "the following arguments are required: --root"),
    ],
)
def test_bad_values_are_one_usage_error_naming_the_flag(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parser_for(Toy).parse_args(["--root", "/r", *argv] if argv else argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


def test_help_sections_and_texts_come_from_the_fields() -> None:
    text = parser_for(Toy).format_help()
    assert "counts:" in text and "inner group:" in text
    assert "--count N" in text and "how many" in text


def test_a_true_switch_without_a_no_flag_is_refused() -> None:
    @dataclasses.dataclass(frozen=True)
    class Bad:
        keep: bool = option("defaults to True", True)

    with pytest.raises(TypeError, match="--no-"):
        parser_for(Bad)


@dataclasses.dataclass(frozen=True)
class Pairs:
    fast: bool = option("the fast way", True, off="--slow")
    tags: tuple[str, ...] = option("one tag per use", (), flag="--tag", choices=("a", "b"))
    secret: int = option("test-only", 0, hidden=True)


@pytest.mark.parametrize(
    ("argv", "want"),
    [
        ([], Pairs()),
        (["--fast"], Pairs()),
        (["--slow"], Pairs(fast=False)),
        (["--tag", "b", "--tag", "a", "--secret", "3"], Pairs(tags=("b", "a"), secret=3)),
    ],
)
def test_a_pair_of_flags_a_repeatable_and_a_hidden_option(argv: list[str], want: Pairs) -> None:
    assert options.build(Pairs, parser_for(Pairs).parse_args(argv)) == want


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (["--fast", "--slow"], "argument --slow: not allowed with argument --fast"),
        (["--tag", "c"], "argument --tag: invalid choice: 'c'"),
    ],
)
def test_a_pair_is_exclusive_and_each_repeat_is_checked(
    argv: list[str], message: str, capsys: pytest.CaptureFixture[str]
) -> None:
    with pytest.raises(SystemExit) as e:
        parser_for(Pairs).parse_args(argv)
    assert e.value.code == 2
    assert message in capsys.readouterr().err.splitlines()[-1]


def test_a_hidden_option_is_not_in_the_help_and_the_pair_is_each_once() -> None:
    text = parser_for(Pairs).format_help()
    assert "--secret" not in text and "test-only" not in text
    assert text.count("--fast") == 3 and "the opposite of --fast" in text  # usage, its line, --slow's help


def watch_args(*argv: str) -> argparse.Namespace:
    return build_parser("watch").parse_args(["watch", "--ckpt-root", "/r", *argv, "--", "cmd"])


def test_watch_flag_defaults_are_the_watch_config_defaults(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("SLURM_NODEID", raising=False)
    built = options.build(WatchConfig, watch_args(), command=("cmd",))
    assert built == WatchConfig(root=Path("/r"), command=("cmd",))


def test_watch_flags_fill_nested_configs_and_keep_their_names() -> None:
    args = watch_args(
        "--verify", "deep", "--hang-timeout", "9", "--verify-timeout", "8", "--max-restarts-per-window", "4",
        "--backoff-max", "6", "--no-progress", "0", "--requeue-exit", "--no-share-store-fix",
        "--notice-signal", "URG", "--stop-grace", "3",
    )  # fmt: skip
    cfg = options.build(WatchConfig, args, command=("cmd",))
    assert cfg.deep_verify and not cfg.share_store_fix and cfg.stop_grace_s == 3.0
    assert cfg.timeouts == PhaseTimeouts(train=9.0, verify=8.0)
    assert (cfg.policy.budget.per_window, cfg.policy.backoff.max_s) == (4, 6.0)
    assert (cfg.policy.no_progress_launches, cfg.policy.requeue_exit) == (0, True)
    assert cfg.notice_signal == signal.SIGURG


def test_every_drill_option_default_is_the_drill_config_default() -> None:
    args = build_parser("drill").parse_args(["drill", "--workdir", "/w"])
    assert options.build(DrillConfig, args) == DrillConfig(workdir=Path("/w"))


def test_watch_help_lists_every_flag_with_its_help_and_default() -> None:
    watch = build_parser("watch")._subparsers._group_actions[0].choices["watch"]  # type: ignore[union-attr]
    flags = [a for a in watch._actions if a.option_strings and a.dest != "help"]
    assert all(a.help for a in flags), [a.option_strings for a in flags if not a.help]
    text = " ".join(watch.format_help().split())
    assert "(default: SIGUSR1)" in text and "(default: 10)" not in text  # a signal by its name
    assert "--learn-floor LEARN_FLOOR the least learned train timeout, in seconds (default: 10.0)" in text


def test_an_optional_value_a_positional_and_the_rest_of_the_words() -> None:
    @dataclasses.dataclass(frozen=True)
    class Cmd:
        step: int = option("the step", positional=True)
        watch: float | None = option("refresh every SECONDS", None, const=2.0)
        rest: tuple[str, ...] = option("the command", (), rest=True)

    p = argparse.ArgumentParser()
    options.add_options(p, Cmd)
    args = p.parse_args(["--watch", "5", "7", "torchrun", "--nproc-per-node=2"])
    assert (args.step, args.watch) == (7, 5.0)
    assert args.rest == ["torchrun", "--nproc-per-node=2"]  # the rest: its flags are not ours
    assert p.parse_args(["--watch", "--", "7"]).watch == 2.0 and p.parse_args(["7"]).watch is None
    with pytest.raises(SystemExit):
        p.parse_args(["seven"])
