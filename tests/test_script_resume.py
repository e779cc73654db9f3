"""A resume from a script of one's own (``trainer.fit(model, datamodule=dm, ckpt_path=PATH)``, no ``lit-grpo``) is
checked as ``lit-grpo fit --ckpt_path`` checks it: a checkpoint of another objective or model is refused, naming each
differing setting, before anything of it is taken; other reward functions are warned of once; a validate compares
the weights' settings only; a setting an older release's checkpoint lacks reads as this release's default."""

from __future__ import annotations

import warnings
from types import SimpleNamespace

import lightning.pytorch as pl
import pytest
import torch
from datamodule_helpers import datamodule_arguments

from lit_grpo.datamodules.rollout import RolloutDataModule
from lit_grpo.runtime.checkpoints import SettingsDiffer, check_resumable
from lit_grpo.runtime.validation import ConfigError
from lit_grpo.update.loss_config import LossConfig
from lit_grpo.update.module import GRPOModule


#: The steps of the checkpoint's run; a resume runs one more.
SAVED = 2


def _trainer(max_steps: int) -> pl.Trainer:
    return pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False, enable_checkpointing=False,
                      enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)


def _module(loss_type: str = "grpo", **options) -> GRPOModule:
    return GRPOModule(**{"model": "tiny-llama", "lr": 1e-3, "loss": LossConfig(loss_type=loss_type), **options})


def _data(group_size: int = 2, reward_funcs: tuple = ("char_fraction",), val_size: int = 0) -> RolloutDataModule:
    return RolloutDataModule(**datamodule_arguments({"val_size": val_size, "group_size": group_size,
                                                     "micro_group_size": 2, "max_new_tokens": 4,
                                                     "reward_funcs": list(reward_funcs)}))


@pytest.fixture(scope="module")
def checkpoint(tmp_path_factory):
    """A script's fit of SAVED steps (grpo, G 2, the char_fraction reward), saved by the trainer (its first step's
    rewards tie: the second moves the weights)."""
    pl.seed_everything(0)
    trainer = _trainer(SAVED)
    trainer.fit(_module(), datamodule=_data())
    path = tmp_path_factory.mktemp("script") / "one.ckpt"
    trainer.save_checkpoint(path)
    return path


def _weights(module: GRPOModule) -> dict[str, torch.Tensor]:
    return {name: value.detach().clone() for name, value in module.named_parameters()}


def _other_warnings(caught) -> list[str]:
    return [str(w.message) for w in caught if "other reward functions" in str(w.message)]


@pytest.mark.parametrize("module_options, data_options, differing", [
    ({"loss_type": "dapo"}, {}, "model.loss.loss_type: 'grpo' in the checkpoint, 'dapo' now"),
    ({}, {"group_size": 4}, "data.sampling.group_size: 2 in the checkpoint, 4 now"),
])
def test_a_script_fit_resuming_with_another_objective_is_refused_naming_it_and_keeps_its_weights(
        checkpoint, module_options, data_options, differing):
    module, data = _module(**module_options), _data(**data_options)
    module.configure_model()  # idempotent: the fit keeps this policy, whose weights the refusal must leave alone
    before = _weights(module)
    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)["state_dict"]
    assert any(not torch.equal(saved[name], value) for name, value in before.items())  # a load would show
    trainer = _trainer(SAVED + 1)
    with pytest.raises(ConfigError) as info:
        trainer.fit(module, datamodule=data, ckpt_path=str(checkpoint))
    assert isinstance(info.value.__cause__, SettingsDiffer)
    assert f"\n  {differing}\n" in str(info.value)
    # the text lit-grpo fit --ckpt_path refuses it with
    with pytest.raises(SettingsDiffer) as cli:
        check_resumable(str(checkpoint), module.hparams, data.hparams)
    assert str(info.value) == f"--ckpt_path: {cli.value}"
    after = _weights(module)
    assert all(torch.equal(before[name], after[name]) for name in before)
    assert trainer.global_step == 0


def test_a_script_fit_resuming_with_the_same_settings_goes_on_without_a_warning(checkpoint):
    trainer = _trainer(SAVED + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_module(), datamodule=_data(), ckpt_path=str(checkpoint))
    assert trainer.global_step == SAVED + 1
    assert not [str(w.message) for w in caught if "checkpoint" in str(w.message) and "other" in str(w.message)]


def test_a_script_fit_resuming_with_other_reward_functions_warns_once_and_goes_on(checkpoint):
    trainer = _trainer(SAVED + 1)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(_module(), datamodule=_data(reward_funcs=("char_fraction", "format")),
                    ckpt_path=str(checkpoint))
    [message] = _other_warnings(caught)
    assert message.startswith(f"checkpoint {checkpoint} was trained with other reward functions than this run's:")
    assert "\n  reward 'format': added (weight 1.0 now)\n" in message
    assert trainer.global_step == SAVED + 1


def test_a_script_validate_compares_the_weights_settings_only(checkpoint):
    # another objective: its weights are this model's, so they are validated
    trainer = _trainer(1)
    trainer.validate(_module(loss_type="dapo"), datamodule=_data(group_size=4, val_size=2), ckpt_path=str(checkpoint))
    # another model: refused before its weights are loaded, as lit-grpo validate refuses it
    with pytest.raises(ConfigError) as info:
        _trainer(1).validate(_module(model="tiny-qwen2"), datamodule=_data(val_size=2), ckpt_path=str(checkpoint))
    assert isinstance(info.value.__cause__, SettingsDiffer)
    assert "holds the weights of another model than this run's:\n  model.model: 'tiny-llama' in the checkpoint, " \
           "'tiny-qwen2' now" in str(info.value)


def test_a_setting_an_older_checkpoint_lacks_reads_as_the_modules_default(checkpoint, tmp_path):
    older = torch.load(checkpoint, map_location="cpu", weights_only=True)
    del older["hyper_parameters"]["multi_objective_aggregation"]  # a release before the setting
    path = tmp_path / "older.ckpt"
    torch.save(older, path)
    trainer = _trainer(SAVED + 1)
    trainer.fit(_module(), datamodule=_data(), ckpt_path=str(path))
    assert trainer.global_step == SAVED + 1
    with pytest.raises(ConfigError, match="model.multi_objective_aggregation: 'sum_then_normalize' in the "
                                          "checkpoint, 'normalize_then_sum' now"):
        _trainer(SAVED + 1).fit(_module(multi_objective_aggregation="normalize_then_sum"), datamodule=_data(),
                        ckpt_path=str(path))


def test_the_data_settings_are_not_compared_with_another_data_modules(checkpoint):
    """A data module of one's own has other settings than ``RolloutDataModule``'s: the checkpoint's G is not
    compared with a setting it does not have (it would read as missing, and refuse every resume)."""
    from lit_grpo.runtime.checkpoints import check_loaded_settings

    class OwnData(pl.LightningDataModule):
        def __init__(self, prompts_file: str = "mine.jsonl"):
            super().__init__()
            self.save_hyperparameters()

    loaded = torch.load(checkpoint, map_location="cpu", weights_only=True)
    module = _module()
    trainer = SimpleNamespace(ckpt_path=str(checkpoint), state=SimpleNamespace(fn="fit"), datamodule=OwnData())
    check_loaded_settings(loaded, module, trainer)
    # the module's own settings are compared all the same
    with pytest.raises(ConfigError, match="model.loss.loss_type: 'grpo' in the checkpoint, 'dapo' now"):
        check_loaded_settings(loaded, _module(loss_type="dapo"), trainer)


def test_a_whole_checkpoint_file_whose_weights_fsdp2s_strategy_loaded_itself_resumes(checkpoint):
    """FSDP2's strategy (``ModelParallelStrategy(save_distributed_checkpoint=False)``: one whole file) loads the
    weights into the sharded policy itself and hands ``on_load_checkpoint`` the rest, without ``state_dict``: that
    is no weights-only file, so the same settings resume (a whole file was refused as having no state_dict) and
    other ones are still refused; another strategy's checkpoint without weights is refused naming it."""
    from lightning.pytorch.strategies import ModelParallelStrategy, SingleDeviceStrategy

    from lit_grpo.runtime.checkpoints import check_loaded_settings

    loaded = torch.load(checkpoint, map_location="cpu", weights_only=True)
    del loaded["state_dict"]  # what ModelParallelStrategy.load_checkpoint of a whole file hands the hook
    trainer = SimpleNamespace(ckpt_path=str(checkpoint), state=SimpleNamespace(fn="fit"), datamodule=_data(),
                              strategy=ModelParallelStrategy())
    check_loaded_settings(loaded, _module(), trainer)
    with pytest.raises(ConfigError, match="model.loss.loss_type: 'grpo' in the checkpoint, 'dapo' now"):
        check_loaded_settings(loaded, _module(loss_type="dapo"), trainer)
    trainer.strategy = SingleDeviceStrategy("cpu")
    with pytest.raises(ConfigError, match="it has no state_dict"):
        check_loaded_settings(loaded, _module(), trainer)


@pytest.mark.parametrize("marked, run", [("validate", "fit"), ("fit", "validate")])
def test_a_checkpoint_marked_compared_for_one_kind_of_run_is_compared_for_the_other(checkpoint, marked, run):
    """``mark_settings_checked`` records the path and whether it was compared for a fit (every resume setting) or
    for a validate (the weights' settings only): a mark of the other kind is no comparison of this one."""
    from lit_grpo.runtime.checkpoints import check_loaded_settings, mark_settings_checked

    loaded = torch.load(checkpoint, map_location="cpu", weights_only=True)
    trainer = SimpleNamespace(ckpt_path=str(checkpoint), state=SimpleNamespace(fn=run), datamodule=_data())
    differing = _module(model="tiny-qwen2", loss_type="dapo")  # refused by a fit and by a validate
    mark_settings_checked(differing, checkpoint, evaluate=marked != "fit")
    with pytest.raises(ConfigError, match="model.model: 'tiny-llama' in the checkpoint, 'tiny-qwen2' now"):
        check_loaded_settings(loaded, differing, trainer)
    # marked for this kind of run, spelt otherwise (the real path): not compared again
    mark_settings_checked(differing, checkpoint.parent / "." / checkpoint.name, evaluate=run != "fit")
    check_loaded_settings(loaded, differing, trainer)


def test_a_mark_stands_for_one_load(checkpoint):
    """A mark skips the comparison of the one load it was made for: the same module resuming the same file again
    (another fit of a script, maybe with another data module) is compared."""
    from lit_grpo.runtime.checkpoints import check_loaded_settings, mark_settings_checked

    loaded = torch.load(checkpoint, map_location="cpu", weights_only=True)
    trainer = SimpleNamespace(ckpt_path=str(checkpoint), state=SimpleNamespace(fn="fit"), datamodule=_data())
    module = _module(loss_type="dapo")
    mark_settings_checked(module, checkpoint, evaluate=False)
    check_loaded_settings(loaded, module, trainer)
    with pytest.raises(ConfigError, match="model.loss.loss_type: 'grpo' in the checkpoint, 'dapo' now"):
        check_loaded_settings(loaded, module, trainer)


@pytest.mark.parametrize("weights_only", [None, True])
def test_the_comparison_before_fsdp2s_load_unpickles_the_checkpoint_as_that_load_does(checkpoint, tmp_path,
                                                                                       weights_only):
    """Under FSDP2 a script's fit compares the checkpoint's settings just before the strategy loads it, reading it
    itself: with the load's ``weights_only`` (None: torch's default, True), as the load would, so a file that runs
    code as it is unpickled is refused naming it, that code never run; it ran before a load that refuses it."""
    import os
    import re

    from lightning.pytorch.trainer.states import TrainerFn

    class RunsCode:  # what unpickling it does: makes a folder
        def __reduce__(self):
            return os.mkdir, (str(tmp_path / "ran"),)

    saved = torch.load(checkpoint, map_location="cpu", weights_only=True)
    path = tmp_path / "code.ckpt"
    torch.save({**saved, "extra": RunsCode()}, path)
    loaded = []

    from lightning.pytorch.strategies import ModelParallelStrategy

    class Strategy(ModelParallelStrategy):  # FSDP2's, its load a stand-in
        restore_checkpoint_after_setup, lightning_module = True, None

        def __init__(self):  # nothing set up: only its load is called
            pass

        def load_checkpoint(self, checkpoint_path, weights_only=None):
            loaded.append(checkpoint_path)
            return {}

    strategy, module = Strategy(), _module()
    module._trainer = SimpleNamespace(strategy=strategy, state=SimpleNamespace(fn=TrainerFn.FITTING),
                                      ckpt_path=str(path), datamodule=_data())
    strategy.lightning_module = module
    module._check_sharded_resume()
    refusal = re.escape(f"--ckpt_path: checkpoint {path} cannot be read: UnpicklingError")
    with pytest.raises(ConfigError, match=refusal):
        strategy.load_checkpoint(str(path), weights_only=weights_only)
    assert not (tmp_path / "ran").exists() and loaded == []


def test_only_a_strategy_that_loads_the_weights_itself_is_compared_before_its_load(tmp_path):
    """The check before the load reads FSDP2's header (a folder's meta.pt, or the file); another strategy that
    restores after setup (DeepSpeed's folder, which has no such header) is left to ``on_load_checkpoint``, which
    compares what it loaded: reading the header there refused a checkpoint that loads."""
    from lit_grpo.runtime.checkpoints import check_settings_before_load

    folder = tmp_path / "deepspeed-ckpt"
    folder.mkdir()  # no meta.pt
    module = _module()
    other = SimpleNamespace(strategy=SimpleNamespace(restore_checkpoint_after_setup=True),
                            state=SimpleNamespace(fn="fit"))
    check_settings_before_load(folder, module, other)  # nothing read, nothing refused, nothing marked
    assert not any("checked" in name for name in vars(module))
