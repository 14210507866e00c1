"""Errors a user can cause. The CLI prints them as one line and exits with 2.

Anything else escaping is a bug in tunekit and keeps its traceback.
"""

SHOWN_CHARS = 40
"""The most of a refused value an error quotes back."""


def shown(value: object, limit: int = SHOWN_CHARS) -> str:
    """``repr(value)`` for an error to quote, cut to ``limit`` characters: a refused
    ``k=1e300`` (an integer of 301 digits once read) is not echoed whole."""
    text = repr(value)
    if len(text) <= limit:
        return text
    return f"{text[: limit - 1]}… ({len(text)} characters)"


class TunekitError(Exception):
    """Base class: bad input or an unusable environment, explained in one line."""

    exit_code = 2


class WorkloadError(TunekitError):
    """A workload cannot be found, loaded or built."""


class ConfigError(TunekitError):
    """A config names an unknown plugin or knob, or a value out of range."""


class PluginError(TunekitError):
    """A plugin is unknown, failed to load, or broke its contract."""


class StoreError(TunekitError):
    """The study store cannot be opened, read or written."""


class HardwareError(TunekitError):
    """A hardware profile is missing fields or holds impossible values."""


class ControlError(TunekitError):
    """The live job refused a request or cannot be reached."""
