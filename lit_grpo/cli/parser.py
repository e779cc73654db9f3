"""``lit-grpo``'s argument parser: LightningCLI's, reading negative numbers and Python's inf and nan as values (a
config file's inf and nan too), and saying a refusal on one line with the option likely meant.
"""

from __future__ import annotations

import argparse
import re
import sys
from collections.abc import Sequence
from typing import Any, NoReturn, get_args

from jsonargparse import DefaultHelpFormatter, Namespace
from lightning.pytorch.cli import LightningArgumentParser

from lit_grpo.runtime.validation import ConfigError
from lit_grpo.update.lr_schedule import warmup_steps_count

from lit_grpo.cli.messages import (PEER_SHARES, _option_names, config_paths, did_you_mean, one_line_reason,
                                   optional_group_reason, other_unknown_keys, peer_value_hint)


class _HelpFormatter(DefaultHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """jsonargparse's help, with the description's line breaks kept."""


_NEGATIVE_NUMBER = re.compile(r"^-((\d+\.?\d*|\.\d+)([eE][-+]?\d+)?|\.?(inf|infinity|nan))$", re.IGNORECASE)
#: Python's spellings of infinity and NaN, which the parser's YAML reads as text, as YAML spells them.
_NON_FINITE = {"inf": ".inf", "+inf": ".inf", "infinity": ".inf", "+infinity": ".inf", "-inf": "-.inf",
               "-infinity": "-.inf", "nan": ".nan", "+nan": ".nan", "-nan": ".nan"}


def _whole_count(key: str, value: Any) -> Any:
    """A count of TRL's written as a float (``warmup_steps: 10.0``, which transformers' TrainingArguments take) as
    the int it holds, text as text (``"10.0"`` -> ``"10"``); any other value as it is, for the parser to refuse (a
    share such as ``0.1`` with what the count is: ``peer_value_hint``). Only the module's own (``model.``): another
    class's setting of that name, a callback's, keeps its value as given."""
    if key not in {f"model.{name}" for name in PEER_SHARES} or isinstance(value, bool):
        return value
    try:
        number = float(value)
    except (TypeError, ValueError):
        return value
    count = warmup_steps_count(number)
    if not isinstance(count, int):
        return value
    return str(count) if isinstance(value, str) else count


def takes_float(typehint: Any) -> bool:
    """Whether a setting of type ``typehint`` takes a float (``float``, ``float | None``, ``int | float``...)."""
    return typehint is float or any(takes_float(arg) for arg in get_args(typehint))


class GRPOArgumentParser(LightningArgumentParser):
    """LightningCLI's parser, whose error for an option it does not know names the known one it most likely meant,
    and which leaves out the usage listing before an error (its length hid the one line that matters; ``--help``
    has it)."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        # argparse would read --model.beta as --model.betas, the prefix of another setting
        super().__init__(*args, **{**kwargs, "allow_abbrev": False})
        # a negative number in exponent notation (--model.lr -1e-5), or -inf, is a value too, not an unknown option
        # that left its setting without one; argparse knows only -1 and -0.5 (its own attribute: it has no setting)
        self._negative_number_matcher = _NEGATIVE_NUMBER

    def _get_values(self, action: argparse.Action, arg_strings: list[str]) -> Any:
        """A float setting's ``inf``, ``-inf`` or ``nan`` read as the number it spells, so that its class refuses it
        (``lr=inf is not allowed; lr must be a finite number > 0``) or takes it, as it does YAML's ``.inf``:
        jsonargparse read it as text and said only that it expected a float."""
        if takes_float(getattr(action, "_typehint", None)):
            arg_strings = [_NON_FINITE.get(value.strip().lower(), value) if isinstance(value, str) else value
                           for value in arg_strings]
        arg_strings = [_whole_count(action.dest, value) for value in arg_strings]
        return super()._get_values(action, arg_strings)

    def _check_value_key(self, action: argparse.Action, value: Any, key: str, cfg: Namespace | None,
                         *args: Any, **kwargs: Any) -> Any:
        """A config file's ``inf``, ``-inf`` or ``nan`` for a float setting read as the number, as on the command
        line (``_get_values``): YAML 1.1 spells them ``.inf`` and ``.nan`` and reads these as text, which
        jsonargparse refused only as not a float."""
        if (isinstance(value, str) and value.strip().lower() in _NON_FINITE
                and takes_float(getattr(action, "_typehint", None))):
            value = float(value)
        return super()._check_value_key(action, _whole_count(key, value), key, cfg, *args, **kwargs)

    def parse_args(self, args: Sequence[str] | None = None, *rest: Any, **kwargs: Any) -> Namespace:
        # kept for an error's account of every unknown key in the configs given (jsonargparse stops at the first)
        self._given_args = list(sys.argv[1:] if args is None else args)
        return super().parse_args(args, *rest, **kwargs)

    def error(self, message: str, ex: Exception | None = None) -> NoReturn:
        parser = getattr(ex, "subcommand_parser", None) or self
        shown = message
        if self.exit_on_error:  # the message shown; a nested type's parser raises it into its group's message
            message = optional_group_reason(message)
            shown = one_line_reason(message)
        known = _option_names(parser)
        also = other_unknown_keys(message, config_paths(getattr(self, "_given_args", [])), known)
        shown += did_you_mean(message, known) + peer_value_hint(message) + also
        try:
            super().error(shown, ex)
        except SystemExit as exit_:  # its cause is what a rank failing here records for the others to name
            raise exit_ from ConfigError(shown)

    def print_usage(self, file: Any = None) -> None:
        """Nothing: argparse prints the usage only before an error, and ``--help`` shows it."""
