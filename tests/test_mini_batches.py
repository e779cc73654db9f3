"""``model.num_mini_batches``: a training step's groups split into that many mini-batches, each an optimizer step
(verl's ppo_mini_batch_size, TRL's steps_per_generation), on the tiny random model (CPU, seconds)."""

import dataclasses

import pytest
import torch

from lit_grpo.datamodules.rollout import RolloutDataModule
from lit_grpo.update.logprobs import completion_logps
from lit_grpo.update.module import GRPOModule
from lit_grpo.update.policy_losses import PolicyLoss

from datamodule_helpers import datamodule_arguments


def make_module(**kwargs) -> GRPOModule:
    module = GRPOModule(**{"model": "tiny-llama", "max_grad_norm": None, **kwargs})
    module.configure_model()
    return module


@pytest.fixture(scope="module")
def batch():
    """B 4 prompts x G 4 completions with a learning signal in every group's pair of mini-batches."""
    module = make_module()
    data = RolloutDataModule(**datamodule_arguments({"prompts_per_step": 4, "reward_funcs": ["char_fraction"]}))
    data.attach(module.policy, module.tokenizer)
    data.setup("fit")
    batch = data.build_train_batch()
    assert batch.num_prompts == 4 and batch.advantages[:2].abs().sum() > 0 and batch.advantages[2:].abs().sum() > 0
    return batch


def groups(batch, start: int, stop: int):
    """The batch of groups ``start`` to ``stop`` only, as a rollout of those prompts alone would hand them over."""
    def cut(value):
        return value[start:stop] if isinstance(value, (torch.Tensor, list)) else value

    fields = {f.name: getattr(batch, f.name) for f in dataclasses.fields(batch)}
    sliced = {name: cut(value) for name, value in fields.items() if name not in ("stats", "metrics")}
    sliced["reward_components"] = {k: cut(v) for k, v in batch.reward_components.items()}
    sliced["columns"] = {k: cut(v) for k, v in batch.columns.items()}
    return dataclasses.replace(batch, **sliced)


class RecordingSGD(torch.optim.SGD):
    """SGD that keeps a copy of the gradients of each step it takes."""

    def __init__(self, params, lr):
        self.named = list(params)
        super().__init__([p for _, p in self.named], lr=lr)
        self.grads: list[dict[str, torch.Tensor]] = []

    def step(self, closure=None):
        self.grads.append({n: p.grad.clone() for n, p in self.named if p.grad is not None})
        return super().step(closure)


def step_grads(module, batch, lr=0.0):
    optimizer = RecordingSGD(module.policy.named_parameters(), lr=lr)
    metrics = module.grpo_step(batch, optimizer)
    return optimizer.grads, metrics


# ------------------------------------------------------------------------------------------------ the steps
def test_each_mini_batch_is_an_optimizer_step_and_each_iteration_passes_over_all(batch):
    """2 mini-batches x 2 iterations: 4 AdamW steps, 4 scheduler steps, and train/lr the mean of their 4 rates."""
    module = make_module(num_mini_batches=2, num_iterations=2, lr=1e-3, warmup_steps=4)
    config = module.configure_optimizers()
    optimizer, scheduler = config["optimizer"], config["lr_scheduler"]["scheduler"]
    metrics = module.grpo_step(batch, optimizer, scheduler)
    steps = {float(state["step"]) for state in optimizer.state.values()}
    assert steps == {4.0} and scheduler.last_epoch == 4
    assert metrics["train/lr"] == pytest.approx(1e-3 * (1 + 2 + 3 + 4) / 4 / 4)


def test_a_fit_counts_the_mini_batches_optimizer_steps_in_global_step_and_the_schedule():
    """max_steps counts optimizer steps: 2 training steps x 2 mini-batches decay the rate over 4 steps, the
    reference syncs every 3 of them (steps 3 and 6 of 2 x 2 x ... : here step 3), and global_step ends at 4."""
    import lightning.pytorch as pl

    from lit_grpo.sampling import SamplingConfig

    rates, steps = [], []

    class Rates(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            rates.append(optimizer.param_groups[0]["lr"])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            steps.append(trainer.global_step)

    pl.seed_everything(0)
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[Rates()])
    module = GRPOModule(model="tiny-llama", loss={"loss_type": "grpo", "beta": 0.1}, lr=1e-3, lr_schedule="linear",
                        num_mini_batches=2, reference_sync={"every_n_steps": 3, "mixup_alpha": 1.0})
    sampling = SamplingConfig(group_size=2, micro_group_size=2, max_new_tokens=4)
    trainer.fit(module, RolloutDataModule(**datamodule_arguments({"val_size": 0, "sampling": sampling})))
    assert steps == [2, 4] and trainer.global_step == 4
    assert rates == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])
    assert not module._reference_is_initial  # synced after optimizer step 3, inside the second training step


def test_a_resumed_fit_goes_on_counting_the_mini_batches_optimizer_steps(tmp_path):
    """A checkpoint after one training step of 2 iterations x 2 mini-batches holds global_step 4; the resumed run
    takes its next training step as optimizer steps 5 to 8, at the rates of a linear decay over its max_steps 8."""
    import lightning.pytorch as pl

    from lit_grpo.sampling import SamplingConfig

    rates, steps = [], []

    class Rates(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            rates.append(optimizer.param_groups[0]["lr"])

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            steps.append((trainer.global_step, trainer.fit_loop.epoch_loop._batches_that_stepped))

    def fit(max_steps, ckpt_path=None):
        pl.seed_everything(0)
        trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=max_steps, logger=False,
                             enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False,
                             limit_val_batches=0, callbacks=[Rates()])
        module = GRPOModule(model="tiny-llama", lr=1e-3, lr_schedule="linear", num_mini_batches=2, num_iterations=2)
        sampling = SamplingConfig(group_size=2, micro_group_size=2, max_new_tokens=4)
        trainer.fit(module, RolloutDataModule(**datamodule_arguments({"val_size": 0, "sampling": sampling})),
                    ckpt_path=ckpt_path)
        return trainer

    fit(4).save_checkpoint(tmp_path / "step4.ckpt")
    assert steps == [(4, 0)] and rates == pytest.approx([1e-3, 7.5e-4, 5e-4, 2.5e-4])
    steps.clear(), rates.clear()
    assert fit(8, tmp_path / "step4.ckpt").global_step == 8
    assert steps == [(8, 1)] and rates == pytest.approx([5e-4, 3.75e-4, 2.5e-4, 1.25e-4])


def test_the_update_peak_is_read_before_each_mini_batchs_optimizer_step_and_the_largest_kept(batch, monkeypatch):
    """On CUDA the allocator's peak is read before every optimizer step (PeakMemoryMonitor resets it inside each, so
    one read at the end would miss an earlier mini-batch's) and the largest is what ``keep_kv_cache: auto`` reads; a
    CPU module stands in for a CUDA one, and a list of readings for the allocator."""
    module = make_module(num_mini_batches=4)
    readings = iter([3 << 20, 7 << 20, 5 << 20, 2 << 20])  # the largest neither the first nor the last read
    monkeypatch.setattr(torch.cuda, "max_memory_allocated", lambda device=None: next(readings))
    monkeypatch.setattr(module, "_device", torch.device("cuda", 0))
    module.grpo_step(batch, torch.optim.SGD(module.policy.parameters(), lr=0.0))
    assert module.measured_update_peak() == 7 << 20
    assert next(readings, None) is None  # one read for each mini-batch


# ------------------------------------------------------------------------------------------------ the normalizers
@pytest.mark.parametrize("loss", [{"loss_type": "grpo"}, {"loss_type": "dapo"}, {"loss_type": "dr_grpo"},
                                  {"loss_type": "bnpo"}, {"loss_type": "cispo", "epsilon_high": 5.0},
                                  {"loss_type": "dapo", "entropy_coef": 0.1, "top_entropy_quantile": 0.5}])
def test_the_first_mini_batchs_gradient_is_a_one_mini_batch_steps_over_its_groups(batch, loss):
    """Every normalizer is the mini-batch's (the loss type's micro-batch weights, dapo's token count, the entropy
    bonus's weight, the high-entropy quantile): the first optimizer step's gradient is that of a plain step over
    the first two groups alone, at the same weights, and the second's is not the whole batch's."""
    split, _ = step_grads(make_module(loss=loss, num_mini_batches=2, train_micro_batch_size=3), batch)
    (alone,), _ = step_grads(make_module(loss=loss, train_micro_batch_size=3), groups(batch, 0, 2))
    (whole,), _ = step_grads(make_module(loss=loss, train_micro_batch_size=3), batch)
    assert len(split) == 2 and split[0].keys() == alone.keys() and len(alone) > 0
    for name in alone:
        torch.testing.assert_close(split[0][name], alone[name], atol=0, rtol=0, msg=name)
    assert any(not torch.allclose(split[0][name], whole[name]) for name in whole)
    # at lr 0 the weights stay: the second step's gradient is the one of the last two groups alone, too
    (second,), _ = step_grads(make_module(loss=loss, train_micro_batch_size=3), groups(batch, 2, 4))
    for name in second:
        torch.testing.assert_close(split[1][name], second[name], atol=0, rtol=0, msg=name)


def test_every_mini_batch_clips_against_the_log_probs_from_before_the_first_step(batch, monkeypatch):
    """The old log-probs of every mini-batch are the rollout's policy's, taken before the first optimizer step:
    the second mini-batch's differ from its current ones (the weights moved), and equal the initial weights'."""
    module = make_module(num_mini_batches=2, lr=0.05)
    with torch.no_grad():
        before = [completion_logps(module.policy, batch.micro_batch(range(start, start + 8)), batch.temperature)[0]
                  for start in (0, 8)]
    handed = []
    call = PolicyLoss.__call__

    def recording(self, logps, old_logps, *args, **kwargs):
        handed.append((logps.detach().clone(), old_logps.clone()))
        return call(self, logps, old_logps, *args, **kwargs)

    monkeypatch.setattr(PolicyLoss, "__call__", recording)
    module.grpo_step(batch, torch.optim.SGD(module.policy.parameters(), lr=0.05))
    assert len(handed) == 2  # one micro-batch of 8 rows in each mini-batch
    for (logps, old), want in zip(handed, before):
        torch.testing.assert_close(old, want, atol=1e-6, rtol=1e-5)
    assert not torch.allclose(handed[1][0], handed[1][1], atol=1e-4)  # the first step moved the weights


# ------------------------------------------------------------------------------------------------ the settings
def test_mini_batches_that_do_not_divide_the_steps_groups_are_refused_naming_both(batch):
    module = make_module(num_mini_batches=3)
    with pytest.raises(ValueError, match=r"model.num_mini_batches=3 must divide the step's groups on each rank, "
                                         r"data.prompts_per_step=4"):
        module.grpo_step(batch, torch.optim.SGD(module.policy.parameters(), lr=0.0))
    for bad in (0, -1, 1.5, True, "2"):
        with pytest.raises(ValueError, match=rf"num_mini_batches={bad!r}"):
            GRPOModule(model="tiny-llama", num_mini_batches=bad)
    # a count too long to print (Python's int-to-str limit) failed in place of the refusal
    with pytest.raises(ValueError, match=r"^model.num_mini_batches=\(an int of 5001 digits\) must divide the step's "
                                         r"groups on each rank, data.prompts_per_step=4"):
        GRPOModule(model="tiny-llama", num_mini_batches=10**5000)._check_mini_batches(4, ValueError)


def test_a_fit_refuses_mini_batches_that_do_not_divide_the_steps_groups_before_its_first_rollout():
    import lightning.pytorch as pl

    from lit_grpo.runtime.validation import ConfigError

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=1, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    data = RolloutDataModule(**datamodule_arguments({"val_size": 0}))
    data.build_train_batch = None  # a rollout would fail otherwise: the refusal must come first
    with pytest.raises(ConfigError, match=r"model.num_mini_batches=4 must divide the step's groups on each rank, "
                                          r"data.prompts_per_step=2"):
        trainer.fit(GRPOModule(model="tiny-llama", num_mini_batches=4), data)


def test_a_fit_whose_max_steps_ends_inside_a_training_step_says_where_it_ends():
    """Lightning stops after whole training steps: max_steps 3 of 2 optimizer steps each runs to global_step 4, which
    its schedule takes as its end; said before the first rollout (verl's and TRL's counts are easily mistaken)."""
    _fit_to_its_max_steps_warning(GRPOModule(model="tiny-llama", num_mini_batches=2),
                                  r"trainer.max_steps=3 is not a multiple of a training step's optimizer steps, 2 "
                                  r"\(model.num_iterations 1 x model.num_mini_batches 2\): the fit runs 2 training "
                                  r"steps, to global_step 4")


def _fit_to_its_max_steps_warning(module: GRPOModule, match: str) -> None:
    """A fit of ``module`` at max_steps 3 warns ``match`` before its first rollout (which fails: none is built)."""
    import lightning.pytorch as pl

    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=3, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0)
    data = RolloutDataModule(**datamodule_arguments({"val_size": 0}))
    data.build_train_batch = None  # no rollout: the warning comes first
    with pytest.warns(UserWarning, match=match), pytest.raises(TypeError):
        trainer.fit(module, data)


def test_a_fit_of_more_iterations_than_python_prints_says_where_it_ends_by_their_digits():
    """A num_iterations of more digits than Python prints (str() raises ValueError past
    sys.get_int_max_str_digits()) is named in the warning of a max_steps inside a training step by its digits, as
    refusals name it, and the fit runs its one training step to that global_step, not to 0: the warning's f-string
    raised ValueError in its place, and the float division of the count ran to 0."""
    from lit_grpo.update.lr_schedule import global_steps_to_run

    huge = 10**5000
    assert global_steps_to_run(3, huge) == huge and global_steps_to_run(10**17 + 1, 1) == 10**17 + 1
    _fit_to_its_max_steps_warning(GRPOModule(model="tiny-llama", num_iterations=huge),
                                  r"trainer.max_steps=3 is not a multiple of a training step's optimizer steps, an "
                                  r"int of 5001 digits \(model.num_iterations an int of 5001 digits x "
                                  r"model.num_mini_batches 1\): the fit runs 1 training steps, to global_step an int "
                                  r"of 5001 digits, where")


def test_a_dynamic_sampling_step_left_short_trains_its_mini_batches_on_the_groups_it_kept():
    """Dynamic sampling whose two rollouts keep at most 1 group of B 4 (the others' rewards all equal): the step is
    filled with dropped groups, and its 2 mini-batches still make 2 optimizer steps a training step, the one holding
    the kept group a step that moves the weights."""
    import lightning.pytorch as pl

    def first_prompt_only(prompts, completions, **columns):
        return [float(len(c) % 3) if "0 + 0" in str(p) else 0.0 for p, c in zip(prompts, completions)]

    grads, steps = [], []

    class Recorder(pl.Callback):
        def on_before_optimizer_step(self, trainer, pl_module, optimizer):
            grads.append(sum(float(p.grad.abs().sum()) for p in pl_module.policy.parameters() if p.grad is not None))

        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            steps.append((trainer.global_step, float(trainer.callback_metrics["reward/frac_zero_std"])))

    pl.seed_everything(0)
    prompts = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(8)]
    data = RolloutDataModule(prompts=prompts, val_size=0, prompts_per_step=4, reward_funcs=[first_prompt_only],
                             dynamic_sampling=True, max_rollouts_per_step=2,
                             sampling={"group_size": 4, "micro_group_size": 4, "max_new_tokens": 6})
    trainer = pl.Trainer(accelerator="cpu", devices=1, max_steps=4, logger=False, enable_checkpointing=False,
                         enable_progress_bar=False, enable_model_summary=False, limit_val_batches=0,
                         callbacks=[Recorder()])
    trainer.fit(GRPOModule(model="tiny-llama", num_mini_batches=2, train_micro_batch_size=4), data)
    assert [step for step, _ in steps] == [2, 4] and trainer.global_step == 4
    # at most 1 kept of the groups its rollouts drew (the second draws only the groups still missing)
    assert all(share >= 6 / 7 for _, share in steps), steps
    # each training step: one mini-batch with the kept group (a gradient), one of fillers alone (none)
    assert [grad > 0 for grad in grads].count(True) == 2 and len(grads) == 4, grads


# ------------------------------------------------------------------------------------------------ ddp
def test_ddp_trains_two_mini_batches_a_step_with_dapos_normalizer_over_both_ranks_mini_batch(tmp_path, eos_model):
    """2 processes, 2 mini-batches of 2 micro-batches a training step: 2 gradient all-reduces a step, global_step
    counts 2 a step, the ranks' weights stay identical, and each optimizer step's dapo normalizer is its
    mini-batch's active tokens over both ranks: at a rate too small to move the weights (a long warm-up) the logged
    gradient norm is the mean of the two mini-batches' norms, recomputed in one process holding both ranks' rows."""
    from tools.step_recorder import read_records
    from two_process_helpers import fit_two_processes

    from lit_grpo.update.sampler_correction import CorrectionStats

    syncs = tmp_path / "syncs"
    record = fit_two_processes(tmp_path, "--model.model", eos_model, "--trainer.strategy", "ddp",
                               "--model.num_mini_batches", "2", "--model.train_micro_batch_size", "2",
                               "--model.warmup_steps", "1000000",
                               "--trainer.callbacks+=tools.step_recorder.StepRecorder",
                               f"--trainer.callbacks.path={syncs}", "--trainer.callbacks.count_grad_syncs=true",
                               "--trainer.callbacks.save_batches=[2]", steps=4)
    ranks = [read_records(record, rank) for rank in (0, 1)]
    assert [r["global_step"] for r in ranks[0]] == [r["global_step"] for r in ranks[1]] == [2, 4]
    for a, b in zip(*ranks):
        assert a["param_sum"] == b["param_sum"] and a["grad_norm"] == b["grad_norm"]
    for rank in (0, 1):
        assert [len(r["grad_syncs"]) for r in read_records(str(syncs), rank)] == [2, 2]  # one per mini-batch

    # the first training step's batches (saved when global_step reached 2)
    batches = [torch.load(f"{syncs}.rank{rank}.step2.pt", weights_only=False) for rank in (0, 1)]
    module = GRPOModule(model=eos_model, loss={"loss_type": "dapo"}, num_mini_batches=2, train_micro_batch_size=2,
                        max_grad_norm=None)
    module.configure_model()
    norms = []
    for index in range(2):
        minis = [module._mini_batches(b)[index] for b in batches]
        total = sum(module._total_active_tokens(micro_batches) for micro_batches in minis)
        grads = []
        for b, micro_batches in zip(batches, minis):
            module._update(b, micro_batches, torch.optim.SGD(module.policy.parameters(), lr=0.0), None, None, total,
                           0, module.sampler_correction.for_batch(False), CorrectionStats())
            grads.append([p.grad.clone() for p in module.policy.parameters()])
        norms.append(float(torch.linalg.vector_norm(torch.stack([torch.linalg.vector_norm(a + b)
                                                                 for a, b in zip(*grads)]))))
    assert norms[0] != pytest.approx(norms[1], rel=1e-3)  # the two mini-batches' steps differ
    assert ranks[0][0]["grad_norm"] == pytest.approx(sum(norms) / 2, rel=1e-4)
