"""GAIN-RL curriculum: the Gaussian draw, the mu rule, checkpoints, uniform sampling, bad inputs (the angle score:
test_angle_score.py)."""

from __future__ import annotations

import io
import math

import pytest
import torch

from lit_grpo.datamodules.curriculum import (
    ADJ_MAX_FRACTION,
    N_FRACTION,
    SIGMA_FRACTION,
    AngleCurriculumSampler,
    PromptSampler,
    UniformPromptSampler,
    build_prompt_sampler,
    defer_duplicates,
    usable_avoid,
    gaussian_rank_log_weights,
    gaussian_rank_probs,
    next_mu,
    sample_without_replacement,
)


def chi_square(counts: torch.Tensor, probs: torch.Tensor) -> tuple[float, int]:
    """Pearson's statistic with bins of expected count < 5 pooled into one; returns (statistic, degrees of freedom)."""
    expected = probs * counts.sum()
    small = expected < 5
    obs = torch.cat([counts[~small].double(), counts[small].double().sum().reshape(1)])
    exp = torch.cat([expected[~small], expected[small].sum().reshape(1)])
    keep = exp > 0
    stat = float(((obs[keep] - exp[keep]) ** 2 / exp[keep]).sum())
    return stat, int(keep.sum()) - 1


def chi_square_critical(df: int, z: float = 3.29) -> float:
    """Wilson-Hilferty upper quantile of chi-square(df); z = 3.29 is p = 0.0005."""
    return df * (1 - 2 / (9 * df) + z * math.sqrt(2 / (9 * df))) ** 3


# ------------------------------------------------------------------------------------------------------- draw
def scored_sampler(num_prompts=20, seed=0, **kwargs) -> AngleCurriculumSampler:
    sampler = AngleCurriculumSampler(num_prompts, seed=seed, **kwargs)
    scores = torch.randperm(num_prompts, generator=torch.Generator().manual_seed(123)).float() / num_prompts
    sampler.set_scores(scores)
    return sampler


def test_set_scores_sorts_descending():
    sampler = AngleCurriculumSampler(4)
    sampler.set_scores(torch.tensor([0.2, 0.9, 0.2, 0.5]))
    assert sampler.order.tolist() == [1, 3, 0, 2]  # ties keep the lower index first


def test_ties_keep_the_lower_index_first_however_many_prompts():
    sampler = AngleCurriculumSampler(1000)
    scores = torch.zeros(1000)
    scores[::3] = 1.0
    sampler.set_scores(scores)
    assert sampler.order.tolist() == list(range(0, 1000, 3)) + [i for i in range(1000) if i % 3]


def test_the_rank_gaussian_is_sigma_wide():
    probs = gaussian_rank_probs(41, 20.0, 4.0)
    assert (probs[24] / probs[20]).item() == pytest.approx(math.exp(-0.5))  # one sigma from mu
    assert (probs[12] / probs[20]).item() == pytest.approx(math.exp(-2.0))  # two sigmas


def test_draw_follows_gaussian_over_rank():
    sampler = scored_sampler(20)
    sampler.mu = 6.3
    probs = gaussian_rank_probs(20, 6.3, sampler.sigma)
    torch.testing.assert_close(sampler.rank_probs(), probs)
    log_weights = gaussian_rank_log_weights(20, 6.3, sampler.sigma)

    # draw() is sample_without_replacement over the ranks, mapped to prompts through the sorted order.
    for batch_size in (1, 4):
        replay = torch.Generator()
        replay.set_state(sampler.generator.get_state())
        ranks = sample_without_replacement(log_weights, batch_size, replay)
        assert sampler.draw(batch_size) == sampler.order[ranks].tolist()

    # Single draws follow the Gaussian exactly (many independent draws in one vectorized call).
    generator = torch.Generator().manual_seed(5)
    singles = sample_without_replacement(log_weights.expand(40000, 20), 1, generator)[:, 0]
    counts = torch.bincount(singles, minlength=20)
    stat, df = chi_square(counts, probs)
    assert stat < chi_square_critical(df), (stat, df)
    assert (counts.double() / counts.sum() - probs).abs().max() < 0.01

    # Batches are successive draws without replacement: the 1st follows p, the 2nd sum_i p_i p_j / (1 - p_i).
    batches = sample_without_replacement(log_weights.expand(20000, 20), 4, generator)
    assert (batches.sort(dim=1).values.diff(dim=1) > 0).all()  # no rank twice in a batch
    stat, df = chi_square(torch.bincount(batches[:, 0], minlength=20), probs)
    assert stat < chi_square_critical(df), (stat, df)
    second_probs = (probs[:, None] * probs[None, :] / (1 - probs[:, None])).fill_diagonal_(0).sum(dim=0)
    stat, df = chi_square(torch.bincount(batches[:, 1], minlength=20), second_probs)
    assert stat < chi_square_critical(df), (stat, df)


def test_draw_never_repeats_within_a_batch_even_when_sigma_is_tiny():
    sampler = scored_sampler(20, sigma=0.05)  # weights far from mu underflow as probabilities
    for batch_size in (5, 20):
        for _ in range(50):
            batch = sampler.draw(batch_size)
            assert len(batch) == batch_size and len(set(batch)) == batch_size
    sampler.mu = 10.0
    assert sampler.order[10].item() in sampler.draw(1)  # tiny sigma: the rank at mu is drawn


# ----------------------------------------------------------------------------------------------------- update
def test_next_mu_matches_hand_computed_values():
    common = dict(n=2.0, alpha=2.0, target_accuracy=0.5, adj_min=0.0, adj_max=3.0, num_prompts=20)
    # 2 tanh(2 (0.75 - 0.5)) + 2 tanh(2 * 0.5) = 2 * 0.4621171573 + 2 * 0.7615941560 = 2.4474226266
    assert next_mu(1.0, 0.75, 0.5, **common) == pytest.approx(3.4474226266, abs=1e-8)
    # 2 tanh(-1) + 2 tanh(0) = -1.5232 -> clamped to adj_min 0
    assert next_mu(1.0, 0.0, 0.0, **common) == 1.0
    # 2 tanh(1) + 2 tanh(2) = 1.52318831 + 1.92805516 = 3.45124347 -> clamped to adj_max 3
    assert next_mu(1.0, 1.0, 1.0, **common) == 4.0
    # a negative adj_min lets mu go back, but never below rank 0; never past rank N - 1 either
    assert next_mu(3.0, 0.0, 0.0, **{**common, "adj_min": -5.0}) == pytest.approx(3.0 - 1.52318831, abs=1e-8)
    assert next_mu(1.0, 0.0, 0.0, **{**common, "adj_min": -5.0}) == 0.0
    assert next_mu(18.5, 1.0, 1.0, **common) == 19.0


def test_update_moves_mu_with_normalized_angle():
    sampler = AngleCurriculumSampler(20, n=2.0, alpha=2.0, target_accuracy=0.5, adj_min=0.0, adj_max=3.0)
    sampler.set_scores(torch.linspace(0.1, 0.9, 20))  # min 0.1, max 0.9
    sampler.update(accuracy=0.75, mean_angle=0.5)  # angle (0.5 - 0.1) / 0.8 = 0.5
    assert sampler.mu == pytest.approx(2.4474226266, abs=1e-7)
    assert sampler.metrics() == {"curriculum/mu": pytest.approx(2.4474226266, abs=1e-7), "curriculum/mean_angle": 0.5}
    sampler.update(accuracy=0.0, mean_angle=0.1)  # angle 0: 2 tanh(-1) < 0 -> clamped to 0
    assert sampler.mu == pytest.approx(2.4474226266, abs=1e-7)
    sampler.update(accuracy=1.0, mean_angle=0.9)  # angle 1: 3.4512 -> clamped to 3
    assert sampler.mu == pytest.approx(5.4474226266, abs=1e-7)
    for _ in range(10):
        sampler.update(accuracy=1.0, mean_angle=0.9)
    assert sampler.mu == 19.0


def test_update_default_angle_is_last_batch_mean_score_and_raw_mode():
    sampler = scored_sampler(20, n=2.0, adj_max=100.0)
    batch = sampler.draw(4)
    mean_score = float(sampler.scores[batch].mean())
    assert sampler.metrics()["curriculum/mean_angle"] == pytest.approx(mean_score)
    sampler.update(accuracy=0.5)
    lo, hi = float(sampler.scores.min()), float(sampler.scores.max())
    assert sampler.mu == pytest.approx(2.0 * math.tanh(2.0 * (mean_score - lo) / (hi - lo)), abs=1e-6)

    # Every draw since the last update counts (e.g. dynamic sampling's extra rounds); an update starts afresh.
    first, second = sampler.draw(3), sampler.draw(2)
    assert sampler.metrics()["curriculum/mean_angle"] == pytest.approx(float(sampler.scores[first + second].mean()))
    sampler.update(accuracy=0.5)
    with pytest.raises(RuntimeError, match="needs a draw"):
        sampler.update(accuracy=0.5)

    raw = scored_sampler(20, n=2.0, adj_max=100.0, angle_normalization="none")
    raw.update(accuracy=0.5, mean_angle=0.3)
    # Python floats and math.tanh on both sides (no vectorized kernel): the same double arithmetic, so 1e-12
    assert raw.mu == pytest.approx(2.0 * math.tanh(0.6), abs=1e-12)


def test_default_sizes_scale_with_the_data_set():
    paper = AngleCurriculumSampler(7500)
    assert (paper.n, paper.sigma, paper.adj_max, paper.adj_min) == pytest.approx((500, 1000, 1000, 0))
    for size in (20, 100_000):
        sampler = AngleCurriculumSampler(size)
        assert sampler.n == pytest.approx(N_FRACTION * size)
        assert sampler.sigma == pytest.approx(SIGMA_FRACTION * size)
        assert sampler.adj_max == pytest.approx(ADJ_MAX_FRACTION * size)


def test_needs_scores_schedule():
    once = AngleCurriculumSampler(10)
    assert once.needs_scores(0)
    once.set_scores(torch.rand(10))
    assert not any(once.needs_scores(e) for e in range(1, 50))

    every2 = AngleCurriculumSampler(10, rescore_every_n_epochs=2)
    assert every2.needs_scores(0)
    every2.set_scores(torch.rand(10))  # epoch 0, from the needs_scores call
    assert [every2.needs_scores(e) for e in (1, 2)] == [False, True]
    every2.set_scores(torch.rand(10))  # epoch 2
    assert [every2.needs_scores(e) for e in (3, 4)] == [False, True]
    assert not PromptSampler(5).needs_scores(0) and not UniformPromptSampler(5).needs_scores(3)


def test_draw_or_update_before_scores_fails_clearly():
    sampler = AngleCurriculumSampler(10)
    with pytest.raises(RuntimeError, match="set_scores"):
        sampler.draw(2)
    with pytest.raises(RuntimeError, match="set_scores"):
        sampler.update(0.5, 0.3)


# ------------------------------------------------------------------------------------------------ checkpoints
def roundtrip(state: dict) -> dict:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)  # plain tensors and Python values only


def test_curriculum_state_round_trip_continues_identically():
    sampler = scored_sampler(30, seed=7, rescore_every_n_epochs=3)
    for step in range(5):
        sampler.draw(4)
        sampler.update(accuracy=step / 5)
    state = roundtrip(sampler.state_dict())
    expected = []
    for step in range(6):
        expected.append(sampler.draw(4))
        sampler.update(accuracy=0.8)
    expected_metrics = sampler.metrics()

    resumed = AngleCurriculumSampler(30, seed=999, rescore_every_n_epochs=3)  # the seed is overwritten by the state
    resumed.load_state_dict(state)
    got = []
    for step in range(6):
        got.append(resumed.draw(4))
        resumed.update(accuracy=0.8)
    assert got == expected and resumed.metrics() == expected_metrics
    assert resumed.needs_scores(3) == sampler.needs_scores(3)


def test_uniform_state_round_trip_mid_epoch():
    sampler = UniformPromptSampler(11, seed=3)
    for _ in range(3):
        sampler.draw(4)  # 12 prompts: one epoch boundary crossed
    state = roundtrip(sampler.state_dict())
    expected = [sampler.draw(4) for _ in range(10)]
    resumed = UniformPromptSampler(11, seed=0)
    resumed.load_state_dict(state)
    assert [resumed.draw(4) for _ in range(10)] == expected and resumed.epoch == sampler.epoch


def test_state_of_another_kind_or_size_is_refused():
    with pytest.raises(ValueError, match="kind='UniformPromptSampler'.*kind='AngleCurriculumSampler'"):
        AngleCurriculumSampler(10).load_state_dict(UniformPromptSampler(10).state_dict())
    with pytest.raises(ValueError, match="num_prompts=10 does not match.*num_prompts=12"):
        UniformPromptSampler(12).load_state_dict(UniformPromptSampler(10).state_dict())
    state = {**UniformPromptSampler(10).state_dict(), "num_prompts": 10**5000}
    # a count too long to print (Python's int-to-str limit) failed with str()'s ValueError in place of the refusal
    with pytest.raises(ValueError, match=r"^state num_prompts=\(an int of 5001 digits\) does not match this sampler's "
                                         r"num_prompts=12: "):
        UniformPromptSampler(12).load_state_dict(state)


@pytest.mark.parametrize("change, message", [
    (lambda state: state.update(kind="Garbage"), r"^state kind='Garbage' is not allowed; it must be a prompt "
                                                 r"sampler's, one of \['UniformPromptSampler', "
                                                 r"'AngleCurriculumSampler'\]$"),
    (lambda state: state.update(kind=["UniformPromptSampler"]), r"^state kind=\['UniformPromptSampler'\] is not "
                                                                r"allowed"),
    (lambda state: state.update(num_prompts=10.0), r"^state num_prompts=10.0 must be an integer >= 1$"),
    (lambda state: state.pop("num_prompts"), r"^state num_prompts=None must be an integer >= 1$"),
])
def test_a_corrupt_sampler_kind_or_count_is_a_plain_error_and_another_curriculum_or_count_another_runs_settings(
        change, message):
    """A sampler of another curriculum or over another number of prompts is a checkpoint of other settings (a
    SettingsDiffer, which the CLI says may be another experiment's run); a kind or a count that is no sampler's is a
    corrupt value, said as one."""
    from lit_grpo.runtime.checkpoints import SettingsDiffer

    with pytest.raises(SettingsDiffer, match=r"kind='UniformPromptSampler'.*\(the checkpoint's curriculum='none', this "
                                             r"run's 'angle'\)$"):
        AngleCurriculumSampler(10).load_state_dict(UniformPromptSampler(10).state_dict())
    with pytest.raises(SettingsDiffer, match=r"^state num_prompts=10 does not match this sampler's num_prompts=12"):
        UniformPromptSampler(12).check_state_dict(UniformPromptSampler(10).state_dict())
    state = UniformPromptSampler(10).state_dict()
    change(state)
    with pytest.raises(ValueError, match=message) as refused:
        UniformPromptSampler(10).load_state_dict(state)
    assert not isinstance(refused.value, SettingsDiffer)


def test_a_sampler_states_check_takes_none_of_it():
    saved = UniformPromptSampler(10, seed=3)
    saved.draw(4)
    sampler = UniformPromptSampler(10, seed=3)
    before = sampler.state_dict()
    sampler.check_state_dict(saved.state_dict())
    assert _same_sampler_state(sampler.state_dict(), before)
    assert not _same_sampler_state(saved.state_dict(), before)


def _same_sampler_state(a: dict, b: dict) -> bool:
    """Whether two sampler states are equal, tensors exactly (NaN equal to NaN)."""
    if list(a) != list(b):
        return False
    for key in a:
        x, y = a[key], b[key]
        if isinstance(x, torch.Tensor) or isinstance(y, torch.Tensor):
            if not (isinstance(x, torch.Tensor) and isinstance(y, torch.Tensor) and torch.equal(x, y)):
                return False
        elif not (x == y or (x != x and y != y)):
            return False
    return True


def _changed(key, value):
    return lambda state: state.__setitem__(key, value)


_UNIFORM_KEYS = "kind, num_prompts, generator, epoch, permutation, position, returned"
_ANGLE_KEYS = "kind, num_prompts, generator, mu, scores, order, scored_epoch, drawn, last_angle, asked_epoch"


@pytest.mark.parametrize("curriculum, change, message", [
    ("none", lambda state: state.pop("position"), r"^a UniformPromptSampler state lacks \['position'\]; it holds "
                                                  + _UNIFORM_KEYS + r" \(returned may be absent\)$"),
    ("none", _changed("mu", 3.0), r"^a UniformPromptSampler state has unknown keys \['mu'\]; it holds "),
    ("none", _changed("generator", torch.zeros(3, dtype=torch.uint8)),
     r"^sampler state generator is not a random generator's state \(torch.Generator.get_state\(\)'s\): "),
    ("none", _changed("permutation", torch.tensor([0, 1, 2, 3, 4, 5, 6, 7, 8, 8])),  # was taken: 9 never drawn
     r"^sampler state permutation must be a permutation of the prompt indices 0 to 9, not \[0, 1, 2, 3, 4, 5, 6, 7, "
     r"8, 8\]$"),
    ("none", _changed("permutation", [-1, 1, 2, 3, 4, 5, 6, 7, 8, 9]),
     r"^sampler state permutation must be a permutation of the prompt indices 0 to 9, not \[-1, 1, "),
    ("none", _changed("permutation", [0, 1, 2]), r"^sampler state permutation must be a permutation of the prompt "
                                                 r"indices 0 to 9, not \[0, 1, 2\]$"),
    ("none", _changed("permutation", torch.arange(10.0)), r"^sampler state permutation must be a list or an integer "
                                                          r"tensor of prompt indices, not a torch.float32 tensor$"),
    ("none", _changed("position", 11), r"^sampler state position=11 is not allowed; sampler state position must be "
                                       r"an integer >= 0 and <= 10$"),
    ("none", _changed("epoch", -1), r"^sampler state epoch=-1 is not allowed; sampler state epoch must be an integer "
                                    r">= 0$"),
    ("none", _changed("returned", torch.tensor([3, 10])),  # was taken, and drew a prompt that does not exist
     r"^sampler state returned\[1\]=10 is not allowed; a prompt index is an integer >= 0 and <= 9$"),
    ("angle", _changed("order", None), r"^sampler state scores, order and scored_epoch are all set \(by set_scores\) "
                                       r"or all None, not scores set, order None, scored_epoch set$"),
    ("angle", _changed("scores", torch.ones(9)), r"^sampler state scores must be None or a tensor of 10 finite "
                                                 r"scores, one per prompt, not a torch.float32 tensor shaped \[9\]$"),
    ("angle", _changed("scores", torch.tensor([math.nan] * 10)), r"^sampler state scores must be None or a tensor "
                                                                 r"of 10 finite scores"),
    ("angle", _changed("order", torch.zeros(10, dtype=torch.long)), r"^sampler state order must be a permutation of "
                                                                    r"the prompt indices 0 to 9, not \[0, 0, "),
    ("angle", _changed("mu", 10.0), r"^sampler state mu=10.0 is not allowed; sampler state mu must be a finite number "
                                    r">= 0 and <= 9$"),
    ("angle", _changed("mu", "2"), r"^sampler state mu='2' is not allowed"),  # was parsed as 2.0
    ("angle", _changed("drawn", [1, -1]), r"^sampler state drawn\[1\]=-1 is not allowed; a prompt index is an "
                                          r"integer >= 0 and <= 9$"),
    ("angle", _changed("last_angle", math.inf), r"^sampler state last_angle=inf is not allowed; it must be a finite "
                                                r"number or nan \(no angle yet\)$"),
    ("angle", _changed("scored_epoch", 1.5), r"^sampler state scored_epoch=1.5 is not allowed; sampler state "
                                             r"scored_epoch must be an integer >= 0$"),
    ("angle", _changed("asked_epoch", None), r"^sampler state asked_epoch=None is not allowed"),
    # shown as every check shows a value: a repr of an int of more than 4300 digits failed in place of the refusal
    ("none", _changed("permutation", 10**5000), r"^sampler state permutation=\(an int of 5001 digits\) must be a list "
                                                r"or an integer tensor of prompt indices$"),
    ("none", _changed("permutation", [10**5000, *range(1, 10)]),
     r"^sampler state permutation must be a permutation of the prompt indices 0 to 9, not a list holding an int of "
     r"more than \d+ digits$"),
    ("none", _changed("returned", [10**5000]), r"^sampler state returned\[0\]=\(an int of 5001 digits\) is not "
                                               r"allowed; a prompt index is an integer >= 0 and <= 9$"),
    ("angle", _changed("last_angle", 10**5000), r"^sampler state last_angle=\(an int of 5001 digits\) is not allowed; "
                                                r"it must be a finite number or nan \(no angle yet\)$"),
    ("angle", _changed("scores", [10**5000] * 10), r"^sampler state scores must be None or a tensor of 10 finite "
                                                   r"scores, one per prompt, not a list holding an int of more than "
                                                   r"\d+ digits$"),
])
def test_a_bad_sampler_state_is_refused_naming_the_bad_key_and_the_sampler_is_left_as_it_was(curriculum, change,
                                                                                             message):
    """A corrupt or foreign checkpoint's sampler state is refused naming what is wrong and what is allowed, before
    any of it is taken (the generator's state was set before the rest failed): a permutation that repeats a prompt
    was taken, and that epoch never drew the prompt it left out; an index past the prompts failed at the draw."""
    def sampler():
        made = build_prompt_sampler(curriculum, 10, seed=4)
        if curriculum == "angle":
            made.set_scores(torch.arange(10.0) / 10)
        made.give_back(made.draw(3)[:1])
        return made

    state = sampler().state_dict()
    change(state)
    target = sampler()
    target.draw(2)
    before = target.state_dict()
    with pytest.raises(ValueError, match=message):
        target.load_state_dict(state)
    assert _same_sampler_state(target.state_dict(), before)


def test_a_sampler_state_of_plain_values_resumes_as_the_saved_one():
    """The indices and numbers a checkpoint may hold as lists or numpy numbers (a state written by hand or through
    numpy) load as the tensors' would."""
    import numpy as np

    sampler = scored_sampler(12, seed=2)
    sampler.draw(3)
    state = sampler.state_dict()
    plain = {**state, "scores": state["scores"].tolist(), "order": state["order"].tolist(), "mu": np.float64(0.0),
             "drawn": [np.int64(i) for i in state["drawn"]], "asked_epoch": np.int64(0)}
    resumed = AngleCurriculumSampler(12)
    resumed.load_state_dict(plain)
    assert resumed.draw(3) == sampler.draw(3) and type(resumed.mu) is float


# ---------------------------------------------------------------------------------------------------- uniform
@pytest.mark.parametrize("num_prompts,batch_size", [(10, 3), (12, 4), (7, 7), (5, 1)])
def test_uniform_sees_every_prompt_once_per_epoch(num_prompts, batch_size):
    sampler = UniformPromptSampler(num_prompts, seed=1)
    epochs = 6
    steps = epochs * num_prompts // batch_size
    batches = [sampler.draw(batch_size) for _ in range(steps)]
    assert all(len(set(b)) == batch_size for b in batches)
    stream = [p for b in batches for p in b]
    for e in range(len(stream) // num_prompts):
        assert sorted(stream[e * num_prompts:(e + 1) * num_prompts]) == list(range(num_prompts))
    assert sampler.epoch == (len(stream) - 1) // num_prompts
    assert sampler.metrics() == {}
    sampler.update(0.3, 0.1)  # a no-op


def test_uniform_is_reproducible_by_seed_and_shuffles_each_epoch():
    def stream(seed):
        sampler = UniformPromptSampler(10, seed=seed)
        return [sampler.draw(5) for _ in range(8)]

    assert stream(4) == stream(4)
    assert stream(4) != stream(5)
    batches = stream(4)
    epochs = [batches[2 * e] + batches[2 * e + 1] for e in range(4)]
    assert len({tuple(e) for e in epochs}) > 1  # a new permutation per epoch


def test_uniform_hands_out_what_is_given_back_first_and_never_twice_in_a_batch():
    sampler = UniformPromptSampler(10, seed=2)
    first = sampler.draw(4)
    sampler.give_back(first[1:3])
    second = sampler.draw(4)
    assert second[:2] == first[1:3] and not set(second[2:]) & set(first)  # then the permutation goes on
    # given back across an epoch boundary: a prompt of the old epoch's tail may already wait in the new one
    sampler = UniformPromptSampler(5, seed=0)
    batches = [sampler.draw(4), sampler.draw(4)]  # the second crosses into epoch 1
    sampler.give_back(batches[1])
    batches += [sampler.draw(5) for _ in range(3)]
    assert all(len(set(batch)) == len(batch) for batch in batches)
    used = batches[0] + batches[2] + batches[3] + batches[4]  # the given-back batch was never used
    counts = [used.count(prompt) for prompt in range(5)]
    assert max(counts) - min(counts) <= 1 and sum(counts) == 19, counts  # each prompt once per epoch, 4 epochs


def test_uniform_hands_back_in_the_order_given_across_calls():
    sampler = UniformPromptSampler(10, seed=0)
    first = sampler.draw(4)
    sampler.give_back(first[:2])
    sampler.give_back(first[2:])
    assert sampler.draw(4) == first


def test_a_draw_that_avoids_the_epochs_last_prompts_takes_the_next_epochs_first():
    # the step's earlier draws are exactly the prompts the epoch has left: the batch comes from the next epoch, and
    # the avoided ones, skipped, are handed out first after it (a repeat only where no other prompt is left)
    sampler = UniformPromptSampler(4, seed=0)
    first = sampler.draw(2)
    rest = [prompt for prompt in range(4) if prompt not in first]
    assert sorted(sampler.draw(2, avoid=rest)) == sorted(first) and sampler.epoch == 1
    assert sorted(sampler.draw(2)) == rest


def test_uniform_state_keeps_what_was_given_back():
    sampler = UniformPromptSampler(9, seed=1)
    sampler.give_back(sampler.draw(3)[::2])
    state = roundtrip(sampler.state_dict())
    resumed = UniformPromptSampler(9, seed=1)
    resumed.load_state_dict(state)
    assert [resumed.draw(4) for _ in range(5)] == [sampler.draw(4) for _ in range(5)]
    older = {key: value for key, value in state.items() if key != "returned"}  # a checkpoint from before
    UniformPromptSampler(9).load_state_dict(older)


@pytest.mark.parametrize("curriculum", ["none", "angle"])
def test_unequal_ranks_over_many_steps_lose_no_prompt(curriculum):
    """Two ranks drawing as dynamic sampling and partial rollouts do (a random number of prompts per step, in
    several rounds), ending each step with ``_StepDraw.finish``: the samplers stay equal, no prompt is on both ranks
    in a step, and with the uniform sampler every prompt is used (or still waiting, given back) once per epoch:
    after every step the counts differ by at most one."""
    import random

    from lit_grpo.datamodules.curriculum import build_prompt_sampler
    from lit_grpo.datamodules.rollout import _StepDraw

    samplers = [build_prompt_sampler(curriculum, 23, seed=5) for _ in range(2)]
    if curriculum == "angle":
        for sampler in samplers:
            sampler.set_scores(torch.linspace(0, 1, 23), 0)
    chance, used = random.Random(0), []
    for _ in range(40):
        steps = [_StepDraw(sampler, 3, 2, rank) for rank, sampler in enumerate(samplers)]
        for step in steps:
            for _ in range(chance.randint(1, 3)):  # rounds of this step on this rank
                step.take(chance.randint(1, 3))
        assert not set(steps[0].taken) & set(steps[1].taken)
        draws, taken = [step.draws for step in steps], [len(step.taken) for step in steps]
        assert steps[0].finish(draws, taken) == steps[1].finish(draws, taken)
        assert samplers[0].state_dict().keys() == samplers[1].state_dict().keys()
        probe = samplers[0].draw(6)
        assert probe == samplers[1].draw(6)  # the same state; the probe given back, as if never drawn
        for sampler in samplers:
            sampler.give_back(probe)
        used += steps[0].taken + steps[1].taken
        if curriculum == "none":
            waiting = [p for sampler in samplers[:1] for p in sampler.state_dict()["returned"].tolist()]
            counts = [(used + waiting).count(prompt) for prompt in range(23)]
            assert max(counts) - min(counts) <= 1, counts


def test_the_curriculums_feedback_is_the_correct_share_else_the_mean_reward_within_0_and_1():
    from lit_grpo.datamodules.rollout import curriculum_accuracy

    # [correct, judged, reward sum, rewarded]
    assert curriculum_accuracy(torch.tensor([3.0, 4.0, 10.0, 8.0])) == 0.75
    assert curriculum_accuracy(torch.tensor([0.0, 0.0, 3.0, 4.0])) == 0.75  # no correctness: the mean reward
    assert curriculum_accuracy(torch.tensor([0.0, 0.0, 12.0, 8.0])) == 1.0
    assert curriculum_accuracy(torch.tensor([0.0, 0.0, -2.0, 8.0])) == 0.0
    assert curriculum_accuracy(torch.zeros(4)) is None  # nothing scored: no information, not accuracy 0


def test_a_step_with_nothing_scored_leaves_the_curriculum_where_it_is(recwarn):
    """Every reward function returned None for every completion: the step carries no accuracy, so mu stays (fed
    0.0 it moved by the gap to the target accuracy on no evidence), the step's draws are forgotten, and the next
    scored step moves mu by its own accuracy and prompts."""
    from lit_grpo.datamodules.rollout import RolloutDataModule
    from lit_grpo.runtime.models import load_model_and_tokenizer

    opinions = []

    def judge(prompts, completions, **kwargs):
        return [opinions[-1]] * len(completions)

    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    data = RolloutDataModule(prompts=[f"q{i} " * (i + 1) for i in range(12)], val_size=0, prompts_per_step=2,
                             curriculum="angle", curriculum_kwargs={"n": 2.0, "adj_min": -5.0},
                             reward_funcs=[judge], sampling={"group_size": 2, "max_new_tokens": 2})
    data.attach(model, tokenizer)
    data.setup("fit")
    data.sampler.mu = 5.0
    opinions.append(None)
    data.build_train_batch()
    assert data.sampler.mu == 5.0 and data.sampler.drawn == []
    opinions.append(1.0)
    data.build_train_batch()
    assert data.sampler.mu > 5.0  # accuracy 1 against the target 0.5, whatever the angle (adj_min -5)
    sampler, mu = data.sampler, data.sampler.mu
    sampler.draw(2)
    sampler.update(None, mean_angle=0.25)  # several ranks: the whole step's mean angle, still what is logged
    assert sampler.mu == mu and sampler.drawn == [] and sampler.metrics()["curriculum/mean_angle"] == 0.25


def test_the_curriculums_feedback_over_ranks_is_the_whole_steps():
    """Several ranks: the step's accuracy and mean angle are over every rank's completions and prompts taken (one
    gather of the sums), not a rank's own, nor a sum of the ranks'."""
    from types import SimpleNamespace

    from lit_grpo.datamodules.rollout import RolloutDataModule, _StepDraw

    data = RolloutDataModule(prompts=[f"q{i}" for i in range(12)], val_size=0, prompts_per_step=2,
                             curriculum="angle", reward_funcs=["char_fraction"])
    data.setup("fit")
    data.sampler.set_scores(torch.linspace(0, 1, 12), 0)
    data._step_draw = step = _StepDraw(data.sampler, 2, 2, 0)  # rank 0 of 2
    taken = step.take(2)
    other = step.drawn[0][2:]  # rank 1's share of the draw, which it took
    rank_1 = torch.tensor([3.0, 4.0, 0.0, 0.0, float(data.sampler.scores[other].double().sum()), 2.0, 1.0, 2.0, 0.0],
                          dtype=torch.float64)  # 3 of 4 correct; its angles, their count, draws, prompts taken, carried
    data._handover = {"all_gather": lambda local: torch.stack([local, rank_1])}
    batch = SimpleNamespace(accuracy_sums=lambda: torch.tensor([1.0, 4.0, 0.0, 0.0], dtype=torch.float64))
    accuracy, mean_angle, unused = data._finish_step(batch)
    assert accuracy == pytest.approx(4 / 8) and unused == 0
    assert mean_angle == pytest.approx(float(data.sampler.scores[taken + other].double().mean()))


def test_the_end_of_a_step_over_ranks_gathers_every_ranks_carried_groups_and_gives_back_what_none_took():
    """Several ranks: the positions every rank carries are gathered (padded to the longest rank's list) into what
    the next step's draws avoid, and the part of a draw no rank took goes back to the sampler."""
    from types import SimpleNamespace

    from lit_grpo.datamodules.rollout import RolloutDataModule, _StepDraw

    data = RolloutDataModule(prompts=[f"q{i}" for i in range(12)], val_size=0, prompts_per_step=2,
                             reward_funcs=["char_fraction"])
    data.setup("fit")
    data._step_draw = step = _StepDraw(data.sampler, 2, 2, 0)  # rank 0 of 2
    step.take(2)
    rank_1 = torch.tensor([0.0, 0.0, 2.0, 4.0, 0.0, 0.0, 1.0, 1.0, 2.0], dtype=torch.float64)  # took 1, carries 2
    gathered = []

    def all_gather(local):
        gathered.append(local.clone())
        other = torch.tensor([9, 5]) if local.dtype == torch.long else rank_1
        return torch.stack([local, other])

    data._handover = {"all_gather": all_gather}
    data._carried_positions = lambda: [3]
    batch = SimpleNamespace(accuracy_sums=lambda: torch.tensor([0.0, 0.0, 1.0, 4.0], dtype=torch.float64))
    accuracy, mean_angle, unused = data._finish_step(batch)
    assert data._in_flight == [3, 5, 9] and gathered[1].tolist() == [3, -1]
    assert unused == 1 and data._step_draw is None
    assert accuracy == pytest.approx(3 / 8) and mean_angle is None


def test_a_draw_avoids_as_many_earlier_draws_as_leave_a_batch():
    """All of ``avoid`` where a batch is left without it; where not, its lowest indices, so every rank (same
    avoid, same order) skips the same ones and the draw repeats as few as it must."""
    assert usable_avoid([5, 1, 3], num_prompts=8, batch_size=4) == {1, 3, 5}
    assert usable_avoid([5, 1, 3, 7, 0], num_prompts=8, batch_size=4) == {0, 1, 3, 5}
    assert usable_avoid([2, 0], num_prompts=4, batch_size=4) == set()
    sampler = UniformPromptSampler(num_prompts=6, seed=0)
    assert set(sampler.draw(4, avoid=[0, 1, 2, 3])) == {2, 3, 4, 5}


@pytest.mark.parametrize("num_prompts, batch_size, draws", [(7, 3, 3), (10, 4, 3), (5, 2, 3)])
def test_steps_that_must_repeat_prompts_still_see_every_prompt_once_per_epoch(num_prompts, batch_size, draws):
    """A step whose draws (dynamic sampling's rounds, or several ranks') need more prompts than there are repeats
    the epoch's next ones: every prompt comes round as often as the others, and nothing piles up to hand out later
    (the lowest-index rule of ``usable_avoid`` alone repeated the highest indices, and the queue grew each step)."""
    sampler = UniformPromptSampler(num_prompts, seed=0)
    stream = []
    for _ in range(60):
        step: list[int] = []
        for _ in range(draws):
            batch = sampler.draw(batch_size, avoid=step)
            assert len(set(batch)) == batch_size
            step += batch
        stream += step
    for e in range(len(stream) // num_prompts):
        assert sorted(stream[e * num_prompts:(e + 1) * num_prompts]) == list(range(num_prompts))
    assert len(sampler.state_dict()["returned"]) <= num_prompts


def test_defer_duplicates_keeps_a_permutation():
    assert defer_duplicates([3, 0, 4, 1, 2], avoid={3, 4}, needed=2) == [0, 1, 3, 4, 2]


def test_base_sampler_draws_distinct_reproducible_batches():
    a, b = PromptSampler(9, seed=2), PromptSampler(9, seed=2)
    draws = [a.draw(4) for _ in range(20)]
    assert draws == [b.draw(4) for _ in range(20)]
    assert all(len(set(d)) == 4 and all(0 <= i < 9 for i in d) for d in draws)
    assert a.metrics() == {}


# ------------------------------------------------------------------------------------------------- bad inputs
@pytest.mark.parametrize("kwargs,message", [
    (dict(sigma=0), r"sigma=0 is not allowed.*> 0"),
    (dict(sigma=-1.5), r"sigma=-1.5 is not allowed.*> 0"),
    (dict(sigma=float("nan")), r"sigma=nan is not allowed.*finite"),
    (dict(n=-1), r"n=-1 is not allowed.*>= 0"),
    (dict(target_accuracy=1.5), r"target_accuracy=1.5 is not allowed.*<= 1"),
    (dict(adj_min=5.0, adj_max=1.0), r"adj_min=5 is not allowed with adj_max=1"),
    (dict(rescore_every_n_epochs=0), r"rescore_every_n_epochs=0 is not allowed.*>= 1"),
    (dict(angle_normalization="zscore"), r"angle_normalization='zscore' is not known.*\['minmax', 'none'\]"),
])
def test_bad_curriculum_options_raise(kwargs, message):
    with pytest.raises(ValueError, match=message):
        AngleCurriculumSampler(20, **kwargs)


@pytest.mark.parametrize("sampler", [PromptSampler(6), UniformPromptSampler(6), scored_sampler(6)],
                         ids=["base", "uniform", "angle"])
def test_bad_batch_sizes_raise(sampler):
    with pytest.raises(ValueError, match=r"batch_size=7 is not allowed.*>= 1 and <= 6"):
        sampler.draw(7)
    with pytest.raises(ValueError, match=r"batch_size=0 is not allowed.*>= 1 and <= 6"):
        sampler.draw(0)
    with pytest.raises(ValueError, match=r"batch_size=2.0 is not allowed.*integer"):
        sampler.draw(2.0)


def test_bad_names_and_values_raise():
    with pytest.raises(ValueError, match=r"curriculum='gain' is not known.*\['none', 'angle'\]"):
        build_prompt_sampler("gain", 10)
    with pytest.raises(ValueError, match=r"curriculum='none' takes no options.*\['sigma'\]"):
        build_prompt_sampler("none", 10, sigma=2.0)
    with pytest.raises(ValueError, match=r"curriculum_kwargs=\['sigmaa'\] are not options of curriculum='angle'; "
                                         r"its options: \['n', 'alpha', 'target_accuracy', 'sigma', "):
        build_prompt_sampler("angle", 10, sigmaa=2.0)
    from lit_grpo.datamodules.curriculum import check_curriculum_options

    # YAML keys 1 and x: each shown as what it is (str() showed the int as the text '1')
    with pytest.raises(ValueError, match=r"curriculum_kwargs=\[1, 'x'\] are not options"):
        check_curriculum_options("angle", {1: 2, "x": 3})
    # a key too long to print (Python's int-to-str limit) failed with str()'s ValueError in place of the refusal
    with pytest.raises(ValueError, match=r"^curriculum_kwargs=\[an int of 5001 digits, 'x'\] are not options of "
                                         r"curriculum='angle'; its options: \['n', "):
        check_curriculum_options("angle", {10**5000: 2, "x": 3})
    with pytest.raises(ValueError, match=r"^curriculum='none' takes no options, got \[an int of 5001 digits, "
                                         r"'sigma'\]; they apply to curriculum='angle' only$"):
        check_curriculum_options("none", {10**5000: 2, "sigma": 3})
    from lit_grpo.datamodules.curriculum import check_curriculum_settings

    # a repr of an int of more than 4300 digits failed in place of the refusal
    with pytest.raises(ValueError, match=r"^curriculum_kwargs=\(an int of 5001 digits\) must be a mapping of the "
                                         r"curriculum's options or None$"):
        check_curriculum_settings("angle", 10**5000, 8)
    with pytest.raises(ValueError, match=r"num_prompts=0 is not allowed.*>= 1"):
        UniformPromptSampler(0)
    sampler = scored_sampler(10)
    with pytest.raises(ValueError, match=r"accuracy=1.5 is not allowed.*>= 0 and <= 1"):
        sampler.update(1.5)
    with pytest.raises(ValueError, match=r"scores of shape \(9,\) are not allowed.*\(10,\)"):
        sampler.set_scores(torch.rand(9))
    with pytest.raises(ValueError, match=r"non-finite values at prompts \[3\]"):
        sampler.set_scores(torch.rand(10).index_fill_(0, torch.tensor([3]), float("nan")))
    assert isinstance(build_prompt_sampler("none", 10), UniformPromptSampler)
    angle = build_prompt_sampler("angle", 10, seed=1, sigma=3.0)
    assert isinstance(angle, AngleCurriculumSampler) and angle.sigma == 3.0


def test_a_sampler_state_over_another_number_of_prompts_is_refused_by_name():
    saved = build_prompt_sampler("none", 10, seed=0).state_dict()
    with pytest.raises(ValueError, match=r"state num_prompts=10 does not match this sampler's num_prompts=8: the "
                                         r"checkpoint drew from another set of training prompts"):
        build_prompt_sampler("none", 8, seed=0).load_state_dict(saved)
