"""The commands' flags: declared once on a settings dataclass, and their value types.

A field made with :func:`setting` carries its default and its :class:`Flag` (names, help, the
environment variable that may give the default, value type, ...); :func:`add_flags` turns a
settings class into argparse arguments and :func:`flag_values` reads them back by field name,
so a default cannot differ between a command's help and the code that uses it. A settings class
that extends :class:`Checked` runs the checks its flags state (a minimum, a choice) whenever it
is made, from flags or by a caller, and refuses a bad value with :class:`SettingsError` naming
the flag.

The value types (argparse ``type=``) word every bad value the same way:
``argument --rate: expected a number > 0, got 0``.

Depends on nothing else in pdserve.
"""

from __future__ import annotations

import argparse
import os
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field, fields
from typing import Any, TypeVar

T = TypeVar("T", int, float)


def _checked(text: str, convert: Callable[[str], T], ok: Callable[[T], bool], expected: str) -> T:
    value = convert(text)  # a ValueError becomes argparse's "invalid <type> value"
    if not ok(value):
        raise argparse.ArgumentTypeError(f"expected {expected}, got {text}")
    return value


def positive_int(text: str) -> int:
    return _checked(text, int, lambda v: v >= 1, "an integer >= 1")


def positive_float(text: str) -> float:
    return _checked(text, float, lambda v: v > 0, "a number > 0")


def non_negative_float(text: str) -> float:
    return _checked(text, float, lambda v: not v < 0, "a number >= 0")


def port(text: str) -> int:
    return _checked(text, int, lambda v: 1 <= v <= 65535, "a port number 1-65535")


def port_or_unset(text: str) -> int | None:
    """A port number; 0 means none (an empty environment variable, or a rendered ``0``)."""
    return int(text) or None


@dataclass(frozen=True)
class Flag:
    """How a setting is given on the command line (and by the environment)."""

    names: tuple[str, ...]  # a positional argument: its one name, without dashes
    help: str
    env: str | None = None  # gives the default; a flag wins
    type: Callable[[str], Any] | None = None  # None: the default's type (a string for None)
    choices: tuple[str, ...] | None = None
    metavar: str | None = None
    minimum: float | None = None  # checked when the settings are made (Checked)
    action: str | Callable[..., argparse.Action] | None = None  # argparse's: store_true, append, ...
    nargs: str | None = None

    @property
    def dest(self) -> str:
        """Where argparse puts the value: the first long name's (unique in a command, unlike field
        names)."""
        name = next((n for n in self.names if n.startswith("--")), self.names[0])
        return name.lstrip("-").replace("-", "_")


def setting(
    default: Any,
    *names: str,
    help: str,
    env: str | None = None,
    type: Callable[[str], Any] | None = None,
    choices: tuple[str, ...] | None = None,
    metavar: str | None = None,
    minimum: float | None = None,
    action: str | Callable[..., argparse.Action] | None = None,
    nargs: str | None = None,
) -> Any:
    """A settings field with its flag: the one place its default is written."""
    flag = Flag(names, help, env, type, choices, metavar, minimum, action, nargs)
    return field(default=default, metadata={"flag": flag})


def flags_of(settings_class: type) -> Iterator[tuple[str, Flag, Any]]:
    """(field name, flag, default) of every field of one settings dataclass that has a flag."""
    for f in fields(settings_class):
        flag = f.metadata.get("flag")
        if flag is not None:
            yield f.name, flag, f.default


class SettingsError(ValueError):
    """A value a command cannot run with; the message names the flag."""


def check_flags(value: object) -> None:
    """The checks every flag of a settings dataclass states: a minimum, a choice."""
    for name, flag, _ in flags_of(type(value)):
        given = getattr(value, name)
        if given is None:
            continue
        if flag.minimum is not None and given < flag.minimum:
            raise SettingsError(f"{flag.names[0]}: expected a value >= {flag.minimum:g}, got {given}")
        if flag.choices is not None and given not in flag.choices:
            raise SettingsError(f"{flag.names[0]}: expected one of {', '.join(flag.choices)}, got {given!r}")


class Checked:
    """A settings dataclass whose flags' checks run when it is made, however it is made (flags,
    environment, or a caller's arguments)."""

    def __post_init__(self) -> None:
        check_flags(self)


def _verbatim(flag: Flag, default: Any) -> str:
    return flag.help


def stating_default(flag: Flag, default: Any) -> str:
    """The help, then ``(default: VALUE)``: where there is a value to show, and the help does not
    word the default itself."""
    if default is None or default is False or default == () or "default" in flag.help:
        return flag.help
    return f"{flag.help} (default: {f'{default:g}' if isinstance(default, float) else default})"


def add_flags(
    parser: argparse.ArgumentParser,
    settings_class: type,
    group: Any = None,
    describe: Callable[[Flag, Any], str] = _verbatim,
) -> None:
    """Add the flags of ``settings_class`` to ``group`` (an argument group; else the parser itself).

    ``describe`` makes a flag's help line from the flag and its default (by default its help as
    written, where argparse's ``%(default)s`` may show the default).
    """
    for _, flag, default in flags_of(settings_class):
        (group or parser).add_argument(*flag.names, **_arguments(parser, flag, default, describe))


def _arguments(
    parser: argparse.ArgumentParser, flag: Flag, default: Any, describe: Callable[[Flag, Any], str]
) -> dict[str, Any]:
    given = {
        "dest": flag.dest if flag.names[0].startswith("-") else None,  # a positional names its own
        "default": list(default) if flag.action == "append" else _env_default(parser, flag, default),
        "type": _value_type(flag, default) if flag.action is None else flag.type,
        "choices": flag.choices,
        "metavar": flag.metavar,
        "action": flag.action,
        "nargs": flag.nargs,
        "help": describe(flag, default),
    }
    return {key: value for key, value in given.items() if value is not None or key == "default"}


def _value_type(flag: Flag, default: Any) -> Callable[[str], Any]:
    return flag.type or (str if default is None else type(default))


def _env_default(parser: argparse.ArgumentParser, flag: Flag, default: Any) -> Any:
    """The flag's default: its environment variable's value when set and not empty."""
    raw = os.environ.get(flag.env) if flag.env else None
    if not raw:
        return default
    convert = _value_type(flag, default)
    try:
        return convert(raw)
    except ValueError:
        kind = (
            "a number" if convert is float else "an integer" if convert in (int, port_or_unset) else "a value"
        )
        parser.error(f"{flag.env}={raw!r} (the default of {flag.names[0]}): expected {kind}")


def flag_values(args: argparse.Namespace, settings_class: type, into: type | None = None) -> dict[str, Any]:
    """The parsed flags of one settings dataclass, by field name; an empty string is no value.

    With ``into`` (a dataclass), only the fields it has too: the flags that configure it, as its
    keyword arguments.
    """
    wanted = {f.name for f in fields(into)} if into is not None else None
    out = {}
    for name, flag, default in flags_of(settings_class):
        if wanted is not None and name not in wanted:
            continue
        value = getattr(args, flag.dest)
        out[name] = None if value == "" and default is None else value
    return out
