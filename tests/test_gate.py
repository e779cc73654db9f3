"""The length-aware scheduler's gain gate (lit_grpo/scheduling/length_aware/trust.py): predictions are followed only
where their gain over arrival order is established."""

import math

import torch

from lit_grpo.scheduling import FIFOScheduler, LengthAwareConfig, simulate_rollout
from lit_grpo.scheduling.least_attained import list_makespan
from lit_grpo.scheduling.length_aware import LengthAwareScheduler, PredictionTrust, make_predictor
from lit_grpo.scheduling.length_aware.trust import (draw_lengths, follow_predictions, guided_gain, preposterior_gain,
                                                    probes_pay)

from scheduler_helpers import planted_rollout


def test_list_makespan_runs_jobs_in_column_order_on_the_first_free_slot():
    jobs = torch.tensor([[1.0, 1.0, 1.0, 1.0, 10.0], [10.0, 1.0, 1.0, 1.0, 1.0]], dtype=torch.float64)
    assert list_makespan(jobs, torch.zeros(2, 2, dtype=torch.float64)).tolist() == [12.0, 10.0]
    busy = torch.tensor([[0.0, 5.0], [0.0, 5.0]], dtype=torch.float64)  # slot 1 frees at step 5
    assert list_makespan(jobs, busy).tolist() == [14.0, 10.0]


def test_draws_survive_what_was_generated_and_stay_under_the_cap():
    generator = torch.Generator().manual_seed(0)
    lengths = draw_lengths([100.0, 100.0], [1.0, 1.0], [0, 300], cap=1000, draws=512, generator=generator)
    assert lengths.shape == (512, 2)
    assert lengths[:, 0].min() >= 1 and lengths[:, 1].min() >= 301 and lengths.max() <= 1000
    assert abs(lengths[:, 0].median().log().item() - math.log(100.0)) < 0.15  # the median is the prediction's


def test_follow_predictions_changes_course_only_where_the_other_one_is_established():
    assert follow_predictions(10.0, 5.0) and not follow_predictions(10.0, 20.0) and not follow_predictions(0.0, 0.0)
    assert follow_predictions(-5.0, 10.0, current=True)  # a tie keeps the guided course
    assert not follow_predictions(-20.0, 10.0, current=True)


def test_exact_predictions_pass_and_equal_predictions_give_no_gain():
    lengths = [1, 1, 1, 1, 10]  # arrival order leaves the long job for last
    exact = [(float(n), 1e-6, 0) for n in lengths]
    mean, std = guided_gain(exact, [], 2, 64, expected=[float(n) for n in lengths])
    assert abs(mean - 2.0) < 1e-6 and std < 1e-6 and follow_predictions(mean, std)
    alike = [(3.0, 1.0, 0)] * 5  # no established correlation: every calibrated median is the mean
    assert guided_gain(alike, [], 2, 64, expected=[3.0] * 5) == (0.0, 0.0)


def _noisy_ratio(seed: int, gain_z: float | None, spread: float = 1.5) -> float:
    gen = torch.Generator().manual_seed(seed)
    rollout = planted_rollout(4, 16, generator=gen, max_new_tokens=512, prompt_spread=0.0, sample_spread=0.6)
    scheduler = LengthAwareScheduler(LengthAwareConfig(make_predictor(f"noisy:{spread}", seed=seed), gain_z=gain_z))
    for _ in range(3):  # two rollouts to earn trust, the third measured
        result = simulate_rollout(scheduler, rollout.lengths, 8, 512)
    return result.decode_steps / simulate_rollout(FIFOScheduler(), rollout.lengths, 8, 512).decode_steps


def test_weak_but_trusted_predictions_never_lose_to_continuous():
    # A noisy oracle of spread 1.5 on lengths of spread 0.6 earns trust (rho ~ 0.37) but orders the tail little
    # better than arrival: followed blindly it loses on some rollouts; gated, never.
    assert max(_noisy_ratio(seed, gain_z=None) for seed in range(8)) > 1.0
    assert max(_noisy_ratio(seed, gain_z=1.0) for seed in range(8)) <= 1.0


def test_probes_pay_only_with_a_strong_enough_correlation():
    assert preposterior_gain(16, 32, 256, 4.0, 1.0, 0.9) == (0.0, 0.0)  # a slot for every sample: nothing waits
    mean, std = preposterior_gain(128, 32, 256, 4.0, 0.8, 0.0)
    assert not follow_predictions(mean, std)
    strong, weak = PredictionTrust(), PredictionTrust()
    gen = torch.Generator().manual_seed(0)
    truth = 4.0 + 0.8 * torch.randn(256, generator=gen)
    for t, noise in zip(truth.tolist(), torch.randn(256, generator=gen).tolist()):
        strong.observe(torch.tensor(t + 0.05 * noise).exp().item(), round(torch.tensor(t).exp().item()))
        weak.observe(torch.tensor(t + 3.0 * noise).exp().item(), round(torch.tensor(t).exp().item()))
    assert probes_pay(strong, 128, 32, 256) and not probes_pay(weak, 128, 32, 256)
