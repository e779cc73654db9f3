"""The sampler correction: importance weights of the trainer's probabilities to the sampler's, per token or per
completion, truncated or masked (pure functions and one small frozen object).

Shapes: ``N`` completions, ``T`` completion tokens (``mask`` marks the ones that count).

The rollout engine returns the log-prob of every token it sampled (``RolloutBatch.sampling_logprobs``); the update
recomputes them with the weights it starts from (``trainer_logps``: the old log-probs before the step's first
optimizer step). Where the two differ (different kernels or precision in the decode loop, a top-k / top-p filter
the sampler renormalized over, or tokens sampled by older weights), the policy loss of each token is multiplied by

    token_*     w_t = exp(trainer_logp_t - sampling_logp_t)                                 ``[N, T]``
    sequence_*  w   = exp(sum over the completion's active tokens of the same difference)  ``[N, 1]``

    *_truncate  w <- clamp(w, clip_min, clip_max)               (a None bound is no bound)
    *_mask      w <- 0 where w < clip_min or w > clip_max, else w unchanged

A token whose sampling log-prob is NaN (the sampler could not score it) counts as a difference of 0.

The default is ``auto``: ``sequence_mask`` with ``clip_max=3`` (TRL's default) for a batch that carries tokens
sampled by older weights (partial rollouts, ``data.over_provision > 1``), ``none`` otherwise. Without carried
samples the engine samples with the very weights the update starts from, in the same process and the same model
code, so the ratio is 1 up to the rounding of the decode kernels, and a correction would only multiply the loss by
that rounding noise. Set a mode yourself for another distribution (a top-k / top-p filter: the sampler
renormalizes over the kept tokens, so each token's ratio is at most 1 and a completion's product shrinks with its
length). ``sampling/sampling_logp_difference/*`` is logged in every mode, so a mismatch shows either way.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass
from typing import Literal, get_args

import torch

from lit_grpo.runtime.validation import check_choice, check_field, check_real, shown_setting

ImportanceSamplingMode = Literal["none", "token_truncate", "token_mask", "sequence_truncate", "sequence_mask"]
IMPORTANCE_SAMPLING_MODES: tuple[str, ...] = get_args(ImportanceSamplingMode)
#: What ``SamplerCorrection.mode`` accepts: a weighting mode, or "auto" (module docstring).
CorrectionMode = Literal["auto", ImportanceSamplingMode]
CORRECTION_MODES: tuple[str, ...] = get_args(CorrectionMode)
#: The mode "auto" turns on for a batch with tokens from older weights (TRL's default).
AUTO_MODE = "sequence_mask"


def sampling_logp_difference(trainer_logps: torch.Tensor, sampling_logps: torch.Tensor,
                             mask: torch.Tensor) -> torch.Tensor:
    """``[N, T]`` ``trainer_logp - sampling_logp`` on active tokens, 0 elsewhere and where either is NaN."""
    diff = (trainer_logps.detach() - sampling_logps.to(trainer_logps.dtype)) * mask.to(trainer_logps.dtype)
    return torch.nan_to_num(diff, nan=0.0)


def importance_sampling_weights(trainer_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor,
                                mode: str, clip_min: float | None = None,
                                clip_max: float | None = None) -> torch.Tensor | None:
    """The correction's weights (module docstring): ``[N, T]`` for token modes, ``[N, 1]`` for sequence modes,
    None for ``mode="none"``. No gradient.

    Args:
        trainer_logps: ``[N, T]`` the trainer's log-probs of the sampled tokens (old log-probs).
        sampling_logps: ``[N, T]`` the sampler's.
        mask: ``[N, T]`` 1 on active tokens.
    """
    check_choice("importance_sampling_mode", mode, IMPORTANCE_SAMPLING_MODES)
    for name, tensor in (("sampling_logps", sampling_logps), ("mask", mask)):
        if tensor.shape != trainer_logps.shape:
            raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected trainer_logps' shape "
                             f"{tuple(trainer_logps.shape)}")
    if mode == "none":
        return None
    log_weights = sampling_logp_difference(trainer_logps, sampling_logps, mask)
    if mode.startswith("sequence"):
        log_weights = log_weights.sum(dim=1, keepdim=True)
    weights = torch.exp(log_weights)
    if mode.endswith("truncate"):
        return torch.clamp(weights, min=clip_min, max=clip_max)
    low = -math.inf if clip_min is None else clip_min
    high = math.inf if clip_max is None else clip_max
    return weights.masked_fill((weights < low) | (weights > high), 0.0)


@dataclass(frozen=True)
class SamplerCorrection:
    """The correction's settings (YAML ``model.sampler_correction``), checked when built; ``weights(...)`` is
    ``importance_sampling_weights``.

    Args:
        mode: auto | none | token_truncate | token_mask | sequence_truncate | sequence_mask (module docstring).
        clip_min: the lower bound of ``[clip_min, clip_max]`` (None: unbounded on that side; > 0).
        clip_max: the upper bound (None: unbounded; ``clip_min < clip_max``, and a truncate mode needs at
            least one of the two).
    """

    mode: CorrectionMode = "auto"
    clip_min: float | None = None
    clip_max: float | None = 3.0

    def __post_init__(self) -> None:
        check_choice("sampler_correction.mode", self.mode, CORRECTION_MODES)
        # an infinite lower bound truncates every weight to inf (a loss of inf) or masks every token (no gradient);
        # an upper one of inf bounds nothing, as None
        check_field(self, "clip_min", check_real, 0, low_open=True, none=True, prefix="sampler_correction.")
        check_field(self, "clip_max", check_real, 0, low_open=True, none=True, finite=False,
                    prefix="sampler_correction.")
        if self.clip_min is not None and self.clip_max is not None and not self.clip_min < self.clip_max:
            raise ValueError(f"{shown_setting('sampler_correction.clip_min', self.clip_min)} must be < "
                             f"{shown_setting('sampler_correction.clip_max', self.clip_max)}")
        if self.mode.endswith("truncate") and self.clip_min is None and self.clip_max is None:
            raise ValueError(f"{shown_setting('sampler_correction.mode', self.mode)} needs "
                             "sampler_correction.clip_min or sampler_correction.clip_max (both are None)")

    def ignored_settings(self) -> list[str]:
        """The bounds given other than their defaults that ``mode="none"`` never reads ("auto" reads them for a
        batch with older samples)."""
        if self.mode != "none":
            return []
        defaults = SamplerCorrection()
        return [name for name in ("clip_min", "clip_max") if getattr(self, name) != getattr(defaults, name)]

    def for_batch(self, has_older_samples: bool) -> SamplerCorrection:
        """The correction for one batch: "auto" becomes ``AUTO_MODE`` when the batch carries tokens sampled by
        older weights (``RolloutBatch.offpolicy_tokens > 0``) and "none" otherwise; any other mode stays."""
        if self.mode != "auto":
            return self
        return dataclasses.replace(self, mode=AUTO_MODE if has_older_samples else "none")

    def weights(self, trainer_logps: torch.Tensor, sampling_logps: torch.Tensor,
                mask: torch.Tensor) -> torch.Tensor | None:
        """``[N, T]`` / ``[N, 1]`` weights, or None when the mode is ``none`` (resolve "auto" with ``for_batch``)."""
        if self.mode == "auto":
            raise ValueError("sampler_correction.mode='auto' is resolved per batch: call for_batch(has_older_samples) "
                             "first (has_older_samples: whether the batch carries tokens sampled by older weights)")
        return importance_sampling_weights(trainer_logps, sampling_logps, mask, self.mode, self.clip_min,
                                           self.clip_max)


class CorrectionStats:
    """``sampling/*`` scalars of one update, accumulated over micro-batches on the device and read once
    (``as_metrics``).

    ``sampling_logp_difference/{mean, max}``: ``|trainer_logp - sampling_logp|`` over active tokens (NaN sampling
    log-probs left out); ``importance_sampling_ratio/{min, mean, max}``: the weights the loss used, over active
    tokens (token modes) or completions (sequence modes), only when a correction is on.
    """

    def __init__(self) -> None:
        self.corrected = False
        self._diffs: list[torch.Tensor] = []   # each micro-batch's [sum, count, max]
        self._ratios: list[torch.Tensor] = []  # each micro-batch's [sum, count, min, max]

    @torch.no_grad()
    def update(self, trainer_logps: torch.Tensor, sampling_logps: torch.Tensor, mask: torch.Tensor,
               weights: torch.Tensor | None) -> None:
        """Add one micro-batch (``[m, T]`` tensors; ``weights`` from ``importance_sampling_weights``)."""
        active = mask.bool()
        delta = (trainer_logps.double() - sampling_logps.double()).abs()
        counted = active & ~torch.isnan(delta)
        delta = delta.where(counted, 0.0)  # >= 0, so the zeros leave the max as it is
        self._diffs.append(torch.stack([delta.sum(), counted.sum().double(), delta.max()]))
        if weights is None:
            return
        self.corrected = True
        values = weights.double()
        counted = torch.ones_like(values, dtype=torch.bool) if weights.shape[1] == 1 else active
        self._ratios.append(torch.stack([values.where(counted, 0.0).sum(), counted.sum().double(),
                                         values.where(counted, math.inf).min(),
                                         values.where(counted, -math.inf).max()]))

    def as_metrics(self) -> dict[str, float]:
        """The logged keys (an empty micro-batch set gives zeros, as TRL), and the weights of the two means under
        several processes (``lit_grpo.rollout.metrics.RATIO_WEIGHTS``)."""
        flat = torch.cat(self._diffs + self._ratios).tolist() if self._diffs else []  # one read of them all
        split = 3 * len(self._diffs)
        diffs = [flat[i:i + 3] for i in range(0, split, 3)]
        ratios = [flat[i:i + 4] for i in range(split, len(flat), 4)]
        diff_count = sum(count for _, count, _ in diffs)
        out = {"sampling/sampling_logp_difference/mean": sum(total for total, _, _ in diffs) / max(diff_count, 1),
               "sampling/sampling_logp_difference/max": max((most for _, _, most in diffs), default=0.0),
               "weight/sampling_logp_tokens": float(diff_count)}
        if self.corrected:
            ratios = [r for r in ratios if r[1]]  # micro-batches with a ratio to count
            count = sum(r[1] for r in ratios)
            out.update({"sampling/importance_sampling_ratio/min": min((r[2] for r in ratios), default=0.0),
                        "sampling/importance_sampling_ratio/mean": sum(r[0] for r in ratios) / max(count, 1),
                        "sampling/importance_sampling_ratio/max": max((r[3] for r in ratios), default=0.0),
                        "weight/importance_sampling_ratios": float(count)})
        return out
