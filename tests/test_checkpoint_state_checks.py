"""A resume from a checkpoint is all or nothing and says what is wrong: the data state's owners (the prompt sampler,
the rollout builder and its engine) are all checked before any of them takes its part; a corrupt sampler state is
a corrupt value, not another run's settings; the checkpoint callback's state is checked before Lightning takes it;
and an engine resumed with another strategy than the one that saved its scheduler's state says what it drops."""

from __future__ import annotations

import warnings

import pytest
import torch
from datamodule_helpers import datamodule_arguments

from lit_grpo.callbacks.run_checkpoint import RunCheckpoint
from lit_grpo.datamodules.rollout import RolloutDataModule
from lit_grpo.runtime.checkpoints import SettingsDiffer
from lit_grpo.runtime.validation import ConfigError
from lit_grpo.sampling import RolloutEngine


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


def _length_aware_sampling(predictor) -> dict:
    """The data module keywords of the length-aware method with ``predictor``, the caller's object."""
    return {"strategy": "infinite", "scheduler": {"length_aware": {"predictor": predictor}}}


def _length_aware_engine_state() -> dict:
    """An engine state of the length-aware method whose predictor learned otherwise than a fresh one (another seed
    and observation count): a sound state that changes the predictor it is loaded into."""
    from lit_grpo.scheduling.config import InfiniteSchedulerConfig
    from lit_grpo.scheduling.length_aware import OnlineLengthPredictor

    learned = OnlineLengthPredictor(seed=5, min_token_observations=3)
    scheduler = InfiniteSchedulerConfig(length_aware={"predictor": learned}).build()
    return {"rollout_index": 3, "scheduler": scheduler.state_dict()}


def test_checking_an_engine_state_leaves_the_callers_length_predictor_as_it_was():
    """The check runs the scheduler's own load on a scratch scheduler of the strategy; the predictor it was given is
    the caller's (the engine's to be), so the check must not load into it: only the load that takes the state may."""
    from lit_grpo.sampling import SamplingConfig
    from lit_grpo.sampling.engine import check_engine_state
    from lit_grpo.scheduling.length_aware import OnlineLengthPredictor

    predictor = OnlineLengthPredictor()
    before = predictor.state_dict()
    config = SamplingConfig(group_size=4, max_new_tokens=8, **_length_aware_sampling(predictor))
    check_engine_state(_length_aware_engine_state(), config)
    assert _same_state(predictor.state_dict(), before)


def test_a_data_state_refused_after_its_engine_state_was_checked_leaves_the_length_predictor_as_it_was():
    """Loaded before setup, a data state's engine state is checked at once and its sampler state once setup has
    built the sampler: a sound scheduler state beside a corrupt sampler state leaves the predictor untouched."""
    from lit_grpo.scheduling.length_aware import OnlineLengthPredictor

    state = {**_moved_sampler_state(), "engine": _length_aware_engine_state()}
    state["sampler"]["position"] = -1
    data = RolloutDataModule(**datamodule_arguments(_length_aware_sampling(OnlineLengthPredictor())))
    predictor = data.sampling.scheduler.length_aware.predictor  # the one the engine will learn with
    before = predictor.state_dict()
    with pytest.raises(ValueError, match=r"^sampler state position=-1 is not allowed"):
        data.load_state_dict(state)
        data.setup("fit")
    assert _same_state(predictor.state_dict(), before)


def test_a_data_state_loaded_before_setup_and_refused_there_leaves_nothing_taken():
    """A state loaded before setup (a Python caller's; Lightning sets up first) has its sampler's part checked only
    once setup has built the sampler: refused there, none of it was taken, the count, the random states and the
    engine's state (kept for the builder) included."""
    import random

    from lit_grpo.datamodules.random_state import get_rng_states

    saved = _set_up()
    state = {**_moved_sampler_state(), "steps_built": 3, "rng": saved.state_dict()["rng"],
             "engine": {"rollout_index": 3}}
    state["sampler"]["position"] = -1
    random.random()  # this process's states now differ from the saved ones
    before = get_rng_states()
    data = RolloutDataModule(**datamodule_arguments({}))
    with pytest.raises(ValueError, match=r"^sampler state position=-1 is not allowed"):
        data.load_state_dict(state)
        data.setup("fit")
    assert data.steps_built == 0 and data._pending_state == {}
    assert get_rng_states()["python"] == before["python"]
    assert _same_state(data.state_dict()["sampler"], _set_up().state_dict()["sampler"])


def test_a_data_state_loaded_before_attach_is_checked_against_the_tool_settings():
    """Tool calling does not run with partial rollouts: a state carrying partial rollouts, loaded before attach has
    rendered the tools for the tokenizer, is refused at once, not by the builder at the first rollout once the
    sampler and the count had taken their parts."""
    from lit_grpo.rollout.builder import Prompt, PromptExample, _Carry, _carried_state
    from lit_grpo.sampling import GroupProgress, SampleProgress

    prompt = Prompt(0, PromptExample("2+3?", None, {"prompt": "2+3?"}), [1, 2, 3])
    carried = GroupProgress(prompt.ids, [SampleProgress() for _ in range(4)], (0, 0), tag=_Carry(prompt))
    state = {**_moved_sampler_state(), "steps_built": 1, "engine": {"rollout_index": 2,
                                                                    "carried": [_carried_state(carried)]}}
    data = _set_up(tools=[_add], max_tool_calling_iterations=1)
    before = data.sampler.state_dict()
    with pytest.raises(ValueError, match=r"carries 1 unfinished group.*data\.tools"):
        data.load_state_dict(state)
    assert _same_state(data.sampler.state_dict(), before)
    assert data.steps_built == 0 and data._pending_state == {}


def _add(a: int, b: int) -> int:
    """Add two integers.

    Args:
        a: the first.
        b: the second.
    """
    return a + b


# ------------------------------------------------------------------------------ corrupt, or another run's
@pytest.mark.parametrize("change, message", [
    (lambda sampler: sampler.update(position=-1), r"^sampler state position=-1 is not allowed"),
    (lambda sampler: sampler.update(epoch="1"), r"^sampler state epoch='1' is not allowed"),
    (lambda sampler: sampler.update(permutation=[0, 0, 1]), r"^sampler state permutation must be a permutation"),
    (lambda sampler: sampler.update(num_prompts="10"), r"^state num_prompts='10' must be an integer >= 1$"),
    (lambda sampler: sampler.update(kind="Garbage"), r"^state kind='Garbage' is not allowed; it must be a "
                                                     r"prompt sampler's, one of \['UniformPromptSampler', "
                                                     r"'AngleCurriculumSampler'\]$"),
    (lambda sampler: sampler.update(train_prompts=5), r"^sampler state train_prompts=5 is not allowed; it must be the "
                                                      r"hash of the training prompts \(a string\)"),
])
def test_a_corrupt_sampler_state_is_a_plain_error_naming_the_bad_value_not_another_runs_settings(change, message):
    """Every ValueError of the sampler was said as a checkpoint of another prompt set or curriculum (a
    SettingsDiffer), which the CLI then names as another experiment's run."""
    state = _moved_sampler_state()
    change(state["sampler"])
    data = _set_up()
    with pytest.raises(ValueError, match=message) as refused:
        data.load_state_dict(state)
    assert not isinstance(refused.value, (ConfigError, SettingsDiffer))


def test_a_data_state_whose_sampler_state_is_no_mapping_is_refused_naming_it():
    state = {**_moved_sampler_state(), "sampler": 5}
    with pytest.raises(ValueError, match=r"^data state sampler=5 is not allowed; it must be a prompt sampler's state "
                                         r"\(a mapping\)$") as refused:
        _set_up().load_state_dict(state)
    assert not isinstance(refused.value, ConfigError)


@pytest.mark.parametrize("saved, now, message", [
    ({"curriculum": "angle"}, {}, r"^--ckpt_path: state kind='AngleCurriculumSampler' cannot be loaded into "
                                  r"UniformPromptSampler"),
    ({"val_size": 4}, {}, r"^--ckpt_path: state num_prompts=8 does not match this sampler's num_prompts=10"),
])
def test_a_sampler_state_of_another_curriculum_or_prompt_set_is_another_runs_settings(saved, now, message):
    state = _moved_sampler_state(**saved)
    with pytest.raises(ConfigError, match=message) as refused:
        _set_up(**now).load_state_dict(state)
    assert isinstance(refused.value.__cause__, SettingsDiffer)


# ------------------------------------------------------------------------------ the checkpoint callback
def _run_checkpoint_state(tmp_path) -> tuple[RunCheckpoint, dict]:
    callback = RunCheckpoint(dirpath=str(tmp_path))
    saved = RunCheckpoint(dirpath=str(tmp_path))
    saved.best_model_path = saved.last_model_path = str(tmp_path / "last.ckpt")
    saved.best_model_score = torch.tensor(0.5)
    return callback, saved.state_dict()


@pytest.mark.parametrize("key, value, message", [
    ("best_model_score", "abc", r"^RunCheckpoint state best_model_score='abc' is not allowed; it must be None or a "
                                r"score \(a number, or a tensor of one\)$"),
    ("best_model_score", torch.ones(2), r"^RunCheckpoint state best_model_score=tensor\(\[1., 1.\]\) is not allowed"),
    ("kth_value", None, r"^RunCheckpoint state kth_value=None is not allowed; it must be a score \(a number, or a "
                        r"tensor of one\)$"),
    ("dirpath", 5, r"^RunCheckpoint state dirpath=5 must be a folder's path or None"),
    ("best_model_path", None, r"^RunCheckpoint state best_model_path=None is not allowed; it must be a path \(a "
                              r"string, empty for none\)$"),
    ("last_model_path", 3, r"^RunCheckpoint state last_model_path=3 is not allowed; it must be a path"),
    ("monitor", 1, r"^RunCheckpoint state monitor=1 is not allowed; it must be None or a logged key \(a string\)$"),
    ("best_k_models", ["a"], r"^RunCheckpoint state best_k_models=\['a'\] is not allowed; it must be a mapping of "
                             r"checkpoint paths to scores$"),
    ("best_k_models", {"a.ckpt": "x"}, r"^RunCheckpoint state best_k_models\['a.ckpt'\]='x' is not allowed; it must "
                                       r"be a score"),
    (3, "x", r"^a RunCheckpoint state has unknown keys \[3\]; it holds monitor, best_model_score, "),
])
def test_a_corrupt_run_checkpoint_state_is_refused_naming_the_key_and_nothing_is_taken(tmp_path, key, value, message):
    callback, state = _run_checkpoint_state(tmp_path)
    state[key] = value
    before = callback.state_dict()
    with pytest.raises(ValueError, match=message):
        callback.load_state_dict(state)
    assert _same_state(callback.state_dict(), before)


def test_a_run_checkpoint_state_lacking_what_lightning_reads_is_refused():
    callback = RunCheckpoint()
    with pytest.raises(ValueError, match=r"^a RunCheckpoint state lacks \['best_model_score'\]"):
        callback.load_state_dict({"best_model_path": ""})


def test_a_run_checkpoint_state_of_another_lightning_version_is_taken(tmp_path):
    callback, state = _run_checkpoint_state(tmp_path)
    state["a_key_of_a_later_lightning"] = {"anything": 1}
    # named as this Lightning's paths are, but not one it writes: left to the restore, which does not read it
    state["a_later_lightnings_model_path"] = None
    callback.load_state_dict(state)
    assert callback.best_model_path == str(tmp_path / "last.ckpt")


def test_lightnings_own_run_checkpoint_state_is_taken(tmp_path):
    callback, state = _run_checkpoint_state(tmp_path)
    state["best_k_models"] = {str(tmp_path / "a.ckpt"): torch.tensor(0.25), str(tmp_path / "b.ckpt"): 0.5}
    callback.load_state_dict(state)
    assert callback.best_model_path == str(tmp_path / "last.ckpt") and float(callback.best_model_score) == 0.5
    assert list(callback.best_k_models) == [str(tmp_path / "a.ckpt"), str(tmp_path / "b.ckpt")]


# ------------------------------------------------------------------------------ another strategy
def _engine(tiny_llama, strategy: str) -> RolloutEngine:
    model, tokenizer = tiny_llama
    return RolloutEngine(model, tokenizer, group_size=4, micro_group_size=2, strategy=strategy, max_new_tokens=8)


@pytest.mark.parametrize("strategy", ["full", "micro", "continuous"])
def test_a_scheduler_state_resumed_by_a_strategy_that_keeps_none_is_dropped_and_said(tiny_llama, strategy):
    saved = _engine(tiny_llama, "infinite")
    saved.scheduler.groups.append([3, 5, 8, 2])
    engine = _engine(tiny_llama, strategy)
    with pytest.warns(UserWarning, match=rf"^the checkpoint's engine state holds its scheduler's state \(the "
                                         rf"'infinite' strategy keeps one\); this run's strategy={strategy!r} keeps "
                                         rf"none and drops it: resume with strategy 'infinite' to keep it$"):
        engine.load_state_dict(saved.state_dict())
    assert engine.rollout_index == saved.rollout_index


def test_an_engine_state_of_a_strategy_that_keeps_none_starts_the_infinite_scheduler_fresh_and_says_so(tiny_llama):
    engine = _engine(tiny_llama, "infinite")
    with pytest.warns(UserWarning, match=r"^the checkpoint's engine state holds no scheduler state \(its strategy "
                                         r"keeps none\); this run's strategy='infinite' starts its scheduler fresh$"):
        engine.load_state_dict({"rollout_index": 4})
    assert engine.rollout_index == 4 and not engine.scheduler.groups


@pytest.mark.parametrize("strategy", ["infinite", "continuous"])
def test_a_scheduler_state_resumed_by_the_same_strategy_says_nothing(tiny_llama, strategy):
    saved = _engine(tiny_llama, strategy)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        _engine(tiny_llama, strategy).load_state_dict(saved.state_dict())


def test_an_engine_given_its_own_scheduler_names_it_not_the_strategy_when_it_drops_or_starts_a_state(tiny_llama):
    """A scheduler given in place of the strategy's (``scheduler=``) is what drops the checkpoint's state or starts
    fresh: the warning names it, and does not tell a run of strategy 'infinite' to resume with strategy 'infinite'."""
    from lit_grpo.scheduling.base import Scheduler
    from lit_grpo.scheduling.least_attained import LeastAttainedScheduler

    model, tokenizer = tiny_llama
    saved = _engine(tiny_llama, "infinite")
    given = RolloutEngine(model, tokenizer, group_size=4, micro_group_size=2, strategy="infinite", max_new_tokens=8,
                          scheduler=Scheduler())
    with pytest.warns(UserWarning, match=r"^the checkpoint's engine state holds its scheduler's state \(the "
                                         r"'infinite' strategy keeps one\); this run's scheduler \(Scheduler, given "
                                         r"in place of strategy 'infinite''s\) keeps none and drops it$"):
        given.load_state_dict(saved.state_dict())
    given = RolloutEngine(model, tokenizer, group_size=4, micro_group_size=2, strategy="micro", max_new_tokens=8,
                          scheduler=LeastAttainedScheduler())
    with pytest.warns(UserWarning, match=r"^the checkpoint's engine state holds no scheduler state \(its strategy "
                                         r"keeps none\); this run's scheduler \(LeastAttainedScheduler, given in "
                                         r"place of strategy 'micro''s\) starts fresh$"):
        given.load_state_dict({"rollout_index": 4})
