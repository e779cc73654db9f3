"""Sampled validation (``data.val_num_samples: k``): val/mean_at_k and val/pass_at_k beside greedy val/accuracy,
reproducible, and leaving the training stream exactly as it was."""

import math

import lightning.pytorch as pl
import pytest
import torch

from lit_grpo.datamodules.rollout import RolloutDataModule
from lit_grpo.update.held_out import sampled_accuracy_at_k
from lit_grpo.update.module import GRPOModule

from datamodule_helpers import datamodule_arguments


def even_length(prompts, completions, **columns):
    """A correctness signal that varies between samples even for a random model: 1 for an even length."""
    return [float(len(c) % 2 == 0) for c in completions]


def make(module, **kwargs) -> RolloutDataModule:
    dm = RolloutDataModule(**datamodule_arguments({"reward_funcs": [even_length], "accuracy_reward": "even_length",
                                                   "val_size": 4, "val_num_samples": 6, "val_temperature": 1.0,
                                                   **kwargs}))
    dm.attach(module.policy, module.tokenizer)
    dm.setup("fit")
    return dm


@pytest.fixture(scope="module")
def module():
    module = GRPOModule(model="tiny-llama", max_grad_norm=None)
    module.configure_model()
    return module


def test_mean_and_pass_at_k_per_prompt():
    nan = math.nan
    accuracy = torch.tensor([[1.0, 0.0, 0.0], [0.0, 0.0, 0.0], [nan, nan, nan], [1.0, nan, 1.0], [0.5, 0.0, 0.0]])
    mean_at_k, pass_at_k = sampled_accuracy_at_k(accuracy)
    torch.testing.assert_close(mean_at_k, torch.tensor([1 / 3, 0.0, 1.0, 0.5 / 3]))
    torch.testing.assert_close(pass_at_k, torch.tensor([1.0, 0.0, 1.0, 0.5]))


def test_sampled_validation_is_reproducible_and_leaves_training_alone(module):
    dm = make(module)
    first = dm.build_val_batch([0, 1, 2, 3])
    assert first.sampled_accuracy.shape == (4, 6)
    assert first.accuracy.shape == (4, 1)  # the greedy pass is still there
    values = first.sampled_accuracy
    assert 0 < float(values.mean()) < 1, "k samples at temperature 1 should disagree on a random model"
    # exact: the same streams, shapes and kernels in one process draw the same tokens (a determinism claim)
    assert torch.equal(dm.build_val_batch([0, 1, 2, 3]).sampled_accuracy, values)  # the same draws again
    assert torch.equal(make(module).build_val_batch([0, 1, 2, 3]).sampled_accuracy, values)  # in a fresh run

    with_validation = dm.build_train_batch()
    without = make(module).build_train_batch()
    assert torch.equal(with_validation.completion_ids, without.completion_ids)
    assert with_validation.indices == without.indices


def test_a_prompts_sampled_draws_do_not_depend_on_its_batch(module):
    """Keyed by the prompt's index in the dataset, not its place in a batch: a prompt validated alone, or
    later in another batch (another rank's share), draws what it drew in the first batch."""
    dm = make(module)
    together = dm.build_val_batch([0, 1, 2, 3]).sampled_accuracy
    assert torch.equal(dm.build_val_batch([2, 3]).sampled_accuracy, together[2:])
    assert torch.equal(dm.build_val_batch([3, 0]).sampled_accuracy, together[[3, 0]])


def test_one_sample_validates_greedily_only(module):
    dm = make(module, val_num_samples=1)
    assert dm.build_val_batch([0, 1]).sampled_accuracy is None
    with pytest.raises(ValueError, match="val_num_samples"):
        make(module, val_num_samples=0)
    with pytest.raises(ValueError, match="val_temperature"):
        make(module, val_temperature=0.0)
    with pytest.raises(ValueError, match=r"val_temperature must be a finite number >= 1e-05"):
        make(module, val_temperature=1e-9)  # below the engine's smallest temperature: refused when built


def test_validate_logs_mean_and_pass_at_k(module):
    dm = make(module)
    trainer = pl.Trainer(accelerator="cpu", devices=1, logger=False, enable_progress_bar=False,
                         enable_model_summary=False, enable_checkpointing=False)
    (metrics,) = trainer.validate(module, dm)
    assert {"val/accuracy", "val/reward", "val/mean_at_k", "val/pass_at_k"} <= set(metrics)
    mean_at_k, pass_at_k = sampled_accuracy_at_k(dm.build_val_batch([0, 1, 2, 3]).sampled_accuracy)
    assert metrics["val/mean_at_k"] == pytest.approx(float(mean_at_k.mean()))
    assert metrics["val/pass_at_k"] == pytest.approx(float(pass_at_k.mean()))
    assert metrics["val/pass_at_k"] >= metrics["val/mean_at_k"]
