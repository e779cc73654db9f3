"""Hugging Face datasets as a prompt source: every local format, Dataset objects, chat messages, columns reaching
the reward functions, and an error naming the file, the row and the column for every bad input."""

import json

import pytest
import torch

import datasets  # the data extra, which tools/setup.sh installs

from lit_grpo.rollout.hf_dataset import dataset_prompts  # noqa: E402
from lit_grpo.rollout.prompts import load_prompts, render_prompt  # noqa: E402
from lit_grpo.datamodules.rollout import RolloutDataModule  # noqa: E402
from lit_grpo.runtime.models import load_model_and_tokenizer  # noqa: E402

ROWS = [{"problem": f"What is {i} / {i + 1}?", "solution": f"\\frac{{{i}}}{{{i + 1}}}", "level": i % 3}
        for i in range(1, 9)]


@pytest.fixture(scope="module")
def table():
    return datasets.Dataset.from_list(ROWS)


def _write(table, tmp_path, kind: str):
    """``table`` written as ``kind``; returns the path data.dataset takes."""
    if kind == "parquet":
        table.to_parquet(tmp_path / "set.parquet")
        return tmp_path / "set.parquet"
    if kind == "jsonl":
        (tmp_path / "set.jsonl").write_text("".join(json.dumps(r) + "\n" for r in ROWS))
        return tmp_path / "set.jsonl"
    if kind == "json":
        (tmp_path / "set.json").write_text(json.dumps(ROWS))
        return tmp_path / "set.json"
    if kind == "csv":
        table.to_csv(tmp_path / "set.csv")
        return tmp_path / "set.csv"
    if kind == "save_to_disk":
        table.save_to_disk(tmp_path / "saved")
        return tmp_path / "saved"
    if kind == "arrow":
        table.save_to_disk(tmp_path / "saved")
        return next((tmp_path / "saved").glob("*.arrow"))
    if kind == "folder":
        (tmp_path / "folder").mkdir()
        table.to_parquet(tmp_path / "folder" / "train-00000.parquet")
        return tmp_path / "folder"
    raise AssertionError(kind)


@pytest.mark.parametrize("kind", ["parquet", "jsonl", "json", "csv", "save_to_disk", "arrow", "folder"])
def test_every_local_format_gives_the_same_examples(table, tmp_path, kind):
    examples = load_prompts(dataset=str(_write(table, tmp_path, kind)), prompt_column="problem",
                            answer_column="solution")
    assert [e.prompt for e in examples] == [r["problem"] for r in ROWS]
    assert [e.answer for e in examples] == [r["solution"] for r in ROWS]
    assert [e.entry["level"] for e in examples] == [r["level"] for r in ROWS]  # every field kept


@pytest.mark.parametrize("name", ["set.jsonl.gz", "set.json.bz2", "set.csv.xz", "SET.JSONL.GZ"])
def test_a_compressed_json_or_csv_file_is_read_as_the_file_it_holds(table, tmp_path, name):
    """gzip, bz2 and xz (the compressions datasets reads with the standard library) after a JSON, JSONL or CSV
    suffix: the rows of the file inside."""
    import bz2
    import gzip
    import lzma

    text = _write(table, tmp_path, name.lower().split(".")[1]).read_bytes()
    compress = {"gz": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress}[name.lower().rsplit(".", 1)[1]]
    (tmp_path / name).write_bytes(compress(text))
    examples = load_prompts(dataset=str(tmp_path / name), prompt_column="problem", answer_column="solution")
    assert [(e.prompt, e.answer) for e in examples] == [(r["problem"], r["solution"]) for r in ROWS]


@pytest.mark.parametrize("name", ["set.parquet.gz", "set.gz", "set.jsonl.zst", "set.txt.gz"])
def test_a_compressed_file_datasets_cannot_read_is_refused_listing_what_is_read(tmp_path, name):
    """A compressed parquet or Arrow file (their own format compresses; datasets does not unpack them), a bare
    ``.gz`` and a compression that needs a package of its own (zstandard) are refused, naming what is read."""
    (tmp_path / name).write_bytes(b"x")
    ending = {"set.parquet.gz": ".parquet.gz", "set.gz": ".gz", "set.jsonl.zst": ".zst", "set.txt.gz": ".txt.gz"}
    with pytest.raises(ValueError, match=rf"data.dataset '{tmp_path / name}': files ending in '{ending[name]}' are not "
                                         r"read; use one of \['.arrow', '.csv', '.json', '.jsonl', '.parquet'\], or, "
                                         r"compressed, one of \['.csv', '.json', '.jsonl'\] followed by one of "
                                         r"\['.bz2', '.gz', '.xz'\] \(e.g. data.jsonl.gz\)"):
        load_prompts(dataset=str(tmp_path / name))


def test_default_columns_and_a_dataset_dict_split(tmp_path):
    splits = datasets.DatasetDict({
        "train": datasets.Dataset.from_list([{"question": "1+1?", "answer": 2}, {"question": "2+2?", "answer": 4}]),
        "test": datasets.Dataset.from_list([{"question": "3+3?", "answer": 6}])})
    splits.save_to_disk(tmp_path / "dict")
    test = dataset_prompts(str(tmp_path / "dict"), split="test")
    assert [(e.prompt, e.answer) for e in test] == [("3+3?", 6)]  # the column's value as it is, as TRL passes it
    assert [e.prompt for e in dataset_prompts(splits)] == ["1+1?", "2+2?"]  # an object, default split "train"
    with pytest.raises(ValueError, match=r"has no split 'validation'; its splits are \['test', 'train'\]"):
        dataset_prompts(str(tmp_path / "dict"), split="validation")


def test_a_chat_columns_keys_a_turn_lacks_are_absent_not_none():
    """Arrow gives each turn every key of the column's struct type, None where the turn has none: such a key is
    absent from the prompt's messages (a template testing ``'name' in m`` would see one), the keys a turn has are
    kept."""
    rows = [{"messages": [{"role": "system", "content": "Be brief.", "name": "setup"},
                          {"role": "user", "content": "1+1?"}]},
            {"messages": [{"role": "user", "content": "2+2?", "name": "ada"}]}]
    data = datasets.Dataset.from_list(rows)
    assert data[0]["messages"][1] == {"role": "user", "content": "1+1?", "name": None}  # as the table holds it
    assert [example.messages for example in dataset_prompts(data)] == [row["messages"] for row in rows]


def test_chat_messages_render_through_the_template():
    _, tokenizer = load_model_and_tokenizer("tiny-llama")
    messages = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+2?"}]
    (example,) = dataset_prompts(datasets.Dataset.from_list([{"messages": messages, "answer": "4"}]))
    assert example.prompt == "What is 2+2?" and example.messages == messages
    ids = render_prompt(tokenizer, example.prompt, None, "{prompt}", example.messages[:-1])
    assert ids == tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=True)["input_ids"]
    with pytest.raises(ValueError, match="and a prompt whose messages start with their own system turn"):
        render_prompt(tokenizer, example.prompt, "Be nice.", "{prompt}", example.messages[:-1])
    # the template's other braces stay as written: only {prompt} is replaced
    boxed = render_prompt(tokenizer, "What is 2+2?", None, "{prompt}\nPut the answer in \\boxed{} {not_a_field}.")
    user = {"role": "user", "content": "What is 2+2?\nPut the answer in \\boxed{} {not_a_field}."}
    assert boxed == tokenizer.apply_chat_template([user], add_generation_prompt=True, tokenize=True)["input_ids"]


def test_datamodule_streams_a_dataset_object_and_rewards_see_every_column(table):
    """A Dataset object trains like any source; its rows' fields reach the reward functions, and the
    hyperparameters that checkpoints store describe it instead of holding it."""
    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    seen = {}

    def spy(prompts, completions, **columns):
        seen.update(columns)
        return [0.0] * len(completions)

    dm = RolloutDataModule(dataset=table, prompt_column="problem", answer_column="solution", val_size=2,
                           prompts_per_step=2, reward_funcs=[spy, "math"],
                           sampling={"group_size": 2, "micro_group_size": 2, "strategy": "continuous",
                                     "max_new_tokens": 4})
    assert dm.hparams["dataset"] == "<datasets.Dataset: 8 rows, columns ['problem', 'solution', 'level']>"
    dm.attach(model, tokenizer)
    dm.setup("fit")
    batch = dm.build_train_batch()
    assert set(seen["level"]) <= {0, 1, 2} and len(seen["level"]) == 4
    assert seen["answer"] == [dm.examples[i].answer for i in batch.indices for _ in range(2)]
    assert seen["solution"] == seen["answer"]
    assert batch.reward_components["math"].shape == (2, 2)  # the math reward scored every completion


def test_a_column_named_question_reaches_the_rewards_and_one_named_as_lit_grpos_own_is_refused():
    """As TRL: every column but "prompt" is a keyword of the reward call, "question" included where it is not the
    prompt. A column named as an argument lit_grpo passes itself would be replaced by it unseen: refused."""
    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    seen = {}

    def spy(prompts, completions, **columns):
        seen.update(columns)
        return [0.0] * len(completions)

    rows = [{"prompt": [{"role": "user", "content": f"What is {i} + 1?"}], "question": f"{i} + 1"} for i in range(6)]
    sampling = {"group_size": 2, "micro_group_size": 2, "strategy": "continuous", "max_new_tokens": 2}
    dm = RolloutDataModule(dataset=datasets.Dataset.from_list(rows), val_size=2, prompts_per_step=2,
                           reward_funcs=[spy], sampling=sampling)
    dm.attach(model, tokenizer)
    dm.setup("fit")
    batch = dm.build_train_batch()
    assert seen["question"] == [rows[i]["question"] for i in batch.indices for _ in range(2)]
    assert "prompt" not in seen
    for field in ("truncated", "completions"):
        clashing = datasets.Dataset.from_list([{**row, field: 1} for row in rows])
        dm = RolloutDataModule(dataset=clashing, val_size=2, prompts_per_step=2, reward_funcs=[spy],
                               sampling=sampling)
        dm.attach(model, tokenizer)
        with pytest.raises(ValueError, match=rf"data.dataset=.<datasets.Dataset: 6 rows.*.: row 0 has the fields "
                                             rf"\['{field}'\], which are names the reward functions get from "
                                             r"lit_grpo itself .*; rename those fields"):
            dm.setup("fit")


def test_a_datasets_own_answer_column_is_never_hidden_behind_another_answer_column():
    """Every column reaches the reward functions under its own name: with an ``answer`` column of its own the
    data is scored against it (``answer``, and ``solution`` under its own name); naming another column the gold
    answer, which the rewards get as ``answer``, would hide that column: refused, naming both and the fixes."""
    rows = [{"problem": "1 + 1?", "answer": 2, "solution": "1 + 1 = 2"}]
    (example,) = dataset_prompts(datasets.Dataset.from_list(rows))
    assert example.answer == 2 and example.entry["solution"] == "1 + 1 = 2"
    with pytest.raises(ValueError, match=r"data.answer_column='solution', but the data has an 'answer' column too: "
                                         r"the reward functions get the gold answer \('solution'\) as 'answer', which "
                                         r"would hide that column; leave answer_column unset .* or rename one"):
        dataset_prompts(datasets.Dataset.from_list(rows), answer_column="solution")
    assert dataset_prompts(datasets.Dataset.from_list(rows), answer_column="answer")[0].answer == 2


def test_chat_prompts_give_the_reward_functions_trls_conversational_form():
    """As TRL: for chat prompts the reward functions get each prompt's messages as the dataset holds them and each
    completion as ``[{"role": "assistant", "content": text}]``, so a TRL reward for chat data runs unchanged; the
    built-in rewards read the completion's text from it."""
    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    seen = {}

    def trl_chat_reward(completions, **kwargs):  # TRL's documented shape for conversational data
        seen["prompts"], seen["completions"] = kwargs["prompts"], completions
        return [float(len(completion[0]["content"])) for completion in completions]

    rows = [{"prompt": [{"role": "system", "content": "Be brief."}, {"role": "user", "content": f"{i} + 1?"}],
             "answer": str(i + 1)} for i in range(6)]
    sampling = {"group_size": 2, "micro_group_size": 2, "strategy": "continuous", "max_new_tokens": 4}
    dm = RolloutDataModule(dataset=datasets.Dataset.from_list(rows), val_size=2, prompts_per_step=2,
                           reward_funcs=[trl_chat_reward, "format", "accuracy", "char_fraction"], sampling=sampling)
    dm.attach(model, tokenizer)
    dm.setup("fit")
    batch = dm.build_train_batch()
    assert seen["prompts"] == [rows[i]["prompt"] for i in batch.indices for _ in range(2)]
    assert seen["completions"] == [[{"role": "assistant", "content": text}] for group in batch.completions
                                   for text in group]
    lengths = torch.tensor([[float(len(text)) for text in group] for group in batch.completions])
    assert torch.equal(batch.reward_components["trl_chat"], lengths)
    expected = [[sum(ch in "0123456789" for ch in text) / len(text) if text else 0.0 for text in group]
                for group in batch.completions]
    torch.testing.assert_close(batch.reward_components["char_fraction"], torch.tensor(expected))
    assert batch.prompts == [rows[i]["prompt"][-1]["content"] for i in batch.indices]  # the logged text


def test_errors_name_the_file_the_row_and_the_column(table, tmp_path):
    path = str(_write(table, tmp_path, "parquet"))
    with pytest.raises(ValueError, match=r"'/nowhere/set.parquet' does not exist .*the Hub is not used"):
        load_prompts(dataset="/nowhere/set.parquet")
    with pytest.raises(ValueError, match=r"'org/some-set' does not exist"):  # a hub id is never looked up
        load_prompts(dataset="org/some-set")
    with pytest.raises(ValueError, match=rf"{path}.*prompt_column='query' is not a column; it has "
                                         r"\['problem', 'solution', 'level'\]"):
        load_prompts(dataset=path, prompt_column="query")
    with pytest.raises(ValueError, match=rf"{path}.*answer_column='gold' is not a column"):
        load_prompts(dataset=path, prompt_column="problem", answer_column="gold")
    other = tmp_path / "other.parquet"
    datasets.Dataset.from_list([{"text": "x", "label": 1}]).to_parquet(other)
    with pytest.raises(ValueError, match=rf"{other}.*no prompt column; it has columns \['text', 'label'\]; set "
                                         r"data.prompt_column"):
        load_prompts(dataset=str(other))
    bad_rows = tmp_path / "bad.jsonl"
    bad_rows.write_text('{"prompt": "fine", "answer": "1"}\n{"prompt": "  ", "answer": "2"}\n')
    with pytest.raises(ValueError, match=rf"{bad_rows}', row 1, column 'prompt': the prompt is empty"):
        load_prompts(dataset=str(bad_rows))
    bad_rows.write_text('{"prompt": "fine", "answer": "1"}\n{"prompt": "also fine", "answer": null}\n')
    with pytest.raises(ValueError, match=rf"{bad_rows}', row 1, column 'answer': the answer is missing"):
        load_prompts(dataset=str(bad_rows))
    chat = datasets.Dataset.from_list([{"messages": [{"role": "user", "content": "hi"},
                                                     {"role": "assistant", "content": "4"}]}])
    with pytest.raises(ValueError, match=r"row 0, column 'messages': the messages must end with a non-empty user "
                                         r"turn.*the last is 'assistant'"):
        dataset_prompts(chat)
    garbage = tmp_path / "broken.parquet"
    garbage.write_bytes(b"this is not parquet")
    with pytest.raises(ValueError, match=rf"{garbage}' cannot be read"):
        load_prompts(dataset=str(garbage))
    # the parser's reason, where datasets wraps it in a DatasetGenerationError that gives none
    not_json = tmp_path / "not_json.jsonl"
    not_json.write_text('{"prompt": "fine", "answer": "1"}\nnot json\n')
    with pytest.raises(ValueError, match=rf"{not_json}' cannot be read: ArrowInvalid: JSON parse error: .* in row 1"):
        load_prompts(dataset=str(not_json))
    # an integer past Python's int-to-str limit (4300 digits): json's bare ValueError named neither file nor line
    long_number = tmp_path / "long_number.jsonl"
    long_number.write_text('{"prompt": "fine", "answer": 1}\n{"prompt": "big", "answer": ' + "9" * 5000 + "}\n")
    with pytest.raises(ValueError, match=rf"{long_number}:2: cannot be read \(Exceeds the limit \(4300 digits\) for "
                                         r"integer string conversion.*\); write so long a number as a string"):
        load_prompts(jsonl_path=str(long_number))
    (tmp_path / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=r"files ending in '.txt' are not read; use one of"):
        load_prompts(dataset=str(tmp_path / "notes.txt"))
    with pytest.raises(ValueError, match=r"has no split 'test'; its splits are \['train'\] \(data.split\)"):
        load_prompts(dataset=path, prompt_column="problem", split="test")
    with pytest.raises(ValueError, match=r"data.split='test'.*is a single split"):
        dataset_prompts(table, split="test")
    with pytest.raises(ValueError, match=r"prompt_column applies to data.dataset only; the prompt source here is "
                                         r"jsonl_path"):
        load_prompts(jsonl_path=str(bad_rows), prompt_column="prompt")
    with pytest.raises(ValueError, match=r"exactly one prompt source .*got \['jsonl_path', 'dataset'\]"):
        load_prompts(jsonl_path=str(bad_rows), dataset=path)
    with pytest.raises(ValueError, match=r"must be a local path or a datasets.Dataset, got list"):
        dataset_prompts([{"prompt": "x"}])


def test_an_empty_file_or_folder_is_said_to_have_no_rows(tmp_path):
    """An empty data file (no bytes, blank lines, a header alone, a table of no rows, or a filter that kept
    nothing, saved) is named as having no rows, not by what the parser says of it (StopIteration, 'Instruction
    "train" corresponds to no data!', an IndexError)."""
    files = {"empty.jsonl": "", "blank.jsonl": "\n\n", "header.csv": "prompt,solution\n", "empty.csv": "",
             "none.json": "[]", "zero.parquet": ""}
    for name, text in files.items():
        (tmp_path / name).write_text(text)
    datasets.Dataset.from_dict({"prompt": [], "solution": []}).to_parquet(tmp_path / "no_rows.parquet")
    datasets.Dataset.from_dict({"prompt": [], "solution": []}).save_to_disk(tmp_path / "saved")
    for name in [*files, "no_rows.parquet", "saved"]:
        with pytest.raises(ValueError, match=rf"data.dataset '{tmp_path / name}' has no rows"):
            load_prompts(dataset=str(tmp_path / name))


def test_a_prompt_longer_than_the_models_positions_is_refused_at_hand_over_naming_its_row(tmp_path):
    """A row whose prompt, with the length cap, runs past the model's positions is named (the source, the row, its
    tokens, how many rows are over) when the policy is handed over, not at the step that first draws it, deep in
    the engine, as "prompt 1" of that step's batch; a held-out row against the validation cap."""
    from lit_grpo.runtime.validation import ConfigError

    rows = [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)} for i in range(6)]
    rows[3]["prompt"] = "long " * 500  # 2500 tokens of the byte-level tokenizer, past tiny-llama's 2048 positions
    path = tmp_path / "rows.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in rows))
    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    data = RolloutDataModule(dataset=str(path), val_size=0, prompts_per_step=2, reward_funcs=["math"],
                             sampling={"group_size": 2, "max_new_tokens": 8})
    data.setup("fit")
    with pytest.raises(ConfigError, match=rf"data.dataset='{path}' row 3: the prompt is 25\d\d tokens as the "
                                          r"model reads it \(templates applied\); with "
                                          r"data.sampling.max_new_tokens=8 that exceeds the model's "
                                          r"max_position_embeddings=2048 \(1 of 6 rows\)"):
        data.attach(model, tokenizer)
    rows[3]["prompt"] = "long " * 390  # fits with 8 new tokens, not with validation's 200
    data = RolloutDataModule(prompts=rows, val_size=5, prompts_per_step=1, reward_funcs=["math"],
                             val_max_new_tokens=200, sampling={"group_size": 2, "max_new_tokens": 8})
    data.setup("fit")
    with pytest.raises(ConfigError, match=r"data.prompts row 3: .* with data.val_max_new_tokens=200 that exceeds"):
        data.attach(model, tokenizer)


def test_without_the_data_extra_the_error_names_it(monkeypatch, tmp_path):
    monkeypatch.setitem(__import__("sys").modules, "datasets", None)  # as if not installed
    with pytest.raises(ImportError, match=r"pip install 'lit-grpo\[data\]'"):
        load_prompts(dataset=str(tmp_path))


#: Rows in verl's layout (its examples/data_preprocess/gsm8k.py): a chat prompt, the gold answer nested in
#: ``reward_model``, the rest in ``extra_info``.
VERL_ROWS = [{"data_source": "openai/gsm8k", "prompt": [{"role": "user", "content": f"What is {i} + {i}?"}],
              "ability": "math", "reward_model": {"style": "rule", "ground_truth": str(2 * i)},
              "extra_info": {"split": "train", "index": i}} for i in range(6)]


def test_a_dotted_answer_column_reads_a_field_inside_a_column(tmp_path):
    """verl keeps the gold answer at ``reward_model.ground_truth``: ``answer_column`` names it by its dotted path, and
    it reaches the reward functions as ``answer`` (the ``reward_model`` column as it is, under its own name)."""
    path = tmp_path / "verl.parquet"
    datasets.Dataset.from_list(VERL_ROWS).to_parquet(path)
    examples = load_prompts(dataset=str(path), answer_column="reward_model.ground_truth")
    assert [e.answer for e in examples] == [str(2 * i) for i in range(6)]
    assert examples[1].entry["reward_model"] == {"style": "rule", "ground_truth": "2"}
    assert examples[1].messages == VERL_ROWS[1]["prompt"]
    with pytest.raises(ValueError, match=r"row 0, column 'reward_model.truth': 'reward_model' holds no field 'truth' "
                                         r"\(its fields: \['ground_truth', 'style'\]\)"):
        load_prompts(dataset=str(path), answer_column="reward_model.truth")
    with pytest.raises(ValueError, match=r"answer_column='reward.ground_truth' is not a column; it has \['data_source'"
                                         r".*a field inside a column is named by its path, e.g. "
                                         r"'reward_model.ground_truth'"):
        load_prompts(dataset=str(path), answer_column="reward.ground_truth")
    with pytest.raises(ValueError, match=r"row 0, column 'ability.x': 'ability' holds 'math', not fields"):
        load_prompts(dataset=str(path), answer_column="ability.x")


def test_verl_rows_without_an_answer_column_name_its_ground_truth_as_the_answer(tmp_path):
    path = tmp_path / "verl.parquet"
    datasets.Dataset.from_list(VERL_ROWS).to_parquet(path)
    with pytest.raises(ValueError, match="score against a gold answer") as refused:
        RolloutDataModule(dataset=str(path), reward_funcs=["math"], val_size=0, prompts_per_step=1).setup()
    assert "for its 'reward_model.ground_truth' set data.answer_column: reward_model.ground_truth" in str(refused.value)
