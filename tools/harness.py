"""What every tool shares: model names, benchmark prompts, records and their medians, peak memory, output files.

Every tool runs from the repository root as ``python -m tools.NAME``; a tool that starts another tool or a training
process in a child gives it :func:`repo_env`, so ``tools`` imports there too.

- Arguments: :func:`comma_names`, :func:`comma_numbers` and :func:`comma_checked`, argparse types for the comma
  lists the tools take (``--strategies continuous,infinite``, ``--threads 1,2``, ``--predictors online,noisy:0.5``),
  each item once, a bad one named with what is allowed.
- Models: ``--model`` takes an alias (:data:`MODEL_ALIASES`: ``tiny``, ``smollm2``), a tiny test model
  (``tiny-llama``, ``tiny-qwen2``), ``random:NAME`` (a real architecture with random weights, offline), a local path
  or a hub id ``owner/name``; :func:`resolve_model` turns it into what ``load_model_and_tokenizer`` loads.
- Prompts: :func:`task_examples` / :func:`task_prompts`, a reasoning-gym task or ``"synthetic"`` (sums written
  locally, for random-weight models), rendered through the chat template as training renders them.
- Records: :func:`config_record` (a run's arguments as JSON values), :func:`median` and :func:`median_record`
  (medians over repeats), :func:`write_json`.
- Peak memory: :func:`peak_tracker`, the library's resettable tracker (``lit_grpo.runtime.memory``); a whole training
  step's phases are measured by ``lit_grpo.callbacks.PeakMemoryMonitor`` itself (tools/bench_grpo_memory.py).
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
from collections.abc import Callable, Iterable, Mapping, Sequence
from pathlib import Path
from typing import Any

ROOT = Path(__file__).resolve().parents[1]
SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
#: Short names the tools accept for ``--model``.
MODEL_ALIASES = {"tiny": "tiny-llama", "smollm2": SMOLLM2}
MODEL_HELP = ("tiny | smollm2 | tiny-llama | tiny-qwen2 | random:NAME (qwen3-0.6b, qwen3-1.7b, qwen3-4b, "
              "llama3.2-1b: that architecture with random weights, offline) | a local path | a hub id owner/name")
SYNTHETIC = "synthetic"


# ------------------------------------------------------------------------------------------------ arguments
def comma_names(allowed: Mapping[str, Any] | Sequence[str]) -> Callable[[str], list]:
    """An argparse type: a comma list of distinct names among ``allowed`` (read lower-case), each given as itself
    or, where ``allowed`` is a mapping, as its value. argparse puts the flag before an error's message."""
    values = dict(allowed) if isinstance(allowed, Mapping) else {name: name for name in allowed}

    def parse(text: str) -> list:
        names = [item.lower() for item in _comma_items(text)]
        unknown = [name for name in names if name not in values]
        if unknown:
            raise argparse.ArgumentTypeError(f"{text!r}: {unknown} not known; use a comma list of "
                                             f"{list(values)}")
        _refuse_repeats(text, names)
        return [values[name] for name in names]
    return parse


def comma_numbers(minimum: float, kind: type = int) -> Callable[[str], list]:
    """An argparse type: a comma list of distinct numbers of ``kind`` (int or float), each ``>= minimum``."""
    def parse(text: str) -> list:
        try:
            numbers = [kind(item) for item in _comma_items(text)]
        except ValueError:
            numbers = []
        if not numbers or min(numbers) < minimum:
            raise argparse.ArgumentTypeError(f"{text!r}: use a comma list of {kind.__name__}s >= {minimum}")
        _refuse_repeats(text, numbers)
        return numbers
    return parse


def comma_checked(check: Callable[[str], Any]) -> Callable[[str], list[str]]:
    """An argparse type: a comma list of distinct items that ``check`` accepts (names with parameters, such as
    ``noisy:0.5``); the ValueError ``check`` raises for a bad one is the error's message."""
    def parse(text: str) -> list[str]:
        items = _comma_items(text)
        for item in items:
            try:
                check(item)
            except ValueError as error:
                raise argparse.ArgumentTypeError(f"{text!r}: {error}") from None
        _refuse_repeats(text, items)
        return items
    return parse


def _comma_items(text: str) -> list[str]:
    items = [item.strip() for item in text.split(",") if item.strip()]
    if not items:
        raise argparse.ArgumentTypeError(f"{text!r}: give at least one item, comma-separated")
    return items


def _refuse_repeats(text: str, items: list) -> None:
    """The tools key their runs by these items: one given twice would be measured twice under one key."""
    repeated = sorted({item for item in items if items.count(item) > 1}, key=str)
    if repeated:
        raise argparse.ArgumentTypeError(f"{text!r}: {repeated} given more than once; give each once")


# ------------------------------------------------------------------------------------------------ models
def resolve_model(name: str) -> str:
    """What ``load_model_and_tokenizer`` loads for ``--model name``; a ValueError naming the allowed forms for a
    name that is none of them (a misspelt alias would otherwise be sent to the hub). An alias resolves without
    importing torch: a tool's arguments are checked before its first child process starts."""
    if name in MODEL_ALIASES:
        return MODEL_ALIASES[name]
    from lit_grpo.runtime.models import RANDOM_MODELS, RANDOM_PREFIX, TINY_MODELS

    if name.startswith(RANDOM_PREFIX):
        if name.removeprefix(RANDOM_PREFIX) not in RANDOM_MODELS:
            raise ValueError(f"model {name!r}: {RANDOM_PREFIX}NAME takes one of {list(RANDOM_MODELS)}")
        return name
    if name in TINY_MODELS or "/" in name or Path(name).expanduser().exists():
        return name
    raise ValueError(f"model {name!r} is not an alias ({', '.join(MODEL_ALIASES)}), a tiny model "
                     f"({', '.join(TINY_MODELS)}), {RANDOM_PREFIX}NAME, a local path or a hub id owner/name")


def add_model_argument(parser: argparse.ArgumentParser, default: str, help_extra: str = "") -> None:
    """``--model``, checked by :func:`resolve_model` when parsed; ``args.model`` keeps the name as given."""
    def checked(name: str) -> str:
        try:
            resolve_model(name)
        except ValueError as error:
            raise argparse.ArgumentTypeError(str(error)) from None
        return name

    parser.add_argument("--model", default=default, type=checked, help=MODEL_HELP + help_extra)


def is_random_model(name: str) -> bool:
    from lit_grpo.runtime.models import RANDOM_PREFIX

    return name.startswith(RANDOM_PREFIX)


def default_task(model: str, task: str | None, real_task: str = "basic_arithmetic") -> str:
    """``task`` when given; else ``"synthetic"`` for a random-weight model (its lengths mean nothing, and no
    reasoning-gym is needed), ``real_task`` for any other."""
    if task is not None:
        return task
    return SYNTHETIC if is_random_model(model) else real_task


def load_policy(model: str, dtype: str | None = None, device: str | None = None):
    """``(model in eval mode, tokenizer)`` for ``--model model``; a training checkpoint (``*.ckpt``) gives its
    trained policy."""
    from lit_grpo.runtime.models import load_model_and_tokenizer

    if model.endswith(".ckpt"):
        from lit_grpo.export import policy_from_checkpoint

        policy, tokenizer, _ = policy_from_checkpoint(model)
        import torch

        policy = policy.to(device=device, dtype=getattr(torch, dtype) if dtype else None)
        return policy.eval(), tokenizer
    policy, tokenizer = load_model_and_tokenizer(resolve_model(model), dtype=dtype, device=device)
    return policy.eval(), tokenizer


# ------------------------------------------------------------------------------------------------ prompts
def task_examples(task: str, count: int, seed: int, task_config: dict | None = None):
    """``count`` PromptExamples: reasoning-gym's ``task``, or ``"synthetic"``: sums of two random three-digit
    numbers with their answers, drawn from ``random.Random(seed)``."""
    from lit_grpo.rollout.prompts import PromptExample, reasoning_gym_prompts

    if task != SYNTHETIC:
        return reasoning_gym_prompts(task, count, seed, task_config)
    rng = random.Random(seed)
    pairs = [(rng.randint(10, 999), rng.randint(10, 999)) for _ in range(count)]
    return [PromptExample(f"What is {a} + {b}? Think step by step, then give the final answer.", str(a + b))
            for a, b in pairs]


def task_prompts(tokenizer: Any, task: str, count: int, seed: int, task_config: dict | None = None,
                 system_prompt: str | None = None) -> list[list[int]]:
    """The token ids of :func:`task_examples` (``task_config``: the reasoning-gym task's settings), each prompt
    rendered through the chat template as training does."""
    from lit_grpo.rollout.prompts import render_prompt

    return [render_prompt(tokenizer, example.prompt, system_prompt)
            for example in task_examples(task, count, seed, task_config)]


# ------------------------------------------------------------------------------------------------ records
def config_record(args: argparse.Namespace, **extra: Any) -> dict[str, Any]:
    """A run's arguments as JSON values (paths as strings), updated with ``extra``."""
    return {**{key: str(value) if isinstance(value, Path) else value for key, value in vars(args).items()}, **extra}


def oracle_gain_kept(steps: float, oracle_steps: float, continuous_steps: float) -> float | None:
    """The share of the oracle's gain in decode steps over continuous that a schedule of ``steps`` keeps (the
    scheduler targets' measure); None where the oracle gains nothing."""
    if oracle_steps >= continuous_steps:
        return None
    return (continuous_steps - steps) / (continuous_steps - oracle_steps)


def median(values: Iterable[float | None]) -> float | None:
    """The median of the values that are not None; None when there are none."""
    present = [value for value in values if value is not None]
    return statistics.median(present) if present else None


def median_record(records: Sequence[dict], fields: Sequence[str]) -> dict:
    """One record for repeats of a run: each of ``fields`` the :func:`median` over ``records``, every other key
    the first record's, and ``"repeats"`` the ``fields`` of each record."""
    if not records:
        raise ValueError("median_record needs at least one record")
    out = {key: value for key, value in records[0].items() if key not in fields}
    out.update({key: median(record.get(key) for record in records) for key in fields})
    out["repeats"] = [{key: record.get(key) for key in fields} for record in records]
    return out


def write_text(path: Path | str | None, text: str) -> None:
    """Write ``text`` to ``path`` (its folders made), replaced whole: written beside it, then renamed, so that a
    process killed while writing leaves the previous file, not half of the new one; nothing when ``path`` is
    None."""
    if path is None:
        return
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_name(path.name + ".partial")
    partial.write_text(text)
    os.replace(partial, path)


def write_json(path: Path | str | None, report: Any, indent: int = 2) -> None:
    """Write ``report`` as JSON to ``path`` (its folders made); nothing when ``path`` is None."""
    write_text(path, json.dumps(report, indent=indent))


# ------------------------------------------------------------------------------------------------ memory
def peak_tracker(device, what: str = "peak memory"):
    """The library's resettable peak tracker for ``device`` (``lit_grpo.runtime.memory``): the CUDA allocator's
    peak, or on CPU the kernel's resident high-water mark, reset at each window (exact per-run peaks; a benchmark
    process is its own and only reader), else RSS sampled every 2 ms. SystemExit naming why where there is none."""
    from lit_grpo.runtime.memory import make_peak_tracker

    tracker, problem = make_peak_tracker(device, "hwm", 0.002)
    if tracker is None:
        tracker, problem = make_peak_tracker(device, "auto", 0.002)
    if tracker is None:
        raise SystemExit(f"cannot measure {what} here: {problem}")
    return tracker


def weights_bytes(model) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


# ------------------------------------------------------------------------------------------------ processes
def repo_env(**extra: str) -> dict[str, str]:
    """This process's environment with the repository root on PYTHONPATH (a child imports ``tools``)."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, **extra}


def tool_command(name: str, *args: str) -> list[str]:
    """The command line that runs ``tools.NAME`` in a child Python (give it :func:`repo_env`)."""
    return [sys.executable, "-m", f"tools.{name}", *args]


def free_port() -> int:
    """A TCP port free on 127.0.0.1 now, for a process group's ``MASTER_PORT``."""
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def lit_grpo_script() -> Path:
    """This interpreter's ``lit-grpo`` console script (beside ``sys.executable``, where pip installs it): PATH's
    first ``lit-grpo`` may belong to another environment, with another lit_grpo."""
    return Path(sys.executable).with_name("lit-grpo")


def lit_grpo_command() -> list[str]:
    """The ``lit-grpo`` command of this interpreter: its console script, else the CLI module under it."""
    script = lit_grpo_script()
    return [str(script)] if script.is_file() else [sys.executable, "-m", "lit_grpo.cli"]
