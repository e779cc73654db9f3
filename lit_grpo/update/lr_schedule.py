"""The learning rate over a run's optimizer steps: a linear warm-up, then constant or a decay towards a floor (0 by
default).

``GRPOModule``'s ``lr_schedule``: "constant" (the default) holds the rate after the warm-up; "linear" (TRL's and
transformers' default) and "cosine" (a half cosine) take it down to ``min_lr_ratio`` of it (0 by default;
transformers' ``cosine_with_min_lr`` with ``min_lr_rate`` is "cosine" with it), which the step after the last one
would reach. The last step is ``trainer.max_steps``'s, which counts optimizer steps, as ``trainer.global_step`` does
(training steps x ``num_iterations`` x ``num_mini_batches``; rounded up to whole training steps, where Lightning
stops): the decay needs it set. The warm-up's first step already has ``1 / warmup_steps`` of the rate (transformers'
has 0), so with a warm-up the whole schedule runs one step ahead of transformers'; without one the two are the same.
verl steps its schedule once a rollout, whatever its mini-batches; TRL's, as this one, once an optimizer step.

A resumed run follows this run's settings (``GRPOModule.on_train_start``): its rate, warm-up, schedule and
``max_steps``, at the step the checkpoint reached.
"""

from __future__ import annotations

import functools
import math
from typing import Any, Callable, Literal

import numpy as np

from lit_grpo.runtime.validation import ConfigError, shown_setting, shown_value

#: What ``warmup_steps`` is, said where one is given as a share (transformers 5 and TRL take a value below 1 as one).
WARMUP_STEPS_COUNT = ("a count of optimizer steps; TRL's warmup_ratio, a share of them, is warmup_ratio x "
                      "trainer.max_steps")

LrSchedule = Literal["constant", "linear", "cosine"]


def is_share(value: Any) -> bool:
    """Whether ``value`` is a share of the steps as transformers 5 and TRL take a count below 1: a float (numpy's
    too) between 0 and 1, both excluded (an int, or a text, is not one)."""
    return isinstance(value, (float, np.floating)) and 0 < value < 1


def warmup_steps_count(value: Any) -> Any:
    """``value`` as an int where it is a float holding a whole number >= 0 (transformers' TrainingArguments takes
    ``warmup_steps=10.0`` as 10 steps), else as it is: a share (:func:`is_share`) or a fraction is refused where
    the settings are checked."""
    if isinstance(value, (float, np.floating)) and float(value).is_integer() and value >= 0:
        return int(value)
    return value


def global_steps_to_run(max_steps: int, optimizer_steps_per_training_step: int) -> int:
    """The ``global_step`` a fit of ``max_steps`` runs to: ``max_steps`` rounded up to whole training steps of
    ``optimizer_steps_per_training_step`` each (Lightning stops after the training step that reaches it);
    ``max_steps`` itself where it sets no limit (-1)."""
    per = optimizer_steps_per_training_step
    # in ints: a float quotient loses counts past 2**53 and runs to 0 against a count past float range
    return -(-max_steps // per) * per if max_steps > 0 else max_steps


def lr_factor(step: int, warmup_steps: int, total_steps: int | None, schedule: LrSchedule,
              min_ratio: float = 0.0) -> float:
    """The base rate's multiplier at optimizer step ``step`` (from 0): ``(step + 1) / warmup_steps`` in the warm-up,
    1 at its last step; from there 1 ("constant"), or falling from 1 at the rate's peak (the warm-up's last step,
    or step 0) to ``min_ratio`` at step ``total_steps``, on a line ("linear") or a half cosine ("cosine")."""
    if step < warmup_steps:
        return (step + 1) / warmup_steps
    if schedule == "constant":
        return 1.0
    peak = max(warmup_steps - 1, 0)
    progress = min((step - peak) / (total_steps - peak), 1.0)  # a run resumed past its total stays at the floor
    decay = 1.0 - progress if schedule == "linear" else 0.5 * (1.0 + math.cos(math.pi * progress))
    return min_ratio + (1.0 - min_ratio) * decay


def lr_lambda(schedule: LrSchedule, warmup_steps: int, max_steps: int | None,
              min_ratio: float = 0.0) -> Callable[[int], float]:
    """``lr_factor`` for ``torch.optim.lr_scheduler.LambdaLR`` (``schedule``, ``warmup_steps`` and ``min_ratio`` as
    ``GRPOModule`` checked them): a decaying ``schedule`` needs ``max_steps`` (the trainer's; None or -1: not set)
    longer than the warm-up."""
    if schedule != "constant":
        if max_steps is None or max_steps < 0:
            floor = f"{min_ratio:g} of it" if min_ratio else "0"
            raise ConfigError(f"{shown_setting('model.lr_schedule', schedule)} decays the rate to {floor} at "
                              f"trainer.max_steps, which is not set ({shown_value(max_steps)}): set it (optimizer "
                              "steps: training steps x model.num_iterations x model.num_mini_batches), or use "
                              "lr_schedule 'constant'")
        if warmup_steps >= max_steps:
            raise ConfigError(f"{shown_setting('model.warmup_steps', warmup_steps)} leaves no step of "
                              f"{shown_setting('trainer.max_steps', max_steps)} for "
                              f"{shown_setting('lr_schedule', schedule)} to decay over: warmup_steps must be < "
                              "max_steps")
    return functools.partial(lr_factor, warmup_steps=warmup_steps, total_steps=max_steps, schedule=schedule,
                             min_ratio=min_ratio)
