"""How far the scheduler trusts a length predictor, measured on the samples that finished.

The scheduler reasons in a lognormal length model (``predictors.expected_length``): a sample's log length is normal
around its log prediction. Whether a prediction deserves that is measured, not assumed. Each finished sample gives a
pair (m, t): the log of the prediction made before it finished (the predictor had not learned from it yet) and
the log of its true length. Treating (m, t) as jointly normal, :class:`PredictionTrust` keeps their decayed means,
spreads and correlation ``rho`` (so it follows the policy as it drifts) and trusts only what is established:

- ``rho_low``: the lower end of a one-sided confidence interval on ``rho`` (Fisher's z, ``CONFIDENCE_Z``
  standard errors at the pairs' effective degrees of freedom within rollouts, as the spreads below are pooled), so
  a correlation seen on a handful of samples, or noise that happens to line up, earns nothing;
- ``calibrate(m)``: the regression of t on m with that slope, i.e. the trusted median
  ``exp(mean_t + rho_low * sd_t / sd_m * (m - mean_m))`` and the trusted error spread
  ``sd_t * sqrt(1 - rho_low^2)``, where the within-rollout variances are pooled over the pairs' degrees of freedom:
  each rollout's pairs deviate from their own estimated mean, which takes one (``N - k`` for ``N`` pairs in ``k``
  rollouts, their weighted counterpart under decay), so small rollouts do not understate the spread.

With ``rho_low = 0`` every sample gets the same median and the population's spread: the predictions carry no
information, and the scheduler runs plain continuous order (first come, first served). As ``rho_low`` grows the
predictions spread out from the mean and their error spread narrows, down to the residual error of an exact
predictor. A predictor that is right but miscalibrated (a constant factor off, or too confident) is corrected by
the same regression.

Trust says whether predictions carry information, not whether it is worth acting on: with weak predictions the
order they give is, for the tail, another draw of the same lottery as arrival order. So a gate (the functions at
the end) estimates under the calibrated lognormal model the makespan of list scheduling in prediction order and in
arrival order on the same draws, and follows the predictions only where the per-draw gain exceeds ``GAIN_Z``
standard deviations: the guided order beats arrival order on almost every rollout the model deems possible.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from typing import Any

import torch

from lit_grpo.runtime.validation import check_real, check_state_keys, shown_setting
from lit_grpo.scheduling.config import GAIN_Z
from lit_grpo.scheduling.least_attained import list_makespan
from lit_grpo.scheduling.length_aware.predictors import MAX_LOG_STD

#: One-sided confidence of ``rho_low`` in standard errors (2: about 98%).
CONFIDENCE_Z = 2.0
#: Weight decay per observed pair (the predictors' ridge regression decays its statistics alike).
DECAY = 0.99
#: Correlations are clamped this far inside (-1, 1), so an exact predictor keeps a finite Fisher z.
_RHO_LIMIT = 1.0 - 1e-15


class PredictionTrust:
    """Joint statistics of (log prediction, log true length) pairs and the trust they earn.

    Correlation and slope are measured *within* rollouts (each rollout's pairs centred on its own means), since a
    scheduler ranks the samples of one rollout: a predictor that only follows the policy's average length from
    one rollout to the next ranks nothing. Past rollouts are folded in with decay; the current one counts as its
    samples finish.
    """

    def __init__(self, decay: float = DECAY, confidence_z: float = CONFIDENCE_Z) -> None:
        # each pair multiplies the older ones' weights by decay: above 1 they would grow without bound, at 0 or
        # below vanish or flip sign; 1 forgets nothing
        self.decay = check_real("decay", decay, low=0, high=1, low_open=True)
        # below 0 rho_low would exceed the correlation measured; 0 trusts it as measured
        self.confidence_z = check_real("confidence_z", confidence_z, low=0)
        # Past rollouts, decayed: weight, squared weight, sums of m and t, centred sums of m^2, t^2, m*t.
        self.past = [0.0] * 7
        # The current rollout, plain sums: count, m, t, m^2, t^2, m*t.
        self.current = [0.0] * 6
        # Past rollouts' pairs beyond each rollout's first: the centred sums' degrees of freedom (undecayed).
        self.past_dof = 0.0
        # The same degrees of freedom weighted as the centred sums are (decayed): their variances' divisor.
        self.past_dof_weight = 0.0

    def observe(self, predicted: float, length: int) -> None:
        """One finished sample: its prediction (tokens, > 0) and its true length (tokens, >= 1)."""
        m, t = math.log(max(predicted, 1e-9)), math.log(max(int(length), 1))
        n, sm, st, smm, stt, smt = self.current
        self.current = [n + 1, sm + m, st + t, smm + m * m, stt + t * t, smt + m * t]

    def end_rollout(self) -> None:
        """Fold the current rollout's pairs into the past ones."""
        n, sm, st, smm, stt, smt = self.current
        if n == 0:
            return
        d = self.decay ** n
        w, w2, pm, pt, cmm, ctt, cmt = self.past
        # The rollout weighs what n pairs would, each decaying the older ones by `decay`, shared equally among its
        # pairs: they finish in order of length, so decaying them one by one would weigh the short ones less. The
        # squared weights are those of that equal share, so that the effective count is that of the weights used.
        own = (1 - d) / (1 - self.decay) if self.decay < 1 else n
        scale = own / n
        self.past = [w * d + own, w2 * d * d + own * scale, pm * d + sm * scale, pt * d + st * scale,
                     cmm * d + (smm - sm * sm / n) * scale, ctt * d + (stt - st * st / n) * scale,
                     cmt * d + (smt - sm * st / n) * scale]
        self.past_dof += n - 1
        # a rollout's centred sum has n - 1 degrees of freedom (one went to its own mean), scaled as its sums are
        self.past_dof_weight = self.past_dof_weight * d + own * (n - 1) / n
        self.current = [0.0] * 6

    @property
    def spread_known(self) -> bool:
        """Whether some rollout has shown two pairs. Centred on its own rollout's mean, a lone pair deviates by
        nothing: before then the within-rollout spreads are 0 for want of data, not measured."""
        return self.past_dof + max(self.current[0] - 1, 0.0) >= 1

    def _within(self) -> tuple[float, float, float, float]:
        """(weight, var_m, var_t, cov_mt) of the centred pairs, past and current: the centred sums over their
        degrees of freedom, each rollout's pairs less the one its own mean took (unbiased for any rollout size;
        over the weight, rollouts of n pairs understated a variance by (n - 1) / n). 0 before two pairs of one
        rollout (``spread_known``)."""
        w, _, _, _, cmm, ctt, cmt = self.past
        n, sm, st, smm, stt, smt = self.current
        if n:
            cmm, ctt, cmt = cmm + smm - sm * sm / n, ctt + stt - st * st / n, cmt + smt - sm * st / n
        weight, dof = w + n, self.past_dof_weight + max(n - 1, 0.0)
        if weight <= 0:
            return 0.0, 0.0, 0.0, 0.0
        if dof <= 0:
            return weight, 0.0, 0.0, 0.0
        return weight, max(cmm / dof, 0.0), max(ctt / dof, 0.0), cmt / dof

    def _levels(self) -> tuple[float, float]:
        """Mean log prediction and mean log length over all pairs (the calibration's intercept)."""
        w, _, pm, pt = self.past[:4]
        n, sm, st = self.current[:3]
        weight = w + n
        return ((pm + sm) / weight, (pt + st) / weight) if weight > 0 else (0.0, 0.0)

    @property
    def effective_count(self) -> float:
        """Kish's effective sample size of the pairs."""
        w, w2, n = self.past[0], self.past[1], self.current[0]
        return (w + n) ** 2 / (w2 + n) if w2 + n > 0 else 0.0

    @property
    def effective_dof(self) -> float:
        """The effective count's degrees of freedom within rollouts: the pairs' (``effective_count``) less each
        rollout's share of them its own mean took, as the within-rollout statistics are pooled (``_within``):
        ``N - k`` for ``N`` pairs in ``k`` rollouts without decay."""
        weight = self.past[0] + self.current[0]
        dof = self.past_dof_weight + max(self.current[0] - 1, 0.0)
        return self.effective_count * dof / weight if weight > 0 else 0.0

    @property
    def rho(self) -> float:
        """The measured within-rollout correlation of log prediction and log length; 0 when either is constant."""
        weight, var_m, var_t, cov = self._within()
        if weight <= 0 or var_m < 1e-12 or var_t < 1e-12:
            return 0.0
        return max(-_RHO_LIMIT, min(_RHO_LIMIT, cov / math.sqrt(var_m * var_t)))

    @property
    def rho_low(self) -> float:
        """The correlation established at ``confidence_z`` standard errors, floored at 0. Fisher's z of a correlation
        has standard error ``1 / sqrt(n - 3)`` for ``n`` pairs about one mean, i.e. ``1 / sqrt(dof - 2)``; here
        each rollout's pairs are centred on their own mean, so ``dof`` is ``effective_dof``, not ``n - 1`` (at 2
        samples a rollout that halves it: over ``n`` the interval covered 91% where it claims 98%)."""
        dof = self.effective_dof
        if dof <= 2:
            return 0.0
        return max(0.0, math.tanh(math.atanh(self.rho) - self.confidence_z / math.sqrt(dof - 2)))

    @property
    def informative(self) -> bool:
        return self.rho_low > 0

    def population(self) -> tuple[float, float]:
        """(mean, std) of the true log lengths within rollouts: the model's prior for a sample not yet predicted.
        The std is infinite until it is measured (``spread_known``); the mean is 0 before any pair."""
        _, _, var_t, _ = self._within()
        return self._levels()[1], math.sqrt(var_t) if self.spread_known else math.inf

    def calibrate(self, predicted: float) -> tuple[float, float]:
        """The trusted ``(median length, log-length spread)`` for a raw prediction (tokens).

        Before any pair was seen the prediction is returned with an infinite spread: nothing is known yet. Until a
        rollout has shown two pairs (``spread_known``) the spread stays infinite: the lengths' level is measured,
        their spread is not (a lone pair in its rollout deviates by nothing from that rollout's mean).
        """
        weight, var_m, var_t, _ = self._within()
        if weight <= 0:
            return predicted, math.inf
        mean_m, mean_t = self._levels()
        rho = self.rho_low
        slope = rho * math.sqrt(var_t / var_m) if var_m > 1e-12 else 0.0
        log_median = mean_t + slope * (math.log(max(predicted, 1e-9)) - mean_m)
        spread = math.sqrt(var_t * max(0.0, 1.0 - rho * rho)) if self.spread_known else math.inf
        return math.exp(log_median), spread

    def state_dict(self) -> dict:
        return {"decay": self.decay, "confidence_z": self.confidence_z, "past": list(self.past),
                "current": list(self.current), "past_dof": self.past_dof, "past_dof_weight": self.past_dof_weight}

    def load_state_dict(self, state: Mapping[str, Any]) -> None:
        """Take ``state`` (``state_dict``'s, from a checkpoint), checked whole first (:func:`_checked_state`): a
        corrupt or foreign one is refused naming the bad key, and leaves this trust as it was."""
        (self.decay, self.confidence_z, self.past, self.current, self.past_dof,
         self.past_dof_weight) = _checked_state(state)


#: The keys of a ``PredictionTrust`` state; the last two are absent from checkpoints written before they were kept.
_STATE_KEYS = ("decay", "confidence_z", "past", "current", "past_dof", "past_dof_weight")
_OPTIONAL_KEYS = ("past_dof", "past_dof_weight")
#: Each list of sums in a state: what it holds, its length, and the entries that cannot be negative (weights, the
#: count, plain sums of squares; the past's centred sums of squares are left free: rounding can put one below 0).
_SUMS = {"past": ("the past rollouts' weight, squared weight, sums of m and t, centred sums of m^2, t^2, m*t", 7,
                  (0, 1)),
         "current": ("the current rollout's count, sums of m, t, m^2, t^2, m*t", 6, (0, 3, 4))}


def _checked_state(state: Any) -> tuple[float, float, list[float], list[float], float, float]:
    """``(decay, confidence_z, past, current, past_dof, past_dof_weight)`` of a ``PredictionTrust`` state, each
    number a plain float, else a ValueError naming the bad key or value and what is allowed."""
    check_state_keys("a PredictionTrust state", state, _STATE_KEYS, _OPTIONAL_KEYS)
    # the settings' own rules (PredictionTrust's constructor)
    decay = check_real("trust state decay", state["decay"], low=0, high=1, low_open=True)
    confidence_z = check_real("trust state confidence_z", state["confidence_z"], low=0)
    past, current = (_checked_sums(name, state[name]) for name in _SUMS)
    if not current[0].is_integer():
        raise ValueError(f"{shown_setting('trust state current[0]', state['current'][0])} is not allowed; the "
                         "current rollout's count of pairs must be a whole number >= 0")
    # A checkpoint without the count: a past of at least two pairs is taken to have measured the spread.
    past_dof = check_real("trust state past_dof", state.get("past_dof", 1.0 if past[0] > 1 else 0.0), low=0)
    # Without the weighted one: the past's weight, the divisor of its variances (uncorrected until it decays).
    past_dof_weight = check_real("trust state past_dof_weight", state.get("past_dof_weight", past[0]), low=0)
    return decay, confidence_z, past, current, past_dof, past_dof_weight


def _checked_sums(name: str, sums: Any) -> list[float]:
    """The list of sums ``name`` of a state (``_SUMS``) as plain floats, else a ValueError naming it."""
    holds, size, nonnegative = _SUMS[name]
    if type(sums) not in (list, tuple) or len(sums) != size:
        raise ValueError(f"{shown_setting(f'trust state {name}', sums)} must be a list of {size} numbers ({holds})")
    return [check_real(f"trust state {name}[{i}]", value, low=0 if i in nonnegative else None)
            for i, value in enumerate(sums)]


# ---- the gate: is following the predictions expected to beat arrival order? --------------------------------

#: Draws of the lengths per decision (common to both orders).
DRAWS = 64
#: The draws are seeded, so a decision is a pure function of its inputs.
SEED = 0


def draw_lengths(
    medians: Sequence[float], spreads: Sequence[float], survived: Sequence[int], cap: int, draws: int = DRAWS,
    generator: torch.Generator | None = None,
) -> torch.Tensor:
    """``[draws, N]`` total lengths ``min(L, cap)``, ``L ~ LogNormal(log median, spread)`` given ``L > survived``.

    Inverse-CDF sampling of the normal truncated below at ``log survived`` (every draw survives what it already
    generated, so a running sample's draws are its possible totals).
    """
    mu = torch.tensor([math.log(max(m, 1e-9)) for m in medians], dtype=torch.float64)
    s = torch.tensor([max(x, 1e-6) for x in spreads], dtype=torch.float64)
    a = torch.tensor([math.log(max(k, 1e-9)) if k > 0 else -math.inf for k in survived], dtype=torch.float64)
    low = torch.special.ndtr((a - mu) / s)  # P(L <= survived)
    u = torch.rand(draws, len(medians), generator=generator, dtype=torch.float64)
    p = (low + u * (1 - low)).clamp(1e-12, 1 - 1e-12)
    lengths = torch.exp(mu + s * torch.special.ndtri(p))
    floor = torch.tensor([k + 1 for k in survived], dtype=torch.float64)
    return torch.minimum(torch.maximum(lengths, floor), torch.tensor(float(cap), dtype=torch.float64))


def guided_gain(
    waiting: Sequence[tuple[float, float, int]], running: Sequence[tuple[float, float, int]], num_slots: int,
    cap: int, expected: Sequence[float], draws: int = DRAWS,
) -> tuple[float, float]:
    """(mean, std) over draws of ``makespan(arrival order) - makespan(longest expected first)``, in steps.

    Args:
        waiting: ``[N]`` ``(median, spread, generated)`` of the waiting samples, in arrival order.
        running: ``[R]`` the same for the running samples (R <= num_slots); their slots free when they end.
        expected: ``[N]`` the waiting samples' expected remaining lengths, the guided order's key.
    """
    if len(waiting) < 2:
        return 0.0, 0.0
    generator = torch.Generator().manual_seed(SEED)
    everyone = list(waiting) + list(running)
    totals = draw_lengths(*zip(*everyone), cap=cap, draws=draws, generator=generator)
    done = torch.tensor([float(k) for _, _, k in everyone], dtype=torch.float64)
    remaining = totals - done
    ready = torch.zeros(draws, num_slots, dtype=torch.float64)
    if running:
        ready[:, : len(running)] = remaining[:, len(waiting):]
    jobs = remaining[:, : len(waiting)]
    order = sorted(range(len(waiting)), key=lambda i: (-expected[i], i))
    gain = list_makespan(jobs, ready) - list_makespan(jobs[:, order], ready)
    return float(gain.mean()), float(gain.std()) if draws > 1 else 0.0


def preposterior_gain(
    num_samples: int, num_slots: int, cap: int, mean_log: float, sd_log: float, rho: float, draws: int = DRAWS,
) -> tuple[float, float]:
    """(mean, std) of the same gain before the predictions exist (to decide whether to wait for them at probes).

    Under the calibrated model with correlation ``rho``, a sample's log length is ``mean_log + sd_log * (rho z1 +
    sqrt(1 - rho^2) z2)`` and its calibrated prediction ranks it by ``z1``; both are drawn (``[draws, N]``).
    """
    if num_samples <= num_slots:
        return 0.0, 0.0
    generator = torch.Generator().manual_seed(SEED)
    z1, z2 = torch.randn(2, draws, num_samples, generator=generator, dtype=torch.float64)
    log_length = mean_log + sd_log * (rho * z1 + math.sqrt(max(0.0, 1 - rho * rho)) * z2)
    jobs = log_length.exp().clamp(1.0, float(cap))
    guided = torch.gather(jobs, 1, torch.argsort(z1, dim=1, descending=True))
    ready = torch.zeros(draws, num_slots, dtype=torch.float64)
    gain = list_makespan(jobs, ready) - list_makespan(guided, ready)
    return float(gain.mean()), float(gain.std())


def probes_pay(trust, num_samples: int, num_slots: int, cap: int, z: float = GAIN_Z) -> bool:
    """Would an order by probe predictions of the trust they earned (a ``PredictionTrust``) establish a gain over
    arrival order? If not, parking samples at their probes to wait for those predictions cannot pay."""
    mean_log, sd_log = trust.population()
    sd_log = min(sd_log, MAX_LOG_STD)  # unmeasured (infinite): as wide as the scheduler's models ever get
    return follow_predictions(*preposterior_gain(num_samples, num_slots, cap, mean_log, sd_log, trust.rho_low), z=z)


def follow_predictions(mean_gain: float, std_gain: float, current: bool = False, z: float = GAIN_Z) -> bool:
    """Follow the predictions from here on? The course changes only where the other one is established better
    (its gain beyond ``z`` standard deviations of the per-draw gain); a tie keeps the ``current`` course."""
    if current:
        return not mean_gain < -z * std_gain
    return mean_gain > z * std_gain
