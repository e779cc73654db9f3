"""Warnings that Lightning and torch print about lit_grpo's own objects and calls, which no user can act on: each is
ignored by the object it concerns, for its message from the module that raises it only, so that the same warning
from a user's own code still shows."""

from __future__ import annotations

import re
import warnings


def ignore_warning(message: str, category: type[Warning], module: str) -> None:
    """Ignore the ``category`` warnings whose message starts with the regex ``message`` raised from a module whose
    name matches the regex ``module``. Added once: adding a filter again resets every module's record of the
    warnings it showed once, which would then show again."""
    item = ("ignore", re.compile(message, re.I), category, re.compile(module), 0)
    if item not in warnings.filters:
        warnings.filterwarnings("ignore", message, category, module)
