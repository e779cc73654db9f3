"""Async reward functions (``async def``, as TRL's): awaited together on one event loop that lives as long as the
process, their errors named and skipped as a plain function's are."""

import asyncio
import threading

import pytest

from lit_grpo.rollout.async_loop import event_loop
from lit_grpo.rollout.rewards import RewardFunctionError, WeightedReward, score_rewards

PROMPTS, COMPLETIONS = ["p", "p", "q", "q"], ["a", "bb", "ccc", "dddd"]


def test_async_functions_run_together_beside_plain_ones():
    """Each waits until the other has started: awaited one after the other, they would time out."""
    events = {}

    async def meet(name, other, completions):
        events.setdefault(name, asyncio.Event()).set()
        await asyncio.wait_for(events.setdefault(other, asyncio.Event()).wait(), timeout=10)
        return [float(len(c)) for c in completions]

    async def first(prompts, completions, **columns):
        return await meet("first", "second", completions)

    async def second(prompts, completions, **columns):
        return [-v for v in await meet("second", "first", completions)]

    def plain(prompts, completions, **columns):
        return [1.0] * len(completions)

    funcs = [WeightedReward(first, 1.0), WeightedReward(plain, 1.0), WeightedReward(second, 0.5)]
    scores = score_rewards(funcs, PROMPTS, COMPLETIONS, group_size=2)
    assert scores.components["first"].tolist() == [1.0, 2.0, 3.0, 4.0]
    assert scores.components["second"].tolist() == [-1.0, -2.0, -3.0, -4.0]
    assert scores.total.tolist() == [1.5, 2.0, 2.5, 3.0]


def test_one_loop_serves_every_call_off_the_callers_thread():
    """A function may keep loop-bound objects between calls; a caller that runs its own loop is no obstacle."""
    loops = []

    async def remember(prompts, completions, **columns):
        loops.append((asyncio.get_running_loop(), threading.current_thread()))
        return [0.0] * len(completions)

    async def caller_with_a_loop():  # a notebook's running loop in the calling thread
        return score_rewards([WeightedReward(remember, 1.0)], PROMPTS, COMPLETIONS, group_size=2)

    score_rewards([WeightedReward(remember, 1.0)], PROMPTS, COMPLETIONS, group_size=2)
    asyncio.run(caller_with_a_loop())
    assert loops[0] == loops[1] and loops[0][0] is event_loop()
    assert loops[0][1] is not threading.main_thread()


def test_an_async_functions_error_is_named_and_its_groups_skipped_as_a_plain_ones():
    async def picky(prompts, completions, **columns):
        if "q" in prompts:
            raise KeyError("no q")
        return [1.0] * len(completions)

    with pytest.raises(RewardFunctionError, match=r"reward function 'picky' raised KeyError: 'no q' on prompt 1 'q'"):
        score_rewards([WeightedReward(picky, 1.0)], PROMPTS, COMPLETIONS, group_size=2)
    with pytest.warns(UserWarning, match="on_error='skip_group': the group is skipped"):
        scores = score_rewards([WeightedReward(picky, 1.0)], PROMPTS, COMPLETIONS, group_size=2,
                               on_error="skip_group")
    assert scores.skipped_groups == [1] and scores.components["picky"][:2].tolist() == [1.0, 1.0]


def test_an_async_function_returning_a_wrong_value_is_named():
    async def short(prompts, completions, **columns):
        return [1.0]

    with pytest.raises(RewardFunctionError, match=r"reward function 'short' returned 1 values? for 4 completions"):
        score_rewards([WeightedReward(short, 1.0)], PROMPTS, COMPLETIONS, group_size=2)


def test_a_failing_async_functions_locals_are_freed_without_a_garbage_collection():
    """As a plain function's: its errors (the whole batch's and a group's) hold its frames, which must not outlive
    the call in a reference cycle (a reward model's tensors would stay until a collection)."""
    import gc
    import weakref

    class Held:
        pass

    held = []

    async def picky(prompts, completions, **columns):
        local = Held()
        held.append(weakref.ref(local))
        if "q" in prompts:
            raise KeyError("no q")
        return [1.0] * len(completions)

    gc.collect()
    gc.disable()
    try:
        with pytest.warns(UserWarning, match="the group is skipped"):
            score_rewards([WeightedReward(picky, 1.0)], PROMPTS, COMPLETIONS, group_size=2, on_error="skip_group")
        alive = [ref() is not None for ref in held]
    finally:
        gc.enable()
    assert len(held) == 3 and not any(alive), alive
