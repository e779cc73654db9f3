"""GAIN-RL angle-concentration curriculum ("Angles Don't Lie", arXiv 2506.02281) as prompt samplers.

A prompt sampler decides, step by step, which training prompts go into the next GRPO batch. Three are here:

- ``PromptSampler``: a fresh uniform draw without replacement at every step (independent across steps).
- ``UniformPromptSampler`` (``curriculum: none``): epoch-style shuffling; one permutation per epoch, consumed in
  order, so every prompt is seen exactly once per epoch.
- ``AngleCurriculumSampler`` (``curriculum: angle``): GAIN-RL. Prompts are sorted by their angle concentration
  (descending) and each step's batch is drawn from a Gaussian over the sorted rank centred at ``mu``; ``mu`` moves
  after every step from the step's accuracy and angle signal.

``build_prompt_sampler(curriculum, num_prompts, seed, **options)`` maps the YAML name to a sampler.

The score (``angle_concentration``, the mean pairwise cosine of a prompt's last-layer token states) lives in
``lit_grpo.datamodules.angle_score``.

The draw
--------
P(rank i) ~ exp(-((i - mu) / sigma)^2 / 2) over the ranks 0..N-1 of the prompts sorted by score, descending (rank
0 = most concentrated; ties keep the lower prompt index first). A batch is drawn without replacement: k successive
draws, each from the Gaussian renormalized over the ranks not yet taken (what the authors' ``numpy.random.choice(
replace=False, p=...)`` does). It is implemented as Gumbel-top-k on the log-weights, which has exactly that
distribution and never underflows when sigma is small compared with the batch.

The update
----------
After each step, ``update(accuracy, mean_angle)`` applies the paper's rule

    mu <- clamp(mu + clamp(n tanh(alpha (acc / 2 - target)) + n tanh(alpha angle), adj_min, adj_max), 0, N - 1).

- ``acc``: the paper's acc is on a 0..2 scale (the authors' reward gives 2.0 per correct answer, and acc is its mean
  over the rollouts), so ``acc / 2`` is the fraction of correct rollouts and target = 0.5 is the target accuracy
  (the paper's beta, the authors' README's "TARGET ACC", ``target_accuracy`` here). Here ``accuracy`` is that
  fraction directly: the step's mean accuracy (or mean reward, when rewards lie in [0, 1]) over the completions of
  the batch that have one (a completion no reward function scored has neither), in [0, 1]; the rule is applied as
  ``n tanh(alpha (accuracy - target_accuracy))``, identical to the paper's with acc = 2 * accuracy.
- ``angle``: the authors' code feeds the *raw* mean cosine (computed in the training forward pass on prompt plus
  completion, averaged over the rollouts since the last update); it is not normalized. Raw cosine levels depend on
  the model, the layer and the prompt format (the final norm alone rescales them), which makes the angle term a
  model-dependent offset rather than a signal. So by default (``angle_normalization="minmax"``) the fed value is
  min-max normalized against the scores of the last scoring pass: angle = (mean_angle - min score) / (max score -
  min score), which is 1 for the most concentrated prompts and 0 for the least (0 when all scores are equal). With
  the default adj_min = 0 the curriculum therefore moves fast through high-concentration prompts and, on
  low-concentration ones, only when accuracy exceeds target_accuracy. ``mean_angle`` is the batch's mean raw angle
  concentration: pass a value measured on the current policy if the trainer has one; by default (None) it is the
  mean stored score of the prompts drawn since the last update. ``angle_normalization="none"`` feeds the raw value,
  as the authors do.
- A step in which nothing was scored (every reward function returned None for every completion, or every group
  was skipped for a reward error) has no accuracy: ``update(None)`` leaves mu where it is and forgets the step's
  draws, as a step with no information; feeding it 0 would move mu by the gap to the target on no evidence.
- mu starts at 0 (the most concentrated prompts) and is a rank position; a rescoring re-sorts the prompts and keeps
  mu. The step's update moves the centre of the *next* draw (the authors' trl loop lags one epoch behind; we do not).
- Several processes: ``RolloutDataModule`` feeds the whole step's accuracy and mean angle (over every rank's batch)
  and the same scores (each rank scores its share of the prompts, one all_gather gives every rank all of them),
  so every rank's sampler holds the same mu, order and generator state at every step.

Default sizes
-------------
The paper's sizes are in prompts for sets of about 7.5k (MATH train: 7.5k, GSM8K: 7.47k): n = 500, sigma = 1000,
adj_max = 1000, adj_min = 0. Unless given, they scale with the data-set size N:
n = N / 15 (``N_FRACTION``), sigma = 2 N / 15 (``SIGMA_FRACTION``), adj_max = 2 N / 15 (``ADJ_MAX_FRACTION``),
adj_min = 0; e.g. N = 20 gives n = 1.33, sigma = adj_max = 2.67; N = 100k gives n = 6667, sigma = adj_max = 13333.
The update runs once per training step (the paper: once per epoch of its subset), so n is a step size in ranks.

State
-----
``state_dict()`` holds tensors and plain Python values only (loadable with ``torch.load(weights_only=True)``):
the random generator's state, and for the uniform sampler the epoch, its permutation and the position in it; for
the curriculum the scores, the sorted order, mu, the epoch of the last scoring and the prompts drawn since the
last update. A sampler built
with the same arguments and given that state continues with identical draws.
"""

from __future__ import annotations

import inspect
import math
from collections.abc import Callable, Collection, Mapping
from typing import Any, Literal, get_args

import torch

from lit_grpo.runtime.checkpoints import SettingsDiffer
from lit_grpo.runtime.validation import (
    check_choice,
    check_int,
    check_int_in_range,
    check_real,
    check_state_keys,
    config_errors,
    integer_within,
    real_within,
    shown_keys,
    shown_setting,
    shown_value,
)

__all__ = ["CURRICULA", "Curriculum", "AngleCurriculumSampler", "PromptSampler", "UniformPromptSampler",
           "build_prompt_sampler"]

Curriculum = Literal["none", "angle"]
CURRICULA: tuple[str, ...] = get_args(Curriculum)
AngleNormalization = Literal["minmax", "none"]
ANGLE_NORMALIZATIONS: tuple[str, ...] = get_args(AngleNormalization)

PAPER_NUM_PROMPTS = 7500  # the size of the sets the paper's defaults were set for (MATH train, GSM8K train)
N_FRACTION = 500 / PAPER_NUM_PROMPTS  # paper n = 500
SIGMA_FRACTION = 1000 / PAPER_NUM_PROMPTS  # paper sigma = 1000
ADJ_MAX_FRACTION = 1000 / PAPER_NUM_PROMPTS  # paper adj_max = 1000

#: The check of each ``AngleCurriculumSampler`` option's value, which needs no prompt count: run as the sampler is
#: built and, on ``curriculum_kwargs``, before any prompt loads (``check_curriculum_settings``).
_ANGLE_OPTION_CHECKS: dict[str, Callable[[str, Any], Any]] = {
    "n": lambda name, value: check_real(name, value, low=0.0),
    "alpha": lambda name, value: check_real(name, value, low=0.0),
    "target_accuracy": lambda name, value: check_real(name, value, low=0.0, high=1.0),
    "sigma": lambda name, value: check_real(name, value, low=0.0, low_open=True),
    "adj_min": check_real,
    "adj_max": check_real,
    "rescore_every_n_epochs": lambda name, value: check_int_in_range(name, value, minimum=1),
    "angle_normalization": lambda name, value: check_choice(name, value, ANGLE_NORMALIZATIONS),
}
#: The options whose None means a default from the prompt count (or, for rescoring, never).
_ANGLE_OPTIONS_NONE = ("n", "sigma", "adj_max", "rescore_every_n_epochs")


# ---------------------------------------------------------------------------------------------------- draw
def gaussian_rank_log_weights(num_prompts: int, mu: float, sigma: float) -> torch.Tensor:
    """``[N]`` float64 unnormalized log-probabilities -((i - mu) / sigma)^2 / 2 of the ranks i = 0..N-1."""
    ranks = torch.arange(num_prompts, dtype=torch.float64)
    return -0.5 * ((ranks - mu) / sigma) ** 2


def gaussian_rank_probs(num_prompts: int, mu: float, sigma: float) -> torch.Tensor:
    """``[N]`` float64: P(rank i) of a single draw, the normalized Gaussian over the ranks."""
    return torch.softmax(gaussian_rank_log_weights(num_prompts, mu, sigma), dim=0)


def sample_without_replacement(log_weights: torch.Tensor, k: int, generator: torch.Generator) -> torch.Tensor:
    """k indices drawn without replacement, in draw order: ``[..., N]`` log-weights -> ``[..., k]`` long.

    Leading dimensions are independent draws (one call draws many batches).

    Gumbel-top-k: the k largest of log_weights + Gumbel noise have the distribution of k successive draws, each
    proportional to the weights of the indices not yet drawn. Working in log space, far-tail weights that would
    underflow to 0 as probabilities still order correctly.
    """
    uniform = torch.rand(log_weights.shape, generator=generator, dtype=torch.float64)
    gumbel = -torch.log(-torch.log(uniform))  # uniform == 0 gives -inf: that index is drawn last
    return torch.topk(log_weights.double() + gumbel, k, dim=-1).indices


def defer_duplicates(permutation: list[int], avoid: set[int], needed: int) -> list[int]:
    """Reorder a new epoch's permutation so its first ``needed`` entries avoid ``avoid``.

    Used when a batch spans two epochs: the tail of the old epoch (``avoid``) is already in the batch, so the first
    ``needed`` prompts of the new epoch not in it move to the front (relative order kept); the rest follow in order.
    The result is still a permutation, so every prompt is seen once per epoch and never twice in one batch.
    """
    front = [p for p in permutation if p not in avoid][:needed]
    taken = set(front)
    return front + [p for p in permutation if p not in taken]


def usable_avoid(avoid: Collection[int], num_prompts: int, batch_size: int) -> set[int]:
    """As many of ``avoid`` as leave ``batch_size`` prompts to draw (the lowest indices where not all can be, the
    same on every rank): a step whose draws span more prompts than there are repeats some rather than stall."""
    return set(sorted({int(prompt) for prompt in avoid})[:max(num_prompts - batch_size, 0)])


# -------------------------------------------------------------------------------------------------- update
def normalize_angle(mean_angle: float, scores: torch.Tensor, how: str = "minmax") -> float:
    """The angle signal fed to the update: min-max against ``scores`` ``[N]`` ("minmax") or the raw value ("none").

    "minmax" gives (mean_angle - min) / (max - min): 1 at the most concentrated prompt, 0 at the least; 0 when all
    scores are equal.
    """
    check_choice("angle_normalization", how, ANGLE_NORMALIZATIONS)
    if how == "none":
        return float(mean_angle)
    low, high = float(scores.min()), float(scores.max())
    span = high - low
    return 0.0 if span <= 0 else (float(mean_angle) - low) / span


def next_mu(mu: float, accuracy: float, angle: float, *, n: float, alpha: float, target_accuracy: float,
            adj_min: float, adj_max: float, num_prompts: int) -> float:
    """GAIN-RL's rule: mu + clamp(n tanh(alpha (accuracy - target_accuracy)) + n tanh(alpha angle), adj_min, adj_max),
    clamped to the ranks [0, N - 1]. ``accuracy`` in [0, 1] is the paper's acc / 2 (see the module docstring).
    """
    adjustment = n * math.tanh(alpha * (accuracy - target_accuracy)) + n * math.tanh(alpha * angle)
    adjustment = min(max(adjustment, adj_min), adj_max)
    return min(max(mu + adjustment, 0.0), float(num_prompts - 1))


# ------------------------------------------------------------------------------------------------ samplers
class PromptSampler:
    """Uniform draw without replacement within a step, independent across steps; a seeded ``torch.Generator``.

    The interface every sampler shares: ``draw`` a step's prompt indices, ``update`` with the step's outcome,
    ``needs_scores`` (False here), ``state_dict``/``load_state_dict`` and ``metrics`` (``{}`` here).
    """

    def __init__(self, num_prompts: int, seed: int = 0):
        self.num_prompts = check_int_in_range("num_prompts", num_prompts, minimum=1)
        self.seed = check_int_in_range("seed", seed, minimum=0)
        self.generator = torch.Generator().manual_seed(self.seed)

    def check_batch_size(self, batch_size: int) -> int:
        """``batch_size`` as an int in [1, num_prompts] (no prompt twice in a batch), else ValueError."""
        return check_int_in_range("batch_size", batch_size, minimum=1, maximum=self.num_prompts)

    def draw(self, batch_size: int, avoid: Collection[int] = ()) -> list[int]:
        """Prompt indices for one training step: ``batch_size`` distinct indices in [0, num_prompts), none of
        ``avoid`` (the step's earlier draws, under several ranks) where enough others are left."""
        batch_size = self.check_batch_size(batch_size)
        avoid = usable_avoid(avoid, self.num_prompts, batch_size)
        order = torch.randperm(self.num_prompts, generator=self.generator).tolist()
        return [prompt for prompt in order if prompt not in avoid][:batch_size]

    def update(self, accuracy: float | None, mean_angle: float | None = None) -> None:
        """Feedback after a step (``accuracy`` None: nothing was scored); uniform sampling ignores it."""

    def give_back(self, prompts: list[int]) -> None:
        """Prompts drawn and not used (several ranks: the part of a global draw no rank took). Here nothing to do:
        every step's draw is independent, so a prompt not used keeps its chance in the next ones."""

    def needs_scores(self, epoch: int) -> bool:
        """Whether the caller must score the prompts (``angle_concentration``) before this epoch; never here."""
        return False

    def state_dict(self) -> dict:
        return {"kind": type(self).__name__, "num_prompts": self.num_prompts,
                "generator": self.generator.get_state()}

    def load_state_dict(self, state: dict) -> None:
        """Take ``state`` (``state_dict``'s, from a checkpoint), checked whole first (``_checked_state``): a corrupt
        or foreign one is refused naming the bad key or value, and leaves the sampler as it was."""
        checked = self._checked_state(state)
        self.generator.set_state(checked.pop("generator"))
        for name, value in checked.items():
            setattr(self, name, value)

    def check_state_dict(self, state: dict) -> None:
        """Refuse ``state`` as ``load_state_dict`` would, taking none of it: for the owner of a whole checkpoint's
        state, which checks every part before any part is taken."""
        self._checked_state(state)

    #: The keys of a state beyond the base's, and those of them an older checkpoint may lack.
    _STATE_KEYS: tuple[str, ...] = ()
    _OPTIONAL_STATE_KEYS: tuple[str, ...] = ()

    def _checked_state(self, state: Any) -> dict[str, Any]:
        """``state``'s values, checked, by the attribute each sets (the generator's state apart), else a ValueError
        naming the bad key or value: a sampler of another curriculum or over another number of prompts first
        (``_check_same_sampler``)."""
        if isinstance(state, Mapping):
            self._check_same_sampler(state)
        check_state_keys(f"a {type(self).__name__} state", state, ("kind", "num_prompts", "generator")
                         + self._STATE_KEYS, self._OPTIONAL_STATE_KEYS)
        generator = state["generator"]
        try:  # torch knows what a generator's state is: a scratch generator takes it first
            torch.Generator().set_state(generator)
        except (TypeError, RuntimeError) as error:
            raise ValueError(f"sampler state generator is not a random generator's state (torch.Generator."
                             f"get_state()'s): {error}") from None
        return {"generator": generator}

    def _check_same_sampler(self, state: Mapping) -> None:
        """Raise a ``SettingsDiffer`` where ``state`` is a sampler's of another curriculum or over another number of
        prompts (a checkpoint of another run's settings), and a ValueError where its kind or count is no sampler's
        (a corrupt one)."""
        kind, own = state.get("kind"), type(self).__name__
        if kind != own:
            if not isinstance(kind, str) or kind not in _CURRICULUM_OF_KIND:
                raise ValueError(f"state kind={shown_value(kind)} is not allowed; it must be a prompt sampler's, one "
                                 f"of {list(_CURRICULUM_OF_KIND)}")
            curricula = (f" (the checkpoint's curriculum={_CURRICULUM_OF_KIND[kind]!r}, this run's "
                         f"{_CURRICULUM_OF_KIND[own]!r})" if own in _CURRICULUM_OF_KIND else "")
            raise SettingsDiffer(f"state kind={kind!r} cannot be loaded into {own}; it needs kind={own!r}{curricula}")
        num_prompts = check_int("state num_prompts", state.get("num_prompts"), 1)
        if num_prompts != self.num_prompts:
            raise SettingsDiffer(f"{shown_setting('state num_prompts', num_prompts)} does not match this sampler's "
                                 f"num_prompts={self.num_prompts}: the checkpoint drew from another set of training "
                                 "prompts (other data settings, or a split made before validation held out repeated "
                                 "prompts whole); resume with its data settings, or start a new run")

    def _prompt_indices(self, name: str, indices: Any, permutation: bool = False) -> list[int]:
        """``indices`` (a list, or an integer tensor, of prompt indices; where ``permutation``, each prompt once) as
        plain ints, else a ValueError naming ``name`` and the bad index."""
        if isinstance(indices, torch.Tensor):
            if indices.dim() != 1 or indices.dtype.is_floating_point or indices.dtype.is_complex \
                    or indices.dtype == torch.bool:
                raise ValueError(f"sampler state {name} must be a list or an integer tensor of prompt indices, not "
                                 f"a {indices.dtype} tensor" + (f" shaped {list(indices.shape)}"
                                                                if indices.dim() != 1 else ""))
            indices = indices.tolist()
        if not isinstance(indices, (list, tuple)):
            raise ValueError(f"{shown_setting(f'sampler state {name}', indices, 80)} must be a list or an integer "
                             "tensor of prompt indices")
        last = self.num_prompts - 1
        if permutation:
            numbers = [integer_within(index, 0, last) for index in indices]
            if None in numbers or sorted(numbers) != list(range(self.num_prompts)):
                raise ValueError(f"sampler state {name} must be a permutation of the prompt indices 0 to {last}, not "
                                 f"{shown_value(list(indices), 120)}")
            return numbers
        checked = []
        for position, index in enumerate(indices):
            number = integer_within(index, 0, last)
            if number is None:
                raise ValueError(f"{shown_setting(f'sampler state {name}[{position}]', index)} is not allowed; a "
                                 f"prompt index is an integer >= 0 and <= {last}")
            checked.append(number)
        return checked

    def metrics(self) -> dict[str, float]:
        return {}


class UniformPromptSampler(PromptSampler):
    """Epoch-style shuffling (``curriculum: none``): a permutation per epoch, consumed in order.

    A batch that crosses an epoch boundary takes the old epoch's tail and then the new epoch's first prompts that are
    not already in the batch (``defer_duplicates``), so every prompt is seen exactly once per epoch and never twice
    in a batch. ``epoch`` is the 0-based epoch of the most recently drawn prompts.

    Prompts given back (``give_back``: drawn, then used by no rank) are handed out first by the next draws, so
    every prompt of the stream is used once, only later; one already in the batch waits for the draw after. A step
    whose draws (``avoid``: its earlier ones) need more prompts than there are repeats the epoch's next ones.
    """

    def __init__(self, num_prompts: int, seed: int = 0):
        super().__init__(num_prompts, seed)
        self.epoch = 0
        self._permutation = self._new_permutation()
        self._position = 0
        self._returned: list[int] = []  # given back, handed out before the permutation continues

    def _new_permutation(self) -> list[int]:
        return torch.randperm(self.num_prompts, generator=self.generator).tolist()

    def draw(self, batch_size: int, avoid: Collection[int] = ()) -> list[int]:
        batch_size = self.check_batch_size(batch_size)
        # a step whose draws span more prompts than there are must repeat some: it repeats the epoch's next ones, so
        # every prompt still comes round once an epoch (avoid's rule alone would repeat the highest indices)
        repeats = len(set(avoid)) > self.num_prompts - batch_size
        avoid = usable_avoid(avoid, self.num_prompts, batch_size)
        batch = self._take_returned(batch_size, avoid)
        while len(batch) < batch_size:
            if self._position == len(self._permutation):
                self.epoch += 1
                self._permutation = defer_duplicates(self._new_permutation(), set(batch) | avoid,
                                                     batch_size - len(batch))
                self._position = 0
            # the epoch's next prompts neither in the batch nor avoided; the others keep their place in line
            rest, skipped = self._permutation[self._position:], set(batch) | avoid
            chosen = [prompt for prompt in rest if prompt not in skipped][:batch_size - len(batch)]
            if not chosen and repeats:  # the step's earlier draws, taken again: the epoch stays whole
                chosen = [prompt for prompt in rest if prompt not in batch][:batch_size - len(batch)]
            if not chosen:  # the epoch's last prompts are all skipped: they go first in the next draw
                self._returned[:0] = rest
                self._position = len(self._permutation)
                continue
            chosen_set = set(chosen)
            self._permutation[self._position:] = chosen + [prompt for prompt in rest if prompt not in chosen_set]
            self._position += len(chosen)
            batch.extend(chosen)
        return batch

    def _take_returned(self, batch_size: int, avoid: set[int]) -> list[int]:
        """Up to ``batch_size`` of the prompts given back, in their order, none twice and none of ``avoid``; the
        others stay given back for a later draw."""
        batch: list[int] = []
        for prompt in list(self._returned):
            if len(batch) < batch_size and prompt not in batch and prompt not in avoid:
                batch.append(prompt)
                self._returned.remove(prompt)
        return batch

    def give_back(self, prompts: list[int]) -> None:
        """Hand ``prompts`` out first in the next draws, in this order."""
        self._returned.extend(int(prompt) for prompt in prompts)

    def state_dict(self) -> dict:
        state = super().state_dict()
        state.update(epoch=self.epoch, permutation=torch.tensor(self._permutation, dtype=torch.long),
                     position=self._position, returned=torch.tensor(self._returned, dtype=torch.long))
        return state

    # a checkpoint from before prompts were given back has no "returned"
    _STATE_KEYS, _OPTIONAL_STATE_KEYS = ("epoch", "permutation", "position", "returned"), ("returned",)

    def _checked_state(self, state: Any) -> dict[str, Any]:
        checked = super()._checked_state(state)
        permutation = self._prompt_indices("permutation", state["permutation"], permutation=True)
        return {**checked, "epoch": check_int_in_range("sampler state epoch", state["epoch"], 0),
                "_permutation": permutation,
                "_position": check_int_in_range("sampler state position", state["position"], 0, len(permutation)),
                "_returned": self._prompt_indices("returned", state.get("returned", []))}


class AngleCurriculumSampler(PromptSampler):
    """GAIN-RL (``curriculum: angle``): a Gaussian over the score rank centred at ``mu``, moved by ``update``.

    Args:
        num_prompts: N, the training set's size.
        seed: seeds the draws.
        n: step size of the update in ranks; default ``N_FRACTION * N`` (paper: 500 for 7.5k prompts).
        alpha: tanh sensitivity (paper: 2).
        target_accuracy: the accuracy in [0, 1] mu moves towards (the paper's beta, 0.5).
        sigma: width of the Gaussian in ranks, > 0; default ``SIGMA_FRACTION * N`` (paper: 1000).
        adj_min, adj_max: bounds of one update's move; defaults 0 and ``ADJ_MAX_FRACTION * N`` (paper: 0, 1000).
        rescore_every_n_epochs: rescore every this many epochs; None scores once (the paper).
        angle_normalization: "minmax" (default) or "none" (raw, as the authors' code); see the module docstring.

    Flow per run: ``if s.needs_scores(epoch): s.set_scores(angle_concentration(model, tok, prompts), epoch)``, then
    per step ``idx = s.draw(B)`` ... ``s.update(accuracy, mean_angle)`` and log ``s.metrics()``.
    """

    def __init__(self, num_prompts: int, seed: int = 0, n: float | None = None, alpha: float = 2.0,
                 target_accuracy: float = 0.5, sigma: float | None = None, adj_min: float = 0.0,
                 adj_max: float | None = None, rescore_every_n_epochs: int | None = None,
                 angle_normalization: AngleNormalization = "minmax"):
        super().__init__(num_prompts, seed)
        size = self.num_prompts
        given = check_angle_options(dict(n=n, alpha=alpha, target_accuracy=target_accuracy, sigma=sigma,
                                         adj_min=adj_min, adj_max=adj_max,
                                         rescore_every_n_epochs=rescore_every_n_epochs,
                                         angle_normalization=angle_normalization))
        self.n = N_FRACTION * size if n is None else given["n"]
        self.alpha, self.target_accuracy = given["alpha"], given["target_accuracy"]
        self.sigma = SIGMA_FRACTION * size if sigma is None else given["sigma"]
        self.adj_min = given["adj_min"]
        self.adj_max = ADJ_MAX_FRACTION * size if adj_max is None else given["adj_max"]
        _check_adjustment_bounds(self.adj_min, self.adj_max)
        self.rescore_every_n_epochs = given["rescore_every_n_epochs"]
        self.angle_normalization = given["angle_normalization"]
        self.mu = 0.0
        self.scores: torch.Tensor | None = None  # [N] float32, by prompt index
        self.order: torch.Tensor | None = None  # [N] long: order[rank] = prompt index, scores descending
        self.scored_epoch: int | None = None
        self.drawn: list[int] = []  # prompts drawn since the last update (all draws of the current step)
        self.last_angle = math.nan  # raw mean angle of the last update's input, or of the prompts drawn since
        self._asked_epoch = 0

    # -- scoring
    def needs_scores(self, epoch: int) -> bool:
        """True before the first scoring, and when ``rescore_every_n_epochs`` epochs passed since the last one."""
        self._asked_epoch = check_int_in_range("epoch", epoch, minimum=0)
        if self.scores is None:
            return True
        if self.rescore_every_n_epochs is None:
            return False
        return epoch - self.scored_epoch >= self.rescore_every_n_epochs

    def set_scores(self, scores: torch.Tensor, epoch: int | None = None) -> None:
        """Store ``[N]`` scores and sort the prompts by them, descending (stable). mu keeps its rank position.

        ``epoch`` (default: the epoch of the latest ``needs_scores`` call) starts the rescoring period.
        """
        scores = torch.as_tensor(scores).detach().float().cpu()
        if scores.shape != (self.num_prompts,):
            raise ValueError(f"scores of shape {tuple(scores.shape)} are not allowed; need shape "
                             f"({self.num_prompts},), one score per prompt")
        if not torch.isfinite(scores).all():
            raise ValueError(f"scores contain non-finite values at prompts "
                             f"{torch.nonzero(~torch.isfinite(scores)).flatten().tolist()[:10]}; all must be finite")
        self.scores = scores.clone()
        self.order = torch.sort(scores, descending=True, stable=True).indices
        self.scored_epoch = self._asked_epoch if epoch is None else check_int_in_range("epoch", epoch, minimum=0)

    def _require_scores(self, what: str) -> None:
        if self.scores is None:
            raise RuntimeError(f"AngleCurriculumSampler.{what} needs scores: call "
                               "set_scores(angle_concentration(model, tokenizer, prompts)) first")

    # -- steps
    def rank_probs(self) -> torch.Tensor:
        """``[N]`` float64: the probability of each rank for a single draw at the current mu."""
        return gaussian_rank_probs(self.num_prompts, self.mu, self.sigma)

    def draw(self, batch_size: int, avoid: Collection[int] = ()) -> list[int]:
        """``batch_size`` distinct prompt indices, drawn by rank from the Gaussian at mu, in draw order; none of
        ``avoid`` (the step's earlier draws, under several ranks) where enough others are left."""
        batch_size = self.check_batch_size(batch_size)
        self._require_scores("draw")
        log_weights = gaussian_rank_log_weights(self.num_prompts, self.mu, self.sigma)
        avoid = usable_avoid(avoid, self.num_prompts, batch_size)
        if avoid:  # drawn last by Gumbel-top-k, so never while enough others are left
            rank_of = torch.empty_like(self.order)
            rank_of[self.order] = torch.arange(self.num_prompts)
            log_weights[rank_of[sorted(avoid)]] = -math.inf
        ranks = sample_without_replacement(log_weights, batch_size, self.generator)
        batch = self.order[ranks].tolist()
        self.drawn.extend(batch)
        self.last_angle = float(self.scores[self.drawn].mean())
        return batch

    def update(self, accuracy: float | None, mean_angle: float | None = None) -> None:
        """Move mu with the step's mean ``accuracy`` in [0, 1] and the batch's raw ``mean_angle``.

        ``mean_angle`` None uses the mean stored score of the prompts drawn since the last update (every draw of
        the step, e.g. the extra rounds of dynamic sampling). ``accuracy`` None: nothing of the step was scored, a
        step with no information: mu stays, the step's draws are forgotten (the next update's angle is its own
        step's), and ``mean_angle``, where given, is still what ``curriculum/mean_angle`` logs.
        """
        if accuracy is None:
            if mean_angle is not None:
                self.last_angle = check_real("mean_angle", mean_angle)
            self.drawn = []
            return
        accuracy = check_real("accuracy", accuracy, low=0.0, high=1.0)
        self._require_scores("update")
        if mean_angle is None:
            if not self.drawn:
                raise RuntimeError("AngleCurriculumSampler.update(mean_angle=None) needs a draw() since the last "
                                   "update, or an explicit mean_angle")
            mean_angle = float(self.scores[self.drawn].mean())
        else:
            mean_angle = check_real("mean_angle", mean_angle)
        angle = normalize_angle(mean_angle, self.scores, self.angle_normalization)
        self.mu = next_mu(self.mu, accuracy, angle, n=self.n, alpha=self.alpha, target_accuracy=self.target_accuracy,
                          adj_min=self.adj_min, adj_max=self.adj_max, num_prompts=self.num_prompts)
        self.last_angle = mean_angle
        self.drawn = []

    def metrics(self) -> dict[str, float]:
        return {"curriculum/mu": float(self.mu), "curriculum/mean_angle": float(self.last_angle)}

    # -- checkpoints
    def state_dict(self) -> dict:
        state = super().state_dict()
        state.update(mu=float(self.mu), scores=self.scores, order=self.order, scored_epoch=self.scored_epoch,
                     drawn=list(self.drawn), last_angle=float(self.last_angle),
                     asked_epoch=self._asked_epoch)
        return state

    _STATE_KEYS = ("mu", "scores", "order", "scored_epoch", "drawn", "last_angle", "asked_epoch")

    def _checked_state(self, state: Any) -> dict[str, Any]:
        checked = super()._checked_state(state)
        scored = {name: state[name] is not None for name in ("scores", "order", "scored_epoch")}
        if len(set(scored.values())) > 1:  # set_scores sets the three together
            said = ", ".join(f"{name} {'set' if given else 'None'}" for name, given in scored.items())
            raise ValueError(f"sampler state scores, order and scored_epoch are all set (by set_scores) or all None, "
                             f"not {said}")
        scores = order = scored_epoch = None
        if scored["scores"]:
            scores = self._checked_scores(state["scores"])
            order = torch.tensor(self._prompt_indices("order", state["order"], permutation=True), dtype=torch.long)
            scored_epoch = check_int_in_range("sampler state scored_epoch", state["scored_epoch"], 0)
        last_angle = state["last_angle"]
        number = real_within(last_angle, finite=False)
        if number is None or math.isinf(number):  # nan: no angle drawn or given yet
            raise ValueError(f"{shown_setting('sampler state last_angle', last_angle)} is not allowed; it must be a "
                             "finite number or nan (no angle yet)")
        return {**checked, "mu": check_real("sampler state mu", state["mu"], 0, self.num_prompts - 1),
                "scores": scores, "order": order, "scored_epoch": scored_epoch,
                "drawn": self._prompt_indices("drawn", state["drawn"]), "last_angle": number,
                "_asked_epoch": check_int_in_range("sampler state asked_epoch", state["asked_epoch"], 0)}

    def _checked_scores(self, scores: Any) -> torch.Tensor:
        """A state's scores as ``set_scores`` keeps them (``[N]`` float32 on the CPU), else a ValueError."""
        try:
            tensor = torch.as_tensor(scores).detach().float().cpu().clone()
        except (TypeError, ValueError, RuntimeError):
            tensor = None
        if tensor is None or tensor.shape != (self.num_prompts,) or not torch.isfinite(tensor).all():
            said = (f"a {scores.dtype} tensor shaped {list(scores.shape)}" if isinstance(scores, torch.Tensor)
                    else shown_value(scores, 80))
            raise ValueError(f"sampler state scores must be None or a tensor of {self.num_prompts} finite scores, one "
                             f"per prompt, not {said}")
        return tensor


#: The curriculum each prompt sampler serves, by its kind (a sampler state's ``kind``).
_CURRICULUM_OF_KIND = {UniformPromptSampler.__name__: "none", AngleCurriculumSampler.__name__: "angle"}


def check_curriculum_settings(curriculum: Any, curriculum_kwargs: Any, score_batch_size: Any) -> int:
    """Refuse a bad curriculum setting before any prompt or model is loaded: its name, its options
    (``curriculum_kwargs``, a mapping or None: each key, and each value by the check the sampler makes, named
    ``data.curriculum_kwargs.KEY`` as at setup) and ``score_batch_size`` (prompts per prefill when the angle
    curriculum scores its prompts), which it returns as a plain int (a numpy integer's too)."""
    score_batch_size = check_int("score_batch_size", score_batch_size, 1)
    if curriculum_kwargs is not None and not isinstance(curriculum_kwargs, Mapping):
        raise ValueError(f"{shown_setting('curriculum_kwargs', curriculum_kwargs, 80)} must be a mapping of the "
                         "curriculum's options or None")
    check_curriculum_options(curriculum, curriculum_kwargs or {})
    if curriculum == "angle" and curriculum_kwargs:
        with config_errors("data.curriculum_kwargs", curriculum_kwargs):
            check_angle_options(curriculum_kwargs)
    return score_batch_size


def check_angle_options(options: Mapping[str, Any]) -> dict[str, Any]:
    """``options`` (``AngleCurriculumSampler``'s, by name; no others) with each value checked as
    ``_ANGLE_OPTION_CHECKS`` says (None kept where it means a default), and ``adj_min <= adj_max`` where both are
    given; a ValueError names the option, its value and what is allowed."""
    checked = {name: None if value is None and name in _ANGLE_OPTIONS_NONE else _ANGLE_OPTION_CHECKS[name](name, value)
               for name, value in options.items()}
    if checked.get("adj_min") is not None and checked.get("adj_max") is not None:
        _check_adjustment_bounds(checked["adj_min"], checked["adj_max"])
    return checked


def _check_adjustment_bounds(adj_min: float, adj_max: float) -> None:
    """Refuse bounds of one update's move where ``adj_min > adj_max``, naming both."""
    if adj_min > adj_max:
        raise ValueError(f"adj_min={adj_min:g} is not allowed with adj_max={adj_max:g}; adj_min must be <= adj_max")


def check_curriculum_options(curriculum: str, options: Collection[str]) -> None:
    """Refuse a curriculum name that is not known, or an option name (of ``curriculum_kwargs``) that the curriculum
    does not take, naming the ones it takes."""
    check_choice("curriculum", curriculum, CURRICULA)
    if curriculum == "none":
        if options:
            raise ValueError(f"curriculum='none' takes no options, got {shown_keys(options)}; they apply to "
                             "curriculum='angle' only")
        return
    own = [name for name in inspect.signature(AngleCurriculumSampler).parameters if name not in ("num_prompts", "seed")]
    unknown = [name for name in options if name not in own]
    if unknown:
        raise ValueError(f"curriculum_kwargs={shown_keys(unknown)} are not options of curriculum='angle'; its "
                         f"options: {own}")


def build_prompt_sampler(curriculum: str, num_prompts: int, seed: int = 0, **options: Any) -> PromptSampler:
    """The sampler for a YAML ``curriculum`` name: "none" -> ``UniformPromptSampler``, "angle" ->
    ``AngleCurriculumSampler(num_prompts, seed, **options)``. Options are only accepted for "angle"."""
    check_curriculum_options(curriculum, options)
    if curriculum == "angle":
        return AngleCurriculumSampler(num_prompts, seed, **options)
    return UniformPromptSampler(num_prompts, seed)
