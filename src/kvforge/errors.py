"""Error types. Every configuration error names the parameter, the value and the rule."""

from __future__ import annotations

from typing import Any


class KVForgeError(Exception):
    """Base class of every error kvforge raises on purpose."""


class ConfigError(KVForgeError, ValueError):
    """An invalid configuration value, caught at construction."""

    def __init__(self, parameter: str, value: Any, rule: str) -> None:
        self.parameter = parameter
        self.value = value
        self.rule = rule
        super().__init__(f"invalid {parameter}={value!r}: {rule}")


class ModelLoadError(KVForgeError):
    """A model name, path or file that cannot be loaded."""


class CacheCapacityError(KVForgeError):
    """The KV-cache budget cannot hold what was asked of it."""


def require(condition: bool, parameter: str, value: Any, rule: str) -> None:
    """Raise ConfigError(parameter, value, rule) unless `condition` holds."""
    if not condition:
        raise ConfigError(parameter, value, rule)


def is_int(value: Any) -> bool:
    """An integer that is not a bool (True is not a count)."""
    return isinstance(value, int) and not isinstance(value, bool)


def is_real(value: Any) -> bool:
    """An int or a float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def is_unicode(text: str) -> bool:
    """A string UTF-8 can encode: no lone surrogate (JSON's "\\ud800" decodes to one, and
    tokenizers and grammar compilers fail on it)."""
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True
