"""Warnings the configured classes raise while they are built, re-issued where the user can act on them: naming
the setting by its full key, at the line of the config file that sets it.
"""

from __future__ import annotations

import contextlib
import sys
import types
import warnings
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import Namespace

from lit_grpo.cli.messages import _LEADING_SETTING, qualified_error
from lit_grpo.runtime.validation import shown_setting


#: The top-level packages of the code that builds the configured classes: a warning a class's constructor raises
#: for its caller (``stacklevel=2``, right in Python) lands there under the CLI.
_BUILDERS = ("lightning", "pytorch_lightning", "lightning_fabric", "lightning_utilities", "jsonargparse", "warnings")


def _is_builder(frame: types.FrameType) -> bool:
    return str(frame.f_globals.get("__name__", "")).split(".")[0] in _BUILDERS


@contextlib.contextmanager
def warnings_at_settings(config: Namespace, args: Sequence[str]) -> Iterator[None]:
    """Re-issue the warnings raised in this block (the configured classes being built) where the user can act on
    them: a class warns at its constructor's caller, here Lightning's and jsonargparse's code, so such a warning
    names its setting by its full key (``warned_setting`` in ``config``) and points at the line of the config file
    that sets it (``setting_location`` over the command's ``args``), else at the line of the class that warned.
    Others keep their place. The user's filters apply where a warning is raised (an error filter, ``-W error``, raises
    it there, in the class that warned) and again to the re-issued warnings, as placed."""
    caught: list[tuple[warnings.WarningMessage, dict[str, Any], tuple[str, int, dict[str, Any]] | None]] = []

    def record(message: Warning | str, category: type[Warning], filename: str, lineno: int, *_: Any) -> None:
        frames, frame = [], sys._getframe(1)
        while frame is not None:
            frames.append(frame)
            frame = frame.f_back
        at = next((i for i, f in enumerate(frames) if (f.f_code.co_filename, f.f_lineno) == (filename, lineno)), None)
        placed = None if at is None else frames[at]
        # the code that warned, called by the builder: not the builder's own warnings (a deprecation of its own)
        warned = next((f for f in frames[:at] if not _is_builder(f)), None) if at is not None else None
        caught.append((warnings.WarningMessage(message, category, filename, lineno),
                       {} if placed is None else placed.f_globals,
                       None if warned is None or not _is_builder(placed)
                       else (warned.f_code.co_filename, warned.f_lineno, warned.f_globals)))

    try:
        with warnings.catch_warnings():
            warnings.showwarning = record
            yield
    finally:
        for caught_warning, module_globals, warned in caught:
            message, filename, lineno = caught_warning.message, caught_warning.filename, caught_warning.lineno
            if warned is not None:
                filename, lineno, module_globals = warned
                message = warned_setting(str(message), config)
                setting = _LEADING_SETTING.match(message)
                filename, lineno = (setting and setting_location(setting.group(1), args)) or (filename, lineno)
            warnings.warn_explicit(message, caught_warning.category, filename, lineno,
                                   module=module_globals.get("__name__"),
                                   registry=module_globals.setdefault("__warningregistry__", {}) if module_globals
                                   else None)


def warned_setting(message: str, config: Namespace) -> str:
    """A class's warning ``message`` with the setting it starts with (``min_lr_ratio=0.5 is ...``) named by its full
    key in ``config`` (``qualified_error``), where the config holds that value there; else ``message`` as it is: a
    class listed in a setting (a callback) has settings that are no config keys, one maybe named as a key is."""
    named = str(qualified_error(ValueError(message), list(config.keys())))
    if named == message:
        return message
    key = _LEADING_SETTING.match(named).group(1)
    value = config.get(key)
    shown = [shown_setting(key, value)]  # as a check's message shows it; its repr and str where they can be printed
    with contextlib.suppress(ValueError):  # an int too long to print (Python's int-to-str limit), held or itself
        shown += [f"{key}={repr(value)}", f"{key}={value}"]
    return named if named.startswith(tuple(shown)) else message


def setting_location(key: str, args: Sequence[str]) -> tuple[str, int] | None:
    """The config file (as ``args`` give it with ``--config``) and the line in it (from 1) that sets ``key`` (a dotted
    config key), where the last of ``args`` to set it is a config file; None where it is the command line itself, or
    nothing."""
    found = None
    for at, arg in enumerate(args):
        name, equals, value = arg.partition("=")
        if name == f"--{key}":
            found = None
        elif name == "--config" and (equals or at + 1 < len(args)):
            path = value if equals else args[at + 1]
            line = yaml_key_line(path, key)
            found = (path, line) if line is not None else found
    return found


def yaml_key_line(path: str, key: str) -> int | None:
    """The line (from 1) of the YAML file ``path`` where the dotted ``key`` is set, nested mapping by mapping; None
    where it is not, or ``path`` is no readable YAML file."""
    try:
        node = yaml.compose(Path(path).read_text())
    except (OSError, ValueError, yaml.YAMLError):
        return None
    line = None
    for part in key.split("."):
        if not isinstance(node, yaml.MappingNode):
            return None
        entry = next(((name, value) for name, value in node.value if name.value == part), None)
        if entry is None:
            return None
        line, node = entry[0].start_mark.line + 1, entry[1]
    return line
