"""One mechanism for every service's settings: a table of ``Setting`` rows (flag, environment
variable, type, help) that generates both the argparse flags and the environment reading.

The gateway (``gateway/config.py``), the workers (``workers/config.py``) and ``kvpush up``
(``up.py``) each declare one table; ``add_arguments(parser, table)`` adds its flags (all with
``default=None``, so "not given" is visible), ``read(table, args, env)`` returns the values that
were given, flag over environment variable (an empty variable counts as unset); the dataclass
of each service holds the defaults. A value that does not parse raises ``ConfigError`` naming
the flag and the variable; library code never exits the process (the CLI entry points turn a
``ConfigError`` into exit status 2 and a one-line message).

Naming: a flag ``--some-thing`` reads ``KVPUSH_SOME_THING`` unless the row names another
variable (the gateway's and the workers' ``--max-inflight`` differ in meaning, so they read
``KVPUSH_GATEWAY_MAX_INFLIGHT`` and ``KVPUSH_WORKER_MAX_INFLIGHT``); durations end in ``-s``.

``apply_gil_switch`` sets the process's GIL switch interval from ``KVPUSH_GIL_SWITCH_US``
(``kvpush.connector.switching``: one variable for a service and the engine processes it
starts, which read it themselves), at a service's start.

Threading model: none (values and pure functions; ``apply_gil_switch`` sets a process-wide value
once, at a start).
"""

from __future__ import annotations

import argparse
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from kvpush.connector import apply_switch_interval


class ConfigError(ValueError):
    """A flag, environment variable or file a service was given is unusable; says which and why."""


def apply_gil_switch(env: Mapping[str, str] | None = None) -> int:
    """Set this process's GIL switch interval (microseconds, returned) from
    ``KVPUSH_GIL_SWITCH_US``; ConfigError if the variable is unusable."""
    try:
        return apply_switch_interval(env)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None


@dataclass(frozen=True)
class Setting:
    """One setting: ``name`` is the config field and argparse dest; ``flags[0]`` is its flag."""

    name: str
    flags: tuple[str, ...]
    parse: Callable[[str], Any]
    help: str
    env: str = ""  # default: KVPUSH_ + the first flag's name
    metavar: str | None = None
    choices: tuple[str, ...] | None = None
    repeat: bool = False  # the flag may be given several times (list); the variable: commas
    flag: bool = True  # False: environment only (fault injection, tests)
    bare: str | None = None  # the value of the flag given without one (``--enforce-eager``)

    @property
    def variable(self) -> str:
        return self.env or "KVPUSH_" + self.flags[0].lstrip("-").replace("-", "_").upper()


def add_arguments(parser: argparse.ArgumentParser, table: Sequence[Setting]) -> None:
    """Every flag of ``table`` (default None: ``read`` then applies the environment)."""
    for row in table:
        if not row.flag:
            continue
        kwargs: dict[str, Any] = {"dest": row.name, "default": None}
        kwargs["help"] = f"{row.help} [{row.variable}]"
        if row.choices:
            kwargs["choices"] = list(row.choices)
        else:
            kwargs["metavar"] = row.metavar or _metavar(row)
        if row.bare is not None:
            kwargs.update(nargs="?", const=row.bare)
        if row.repeat:
            kwargs["action"] = "append"
        elif row.parse is not str:
            kwargs["type"] = _flag_parser(row)
        parser.add_argument(*row.flags, **kwargs)


def read(
    table: Sequence[Setting], args: argparse.Namespace, env: Mapping[str, str]
) -> dict[str, Any]:
    """The settings given by flag or environment variable (flag first); absent ones are left
    out so the config's defaults apply."""
    values: dict[str, Any] = {}
    for row in table:
        raw = getattr(args, row.name, None) if row.flag else None
        if raw is None or raw == []:
            text = env.get(row.variable, "")
            if text == "":
                continue
            raw = [part.strip() for part in text.split(",")] if row.repeat else text
            source = row.variable
        elif not row.repeat and row.parse is not str:
            values[row.name] = raw  # argparse already parsed it (``type``)
            continue
        else:
            source = row.flags[0]
        try:
            values[row.name] = [row.parse(r) for r in raw if r] if row.repeat else row.parse(raw)
        except (TypeError, ValueError) as exc:
            raise ConfigError(f"{source}: invalid value {raw!r} ({exc})") from None
    return values


def _metavar(row: Setting) -> str:
    if row.parse is int:
        return "N"
    if row.parse is float:
        return "S" if row.name.endswith("_s") else "X"
    return "VALUE"


def _flag_parser(row: Setting) -> Callable[[str], Any]:
    """argparse's ``type``: parse errors become argparse's own one-line usage error."""

    def parse(text: str) -> Any:
        try:
            return row.parse(text)
        except (TypeError, ValueError) as exc:
            raise argparse.ArgumentTypeError(f"invalid value {text!r} ({exc})") from None

    return parse
