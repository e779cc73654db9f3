"""What reward functions log beside their values: TRL's ``log_metric`` and ``log_extra`` keywords.

Every reward call gets two callables (``lit_grpo.rollout.rewards.score_rewards``)::

    log_metric(name, value)     a number; a training step logs the mean of its calls' values as reward/<name>
                                (several processes: over every rank's values)
    log_extra(column, values)   one value per completion of the call: a column of CompletionLogger's table; a
                                torch tensor's or NumPy array's values are kept as Python values (``plain_value``)

A call that raises logs nothing: on a retry one group at a time, the groups' calls log instead. Validation's
calls get them too: their metrics are logged as ``val/reward/<name>`` (the greedy completions' calls, as
``val/reward`` is theirs) and ``val/reward_at_k/<name>`` (sampled validation's, ``data.val_num_samples``, as
``val/mean_at_k`` is theirs), each the mean over the validation run (as TRL logs an evaluation's as
``eval_<name>``; ``lit_grpo.update.held_out.ValidationLogs``); their columns are not shown.
"""

from __future__ import annotations

import math
import numbers
from collections.abc import Mapping, Sequence, Set as AbstractSet
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from lit_grpo.runtime.validation import shown_value

#: The keywords a reward call gets for logging, beside ``trainer_state``.
LOG_KEYWORDS = ("log_metric", "log_extra")
#: The columns CompletionLogger's table has of its own: an extra column may not take their names.
TABLE_COLUMNS = ("prompt", "k", "reward", "length", "completion")
#: What ``log_metric(name, value)`` is logged under, ``<prefix>/<name>``: ``reward`` for a training step's and the
#: greedy validation's calls, ``reward_at_k`` for sampled validation's (as val/mean_at_k, pass_at_k are its).
LOGGED_REWARD_PREFIXES = ("reward", "reward_at_k")
#: The ``reward/<name>`` keys lit_grpo logs itself; a reward function's ``reward/<fn_name>/mean`` too.
OWN_REWARD_KEYS = ("mean", "std", "frac_zero_std", "skipped_groups")


def as_number(value: Any) -> float | None:
    """``value`` as a float if it is one number (a Python, NumPy or one-element torch bool or number), else None; a
    number beyond float range (an int) as the infinity of its sign, which a reward's check refuses as it does
    ``inf``."""
    # a NumPy bool, like Python's and torch's, is 1.0 or 0.0. Only bools and numbers are read: item() makes a
    # nanosecond datetime64 or timedelta64 an int, and a timedelta64 is a NumPy integer (a numbers.Real) too
    if isinstance(value, np.timedelta64):
        return None
    if isinstance(value, torch.Tensor) and value.numel() == 1 or isinstance(value, (np.bool_, np.number)):
        value = value.item()
    if not isinstance(value, numbers.Real):
        return None
    try:
        return float(value)
    except OverflowError:  # a number past float's range, such as the int 10**400
        return math.inf if value > 0 else -math.inf


def plain_value(value: Any) -> Any:
    """``value`` as Python holds it: a torch tensor's or a NumPy array's or scalar's values (``tolist``: a number, or
    nested lists of them), anything else as it is. A logged column keeps no tensor (nor the device memory behind
    it), and a table shows ``0.5`` where the tensor's repr read ``tensor(0.5000)``."""
    return value.tolist() if isinstance(value, (torch.Tensor, np.ndarray, np.generic)) else value


class CallLog:
    """What one call of reward function ``fn_name`` on ``n`` completions logs: its ``metric`` and ``extra`` are the
    call's ``log_metric`` and ``log_extra``."""

    def __init__(self, fn_name: str, n: int):
        self.fn_name, self.n = fn_name, n
        self.metrics: dict[str, list[float]] = {}
        self.extras: dict[str, list[Any]] = {}

    def metric(self, name: str, value: Any) -> None:
        if not isinstance(name, str) or not name or name.startswith("/") or name.endswith("/"):
            raise ValueError(f"reward function {self.fn_name!r} called log_metric with the name "
                             f"{shown_value(name)}; it must be a non-empty string, not starting or ending with '/' "
                             "(it is logged as reward/<name>)")
        number = as_number(value)  # NaN and inf are logged as they are, as TRL does: a diagnostic, not a reward
        if number is None:
            raise ValueError(f"reward function {self.fn_name!r} called log_metric({name!r}, {shown_value(value)}); "
                             "the value must be one number")
        self.metrics.setdefault(name, []).append(number)

    def extra(self, column: str, values: Sequence[Any]) -> None:
        values = plain_value(values)  # a tensor of the call's values: each one a number
        if not isinstance(column, str) or not column or column in TABLE_COLUMNS:
            raise ValueError(f"reward function {self.fn_name!r} called log_extra with the column "
                             f"{shown_value(column)}; it must be a non-empty string other than the table's own "
                             f"columns {list(TABLE_COLUMNS)}")
        unordered = isinstance(values, (str, bytes, Mapping, AbstractSet)) or not hasattr(values, "__len__")
        if unordered or len(values) != self.n:
            shown = f"{type(values).__name__} {shown_value(values)}" if unordered else f"{len(values)} values"
            raise ValueError(f"reward function {self.fn_name!r} called log_extra({column!r}, ...) with {shown}; it "
                             f"must give one value per completion of the call ({self.n}), in their order")
        if column in self.extras:
            raise ValueError(f"reward function {self.fn_name!r} called log_extra({column!r}, ...) twice in one call; "
                             "give each column once")
        self.extras[column] = [plain_value(value) for value in values]

    def keywords(self) -> dict[str, Any]:
        """The call's logging keywords, by their names (``LOG_KEYWORDS``)."""
        return {"log_metric": self.metric, "log_extra": self.extra}


@dataclass
class RewardLogs:
    """What the reward calls of one ``score_rewards`` logged.

    Attributes:
        metrics: ``{name: values}``, every value each call logged, in call order.
        extras: ``{column: [N]}`` per completion, None where no call gave the column a value.
        logged_by: ``{column: [N]}`` the reward function that logged each completion's value, None where none did
            (its value may be None too: a column of Nones is logged still).
    """

    n: int
    metrics: dict[str, list[float]] = field(default_factory=dict)
    extras: dict[str, list[Any]] = field(default_factory=dict)
    logged_by: dict[str, list[str | None]] = field(default_factory=dict, repr=False)

    def add(self, call: CallLog, offset: int = 0) -> None:
        """Take in a call that returned, made on completions ``offset`` to ``offset + call.n``."""
        for name, values in call.metrics.items():
            self.metrics.setdefault(name, []).extend(values)
        for column, values in call.extras.items():
            owners = self.logged_by.setdefault(column, [None] * self.n)
            other = next((owner for owner in owners[offset:offset + call.n] if owner is not None), None)
            if other is not None:
                raise ValueError(f"the column {column!r} was logged by two reward functions ({call.fn_name!r} and "
                                 f"{other!r}) for the same completions; give each its own column name")
            owners[offset:offset + call.n] = [call.fn_name] * call.n
            self.extras.setdefault(column, [None] * self.n)[offset:offset + call.n] = values

    def group_extra(self, column: str, group: int, size: int) -> list[Any]:
        """``[size]`` the column's values of group ``group`` (completions ``group x size`` on; None where absent)."""
        values = self.extras.get(column)
        return values[group * size:(group + 1) * size] if values is not None else [None] * size

    def check_names(self, reward_names: Sequence[str]) -> None:
        """Refuse a metric whose ``reward/<name>`` key lit_grpo logs itself."""
        own = {*OWN_REWARD_KEYS, *(f"{name}/mean" for name in reward_names)}
        clashing = sorted(own & set(self.metrics))
        if clashing:
            raise ValueError(f"log_metric names {clashing} would be logged as {[f'reward/{n}' for n in clashing]}, "
                             "keys lit_grpo logs itself (the reward's mean, std, frac_zero_std, skipped_groups and "
                             "each reward function's <name>/mean); use other names")


def step_metrics(logs: Sequence[RewardLogs], prefix: str = "reward") -> dict[str, float]:
    """``reward/<name>``: the mean of every value logged under ``name`` in a step's reward calls (``logs``), and its
    count under ``weight/reward/<name>`` (``lit_grpo.rollout.metrics.RATIO_WEIGHTS``: ranks weigh by it); under
    ``prefix`` (``LOGGED_REWARD_PREFIXES``) for another ``reward``: ``reward_at_k``, sampled validation's calls."""
    if prefix not in LOGGED_REWARD_PREFIXES:
        raise ValueError(f"prefix {prefix!r} is not one of {LOGGED_REWARD_PREFIXES}")
    values: dict[str, list[float]] = {}
    for log in logs:
        for name, logged in log.metrics.items():
            values.setdefault(name, []).extend(logged)
    out: dict[str, float] = {}
    for name, logged in values.items():
        out[f"{prefix}/{name}"] = math.fsum(logged) / len(logged)
        out[f"weight/{prefix}/{name}"] = float(len(logged))
    return out
