"""verl's reward functions run unchanged: ``compute_score(data_source, solution_str, ground_truth, extra_info)``,
called once per completion with the row's fields as verl's reward managers pass them (``VerlScore``), on rows in
verl's parquet layout (examples/data_preprocess/gsm8k.py)."""

import asyncio
import re

import pytest

import datasets  # the data extra, which tools/setup.sh installs

from lit_grpo.datamodules.rollout import RolloutDataModule
from lit_grpo.rollout.prompts import PromptExample
from lit_grpo.rollout.rewards import (RewardFunctionError, build_reward_funcs, check_reward_columns,
                                      score_rewards)
from lit_grpo.runtime.models import load_model_and_tokenizer

ROWS = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
         "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
         "extra_info": {"split": "train", "index": i}} for i in range(6)]


def compute_score(data_source, solution_str, ground_truth, extra_info=None):
    """A verl custom reward function (its custom_reward_function.name default), as verl's gsm8k scorer reads."""
    found = re.findall(r"#### (\-?[0-9\.\,]+)", solution_str)
    return 0.0 if not found else 1.0 if found[-1].replace(",", "") == ground_truth else 0.1


def _columns(rows, answers=None):
    """The per-completion columns a call gets for ``rows`` (one completion each): the row as ``entry`` and each of
    its fields but the prompt under its own name, as ``score_rewards`` gets them from the data module."""
    columns = {"entry": rows, "answer": answers or [None] * len(rows)}
    for key in {key for row in rows for key in row} - {"prompt"}:
        columns[key] = [row.get(key) for row in rows]
    return columns


def test_a_verl_compute_score_gets_each_completions_text_and_its_rows_fields():
    seen = []

    def spy(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((data_source, solution_str, ground_truth, extra_info))
        return compute_score(data_source, solution_str, ground_truth, extra_info)

    (reward,) = build_reward_funcs([spy])
    assert reward.name == "spy"
    rows = ROWS[1:4]
    texts = ["so #### 2", "#### 5", "no answer"]
    completions = [[{"role": "assistant", "content": text}] for text in texts]  # chat prompts: TRL's form
    scores = score_rewards([reward], [row["prompt"] for row in rows], completions, _columns(rows))
    assert scores.components["spy"].tolist() == pytest.approx([1.0, 0.1, 0.0])  # float32
    assert seen == [("openai/gsm8k", text, row["reward_model"]["ground_truth"], row["extra_info"])
                    for text, row in zip(texts, rows)]


def test_without_verls_fields_the_gold_answer_is_the_ground_truth_and_extra_info_is_empty():
    seen = []

    def score(data_source, solution_str, ground_truth, extra_info=None):
        seen.append((data_source, ground_truth, extra_info))
        return float(solution_str.strip() == ground_truth)

    rows = [{"prompt": "2 + 2?", "answer": "4"}, {"prompt": "1 + 2?", "answer": "3"}]
    scores = score_rewards(build_reward_funcs([score]), ["2 + 2?", "1 + 2?"], ["4", "4"], _columns(rows, ["4", "3"]))
    assert scores.total.tolist() == [1.0, 0.0]
    assert seen == [(None, "4", {}), (None, "3", {})]  # verl passes {} where a row has no extra_info


def test_a_dict_result_is_its_score_and_its_other_keys_are_logged_columns():
    def score(data_source, solution_str, ground_truth, extra_info=None):
        correct = solution_str == ground_truth
        return {"score": float(correct), "acc": correct, "pred": solution_str}

    rows = ROWS[:2]
    scores = score_rewards(build_reward_funcs([score]), ["p", "q"], ["0", "7"], _columns(rows))
    assert scores.total.tolist() == [1.0, 0.0]
    assert scores.logs.extras == {"acc": [True, False], "pred": ["0", "7"]}

    def no_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"reward": 1.0}

    with pytest.raises(RewardFunctionError, match=r"reward function 'no_score' raised ValueError: it returned "
                                                  r"\{'reward': 1.0\}; a verl reward function returns a number or a "
                                                  r"dict with the number under 'score' on prompt 0 'p'"):
        score_rewards(build_reward_funcs([no_score]), ["p", "q"], ["0", "7"], _columns(rows))

    def huge_no_score(data_source, solution_str, ground_truth, extra_info=None):
        return {"reward": 10**5000}

    # shown as every check shows a value: a repr of an int of more than 4300 digits failed in place of the refusal
    with pytest.raises(RewardFunctionError, match=r"raised ValueError: it returned a dict holding an int of more "
                                                  r"than \d+ digits; a verl reward function returns a number"):
        score_rewards(build_reward_funcs([huge_no_score]), ["p", "q"], ["0", "7"], _columns(rows))


def test_an_async_verl_function_and_verls_reward_kwargs_are_taken():
    async def judged(data_source, solution_str, ground_truth, extra_info=None, bonus=0.0):
        await asyncio.sleep(0)
        return float(solution_str == ground_truth) + bonus

    rows = ROWS[:2]
    rewards = build_reward_funcs([{"name": judged, "kwargs": {"bonus": 0.5}}])  # custom_reward_function.reward_kwargs
    scores = score_rewards(rewards, ["p", "q"], ["0", "7"], _columns(rows))
    assert scores.components["judged"].tolist() == [1.5, 0.5]


def test_rows_with_no_ground_truth_are_refused_before_the_model_loads():
    examples = [PromptExample("a?", None, {"prompt": "a?", "data_source": "x"})]
    with pytest.raises(ValueError, match=r"reward function 'compute_score' is verl's compute_score\(data_source, "
                                         r"solution_str, ground_truth, extra_info\): it needs each row's "
                                         r"reward_model.ground_truth \(verl's layout\) or a gold answer "
                                         r"\(data.answer_column\); row 0 of rows.parquet has neither \(its fields: "
                                         r"\['data_source', 'prompt'\]\)"):
        check_reward_columns(build_reward_funcs([compute_score]), examples, "rows.parquet")


def test_a_verl_parquet_trains_with_verls_reward_function_and_the_math_reward(tmp_path):
    """verl's data and reward function as they are, beside lit_grpo's ``math`` reading the same gold answer through
    ``answer_column: reward_model.ground_truth``."""
    path = tmp_path / "train.parquet"
    datasets.Dataset.from_list(ROWS).to_parquet(path)
    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    dm = RolloutDataModule(dataset=str(path), answer_column="reward_model.ground_truth", val_size=2,
                           prompts_per_step=2, reward_funcs=[compute_score, "math"],
                           sampling={"group_size": 2, "micro_group_size": 2, "strategy": "continuous",
                                     "max_new_tokens": 4})
    dm.attach(model, tokenizer)
    dm.setup("fit")
    batch = dm.build_train_batch()
    assert batch.reward_components["compute_score"].shape == (2, 2)
    expected = [[compute_score("openai/gsm8k", text, ROWS[i]["reward_model"]["ground_truth"]) for text in group]
                for i, group in zip(batch.indices, batch.completions)]
    assert batch.reward_components["compute_score"].tolist() == expected
    assert batch.reward_components["math"].shape == (2, 2)


def test_a_call_on_a_row_with_no_ground_truth_names_the_function_and_the_prompt():
    with pytest.raises(RewardFunctionError, match=r"reward function 'compute_score' raised ValueError: it is verl's "
                                                  r"compute_score\(.*\), which needs each row's reward_model."
                                                  r"ground_truth .* on prompt 0 'a\?'"):
        score_rewards(build_reward_funcs([compute_score]), ["a?"], ["1"], _columns([{"prompt": "a?"}]))


def test_a_function_for_verls_batch_reward_manager_gets_every_completion_in_one_call():
    calls = []

    def batch_score(data_sources, solution_strs, ground_truths, extra_infos, **kwargs):
        calls.append((data_sources, solution_strs, ground_truths, extra_infos))
        return [{"score": float(s == g), "pred": s} for s, g in zip(solution_strs, ground_truths)]

    rows = ROWS[:3]
    scores = score_rewards(build_reward_funcs([batch_score]), ["p", "q", "r"], ["0", "1", "4"], _columns(rows))
    assert scores.total.tolist() == [1.0, 0.0, 1.0]
    assert calls == [(["openai/gsm8k"] * 3, ["0", "1", "4"], ["0", "2", "4"], [row["extra_info"] for row in rows])]
    assert scores.logs.extras == {"pred": ["0", "1", "4"]}
