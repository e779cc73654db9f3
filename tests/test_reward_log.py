"""What reward functions log (TRL's ``log_metric`` and ``log_extra``): collected per call, refused when malformed,
logged as ``reward/<name>`` by a fit (the whole step's over ranks) and shown as columns of CompletionLogger's table."""

import math

import pytest
import torch

from lit_grpo.callbacks.completion_logger import sample_table
from lit_grpo.rollout.rewards import WeightedReward, score_rewards
from two_process_helpers import fit_two_processes


def logging_reward(prompts, completions, log_metric, log_extra, **columns):
    """Scores each completion's length; logs the call's mean length and each completion's first character."""
    lengths = [float(len(c)) for c in completions]
    log_metric("call_length", sum(lengths) / len(lengths))
    log_extra("first", [c[:1] for c in completions])
    return lengths


def rank_logging_reward(prompts, completions, completion_length, log_metric, log_extra, **columns):
    """Weight 0 beside the config's rewards: logs each call's mean completion tokens, a metric rank 0 alone logs,
    and each completion's rank."""
    rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
    log_metric("call_tokens", sum(completion_length) / len(completion_length))
    if rank == 0:
        log_metric("rank0_only", 3.0)
    log_extra("rank", [rank] * len(completions))
    return [0.0] * len(completions)


def test_logged_metrics_and_columns_reach_the_scores():
    async def judged(prompts, completions, log_metric, **columns):  # an async function logs as a plain one
        log_metric("judge_calls", 1)
        log_metric("judge_calls", True)  # bools and NumPy / torch scalars are numbers, as rewards are
        log_metric("unparsed_share", math.nan)  # a diagnostic's NaN is logged as it is, as TRL does
        log_metric("blowup", -10**400)  # an int beyond float range: as the float it overflows to
        return [1.0] * len(completions)

    scores = score_rewards([WeightedReward(logging_reward), WeightedReward(judged)], ["p"] * 4,
                           ["ab", "c", "def", "gh"], group_size=2)
    expected = {"call_length": [2.0], "judge_calls": [1.0, 1.0], "unparsed_share": [math.nan], "blowup": [-math.inf]}
    # key by key: pytest 9.2's approx refuses a mapping whose values are lists
    assert scores.logs.metrics.keys() == expected.keys()
    for key, values in expected.items():
        assert scores.logs.metrics[key] == pytest.approx(values, nan_ok=True), key
    assert scores.logs.extras == {"first": ["a", "c", "d", "g"]}
    assert scores.total.tolist() == [3.0, 2.0, 4.0, 3.0]


def test_a_call_that_raises_logs_nothing_and_its_groups_calls_do():
    """The whole batch's call raises after logging: its logs are dropped; the retry one group at a time logs per
    group, and a group it still fails on (skipped) leaves its rows' column empty."""
    def flaky(prompts, completions, log_metric, log_extra, **columns):
        log_metric("calls", float(len(completions)))
        log_extra("seen", list(completions))
        if "bad" in completions:
            raise ValueError("bad completion")
        return [1.0] * len(completions)

    with pytest.warns(UserWarning, match="skipped"):
        scores = score_rewards([WeightedReward(flaky)], ["p"] * 6, ["a", "b", "bad", "c", "d", "e"], group_size=2,
                               on_error="skip_group")
    assert scores.skipped_groups == [1]
    assert scores.logs.metrics == {"calls": [2.0, 2.0]}  # groups 0 and 2; neither the batch's call nor group 1's
    assert scores.logs.extras == {"seen": ["a", "b", None, None, "d", "e"]}


def test_tensor_and_numpy_values_of_a_column_are_kept_and_shown_as_python_values():
    """A column given as a tensor, or holding tensors and NumPy scalars, keeps their Python values: the table shows
    ``0.500``, not ``tensor(0.5000)``."""
    from types import SimpleNamespace

    import numpy as np

    def scored(prompts, completions, log_extra, **columns):
        log_extra("score", torch.tensor([0.5, 0.25]))
        log_extra("count", [np.int64(3), torch.tensor(2)])
        log_extra("pair", [torch.tensor([1, 2]), np.array([3.5, 4.0])])
        return [0.0] * len(completions)

    extras = score_rewards([WeightedReward(scored)], ["p"] * 2, ["a", "b"], group_size=2).logs.extras
    assert extras == {"score": [0.5, 0.25], "count": [3, 2], "pair": [[1, 2], [3.5, 4.0]]}
    assert [type(v) for column in extras.values() for v in column] == [float, float, int, int, list, list]
    batch = SimpleNamespace(prompts=["p"], completions=[["a", "b"]], completion_lengths=torch.tensor([[1, 1]]),
                            truncated=torch.tensor([[False, False]]), rewards=torch.zeros(1, 2),
                            reward_extras={column: [values] for column, values in extras.items()})
    table = sample_table(batch, num_prompts=1, num_completions=2, max_chars=40)
    assert table.splitlines()[2] == "| p | 0 | 0.000 | 1 | 0.500 | 3 | \\[1, 2\\] | a |"
    assert "tensor" not in table


@pytest.mark.parametrize("body, match", [
    (lambda m, e, n: m("loss", "0.5"), r"log_metric\('loss', '0.5'\); the value must be one number"),
    (lambda m, e, n: m("loss", [0.5]), r"log_metric\('loss', \[0.5\]\); the value must be one number"),
    # Python refuses to print an int of more than 4300 digits: the message said only that
    (lambda m, e, n: m("loss", [10**5000]), r"log_metric\('loss', a list holding an int of more than 4300 digits\); "
                                            r"the value must be one number"),
    (lambda m, e, n: m("", 1.0), r"log_metric with the name ''; it must be a non-empty string"),
    (lambda m, e, n: m(10**5000, 1.0), r"log_metric with the name an int of 5001 digits; it must be a non-empty "),
    (lambda m, e, n: e(10**5000, [0] * n), r"log_extra with the column an int of 5001 digits; it must be a "),
    (lambda m, e, n: m("x/", 1.0), r"with the name 'x/'"),
    (lambda m, e, n: m("mean", 1.0), r"log_metric names \['mean'\] would be logged as \['reward/mean'\]"),
    (lambda m, e, n: m("f/mean", 1.0), r"names \['f/mean'\] would be logged as \['reward/f/mean'\]"),
    (lambda m, e, n: e("why", ["x"] * (n - 1)), r"log_extra\('why', \.\.\.\) with 3 values; it must give one value "
                                                 r"per completion of the call \(4\)"),
    (lambda m, e, n: e("why", "abcd"), r"with str 'abcd'"),
    (lambda m, e, n: e("reward", [0] * n), r"the column 'reward'; it must be a non-empty string other than"),
    (lambda m, e, n: (e("why", [0] * n), e("why", [1] * n)), r"log_extra\('why', \.\.\.\) twice in one call"),
])
def test_malformed_logs_are_refused_naming_the_value(body, match):
    def f(prompts, completions, log_metric, log_extra, **columns):
        body(log_metric, log_extra, len(completions))
        return [0.0] * len(completions)

    with pytest.raises(Exception, match=match):
        score_rewards([WeightedReward(f)], ["p"] * 4, ["x"] * 4, group_size=4)  # raising: a reward's error


def test_two_functions_filling_one_column_and_a_column_named_as_a_keyword_are_refused():
    def a(prompts, completions, log_extra, **columns):
        log_extra("why", ["a"] * len(completions))
        return [0.0] * len(completions)

    def b(prompts, completions, log_extra, **columns):
        log_extra("why", ["b"] * len(completions))
        return [0.0] * len(completions)

    def none(prompts, completions, log_extra, **columns):  # a column whose values are all None is logged still
        log_extra("why", [None] * len(completions))
        return [0.0] * len(completions)

    for first in (a, none):
        with pytest.raises(ValueError, match=rf"the column 'why' was logged by two reward functions \('b' and "
                                             rf"'{first.__name__}'\)"):
            score_rewards([WeightedReward(first), WeightedReward(b)], ["p"] * 2, ["x"] * 2, group_size=2)
    with pytest.raises(ValueError, match=r"a column is named 'log_metric'"):
        score_rewards([WeightedReward(a)], ["p"] * 2, ["x"] * 2, {"log_metric": [1, 2]}, group_size=2)


def test_a_fit_logs_the_steps_mean_and_the_table_shows_the_column(tmp_path):
    """``reward/call_length`` is the mean of the step's calls' values (dynamic sampling: several calls a step);
    the batch carries each completion's logged value for CompletionLogger's table."""
    from lightning.pytorch import Trainer

    from lit_grpo.datamodules.rollout import RolloutDataModule
    from lit_grpo.update.module import GRPOModule

    calls = []

    def recorded(prompts, completions, log_metric, log_extra, **columns):
        calls.append(sum(len(c) for c in completions) / len(completions))
        return logging_reward(prompts, completions, log_metric, log_extra)

    batches = []

    from lightning.pytorch.callbacks import Callback

    class KeepBatches(Callback):
        def on_train_batch_end(self, trainer, pl_module, outputs, batch, batch_idx):
            batches.append((batch, trainer.callback_metrics["reward/call_length"].item()))

    prompts = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(8)]
    data = RolloutDataModule(prompts=prompts, val_size=0, prompts_per_step=2, reward_funcs=[recorded],
                             sampling={"group_size": 2, "max_new_tokens": 4}, dynamic_sampling=True,
                             max_rollouts_per_step=2)
    trainer = Trainer(max_steps=2, logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      limit_val_batches=0, default_root_dir=tmp_path, enable_model_summary=False,
                      callbacks=[KeepBatches()])
    trainer.fit(GRPOModule(model="tiny-llama"), datamodule=data)
    (first, logged_first), (second, logged_second) = batches
    rounds = [int(b.metrics["rollout/rollouts_per_step"]) for b, _ in batches]
    assert logged_first == pytest.approx(sum(calls[:rounds[0]]) / rounds[0])
    assert logged_second == pytest.approx(sum(calls[rounds[0]:]) / rounds[1])
    for batch, _ in batches:
        assert batch.reward_extras["first"] == [[c[:1] for c in group] for group in batch.completions]
    table = sample_table(first, num_prompts=1, num_completions=2, max_chars=40)
    assert table.splitlines()[0] == "| prompt | k | reward | length | first | completion |"


def test_a_validation_logs_what_its_reward_calls_log_under_val(tmp_path):
    """As TRL logs an evaluation's ``log_metric`` values (``eval_<name>``): ``val/reward/<name>`` is the mean of
    every value validation's reward calls logged, over its batches."""
    from lightning.pytorch import Trainer

    from lit_grpo.datamodules.rollout import RolloutDataModule
    from lit_grpo.update.module import GRPOModule

    calls = []

    def recorded(prompts, completions, log_metric, log_extra, **columns):
        calls.append(len(completions))
        log_metric("completions_seen", float(len(completions)))
        return [0.0] * len(completions)

    prompts = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(8)]
    data = RolloutDataModule(prompts=prompts, val_size=3, val_batch_size=2, prompts_per_step=2,
                             reward_funcs=[recorded], sampling={"group_size": 2, "max_new_tokens": 2})
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      default_root_dir=tmp_path, enable_model_summary=False)
    trainer.validate(GRPOModule(model="tiny-llama"), datamodule=data)
    assert sorted(calls) == [1, 2]  # two batches: 2 held-out prompts, then 1, one greedy completion each
    assert trainer.callback_metrics["val/reward/completions_seen"].item() == pytest.approx(1.5)
    assert not any(key.startswith("reward/") for key in trainer.callback_metrics)


def test_sampled_validations_logged_metrics_are_logged_apart_from_the_greedy_ones(tmp_path):
    """With ``val_num_samples`` k > 1, what the sampled completions' calls log is ``val/reward_at_k/<name>``, as
    their correctness is val/mean_at_k; ``val/reward/<name>`` stays the greedy calls', as val/reward is: a mean over
    both mixed a judge's greedy and sampled scores."""
    from lightning.pytorch import Trainer

    from lit_grpo.datamodules.rollout import RolloutDataModule
    from lit_grpo.update.module import GRPOModule

    def recorded(prompts, completions, log_metric, **columns):
        log_metric("completions_seen", float(len(completions)))
        return [0.0] * len(completions)

    prompts = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(8)]
    data = RolloutDataModule(prompts=prompts, val_size=3, val_batch_size=2, prompts_per_step=2, val_num_samples=3,
                             reward_funcs=[recorded], sampling={"group_size": 2, "max_new_tokens": 2})
    trainer = Trainer(logger=False, enable_checkpointing=False, enable_progress_bar=False,
                      default_root_dir=tmp_path, enable_model_summary=False)
    trainer.validate(GRPOModule(model="tiny-llama"), datamodule=data)
    logged = {key: value.item() for key, value in trainer.callback_metrics.items() if key.startswith("val/reward")}
    # two batches of 2 and 1 held-out prompts: greedy calls on 2 and 1 completions, sampled ones on 6 and 3
    assert logged == {"val/reward": 0.0, "val/reward/completions_seen": pytest.approx(1.5),
                      "val/reward_at_k/completions_seen": pytest.approx(4.5)}


@pytest.mark.xdist_group("ddp_run")
def test_under_two_processes_a_logged_metric_is_the_mean_of_every_ranks_values(tmp_path):
    """Each rank's calls log ``call_tokens``; rank 0 alone logs ``rank0_only``: both ranks log both keys, the
    first the mean over the ranks' values, the second rank 0's value (no hang on the names one rank lacks); so
    does the validation after step 2, under ``val/reward/``."""
    from tools.step_recorder import read_records, read_validations

    funcs = ("[{name: accuracy, weight: 1.0}, {name: char_fraction, weight: 1.0}, "
             "{name: test_reward_log:rank_logging_reward, weight: 0.0}]")
    record = fit_two_processes(tmp_path, "--trainer.strategy", "ddp", "--data.reward_funcs", funcs, steps=2)
    ranks = [read_records(record, rank) for rank in (0, 1)]
    a, b = (records[0] for records in ranks)
    per_rank = [sum(len(ids) for group in r["completion_ids"] for ids in group)
                / sum(len(group) for group in r["completion_ids"]) for r in (a, b)]
    for r in (a, b):
        assert r["logged"]["reward/call_tokens"] == pytest.approx(sum(per_rank) / 2, rel=1e-6)
        assert r["logged"]["reward/rank0_only"] == 3.0
    batches = [torch.load(f"{record}.rank{rank}.step1.pt", weights_only=False) for rank in (0, 1)]
    assert [{v for group in batch.reward_extras["rank"] for v in group} for batch in batches] == [{0}, {1}]
    validations = [read_validations(record, rank) for rank in (0, 1)]  # before training (FitSummary) and after
    assert len(validations[0]) == len(validations[1]) == 2
    for first, second in zip(*validations):
        assert first["logged"]["val/reward/rank0_only"] == second["logged"]["val/reward/rank0_only"] == 3.0
        assert first["logged"]["val/reward/call_tokens"] == second["logged"]["val/reward/call_tokens"] > 0
