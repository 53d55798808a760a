"""Reading Shoal's environment, and the ``knob`` field that declares a setting once.

Every setting that reaches a worker through its environment is one dataclass field declared with ``knob(...)``: its
environment name (without prefix), shoalrun flag, horovodrun config-file key, type (the field's annotation), default
and help. The shoalrun parser, the workers' environment, ``from_env`` and the knobs table in docs/knobs.md are all
made from those fields, so adding a knob is adding one field.

Each knob is read under the ``SHOAL_`` name and, for scripts written for horovodrun, the ``HOROVOD_`` name; the
``SHOAL_`` name wins when both are set. Precedence is: field defaults < environment < explicit arguments or flags.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import typing
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, TypeVar

PREFIX = "SHOAL_"
"""Shoal's prefix; every name below is written without it."""
HOROVOD_PREFIX = "HOROVOD_"
"""The prefix horovodrun scripts use; read too, and written beside Shoal's for a worker's identity."""


def env_name(name: str) -> str:
    """The full variable name of a Shoal setting: ``env_name("RANK") == "SHOAL_RANK"``."""
    return PREFIX + name


def env_str(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """Return ``SHOAL_<name>`` or else ``HOROVOD_<name>``, or None when neither is set or both are empty."""
    source = os.environ if env is None else env
    for prefix in (PREFIX, HOROVOD_PREFIX):
        value = source.get(prefix + name)
        if value is not None and value.strip() != "":
            return value.strip()
    return None


def parse_value(name: str, raw: str, kind: type) -> Any:
    """``raw`` as ``kind``, with an error that names the variable when it does not parse."""
    if kind is bool:
        lowered = raw.lower()
        if lowered in ("1", "true", "yes", "on"):
            return True
        if lowered in ("0", "false", "no", "off"):
            return False
        raise ValueError(f"{PREFIX}{name} (or {HOROVOD_PREFIX}{name}) must be a boolean (1/0, true/false), got {raw!r}")
    try:
        return kind(raw)
    except ValueError:
        what = "an integer" if kind is int else "a number"
        raise ValueError(f"{PREFIX}{name} (or {HOROVOD_PREFIX}{name}) must be {what}, got {raw!r}") from None


def env_int(name: str, default: int, env: Mapping[str, str] | None = None) -> int:
    """Read an integer knob, with a clear error that names the variable when it does not parse."""
    raw = env_str(name, env)
    return default if raw is None else int(parse_value(name, raw, int))


def env_float(name: str, default: float, env: Mapping[str, str] | None = None) -> float:
    """Read a float knob, with a clear error that names the variable when it does not parse."""
    raw = env_str(name, env)
    return default if raw is None else float(parse_value(name, raw, float))


def env_bool(name: str, default: bool, env: Mapping[str, str] | None = None) -> bool:
    """Read a boolean knob: 1/true/yes/on and 0/false/no/off, case-insensitive."""
    raw = env_str(name, env)
    return default if raw is None else bool(parse_value(name, raw, bool))


@dataclass(frozen=True)
class Knob:
    """What one setting's field carries besides its type and default."""

    help: str
    """One sentence for ``--help`` and docs/knobs.md; the default is added to both from the field."""
    env: str | None = None
    """Environment name without prefix (read as SHOAL_ and HOROVOD_), or None when workers never see it."""
    flags: tuple[str, ...] = ()
    """shoalrun's spellings, the first shown in docs (horovodrun's, so job scripts keep working)."""
    hidden_flags: tuple[str, ...] = ()
    """Accepted but not shown: a boolean's negation (``--no-autotune``) or an alias kept for old scripts."""
    off_flags: tuple[str, ...] = ()
    """Shown flags that set a ``bool | None`` field to False (``--no-hierarchical-allreduce``)."""
    off_help: str = ""
    """Help of ``off_flags``."""
    group: str = ""
    """The ``--help`` section ("" for the top)."""
    config_key: str | None = None
    """horovodrun's ``--config-file`` key, ``section.key``."""
    inverted: bool = False
    """The config-file key says the opposite of the field (``stall_check.enabled`` for ``stall_check_disabled``)."""
    flag_scale: float = 1.0
    """The field is the flag's value times this (``--fusion-threshold-mb`` to bytes)."""
    flag_type: Callable[[str], Any] | None = None
    """How the flag's text is read, when not by the field's type (``str.upper`` for a log level)."""
    choices: tuple[str, ...] | None = None
    """The values the flag accepts."""
    metavar: str | None = None
    """The flag's value as ``--help`` names it (space-separated names when it takes several values)."""
    nargs: int | None = None
    """How many values the flag takes, when more than one (``--blacklist-cooldown-range MIN MAX``)."""
    path: bool = False
    """A file name: made absolute before it goes to workers, which may start in another directory."""
    env_lower: bool = False
    """Written to the environment in lower case (a log level)."""
    shown_default: str | None = None
    """The default as a person reads it ("64 MiB"), when the value itself is not."""


def knob(default: Any, help: str, **details: Any) -> Any:
    """A dataclass field declared as a setting: ``cycle_time_ms: float = knob(1.0, "...", env="CYCLE_TIME")``."""
    if isinstance(default, (list, dict, set)):
        return dataclasses.field(default_factory=lambda: type(default)(default), metadata={"knob": Knob(help, **details)})
    return dataclasses.field(default=default, metadata={"knob": Knob(help, **details)})


_SAME_DEFAULT: Any = object()


def knob_from(cls: type, name: str, default: Any = _SAME_DEFAULT, **details: Any) -> Any:
    """A field that is ``cls``'s field ``name`` (environment name, help, default), with ``details`` added: how
    shoalrun's flag declares a setting its workers read, without saying it twice. ``default`` replaces the field's
    (None for a flag that is refused where it means nothing; give ``shown_default`` then)."""
    field = {f.name: f for f in dataclasses.fields(cls)}[name]
    value = field.default if default is _SAME_DEFAULT else default
    return dataclasses.field(default=value, metadata={"knob": dataclasses.replace(field.metadata["knob"], **details)})


@dataclass(frozen=True)
class Setting:
    """One declared field of a settings class: its name, resolved type, default and knob."""

    name: str
    kind: type
    """The value's type with any ``| None`` taken off: int, float, bool, str, list or set."""
    optional: bool
    """The field may be None (meaning: not given, or automatic)."""
    default: Any
    knob: Knob

    def from_flag(self, value: Any) -> Any:
        """A flag's (or config-file key's) value as the field holds it: scaled, and of the field's type."""
        return self.kind(value * self.knob.flag_scale) if self.knob.flag_scale != 1 else value

    def from_environment(self, env: Mapping[str, str] | None = None) -> Any:
        """This setting's value in ``env`` (os.environ by default), parsed; None when unset."""
        raw = None if self.knob.env is None else env_str(self.knob.env, env)
        if raw is None or self.kind is str:
            return raw
        return parse_value(self.knob.env or self.name, raw, self.kind)

    def default_text(self) -> str:
        """The default as docs and ``--help`` show it."""
        if self.knob.shown_default is not None:
            return self.knob.shown_default
        value = self.default
        if isinstance(value, bool):
            return "on" if value else "off"
        return "none" if value is None else str(value)


def settings(cls: type) -> Iterator[Setting]:
    """The ``knob`` fields of dataclass ``cls``, in declaration order."""
    return iter(_settings(cls))


@functools.cache
def _settings(cls: type) -> tuple[Setting, ...]:
    """``settings``, worked out once per class (type hints are evaluated from strings)."""
    return tuple(_declared(cls))


def _declared(cls: type) -> Iterator[Setting]:
    hints = typing.get_type_hints(cls)
    for field in dataclasses.fields(cls):
        knob_info = field.metadata.get("knob")
        if knob_info is None:
            continue
        kind, optional = _base_type(hints[field.name])
        if field.default is not dataclasses.MISSING:
            default = field.default
        elif field.default_factory is not dataclasses.MISSING:
            default = field.default_factory()
        else:
            default = None
        yield Setting(field.name, kind, optional, default, knob_info)


def _base_type(hint: Any) -> tuple[type, bool]:
    """``int | None`` -> (int, True); ``list[str]`` -> (list, False)."""
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    optional = type(None) in typing.get_args(hint)
    if optional and len(args) == 1:
        hint = args[0]
    origin = typing.get_origin(hint)
    return (origin if origin is not None else hint), optional


Settings = TypeVar("Settings")


def from_env(cls: type[Settings], env: Mapping[str, str] | None = None, **explicit: Any) -> Settings:
    """``cls`` with its defaults overridden by the environment, then by ``explicit`` values."""
    values: dict[str, Any] = {}
    for setting in settings(cls):
        value = None if setting.name in explicit else setting.from_environment(env)
        if value is not None:
            values[setting.name] = value
    values.update(explicit)
    return cls(**values)


def read_setting(cls: type, name: str, env: Mapping[str, str] | None = None) -> Any:
    """One field of ``cls`` under the environment (its default when unset): a bad value of another setting never
    gets in the way of reading this one."""
    setting = next(s for s in settings(cls) if s.name == name)
    value = setting.from_environment(env)
    return setting.default if value is None else value


def to_env(setting: Setting, value: Any) -> str:
    """How a worker's environment carries ``value`` of ``setting`` (the inverse of ``from_env``)."""
    if isinstance(value, bool):
        return "1" if value else "0"
    if setting.knob.path:
        return os.path.abspath(str(value))
    text = str(value)
    return text.lower() if setting.knob.env_lower else text


def markdown_rows(*classes: type) -> list[str]:
    """The docs/knobs.md table: one row per environment name among ``classes``' knobs, with every flag that sets it."""
    rows: dict[str, tuple[Setting, list[str]]] = {}
    for cls in classes:
        for setting in settings(cls):
            if setting.knob.env is None:
                continue
            _, flags = rows.setdefault(setting.knob.env, (setting, []))
            flags.extend(f for f in (*setting.knob.flags[:1], *setting.knob.off_flags) if f not in flags)
    lines = ["| variable (or `HOROVOD_` name) | shoalrun flag | meaning |", "|---|---|---|"]
    for name, (setting, flags) in rows.items():
        shown = ", ".join(f"`{f}`" for f in flags)
        lines.append(f"| `{env_name(name)}` | {shown} | {setting.knob.help} (default: {setting.default_text()}) |")
    return lines
