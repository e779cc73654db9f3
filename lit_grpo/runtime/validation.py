"""Argument checks shared across lit_grpo: each error names the bad value and what is allowed."""

from __future__ import annotations

import contextlib
import dataclasses
import math
import numbers
import os
import re
from collections.abc import Collection, Iterator, Mapping
from typing import Any


#: The largest seed: numpy's and Lightning's (``seed_everything``) bound, so one seed means the same everywhere.
SEED_MAX = 2**32 - 1


#: ``torch_num_threads``' bound, in threads per core: more only wait on each other (and thousands crash OpenMP).
MAX_THREADS_PER_CORE = 4


def available_cores() -> int:
    """The cores this process may run on (its CPU affinity; ``os.cpu_count()`` where that is unknown)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


def check_thread_count(name: str, threads: int) -> int:
    """``threads`` if it is in [1, ``MAX_THREADS_PER_CORE`` x the cores this process may run on], else a
    ValueError naming ``name``, the value and that range."""
    cores = available_cores()
    if isinstance(threads, bool) or not isinstance(threads, int) or not 1 <= threads <= MAX_THREADS_PER_CORE * cores:
        raise ValueError(f"{name}={threads!r} must be in [1, {MAX_THREADS_PER_CORE * cores}] ({MAX_THREADS_PER_CORE} "
                         f"a core of the {cores} this process may run on)")
    return threads


class ConfigError(ValueError):
    """A bad setting found while a run sets itself up (a prompt source, a dtype, a dataset column): ``lit-grpo``
    reports it as it reports a parse error, one ``error:`` line and exit 2, wherever it is raised."""


@contextlib.contextmanager
def config_errors(where: str, settings: Collection[str] = ()) -> Iterator[None]:
    """Re-raise what a setting makes fail in this block (a ValueError, a missing file or key, a wrong type) as a
    :class:`ConfigError` whose message starts with ``where`` (see :func:`setting_message`; ``settings``: the names
    of the settings under ``where``)."""
    try:
        yield
    except ConfigError:
        raise
    except (ValueError, FileNotFoundError, KeyError, TypeError) as error:
        message = error.args[0] if isinstance(error, KeyError) and error.args else error
        raise ConfigError(setting_message(where, str(message), settings)) from error


_DOTTED_KEY = re.compile(r"[A-Za-z_]\w*(?:\.[A-Za-z_]\w*)*")
_LEADING_SETTING = re.compile(r"([A-Za-z_][\w.]*)=")


def setting_message(where: str, message: str, settings: Collection[str] = ()) -> str:
    """``message`` said under the config key ``where``. One that starts with a setting and its value names it by its
    key, as the command line writes it: a setting of ``settings`` (``data``, ``val_size=-1 ...``:
    ``data.val_size=-1 ...``), or ``where``'s own (``model.peft_config``, ``peft_config.r=0 ...``:
    ``model.peft_config.r=0 ...``). Any other message follows ``where: ``: a name not known to be a setting under
    ``where`` (a tool's check of ``over_provision``) is not given a key that does not exist."""
    leading = _LEADING_SETTING.match(message)
    if leading is None or not _DOTTED_KEY.fullmatch(where):
        return f"{where}: {message}"
    outer, name = where.split("."), leading.group(1).split(".")
    if name[0] == outer[-1]:
        key = ".".join(outer[:-1] + name)
    elif name[0] in settings:
        key = ".".join(outer + name)
    else:
        return f"{where}: {message}"
    return key + message[len(leading.group(1)):]


def check_int(name: str, value: Any, minimum: int, hint: str = "") -> int:
    """Return ``value`` if it is an int (not a bool) ``>= minimum``, else raise a ValueError naming it (and
    ``hint``, said after it in parentheses)."""
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} must be an integer >= {minimum}" + (f" ({hint})" if hint else ""))
    return value


def check_int_in_range(name: str, value: Any, minimum: int | None = None, maximum: int | None = None) -> int:
    """``value`` as an int if it is an integral number (not a bool) within the bounds, else a ValueError naming it."""
    allowed = "an integer" + (f" >= {minimum}" if minimum is not None else "") + (
        f" and <= {maximum}" if maximum is not None else "")
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{name}={value!r} is not allowed; {name} must be {allowed}")
    value = int(value)
    if (minimum is not None and value < minimum) or (maximum is not None and value > maximum):
        raise ValueError(f"{name}={value!r} is not allowed; {name} must be {allowed}")
    return value


def check_real(name: str, value: Any, low: float | None = None, high: float | None = None,
               low_open: bool = False, high_open: bool = False) -> float:
    """``value`` as a float if it is a finite real (not a bool) within the bounds (``low`` excluded when
    ``low_open``, ``high`` when ``high_open``), else a ValueError naming it."""
    bounds = []
    if low is not None:
        bounds.append(f"{'>' if low_open else '>='} {low:g}")
    if high is not None:
        bounds.append(f"{'<' if high_open else '<='} {high:g}")
    allowed = "a finite number" + (" " + " and ".join(bounds) if bounds else "")
    message = f"{name}={value!r} is not allowed; {name} must be {allowed}"
    if isinstance(value, bool) or not isinstance(value, numbers.Real) or not math.isfinite(float(value)):
        raise ValueError(message)
    number = float(value)
    if low is not None and (number <= low if low_open else number < low):
        raise ValueError(message)
    if high is not None and (number >= high if high_open else number > high):
        raise ValueError(message)
    return number


def check_bool(name: str, value: Any) -> bool:
    """``value`` if it is a bool, else a ValueError naming it: a string such as ``"false"`` is truthy, so taking any
    value as a switch would turn it on."""
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} must be True or False")
    return value


def check_text(name: str, value: Any, none: bool = False) -> str | None:
    """``value`` if it is a non-empty string (or None where ``none``), else a ValueError naming it."""
    if (value is None and none) or (isinstance(value, str) and value):
        return value
    raise ValueError(f"{name}={value!r} must be a non-empty string" + (" or None" if none else ""))


def settings_from(name: str, value: Any, cls: type) -> Any:
    """``value`` as a ``cls`` (a settings dataclass): itself, or built from a mapping of its fields, an unknown one
    named with the fields allowed (not the dataclass's TypeError); anything else is a TypeError naming ``name``."""
    if isinstance(value, Mapping):
        known = [f.name for f in dataclasses.fields(cls)]
        if unknown := sorted(set(value) - set(known), key=str):
            raise ValueError(f"unknown {name} options {unknown}; allowed: {known}")
        return cls(**value)
    if not isinstance(value, cls):
        raise TypeError(f"{name}={value!r} must be a {cls.__name__} or a dict of its fields")
    return value


def check_folder(name: str, value: Any, unset: str) -> Any:
    """``value`` if it is None (``unset`` says what that means) or a folder's path, else a ValueError naming it:
    an empty path would be the current folder."""
    if value is not None and (not isinstance(value, (str, os.PathLike)) or not os.fspath(value)):
        raise ValueError(f"{name}={value!r} must be a folder's path or None ({unset})")
    return value


def check_choice(name: str, value: Any, choices: tuple[str, ...]) -> str:
    """``value`` if it is one of ``choices``, else a ValueError listing them."""
    if value not in choices:
        raise ValueError(f"{name}={value!r} is not known; use one of {list(choices)}")
    return value
