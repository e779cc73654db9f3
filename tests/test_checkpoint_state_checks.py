"""A resume from a checkpoint is all or nothing and says what is wrong: the data state's owners (the prompt sampler,
the rollout builder and its engine) are all checked before any of them takes its part."""

from __future__ import annotations

import pytest
import torch
from datamodule_helpers import datamodule_arguments

from lit_grpo.datamodules.rollout import RolloutDataModule


def _set_up(**kwargs) -> RolloutDataModule:
    data = RolloutDataModule(**datamodule_arguments(kwargs))
    data.setup("fit")
    return data


def _same_state(a, b) -> bool:
    """Whether two (nested) states are equal, tensors exactly."""
    if isinstance(a, torch.Tensor) or isinstance(b, torch.Tensor):
        return isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor) and torch.equal(a, b)
    if isinstance(a, dict) and isinstance(b, dict):
        return list(a) == list(b) and all(_same_state(a[key], b[key]) for key in a)
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same_state(x, y) for x, y in zip(a, b))
    return a == b


def _moved_sampler_state(**kwargs) -> dict:
    """A data state whose sampler has drawn a step (the state of another point of the stream)."""
    saved = _set_up(**kwargs)
    if not saved.sampler.needs_scores(0):  # the curriculum draws once it has scored the prompts
        saved.sampler.draw(2)
    return saved.state_dict()


# ------------------------------------------------------------------------------ the data state, all or nothing
@pytest.mark.parametrize("strategy, engine, message", [
    ("continuous", {"rollout_index": -1}, r"^rollout_index=-1 is not allowed"),
    ("continuous", {"rollout_index": 2, "carried": 5}, r"^builder state carried=5 must be a list of carried groups"),
    ("continuous", {"rollout_index": 2, "groups_scored": "3"}, r"^builder state groups_scored='3' must be an integer"),
    ("infinite", {"rollout_index": 2, "scheduler": {"groups": "x"}}, r"^scheduler state groups='x' must be a list of "
                                                                     r"finished groups$"),
])
@pytest.mark.parametrize("built", [False, True])
def test_a_data_state_whose_engine_state_is_corrupt_is_refused_whole_and_the_sampler_stays(
        tiny_llama, strategy, engine, message, built):
    """Lightning restores the data state after setup and before the first rollout builds the engine (``built``
    False): the engine's state was kept unchecked until then, and the sampler had taken its state already. With
    the builder built, the sampler took its state before the builder refused the engine's."""
    model, tokenizer = tiny_llama
    state = {**_moved_sampler_state(strategy=strategy), "engine": engine}
    data = _set_up(strategy=strategy)
    data.attach(model, tokenizer)
    if built:
        data._require_builder()
    before = data.sampler.state_dict()
    with pytest.raises(ValueError, match=message):
        data.load_state_dict(state)
    assert _same_state(data.sampler.state_dict(), before)
    assert data._pending_state == {} and data.steps_built == 0


@pytest.mark.parametrize("built", [False, True])
def test_a_sound_data_state_is_taken_by_every_owner(tiny_llama, built):
    model, tokenizer = tiny_llama
    state = {**_moved_sampler_state(), "steps_built": 1, "engine": {"rollout_index": 3}}
    data = _set_up()
    data.attach(model, tokenizer)
    if built:
        data._require_builder()
    data.load_state_dict(state)
    saved_sampler = {key: value for key, value in state["sampler"].items() if key != "train_prompts"}
    assert _same_state(data.sampler.state_dict(), saved_sampler)
    assert data.steps_built == 1 and data.engine.rollout_index == 3
