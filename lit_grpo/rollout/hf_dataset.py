"""Hugging Face ``datasets`` as a prompt source: local parquet / JSON / JSONL / CSV / Arrow files (JSON, JSONL and
CSV also compressed with gzip, bz2 or xz: ``data.jsonl.gz``), a folder of them, a folder written by
``Dataset.save_to_disk``, or a ``datasets.Dataset`` (``DatasetDict``) object.

Local only: a path that does not exist is an error naming it; nothing is looked up on the Hub (a string is never
passed to ``load_dataset`` unless it is an existing file or folder). Needs the ``data`` extra
(``pip install 'lit-grpo[data]'``): datasets with pyarrow and pandas is a large install that reasoning-gym tasks,
JSONL files and prompt lists do without.

Each row becomes a :class:`~lit_grpo.rollout.prompts.PromptExample` whose ``entry`` is the whole row, so every
column reaches the reward functions (as a JSONL row's fields do). The prompt is ``prompt_column`` (default: the
first of ``prompt``, ``question``, ``problem``, ``messages`` the data has): a string (the user message) or a chat
``messages`` list (``[{"role": ..., "content": ...}, ...]``, ending with a user turn; each turn's other keys
kept but those the table holds as None: ``prompts.check_messages``). The gold answer is
``answer_column`` (default ``answer`` when present; else the rows have none), passed to the reward functions as
``answer`` and under its own name; a dataset with an ``answer`` column of its own takes no other ``answer_column``
(that column would be hidden from the rewards). A dotted ``answer_column`` that is not a column names a field inside
one: verl's ``reward_model.ground_truth`` (its rows keep the gold answer there; the rewards get the whole
``reward_model`` column too).
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

from lit_grpo.rollout.prompts import PromptExample, check_messages
from lit_grpo.runtime.validation import shown_value

#: Prompt columns looked for, in order, when ``prompt_column`` is not given.
PROMPT_COLUMNS = ("prompt", "question", "problem", "messages")
#: File suffixes and the ``datasets`` builder that reads them.
FILE_BUILDERS = {".parquet": "parquet", ".json": "json", ".jsonl": "json", ".csv": "csv", ".arrow": "arrow"}
#: Compressions ``datasets`` unpacks with the standard library alone (zstd and lz4 need packages of their own), after
#: one of these suffixes (``data.jsonl.gz``); parquet and Arrow files compress inside their own format.
COMPRESSIONS = (".bz2", ".gz", ".xz")
COMPRESSIBLE = (".csv", ".json", ".jsonl")


def _datasets():
    try:
        import datasets
    except ImportError as err:
        raise ImportError("data.dataset needs Hugging Face datasets: pip install 'lit-grpo[data]' "
                          "(or pip install datasets)") from err
    return datasets


def is_dataset_object(value: Any) -> bool:
    """Whether ``value`` is a ``datasets.Dataset`` or ``DatasetDict`` (checked without importing datasets)."""
    return type(value).__module__.startswith("datasets.") and type(value).__name__ in ("Dataset", "DatasetDict")


def describe_source(dataset: Any) -> str:
    """What a checkpoint's hyperparameters record for ``dataset``: the path, or a short description of an object
    (the rows themselves are never pickled into checkpoints)."""
    if isinstance(dataset, (str, os.PathLike)):
        return os.fspath(dataset)
    if type(dataset).__name__ == "DatasetDict":
        return f"<datasets.DatasetDict {dict((k, v.num_rows) for k, v in dataset.items())}>"
    return f"<datasets.Dataset: {dataset.num_rows} rows, columns {list(dataset.column_names)}>"


def unwrapped_read_error(error: BaseException) -> BaseException:
    """The error that says why a file could not be read: datasets' ``DatasetGenerationError`` ("An error occurred
    while generating the dataset") wraps the parser's (``JSON parse error: ... in row 1``) as its cause."""
    from datasets.exceptions import DatasetGenerationError  # datasets read the file: imported already

    while isinstance(error, DatasetGenerationError) and error.__cause__ is not None:
        error = error.__cause__
    return error


def load_local_dataset(path: str | os.PathLike, split: str = "train"):
    """The ``split`` of a local dataset as a ``datasets.Dataset`` (module docstring); errors name the path."""
    datasets = _datasets()
    source = Path(path).expanduser()
    if not source.exists():
        raise ValueError(f"data.dataset {os.fspath(path)!r} does not exist (a local parquet / JSON / JSONL / CSV / "
                         "Arrow file, a folder of them, or a folder written by save_to_disk; the Hub is not used)")
    try:
        if source.is_dir() and any((source / name).is_file() for name in ("dataset_info.json", "state.json",
                                                                           "dataset_dict.json")):
            loaded = datasets.load_from_disk(str(source))
        elif source.is_dir():
            loaded = datasets.load_dataset(str(source))
        else:
            loaded = datasets.load_dataset(file_builder(source), data_files={"train": str(source)})
    except Exception as err:  # noqa: BLE001 - pyarrow / json / datasets errors all mean an unreadable file
        if isinstance(err, ValueError) and str(source) in str(err):
            raise
        if holds_no_rows(err, source):
            raise ValueError(f"data.dataset {str(source)!r} has no rows; give at least one prompt row") from err
        reason = unwrapped_read_error(err)
        said = str(err) if isinstance(err, ValueError) else f"{type(reason).__name__}: {reason}"
        raise ValueError(f"data.dataset {str(source)!r} cannot be read: {said}") from err
    return select_split(loaded, split, str(source))


def file_builder(source: Path) -> str:
    """The ``datasets`` builder that reads the file ``source``, by its suffix (``FILE_BUILDERS``), after which a
    JSON, JSONL or CSV file may have a compression's (``COMPRESSIONS``); else an error listing what is read."""
    last_two = [suffix.lower() for suffix in source.suffixes[-2:]]
    if last_two[-1:] and last_two[-1] in COMPRESSIONS:
        if len(last_two) == 2 and last_two[0] in COMPRESSIBLE:
            return FILE_BUILDERS[last_two[0]]
        ending = "".join(source.suffixes[-2:])
    elif last_two[-1:] and last_two[-1] in FILE_BUILDERS:
        return FILE_BUILDERS[last_two[-1]]
    else:
        ending = source.suffix
    raise ValueError(f"data.dataset {str(source)!r}: files ending in {ending!r} are not read; use one of "
                     f"{sorted(FILE_BUILDERS)}, or, compressed, one of {list(COMPRESSIBLE)} followed by one of "
                     f"{list(COMPRESSIONS)} (e.g. data.jsonl.gz); decompress a file compressed otherwise first")


def holds_no_rows(error: BaseException, source: Path) -> bool:
    """Whether reading ``source`` failed with ``error`` because it holds no rows: its parsers say so only in their
    own terms (an empty JSONL file's StopIteration, a table of no rows' 'Instruction "train" corresponds to no
    data!', an empty CSV's EmptyDataError, a saved empty dataset's IndexError)."""
    if source.is_file() and source.stat().st_size == 0:
        return True
    state = source / "state.json"
    if source.is_dir() and state.is_file():  # save_to_disk of no rows writes no data file, then cannot load it
        try:
            return json.loads(state.read_text()).get("_data_files") == []
        except (OSError, ValueError):
            return False
    while error is not None:
        if isinstance(error, StopIteration) or type(error).__name__ == "EmptyDataError" or \
                "corresponds to no data" in str(error):
            return True
        error = error.__cause__ or error.__context__
    return False


def select_split(loaded: Any, split: str, where: str):
    """``loaded[split]`` for a ``DatasetDict``; a ``Dataset`` is one split already (``split`` must then be "train",
    the name a single file's rows get)."""
    if type(loaded).__name__ == "DatasetDict" or isinstance(loaded, Mapping):
        if split not in loaded:
            raise ValueError(f"data.dataset {where!r} has no split {split!r}; its splits are {sorted(loaded)} "
                             "(data.split)")
        return loaded[split]
    if split != "train":
        raise ValueError(f"data.split={split!r}: data.dataset {where!r} is a single split (its rows are 'train'); "
                         "use split 'train' or a dataset with that split")
    return loaded


def resolve_columns(columns: Sequence[str], prompt_column: str | None, answer_column: str | None,
                    where: str) -> tuple[str, str | None]:
    """``(prompt column, answer column or None)``; a named column that is missing is an error listing the
    columns the data has, and so is an answer column other than the data's own ``answer`` column (every column
    reaches the reward functions under its own name, and ``answer`` is the gold answer's)."""
    columns = list(columns)
    if prompt_column is None:
        prompt_column = next((c for c in PROMPT_COLUMNS if c in columns), None)
        if prompt_column is None:
            raise ValueError(f"data.dataset {where!r}: no prompt column; it has columns {columns}; set "
                             f"data.prompt_column (looked for {list(PROMPT_COLUMNS)})")
    elif prompt_column not in columns:
        raise ValueError(f"data.dataset {where!r}: data.prompt_column={prompt_column!r} is not a column; it has "
                         f"{columns}")
    if answer_column is None:
        answer_column = "answer" if "answer" in columns else None
    elif answer_column not in columns and answer_column.split(".")[0] not in columns:
        dotted = " (a field inside a column is named by its path, e.g. 'reward_model.ground_truth')" \
            if "." in answer_column else ""
        raise ValueError(f"data.dataset {where!r}: data.answer_column={answer_column!r} is not a column; it has "
                         f"{columns}{dotted}")
    elif answer_column != "answer" and "answer" in columns:
        # the reward functions get the gold answer as `answer`: the data's own `answer` column would reach them
        # under another column's values, unseen (TRL passes every column under its own name)
        raise ValueError(f"data.dataset {where!r}: data.answer_column={answer_column!r}, but the data has an 'answer' "
                         f"column too: the reward functions get the gold answer ({answer_column!r}) as 'answer', "
                         "which would hide that column; leave answer_column unset to score against 'answer', or "
                         "rename one of the two columns (e.g. Dataset.rename_column)")
    return prompt_column, answer_column


def column_value(row: Mapping[str, Any], column: str, at: str) -> Any:
    """``row[column]``, or where ``column`` is no column but a dotted path (verl keeps the gold answer at
    ``reward_model.ground_truth``), the field it names inside a column; ``at`` names the row, for the errors."""
    if column in row:
        return row[column]
    head, *path = column.split(".")
    value, holder = row[head], head
    for name in path:
        if not isinstance(value, Mapping):
            raise ValueError(f"{at}, column {column!r}: {holder!r} holds {shown_value(value, 80)}, not fields")
        if name not in value:
            raise ValueError(f"{at}, column {column!r}: {holder!r} holds no field {name!r} (its fields: "
                             f"{sorted(value)})")
        value, holder = value[name], f"{holder}.{name}"
    return value


def dataset_prompts(dataset: Any, prompt_column: str | None = None, answer_column: str | None = None,
                    split: str = "train") -> list[PromptExample]:
    """One example per row of a local dataset path or a ``datasets.Dataset`` / ``DatasetDict`` (module docstring).

    Errors name the dataset, the row (its index in the split) and the column.
    """
    if isinstance(dataset, (str, os.PathLike)):
        where = os.fspath(dataset)
        data = load_local_dataset(dataset, split)
    elif is_dataset_object(dataset):
        where = describe_source(dataset)
        data = select_split(dataset, split, where)
    else:
        raise ValueError(f"data.dataset must be a local path or a datasets.Dataset, got {type(dataset).__name__} "
                         f"{shown_value(dataset, 80)}")
    prompt_column, answer_column = resolve_columns(data.column_names, prompt_column, answer_column, where)
    examples = []
    for index, row in enumerate(data):
        at = f"data.dataset {where!r}, row {index}, column {prompt_column!r}"
        value = row[prompt_column]
        if isinstance(value, str):
            if not value.strip():
                raise ValueError(f"{at}: the prompt is empty")
            prompt, messages = value, None
        elif value is None:
            raise ValueError(f"{at}: the prompt is missing (null)")
        else:
            messages = check_messages(value, at)
            prompt = messages[-1]["content"]
        answer = column_value(row, answer_column, f"data.dataset {where!r}, row {index}") \
            if answer_column is not None else None
        if answer_column is not None and (answer is None or not str(answer).strip()):
            raise ValueError(f"data.dataset {where!r}, row {index}, column {answer_column!r}: the answer is missing "
                             f"({shown_value(answer)}); fill it, or drop the row")
        examples.append(PromptExample(prompt=prompt, answer=answer, entry=dict(row), messages=messages))
    if not examples:
        raise ValueError(f"data.dataset {where!r} (split {split!r}) has no rows")
    return examples
