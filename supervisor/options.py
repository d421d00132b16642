"""Command-line options declared once, on the config dataclass field they fill.

A field made with ``option(help, default, ...)`` carries its flag, help and parsing in its metadata;
``add_options`` makes the argparse flags from a dataclass's fields (recursing into fields made with
``nested``), and ``build`` makes the dataclass from the parsed namespace. Adding an option is adding
one field. Generic and torch-free: any frozen config dataclass can use it (the watchdog's, the
drill's, a trainer's), the way torchtitan's JobConfig or NVRx's FaultToleranceConfig declare theirs.
"""

from __future__ import annotations

import argparse
import dataclasses
import os
import types
from collections.abc import Callable, Mapping, Sequence
from dataclasses import MISSING, dataclass
from typing import Any, Union, get_args, get_origin, get_type_hints

from supervisor.errors import UserError

OPTION = "option"  # field metadata keys
NESTED = "nested"


def _positive(value: Any) -> str:
    return "" if value > 0 else "must be positive"


def _not_negative(value: Any) -> str:
    return "" if value >= 0 else "must not be negative"


# Bounds an option may declare (``check=``): each returns "" or what is wrong with the value.
POSITIVE = _positive
NOT_NEGATIVE = _not_negative


@dataclass(frozen=True)
class Option:
    """How a field appears on the command line (see ``option``)."""

    help: str
    flag: str = ""
    metavar: str | None = None
    parse: Callable[[str], Any] | None = None
    choices: Mapping[str, Any] | Sequence[Any] | None = None
    env: str = ""
    check: Callable[[Any], str] | None = None
    group: str = ""
    off: str = ""
    hidden: bool = False
    const: Any = None  # given without a value: the option takes this (``--watch`` alone: 2 s)
    positional: bool = False  # an argument, not a flag (``ckpt quarantine STEP``)
    rest: bool = False  # positional: every remaining word (``slurm launch -- TRAINER ARGS``)


def option(  # noqa: PLR0913  one keyword per Option field, all optional
    help: str,
    default: Any = MISSING,
    *,
    default_factory: Callable[[], Any] | Any = MISSING,
    flag: str = "",
    metavar: str | None = None,
    parse: Callable[[str], Any] | None = None,
    choices: Mapping[str, Any] | Sequence[Any] | None = None,
    env: str = "",
    check: Callable[[Any], str] | None = None,
    group: str = "",
    off: str = "",
    hidden: bool = False,
    const: Any = None,
    positional: bool = False,
    rest: bool = False,
) -> Any:
    """A dataclass field that is also a command-line option.

    ``flag`` defaults to ``--field-name``; ``parse`` to the field's type (a ``bool`` field is a switch:
    ``--flag`` sets it when its default is False, a ``--no-...`` flag clears it when True); a field
    without a default is a required option. ``choices`` maps the words accepted to the field's
    values (or lists the values). ``env`` names an environment variable that, when set, is the flag's
    default (the field's default stays for code that builds the config itself). ``check`` bounds
    the value (POSITIVE, NOT_NEGATIVE). ``group`` titles the help section it is listed in.
    ``off`` gives a bool field a second flag that clears it, the two mutually exclusive
    (``--async-save``/``--sync-save``). A ``tuple[X, ...]`` field is a repeatable option, one X
    per use (its choices bound each). ``hidden`` leaves a test-only option out of ``--help``.
    ``const``: the flag may be given without a value, and then means this. ``positional``: an
    argument named by the field, not a flag; ``rest``: a positional ``tuple[str, ...]`` field that
    takes every remaining word.
    """
    opt = Option(
        help, flag, metavar, parse, choices, env, check, group, off, hidden, const, positional or rest, rest
    )
    meta = {OPTION: opt}
    return dataclasses.field(default=default, default_factory=default_factory, metadata=meta)


def nested(cls: type, group: str = "") -> Any:
    """A field holding another config dataclass whose own fields are options (listed under
    ``group`` unless they name their own)."""
    return dataclasses.field(default_factory=cls, metadata={NESTED: group})


def flag_of(f: dataclasses.Field[Any]) -> str:
    opt: Option = f.metadata[OPTION]
    if opt.positional:
        return f.name
    return opt.flag or "--" + f.name.replace("_", "-")


def dest_of(f: dataclasses.Field[Any]) -> str:
    return flag_of(f).removeprefix("--").replace("-", "_")


def add_options(parser: argparse.ArgumentParser, cls: type, group: str = "") -> None:
    """One argparse flag per option field of ``cls`` (and of its nested configs), in field order."""
    _add(parser, cls, group, {})


def _add(parser: argparse.ArgumentParser, cls: type, group: str, groups: dict[str, Any]) -> None:
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if NESTED in f.metadata:
            _add(parser, hints[f.name], f.metadata[NESTED] or group, groups)
        elif OPTION in f.metadata:
            title = f.metadata[OPTION].group or group
            if title and title not in groups:
                groups[title] = parser.add_argument_group(title)
            target = groups[title] if title else parser
            if f.metadata[OPTION].off:
                _add_pair(target, f)
            elif f.metadata[OPTION].positional:
                target.add_argument(flag_of(f), **_argument(f, hints[f.name]))
            else:
                target.add_argument(flag_of(f), dest=dest_of(f), **_argument(f, hints[f.name]))


def _add_pair(target: argparse.ArgumentParser | argparse._ArgumentGroup, f: dataclasses.Field[Any]) -> None:
    """A bool field's flag and its ``off`` flag, one of them at most."""
    opt: Option = f.metadata[OPTION]
    pair = target.add_mutually_exclusive_group()
    pair.add_argument(flag_of(f), dest=dest_of(f), action="store_true", default=_default(f), help=opt.help)
    off_help = f"the opposite of {flag_of(f)}"
    pair.add_argument(opt.off, dest=dest_of(f), action="store_false", default=_default(f), help=off_help)


def _argument(f: dataclasses.Field[Any], hint: Any) -> dict[str, Any]:
    """add_argument's keywords for one option field."""
    opt: Option = f.metadata[OPTION]
    default = _default(f)
    kw: dict[str, Any] = {"help": argparse.SUPPRESS if opt.hidden else opt.help}
    if opt.rest:
        return {**kw, "nargs": argparse.REMAINDER}
    if get_origin(hint) is tuple:  # repeatable: None when never given (build keeps the default)
        (item, _) = get_args(hint)
        kw.update(action="append", default=None, type=_checked(opt.parse or item, opt.check))
        return {**kw, "choices": tuple(opt.choices)} if opt.choices is not None else kw
    if _scalar(hint) is bool and opt.parse is None and opt.choices is None:
        if default and not flag_of(f).startswith("--no-"):
            raise TypeError(f"{f.name}: a switch that defaults to True needs a --no-... flag")
        return {**kw, "action": "store_true"}
    if default is MISSING:
        kw.update({} if opt.positional else {"required": True})
    else:
        kw["default"] = default
    if opt.const is not None:
        kw.update(nargs="?", const=opt.const)
    if isinstance(opt.choices, Mapping):
        words = {v: k for k, v in opt.choices.items()}
        kw["choices"] = tuple(opt.choices)
        if default is not MISSING:
            kw["default"] = words[default]
        return kw
    parse = opt.parse or _scalar(hint)
    kw["type"] = _checked(parse, opt.check)
    if opt.env and os.environ.get(opt.env):
        kw["default"] = parse(os.environ[opt.env])
    if opt.choices is not None:
        kw["choices"] = tuple(opt.choices)
    if opt.metavar:
        kw["metavar"] = opt.metavar
    return kw


def _default(f: dataclasses.Field[Any]) -> Any:
    if f.default is not MISSING:
        return f.default
    if f.default_factory is not MISSING:
        return f.default_factory()
    return MISSING


def _scalar(hint: Any) -> Any:
    """``float`` of ``float | None``; the type itself otherwise."""
    if get_origin(hint) in (Union, types.UnionType):
        (inner,) = (a for a in get_args(hint) if a is not type(None))
        return inner
    return hint


def _checked(parse: Callable[[str], Any], check: Callable[[Any], str] | None) -> Callable[[str], Any]:
    """``parse``, then ``check``; a user error (a bad signal name...) becomes argparse's one line.
    Keeps parse's name, so argparse still says "invalid float value: 'x'"."""

    def convert(raw: str) -> Any:
        try:
            value = parse(raw)
        except UserError as e:
            raise argparse.ArgumentTypeError(str(e)) from None
        problem = check(value) if check else ""
        if problem:
            raise argparse.ArgumentTypeError(f"{problem}, not {raw}")
        return value

    convert.__name__ = getattr(parse, "__name__", "value")
    return convert


def build(cls: type, args: argparse.Namespace, **given: Any) -> Any:
    """``cls`` from the parsed options (nested configs too); ``given`` fills fields that are not
    options (or overrides them)."""
    hints = get_type_hints(cls)
    kw: dict[str, Any] = {}
    for f in dataclasses.fields(cls):
        if f.name in given:
            kw[f.name] = given[f.name]
        elif NESTED in f.metadata:
            kw[f.name] = build(hints[f.name], args)
        elif OPTION in f.metadata:
            kw[f.name] = _value(f, getattr(args, dest_of(f)))
    return cls(**kw)


def _value(f: dataclasses.Field[Any], raw: Any) -> Any:
    opt: Option = f.metadata[OPTION]
    if isinstance(raw, list):  # a repeatable option given
        return tuple(raw)
    if raw is None and isinstance(_default(f), tuple):  # ... and not given
        return _default(f)
    if isinstance(opt.choices, Mapping):
        return opt.choices[raw]
    if flag_of(f).startswith("--no-") and isinstance(raw, bool):
        return not raw
    return raw


def table(cls: type) -> list[tuple[str, str, str]]:
    """(flag, default, help) of every visible option of ``cls`` and its nested configs, in field
    order: what ``--help`` says, for a generated docs table (supervisor/docgen.py)."""
    rows: list[tuple[str, str, str]] = []
    hints = get_type_hints(cls)
    for f in dataclasses.fields(cls):
        if NESTED in f.metadata:
            rows += table(hints[f.name])
        elif OPTION in f.metadata and not f.metadata[OPTION].hidden:
            opt: Option = f.metadata[OPTION]
            flag = flag_of(f) + (f" / {opt.off}" if opt.off else "")
            rows.append((flag, _shown_default(f), opt.help))
    return rows


def _shown_default(f: dataclasses.Field[Any]) -> str:
    if f.default is MISSING and f.default_factory is not MISSING and not isinstance(f.default_factory, type):
        return "computed at start"  # e.g. a dated folder: the help says how
    default = _default(f)
    if default is MISSING:
        return "required"
    opt: Option = f.metadata[OPTION]
    if isinstance(opt.choices, Mapping):
        default = {v: k for k, v in opt.choices.items()}.get(default, default)
    if default is None or default == ():
        return "-"
    return str(default.value if hasattr(default, "value") else default)
