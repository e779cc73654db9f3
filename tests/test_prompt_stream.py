"""The training prompt stream over many steps: no drawn prompt lost, none repeated within an epoch, and a run stopped
and resumed from its data state (or a step whose build failed and was redone) draws and trains on exactly what an
uninterrupted run does, across sampler epochs, with partial rollouts, dynamic sampling and the curriculum."""

from __future__ import annotations

import collections
import io
import threading
from concurrent.futures import ThreadPoolExecutor
from types import SimpleNamespace

import pytest
import torch
from datamodule_helpers import datamodule_arguments
from lightning.pytorch.trainer.states import TrainerFn

from lit_grpo import GRPOModule
from lit_grpo.datamodules.rollout import RolloutDataModule

STEPS = 12  # 10 training prompts, 2 a step: five steps a sampler epoch, so the run crosses two epoch boundaries

SETTINGS = {
    "uniform": {},
    "partial": {"over_provision": 2.0, "max_staleness": 1},
    "dynamic": {"dynamic_sampling": True, "max_rollouts_per_step": 3},
    "angle": {"curriculum": "angle"},
}


def half_flat(prompts, completions, **kwargs):
    """A constant reward for the prompts of even numbers (groups without signal, which dynamic sampling drops)."""
    return [1.0 if int(p.split()[2]) % 2 == 0 else float(sum(map(ord, c)) % 5) for p, c in zip(prompts, completions)]


class FailsOnce:
    """``half_flat``, raising at its ``at``-th call (a step whose build fails and is redone)."""

    def __init__(self, at: int):
        self.at, self.calls = at, 0

    def __call__(self, prompts, completions, **kwargs):
        self.calls += 1
        if self.calls == self.at:
            raise RuntimeError("a reward service is down")
        return half_flat(prompts, completions, **kwargs)


@pytest.fixture(scope="module")
def module():
    module = GRPOModule(model="tiny-llama", max_grad_norm=None)
    module.configure_model()
    return module


def _checkpointed(state: dict) -> dict:
    """``state`` through a checkpoint file's round trip (``torch.save``, then ``torch.load(weights_only=True)``)."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


class Stream:
    """A data module's training steps, recording each step's drawn and trained prompt indices; ``resume`` swaps in
    a new data module from the current one's checkpointed state, as a stopped run's resume does."""

    def __init__(self, module, settings: dict, reward=half_flat):
        self.module, self.settings, self.reward = module, settings, reward
        self.drawn: list[list[int]] = []
        self.trained: list[list[int]] = []
        self.unused: list[float] = []  # data/prompts_unused (several ranks)
        self.failures = 0
        self.dm = self._datamodule()

    def _datamodule(self, state: dict | None = None) -> RolloutDataModule:
        """A data module of these settings, from ``state`` (a checkpoint's) where given, recording its draws."""
        dm = RolloutDataModule(**datamodule_arguments({"reward_funcs": [self.reward], **self.settings}))
        if state is not None:
            dm.load_state_dict(state)  # before setup and attach, as Lightning does
        dm.attach(self.module.policy, self.module.tokenizer)
        dm.setup("fit")
        return self._recording(dm)

    def _recording(self, dm: RolloutDataModule) -> RolloutDataModule:
        draw = dm._draw

        def recorded(count):
            prompts = draw(count)
            self._step_drawn.extend(p.index for p in prompts)
            return prompts

        dm._draw = recorded
        return dm

    def step(self) -> None:
        self._step_drawn = []
        try:
            batch = self.dm.build_train_batch()
        except RuntimeError as error:  # the build rolled back: redo the step, as a resume would
            assert "a reward service is down" in str(error)
            self.failures += 1
            return self.step()
        self.drawn.append(self._step_drawn)
        self.trained.append(list(batch.indices))
        self.unused.append(batch.metrics.get("data/prompts_unused", 0.0))

    def resume(self) -> None:
        self.dm = self._datamodule(_checkpointed(self.dm.state_dict()))

    def in_flight(self) -> list[int]:
        """The prompts of the groups carried into the next step (partial rollouts)."""
        return [group.tag.prompt.index for group in self.dm._require_builder().carried]


def _run(module, settings: dict, stop_after: int | None = None, reward=half_flat) -> Stream:
    stream = Stream(module, settings, reward)
    for step in range(STEPS):
        if step == stop_after:
            stream.resume()
        stream.step()
    return stream


@pytest.fixture(scope="module")
def uninterrupted(module):
    """``name`` -> the uninterrupted run of ``SETTINGS[name]``, run once for the module's tests, which only read it
    (a run's draws follow from its settings alone: the resumed and redone runs must match it)."""
    runs = {}

    def run(name: str) -> Stream:
        if name not in runs:
            runs[name] = _run(module, SETTINGS[name])
        return runs[name]

    return run


@pytest.mark.parametrize("name", list(SETTINGS))
def test_a_stopped_and_resumed_stream_draws_and_trains_as_an_uninterrupted_one(module, uninterrupted, name):
    whole = uninterrupted(name)
    for stop_after in (3, 7):  # within the first sampler epoch, and within the second
        resumed = _run(module, SETTINGS[name], stop_after)
        assert resumed.drawn == whole.drawn, stop_after
        assert resumed.trained == whole.trained, stop_after
        assert resumed.in_flight() == whole.in_flight(), stop_after
    assert all(len(set(step)) == len(step) == 2 for step in whole.trained)  # B groups, no prompt twice in a step
    if name == "angle":
        return
    # the uniform sampler: every prompt drawn once a sampler epoch (counts differ by at most one at any time)
    drawn = [prompt for step in whole.drawn for prompt in step]
    counts = collections.Counter(drawn)
    assert set(counts) == set(whole.dm.train_indices) and max(counts.values()) - min(counts.values()) <= 1
    for step, (drawn_now, trained_now) in enumerate(zip(whole.drawn, whole.trained)):
        if name == "partial":  # every drawn group is trained on once: this step or a later one, or still carried
            continue
        assert set(trained_now) <= set(drawn_now), step
        if name == "uniform":
            assert drawn_now == trained_now, step
    if name == "partial":
        returned = [prompt for step in whole.trained for prompt in step] + whole.in_flight()
        assert sorted(returned) == sorted(drawn)
        assert any(set(trained) - set(drawn) for drawn, trained in zip(whole.drawn, whole.trained))  # carried some
    if name == "dynamic":  # some groups were dropped for want of signal, and more prompts drawn instead
        assert len(drawn) > 2 * STEPS


@pytest.mark.parametrize("name", ["uniform", "partial", "dynamic"])
def test_a_step_whose_reward_raised_is_redone_drawing_what_the_uninterrupted_run_drew(module, uninterrupted, name):
    """``on_reward_error: raise``: the failed build gives its draws back (the stream rolls back to the step's start),
    so the redone step draws the same prompts and the run goes on as if it had never failed."""
    whole = uninterrupted(name)
    failing = _run(module, SETTINGS[name], reward=FailsOnce(at=9))
    assert failing.failures == 1
    assert failing.drawn == whole.drawn and failing.trained == whole.trained
    assert failing.in_flight() == whole.in_flight()


# ------------------------------------------------------------------------------------------------ several ranks
WORLD = 2


class Gather:
    """An all_gather between threads, one a rank: ``[world, *shape]``, every rank's tensor in rank order."""

    def __init__(self, world: int):
        self.barrier = threading.Barrier(world, timeout=120)  # a rank that skips a collective fails the test
        self.slots: list[torch.Tensor | None] = [None] * world

    def of_rank(self, rank: int):
        def gather(tensor: torch.Tensor) -> torch.Tensor:
            self.slots[rank] = tensor.detach().clone()
            self.barrier.wait()
            out = torch.stack(self.slots)
            self.barrier.wait()  # every rank has read the slots before any writes the next
            return out
        return gather


class RankStream(Stream):
    """One rank's ``Stream`` under ``WORLD`` ranks (threads): a stand-in trainer names its rank, ``gather`` is the
    ranks' all_gather."""

    def __init__(self, module, settings: dict, rank: int, gather: Gather):
        self.rank, self.gather = rank, gather
        super().__init__(module, settings)

    def _datamodule(self, state: dict | None = None) -> RolloutDataModule:
        dm = RolloutDataModule(**datamodule_arguments({"reward_funcs": [self.reward], **self.settings}))
        dm.trainer = SimpleNamespace(world_size=WORLD, global_rank=self.rank, current_epoch=0, global_step=0,
                                     max_steps=-1, max_epochs=None, state=SimpleNamespace(fn=TrainerFn.FITTING),
                                     lightning_module=self.module)
        if state is not None:
            dm.load_state_dict(state)
        dm.attach(self.module.policy, self.module.tokenizer, world_size=WORLD,
                  all_gather=self.gather.of_rank(self.rank))
        dm.setup("fit")
        return self._recording(dm)


def _checkpoint_of_ranks(streams: list[RankStream]) -> dict:
    """What ``RolloutDataModule.state_dict`` saves under several processes: rank 0's state with every rank's random
    states and engine state (its gather, made here by hand: no process group between threads)."""
    states = [stream.dm.state_dict() for stream in streams]
    state = {key: value for key, value in states[0].items() if key != "engine"}
    state["rng_by_rank"] = [rank_state["rng"] for rank_state in states]
    state["engine_by_rank"] = [rank_state["engine"] for rank_state in states]
    return _checkpointed(state)


def _run_ranks(modules, settings: dict, stop_after: int | None = None) -> list[RankStream]:
    gather = Gather(WORLD)
    streams = [RankStream(module, settings, rank, gather) for rank, module in enumerate(modules)]
    with ThreadPoolExecutor(WORLD) as pool:
        for step in range(STEPS):
            if step == stop_after:
                state = _checkpoint_of_ranks(streams)
                for stream in streams:
                    stream.dm = stream._datamodule(state)
            list(pool.map(lambda stream: stream.step(), streams))
    return streams


@pytest.fixture(scope="module")
def rank_modules():
    modules = []
    for _ in range(WORLD):
        module = GRPOModule(model="tiny-llama", max_grad_norm=None)
        module.configure_model()
        modules.append(module)
    return modules


@pytest.mark.parametrize("name", list(SETTINGS))
def test_under_two_ranks_each_prompt_is_drawn_by_one_rank_and_a_resume_draws_as_the_uninterrupted_run(
        rank_modules, name):
    whole = _run_ranks(rank_modules, SETTINGS[name])
    for step in range(STEPS):
        assert not set(whole[0].drawn[step]) & set(whole[1].drawn[step]), step  # each prompt on one rank
        assert not set(whole[0].trained[step]) & set(whole[1].trained[step]), step
    resumed = _run_ranks(rank_modules, SETTINGS[name], stop_after=5)
    for rank in range(WORLD):
        assert resumed[rank].drawn == whole[rank].drawn, rank
        assert resumed[rank].trained == whole[rank].trained, rank
        assert resumed[rank].in_flight() == whole[rank].in_flight(), rank
    samplers = [stream.dm.sampler.state_dict() for stream in whole]
    if name == "angle":  # the same curriculum on every rank
        assert samplers[0]["mu"] == samplers[1]["mu"] and torch.equal(samplers[0]["order"], samplers[1]["order"])
        assert torch.equal(samplers[0]["generator"], samplers[1]["generator"])
        return
    assert torch.equal(samplers[0]["permutation"], samplers[1]["permutation"])
    assert samplers[0]["position"] == samplers[1]["position"]
    assert torch.equal(samplers[0]["returned"], samplers[1]["returned"])  # the same state on every rank
    # every prompt taken once a sampler epoch, or given back and waiting: counts differ by at most one
    taken = [prompt for stream in whole for step in stream.drawn for prompt in step]
    waiting = [whole[0].dm.train_indices[p] for p in samplers[0]["returned"].tolist()]
    counts = collections.Counter(taken + waiting)
    assert set(counts) == set(whole[0].dm.train_indices) and max(counts.values()) - min(counts.values()) <= 1
    if name == "dynamic":  # ranks asked for different numbers of prompts: what no rank took went back
        assert any(whole[0].unused)
    if name == "partial":
        returned = [p for stream in whole for step in stream.trained for p in step] + [
            p for stream in whole for p in stream.in_flight()]
        assert sorted(returned) == sorted(taken)


# ------------------------------------------------------------------------------------------------ prompts in flight
IN_FLIGHT_STEPS = 15  # the sampler's epoch boundary at step 14 met a prompt whose group from step 13 was carried


def _carried_everywhere(streams) -> set[int]:
    return {prompt for stream in streams for prompt in stream.in_flight()}


@pytest.mark.parametrize("max_staleness", [1, 3])
def test_a_prompt_whose_group_is_carried_is_not_drawn_again(module, max_staleness):
    """Partial rollouts: a fresh draw skips the prompts of the carried groups (a prompt drawn beside its own carried
    group would run twice at once, and could be trained on twice in one batch)."""
    stream = Stream(module, {"over_provision": 2.0, "max_staleness": max_staleness})
    for step in range(IN_FLIGHT_STEPS):
        in_flight = _carried_everywhere([stream])
        stream.step()
        assert not in_flight & set(stream.drawn[-1]), (step, in_flight, stream.drawn[-1])


def test_under_two_ranks_a_prompt_carried_on_any_rank_is_not_drawn_again(rank_modules):
    """The carried groups of every rank are gathered at the end of each step, so a global draw skips them all; a
    resume keeps them (the data state's ``in_flight``)."""
    settings = {"over_provision": 2.0, "max_staleness": 3}
    gather = Gather(WORLD)
    streams = [RankStream(module, settings, rank, gather) for rank, module in enumerate(rank_modules)]
    with ThreadPoolExecutor(WORLD) as pool:
        for step in range(STEPS):
            if step == 6:
                state = _checkpoint_of_ranks(streams)
                for stream in streams:
                    stream.dm = stream._datamodule(state)
            in_flight = _carried_everywhere(streams)
            list(pool.map(lambda stream: stream.step(), streams))
            drawn = {prompt for stream in streams for prompt in stream.drawn[-1]}
            assert not in_flight & drawn, (step, in_flight, drawn)


@pytest.mark.parametrize("state, message", [
    ({"position": 3}, r"^a RequestStream state has unknown keys \['position'\]; it holds nothing$"),
    ([], r"^a RequestStream state must be an empty mapping, not list$"),
])
def test_a_request_streams_state_holds_nothing_and_anything_else_is_refused(state, message):
    """The request stream's position is the data module's (``RolloutDataModule.state_dict``): Lightning saves the
    stream's empty state and gives it back; another loader's state was taken in silence."""
    from lit_grpo.datamodules.requests import RequestStream

    stream = RequestStream("train", 3)
    stream.load_state_dict(stream.state_dict())
    with pytest.raises(ValueError, match=message):
        stream.load_state_dict(state)
    assert [request.step for request in stream] == [0, 1, 2]


def _rng_with(**changes):
    from lit_grpo.datamodules.random_state import get_rng_states

    return {**get_rng_states(), **changes}


@pytest.mark.parametrize("state, message", [
    ({"steps_built": 2, "rollout_index": 3}, r"^a RolloutDataModule state has unknown keys \['rollout_index'\]; it "
                                             r"holds steps_built, rng, rng_by_rank, in_flight, sampler, engine, "
                                             r"engine_by_rank \(each may be absent\)$"),
    ({"steps_built": "2"}, r"^data state steps_built='2' must be an integer >= 0$"),  # was parsed as 2
    ({"steps_built": 2, "in_flight": [3, -1]}, r"^data state in_flight=\[3, -1\] is not allowed; it must be a list "
                                               r"of prompt positions \(integers >= 0\)$"),
    # shown as every check shows a value: a repr of an int of more than 4300 digits failed
    ({"steps_built": 2, "in_flight": [-10**5000]}, r"^data state in_flight=a list holding an int of more than \d+ "
                                                    r"digits is not allowed; it must be a list of prompt positions"),
    # a rank's state that is no list or mapping: a bare TypeError (or dict()'s ValueError) named no key
    ({"steps_built": 2, "engine_by_rank": 5}, r"^data state engine_by_rank=5 is not allowed; it must be a list of "
                                              r"the saving ranks' rollout builder states \(mappings\)$"),
    ({"steps_built": 2, "engine_by_rank": {"rollout_index": 2}},
     r"^data state engine_by_rank=\{'rollout_index': 2\} is not allowed; it must be a list of the saving ranks'"),
    ({"steps_built": 2, "engine_by_rank": 10**5000}, r"^data state engine_by_rank=\(an int of 5001 digits\) is not "
                                                     r"allowed; it must be a list"),
    ({"steps_built": 2, "engine_by_rank": [{}, 5]}, r"^data state engine_by_rank\[1\]=5 is not allowed; it must be a "
                                                    r"rank's rollout builder state \(a mapping\)$"),
    ({"steps_built": 2, "engine_by_rank": ["ab"]}, r"^data state engine_by_rank\[0\]='ab' is not allowed; it must be "
                                                   r"a rank's rollout builder state \(a mapping\)$"),
    ({"steps_built": 2, "engine": 5}, r"^data state engine=5 is not allowed; it must be a rollout builder state \(a "
                                      r"mapping\)$"),
    ({"steps_built": 2, "engine": [("rollout_index", 2)]}, r"^data state engine=\[\('rollout_index', 2\)\] is not "
                                                           r"allowed; it must be a rollout builder state"),
    ({"steps_built": 2, "engine": {"rollout_index": 2, "carried_by_rank": 5}},
     r"^data state engine.carried_by_rank=5 is not allowed; it must be a list of the saving ranks' carried groups$"),
    ({"steps_built": 2, "rng_by_rank": 5}, r"^data state rng_by_rank=5 is not allowed; it must be a list of the "
                                           r"saving ranks' random states$"),
    ({"steps_built": 2, "rng": {"torch": [1, 2, 3]}}, r"^data state rng\['torch'\] is not a random state of torch's "
                                                      r"generator: "),  # torch's error, after python's was set
    ({"steps_built": 2, "rng": lambda: _rng_with(python=[3, [0] * 5, None])},
     r"^data state rng\['python'\] is not a random state of python's random module: "),
    ({"steps_built": 2, "rng": lambda: _rng_with(numpy=["MT19937", [1, 2], 0, 0, 0.0])},
     r"^data state rng\['numpy'\] is not a random state of numpy's global generator: "),
    ({"steps_built": 2, "rng": lambda: _rng_with(cuda="abc")}, r"^data state rng\['cuda'\] is not a random state of "
                                                               r"the CUDA device's generator: "),
    ({"steps_built": 2, "rng": lambda: _rng_with(gpu=[0])}, r"^data state rng has unknown keys \['gpu'\]; it holds "
                                                            r"python, numpy, torch, cuda \(each may be absent\)$"),
])
def test_a_bad_data_state_is_refused_naming_the_bad_key_and_nothing_is_taken(state, message):
    """A corrupt or foreign checkpoint's data state is refused naming what is wrong and what is allowed, before any
    of it is taken (the random states are tried on scratch generators): a count was parsed, and a bad random state
    failed inside numpy or torch after the count, the positions in flight and the other random states were taken."""
    import random

    from lit_grpo.datamodules.random_state import get_rng_states

    data = RolloutDataModule(prompts=["1 + 1", "2 + 2"], val_size=0)
    data.load_state_dict({"steps_built": 5, "in_flight": [1]})
    state = {key: value() if callable(value) else value for key, value in state.items()}
    random.random()
    before = get_rng_states()
    with pytest.raises(ValueError, match=message):
        data.load_state_dict(state)
    held = data.state_dict()  # before setup the loaded state is kept whole, for setup to take
    assert (held["steps_built"], held["in_flight"], "engine" in held) == (5, [1], False)
    after = get_rng_states()
    assert after["python"] == before["python"] and torch.equal(after["torch"], before["torch"])
    assert after["numpy"][1] == before["numpy"][1]
