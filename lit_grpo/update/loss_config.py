"""``LossConfig``: the GRPO loss settings, typed and checked once (TRL's ``GRPOConfig`` names and meanings).

One frozen dataclass serves the loss objects (``make_loss(config)``, lit_grpo.update.policy_losses), the functional
``policy_loss(..., **settings)`` (lit_grpo.update.loss) and the YAML (``model.loss``), so a wrong value fails when
the config is built (``Literal`` fields already when the YAML is parsed), with a message that names the key::

    model:
      loss:
        loss_type: dapo          # grpo | bnpo | dr_grpo | dapo | cispo | sapo | luspo | vespo
        epsilon_low: 0.2
        epsilon_high: 0.28
        beta: 0.0                # k3 KL weight; > 0 loads a reference model
        entropy_coef: 0.0        # entropy bonus weight (TRL's); use_adaptive_entropy: Skywork-OR1's control
"""

from __future__ import annotations

import warnings
from dataclasses import dataclass, fields
from typing import Literal, get_args

from lit_grpo.runtime.validation import check_bool, check_choice, check_field, check_real, shown_setting
from lit_grpo.update.surrogates import IMPORTANCE_SAMPLING_LEVELS, ImportanceSamplingLevel

LossType = Literal["grpo", "bnpo", "dr_grpo", "dapo", "cispo", "sapo", "luspo", "vespo"]
LOSS_TYPES: tuple[str, ...] = get_args(LossType)
#: The losses whose surrogate is PPO's clip (``epsilon_low``, ``epsilon_high`` and ``delta`` bound its ratio).
CLIP_LOSSES = ("grpo", "bnpo", "dr_grpo", "dapo", "luspo")
#: The settings that shape sapo's gate and vespo's weight.
SHAPE_SETTINGS = ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg",
                  "vespo_lambda_neg")
#: The settings of the adaptive entropy control, read only with ``use_adaptive_entropy``.
ADAPTIVE_ENTROPY_SETTINGS = ("entropy_coef_min", "entropy_coef_max", "entropy_coef_delta", "entropy_target")


@dataclass(frozen=True)
class LossConfig:
    """Which loss variant and its settings.

    Attributes:
        loss_type: grpo | bnpo | dr_grpo | dapo | cispo | sapo | luspo | vespo (their aggregation:
            lit_grpo.update.policy_losses).
        epsilon_low, epsilon_high: clip range ``[1 - epsilon_low, 1 + epsilon_high]`` of the ratio (cispo: the
            ratio's cap is ``epsilon_high`` itself, so it must be >= 1, typically 5.0).
        delta: the clip losses' cap on the unclipped term's ratio (INTELLECT-2's two-sided clip: it bounds a
            negative advantage's ratio, which PPO's clip leaves unbounded), > 1 + epsilon_high; None: no cap.
        beta: weight of the k3 KL penalty (``> 0`` needs reference log-probs; ``GRPOModule`` then loads a
            reference model).
        importance_sampling_level: ``"token"`` or ``"sequence"`` (GSPO: one ratio per completion).
        kl_bias_correction: weigh the k3 KL by the importance ratio.
        off_policy_mask_threshold: drop the policy term of a completion with a negative advantage whose mean
            ``sampling_logp - logp`` exceeds it (DeepSeek-V3.2's off-policy sequence mask, e.g. 0.5); None: off.
        top_entropy_quantile: the share of tokens by entropy whose policy term is kept ("Beyond the 80/20 rule",
            e.g. 0.2), in [0, 1]: a token stays where its entropy is at or above the ``1 - top_entropy_quantile``
            quantile of the micro-batch's loss tokens (at 0 only the highest); 1 (default): every token. Under
            several processes the quantile spans every rank's micro-batch of the same index, as TRL's.
        sapo_temperature_pos, sapo_temperature_neg: sapo's gate ``tau`` for ``A > 0`` / ``A <= 0`` (> 0).
        vespo_k_pos, vespo_lambda_pos, vespo_k_neg, vespo_lambda_neg: vespo's weight
            ``phi(w) = exp(lambda) w^k exp(-lambda w)`` for ``A >= 0`` / ``A < 0``: ``k`` (>= 0) sets how fast it
            falls for ``w < 1``, ``lambda`` (> 0) for ``w > 1``.
        entropy_coef: weight of the entropy bonus, ``loss - entropy_coef x H`` with ``H`` each micro-batch's mean
            token entropy (at the sampling temperature) over the tokens the policy term acts on (the loss mask, times
            the high-entropy mask under ``top_entropy_quantile`` < 1), whatever the loss type's normalizer
            (lit_grpo.update.entropy_bonus); a finite number, 0 (default): no bonus, and no entropy gradient.
            With ``use_adaptive_entropy``: the initial coefficient, in ``[entropy_coef_min, entropy_coef_max]``.
        use_adaptive_entropy: Skywork-OR1's adaptive entropy control (TRL's): after each optimizer step the
            coefficient moves by ``entropy_coef_delta`` within ``[entropy_coef_min, entropy_coef_max]``, up where
            that step's entropy (over every micro-batch and rank) is at or below ``entropy_target``, else down; a step
            applies the bonus only where the previous step's entropy was at or below the target (never in the first).
        entropy_coef_min, entropy_coef_max: the coefficient's bounds (finite, min <= max).
        entropy_coef_delta: the coefficient's step (finite, >= 0).
        entropy_target: the mean token entropy in nats (finite, >= 0) below which the bonus engages; measured over
            the same tokens as the bonus.
    """

    loss_type: LossType = "dapo"
    epsilon_low: float = 0.2
    epsilon_high: float = 0.28
    delta: float | None = None
    beta: float = 0.0
    importance_sampling_level: ImportanceSamplingLevel = "token"
    kl_bias_correction: bool = False
    off_policy_mask_threshold: float | None = None
    top_entropy_quantile: float = 1.0
    sapo_temperature_pos: float = 1.0
    sapo_temperature_neg: float = 1.05
    vespo_k_pos: float = 2.0
    vespo_lambda_pos: float = 3.0
    vespo_k_neg: float = 3.0
    vespo_lambda_neg: float = 2.0
    entropy_coef: float = 0.0
    use_adaptive_entropy: bool = False
    entropy_coef_min: float = 0.0
    entropy_coef_max: float = 1.0
    entropy_coef_delta: float = 0.005
    entropy_target: float = 0.2

    def __post_init__(self) -> None:
        check_choice("loss_type", self.loss_type, LOSS_TYPES)
        check_choice("importance_sampling_level", self.importance_sampling_level, IMPORTANCE_SAMPLING_LEVELS)
        # a bool would weigh as 0 or 1 and a string fail the comparisons below; beta and the shapes multiply the loss
        # or its weight, so they must be finite
        check_field(self, "epsilon_low", check_real, 0, 1, high_open=True, hint="1 - epsilon_low is the ratio's lower "
                    "clip")
        check_field(self, "epsilon_high", check_real, 0, finite=False, hint="inf: no upper clip")
        check_field(self, "beta", check_real, 0)
        for name in ("sapo_temperature_pos", "sapo_temperature_neg", "vespo_lambda_pos", "vespo_lambda_neg"):
            check_field(self, name, check_real, 0, low_open=True)
        # below 0 vespo's weight would grow without bound as the ratio falls to 0
        for name in ("vespo_k_pos", "vespo_k_neg"):
            check_field(self, name, check_real, 0)
        check_field(self, "delta", check_real, none="no cap", finite=False)
        # at or below the upper clip a negative advantage's ratio is capped at 1 + epsilon_high whatever delta is, and
        # a positive one's clip tightens to delta (below 1 that zeroes on-policy gradients); at it, TRL logs no high
        # clip (its shares read the capped ratio, ours the ratio)
        if self.delta is not None and self.loss_type in CLIP_LOSSES and not self.delta > 1 + self.epsilon_high:
            raise ValueError(f"{shown_setting('delta', self.delta)} must be > 1 + epsilon_high = "
                             f"{1 + self.epsilon_high!r} (it caps the ratio above the clip range), or None")
        check_field(self, "off_policy_mask_threshold", check_real, 0, hint="a mean log-prob gap to the sampler, e.g. "
                    "0.5", none="off")
        check_field(self, "top_entropy_quantile", check_real, 0, 1, hint="the share of tokens by entropy whose policy "
                    "term is kept, e.g. 0.2; 1: every token")
        check_bool("kl_bias_correction", self.kl_bias_correction)
        self._check_entropy_bonus()
        # the cap is on the ratio itself: below 1 it would shrink every on-policy token's gradient
        if self.loss_type == "cispo" and not self.epsilon_high >= 1:
            raise ValueError(f"loss_type='cispo' caps the ratio at epsilon_high itself; "
                             f"{shown_setting('epsilon_high', self.epsilon_high)} must be >= 1 (5.0 is the usual "
                             "value)")
        # as TRL warns: each paper's setup, which the other level departs from
        if self.loss_type == "luspo" and self.importance_sampling_level != "sequence":
            warnings.warn("loss_type='luspo' is GSPO's sequence-level loss scaled by each completion's length; "
                          "its paper uses importance_sampling_level='sequence'", stacklevel=3)
        if self.importance_sampling_level == "sequence" and self.loss_type in ("bnpo", "dr_grpo", "dapo", "cispo"):
            warnings.warn(f"importance_sampling_level='sequence' with loss_type={self.loss_type!r}, which sums its "
                          "tokens' terms, weighs each completion by its length instead of optimizing GSPO's "
                          "per-sequence objective; loss_type='grpo' is GSPO's setup", stacklevel=3)
        if self.loss_type == "vespo" and self.importance_sampling_level != "token":
            warnings.warn("loss_type='vespo' weighs each completion by its own sequence ratio; "
                          "importance_sampling_level='sequence' changes only kl_bias_correction's ratio (keep "
                          "'token', the default)", stacklevel=3)
        if ignored := self.ignored_settings():
            warnings.warn(f"loss settings {ignored} have no effect with loss_type={self.loss_type!r}, beta="
                          f"{self.beta!r} and use_adaptive_entropy={self.use_adaptive_entropy!r}; they are ignored",
                          stacklevel=3)

    def _check_entropy_bonus(self) -> None:
        """Raise naming the first bad entropy bonus setting."""
        check_bool("use_adaptive_entropy", self.use_adaptive_entropy)
        for name in ("entropy_coef", "entropy_coef_min", "entropy_coef_max"):
            check_field(self, name, check_real)
        for name in ("entropy_coef_delta", "entropy_target"):  # a negative step would turn the control around
            check_field(self, name, check_real, 0)
        if not self.use_adaptive_entropy:
            return
        if self.entropy_coef_min > self.entropy_coef_max:
            raise ValueError(f"{shown_setting('entropy_coef_min', self.entropy_coef_min)} must be <= "
                             f"{shown_setting('entropy_coef_max', self.entropy_coef_max)}")
        # outside the bounds the control could apply a coefficient above entropy_coef_max for a few steps
        if not self.entropy_coef_min <= self.entropy_coef <= self.entropy_coef_max:
            raise ValueError(f"{shown_setting('entropy_coef', self.entropy_coef)} is the initial coefficient under "
                             f"use_adaptive_entropy; it must be within [entropy_coef_min, entropy_coef_max] = "
                             f"[{self.entropy_coef_min!r}, {self.entropy_coef_max!r}]")

    @property
    def entropy_bonus_on(self) -> bool:
        """Whether the loss has an entropy bonus (and the update an entropy gradient): a coefficient other than 0,
        or the adaptive control (which may raise it from 0)."""
        return self.entropy_coef != 0 or self.use_adaptive_entropy

    def ignored_settings(self) -> list[str]:
        """The settings given other than their defaults that this loss never reads: the KL's with ``beta`` 0,
        sapo's and vespo's shapes in another loss, the clip bounds sapo and vespo have none of (and cispo's lower
        one and ``delta``), the adaptive entropy control's without ``use_adaptive_entropy``."""
        unread = unread_settings(self.loss_type, self.beta, self.use_adaptive_entropy)
        return [f.name for f in fields(self) if f.name in unread and getattr(self, f.name) != f.default]


def unread_settings(loss_type: str, beta: float, use_adaptive_entropy: bool = False) -> set[str]:
    """The ``LossConfig`` fields a loss of ``loss_type`` with ``beta`` and ``use_adaptive_entropy`` never reads,
    whatever their values (``LossConfig.ignored_settings``; a resume does not compare them)."""
    unread = set() if use_adaptive_entropy else set(ADAPTIVE_ENTROPY_SETTINGS)
    if beta == 0:
        unread.add("kl_bias_correction")
    if loss_type != "sapo":
        unread.update(("sapo_temperature_pos", "sapo_temperature_neg"))
    if loss_type != "vespo":
        unread.update(("vespo_k_pos", "vespo_lambda_pos", "vespo_k_neg", "vespo_lambda_neg"))
    if loss_type not in CLIP_LOSSES:
        unread.update(("epsilon_low", "delta"))
    if loss_type in ("sapo", "vespo"):
        unread.add("epsilon_high")
    return unread
