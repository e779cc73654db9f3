"""Test helpers for the "infinite" scheduler: trusted predictions, and rollouts with a planted length signal."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch

from lit_grpo.scheduling import SampleKey
from lit_grpo.scheduling.length_aware import LengthAwareScheduler


def trust_predictions(scheduler: LengthAwareScheduler, kind: str = "probe") -> None:
    """Give ``scheduler`` a history of exact ``kind`` predictions ("probe" or "prompt"), so it trusts them from its
    next rollout on: engine tests of parking and planning need the mechanism without rollouts spent earning it."""
    # trusted means followed: no gain gate (length_aware/trust.py) between the trust and the plan
    scheduler.config = dataclasses.replace(scheduler.config, gain_z=None)
    trust = scheduler.trust[kind]
    for length in range(1, 65):
        trust.observe(float(length), length)
    trust.end_rollout()
    assert trust.informative


@dataclass
class SyntheticRollout:
    """Lengths with a planted signal: ``log L = mu_p + spread * z_pk`` (clipped to [1, cap]).

    ``prompt_features[p]`` encode ``mu_p`` and ``token_features[p, k]`` encode ``z_pk`` along fixed random
    directions, plus Gaussian noise of std ``noise`` per dimension.
    """

    lengths: list[list[int]]
    prompt_features: torch.Tensor  # [B, H]
    token_features: torch.Tensor  # [B, G, H]

    def token_feature(self, key: SampleKey, generated: int) -> torch.Tensor:
        return self.token_features[key[0], key[1]]


def planted_rollout(
    num_prompts: int,
    group_size: int,
    hidden: int = 32,
    max_new_tokens: int = 1024,
    mean_log_length: float = 5.0,
    prompt_spread: float = 0.5,
    sample_spread: float = 0.6,
    noise: float = 0.3,
    signal: float = 3.0,
    generator: torch.Generator | None = None,
    directions: torch.Tensor | None = None,
    prompt_offsets: torch.Tensor | None = None,
) -> SyntheticRollout:
    """A synthetic rollout for predictor and scheduler tests (see :class:`SyntheticRollout`).

    ``directions`` (``[2, H]``, unit rows) fixes where the signal lives, so a series of rollouts shares it, as a
    policy's hidden-state geometry does across steps; default: drawn from ``generator``. ``prompt_offsets``
    (``[B]``, the ``mu_p``) makes prompts recur with the same length profile; default: fresh prompts.
    """
    g = generator if generator is not None else torch.Generator().manual_seed(0)
    if directions is None:
        directions = torch.nn.functional.normalize(torch.randn(2, hidden, generator=g), dim=1)
    mu = prompt_offsets if prompt_offsets is not None else prompt_spread * torch.randn(num_prompts, generator=g)
    z = torch.randn(num_prompts, group_size, generator=g)
    log_lengths = mean_log_length + mu[:, None] + sample_spread * z
    lengths = log_lengths.exp().round().clamp(1, max_new_tokens).long().tolist()
    prompt_features = noise * torch.randn(num_prompts, hidden, generator=g) + signal * mu[:, None] * directions[0]
    token_features = noise * torch.randn(num_prompts, group_size, hidden, generator=g)
    token_features = token_features + signal * z[..., None] * directions[1] + prompt_features[:, None, :]
    return SyntheticRollout(lengths, prompt_features, token_features)
