"""How config fields are declared and checked: :func:`_f` metadata, :class:`ConfigError`, :class:`_Section`.

Every config dataclass in :mod:`rlflow.trainer.config` declares its fields with :func:`_f`
(default, one-line help, allowed values or bounds). :class:`_Section` checks them in
``__post_init__``, and :mod:`rlflow.trainer.config_docs` renders the same metadata into
``docs/configuration.md``, so the checks and the reference cannot drift apart.
"""

from __future__ import annotations

import dataclasses
import types
import typing
from typing import Any

from rlflow.fields import declared_field

__all__ = ["ConfigError", "optional_section"]


class ConfigError(ValueError):
    """A config value is unknown, of the wrong type, out of range or inconsistent with another.

    ``key`` is the full dotted key (``"models.actor.lr"``; relative to the section for a section
    built directly in Python), ``problem`` says what is wrong and what is allowed, ``source`` the
    YAML file or override the value came from, when known.
    """

    def __init__(self, key: str, problem: str, source: str | None = None) -> None:
        self.key, self.problem, self.source = key, problem, source
        where = f" ({source})" if source else ""
        super().__init__(f"{key}: {problem}{where}")

    def prefixed(self, prefix: str) -> ConfigError:
        """The same error with ``prefix.`` put in front of its key."""
        return ConfigError(f"{prefix}.{self.key}" if prefix else self.key, self.problem, self.source)

    def with_source(self, source: str | None) -> ConfigError:
        return ConfigError(self.key, self.problem, source)


# --- Field declarations: default + one-line help + allowed values, checked by _check_fields. ---


_f = declared_field  # the short name every config section declares its fields with


def _choices_of(f: dataclasses.Field) -> tuple[str, ...] | None:
    choices = f.metadata.get("choices")
    return tuple(choices() if callable(choices) else choices) if choices is not None else None


def _bounds_text(f: dataclasses.Field) -> str:
    ops = (("gt", ">"), ("ge", ">="), ("lt", "<"), ("le", "<="))
    return ", ".join(f"{op} {f.metadata[k]:g}" for k, op in ops if f.metadata.get(k) is not None)


def _check_scalar(name: str, value: Any, f: dataclasses.Field) -> None:
    choices = _choices_of(f)
    if choices is not None and value not in choices:
        raise ConfigError(name, f"{value!r} is not allowed; expected one of {list(choices)}")
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        m = f.metadata
        ok = (
            (m.get("gt") is None or value > m["gt"])
            and (m.get("ge") is None or value >= m["ge"])
            and (m.get("lt") is None or value < m["lt"])
            and (m.get("le") is None or value <= m["le"])
        )
        if not ok:
            raise ConfigError(name, f"{value!r} is out of range; expected {_bounds_text(f)}")


def _type_ok(value: Any, hint: Any) -> bool:
    """Shallow runtime check of ``value`` against a resolved type hint (containers by kind only)."""
    origin = typing.get_origin(hint)
    if origin in (typing.Union, types.UnionType):
        return any(_type_ok(value, h) for h in typing.get_args(hint))
    if hint is type(None):
        return value is None
    if hint is Any:
        return True
    if hint is float:
        return isinstance(value, (int, float)) and not isinstance(value, bool)
    if hint is int:
        return isinstance(value, int) and not isinstance(value, bool)
    if origin is not None:
        return isinstance(value, origin)
    return isinstance(value, hint)


def _check_fields(obj: Any) -> None:
    """Type, choices and bounds of every field of the dataclass ``obj`` (keys relative to it)."""
    hints = typing.get_type_hints(type(obj))
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        if not _type_ok(value, hints[f.name]):
            raise ConfigError(f.name, f"{value!r} has type {type(value).__name__}; expected {f.type}")
        items = value if isinstance(value, (list, tuple)) and f.metadata.get("choices") is not None else [value]
        if value is not None:
            for item in items:
                _check_scalar(f.name, item, f)


def optional_section(hint: Any) -> type | None:
    """The section class of a ``Section | None`` field (a section that is off when null), else ``None``."""
    if typing.get_origin(hint) not in (typing.Union, types.UnionType):
        return None
    args = [a for a in typing.get_args(hint) if a is not type(None)]
    return args[0] if len(args) == 1 and dataclasses.is_dataclass(args[0]) else None


def _reward_names() -> list[str]:
    # Read when a config is validated, not at import: users register their own rewards before
    # loading a config, and importing rlflow.workers here would pull Ray into every config user.
    from rlflow.workers.rewards import list_rewards

    return list_rewards()


class _Section:
    """Base of every config dataclass: field checks from metadata, then the class's own ``_check``."""

    def __post_init__(self) -> None:
        _check_fields(self)
        self._check()

    def _check(self) -> None:
        """Checks across fields; raise :class:`ConfigError` with a key relative to this section."""
