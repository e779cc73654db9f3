"""Test helpers for the "infinite" scheduler."""

from __future__ import annotations

import dataclasses

from lit_grpo.scheduling import InfiniteScheduler


def trust_predictions(scheduler: InfiniteScheduler, kind: str = "probe") -> None:
    """Give ``scheduler`` a history of exact ``kind`` predictions ("probe" or "prompt"), so it trusts them from its
    next rollout on: engine tests of parking and planning need the mechanism without rollouts spent earning it."""
    # trusted means followed: no gain gate (gate.py) between the trust and the plan
    scheduler.config = dataclasses.replace(scheduler.config, gain_z=None)
    trust = scheduler.trust[kind]
    for length in range(1, 65):
        trust.observe(float(length), length)
    trust.end_rollout()
    assert trust.informative
