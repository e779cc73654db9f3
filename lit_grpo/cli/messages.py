"""jsonargparse's and Lightning's refusals of a setting said on one line that names the setting by its full key,
with hints: the option likely meant, TRL's or verl's name or value for it, a close class name, a config file's other
unknown keys.
"""

from __future__ import annotations

import argparse
import difflib
import importlib
import inspect
import re
import textwrap
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import yaml
from jsonargparse import Namespace

from lit_grpo.callbacks._paths import shown_path
from lit_grpo.runtime.models import NO_PROMPT_LENGTH_LIMIT
from lit_grpo.update.lr_schedule import WARMUP_STEPS_COUNT, is_share


_LEADING_SETTING = re.compile(r"^([A-Za-z_][\w.]*)=")


def qualified_error(error: ValueError, keys: Sequence[str]) -> ValueError:
    """``error`` with the setting its message starts with (``sampling.temperature=-1.0 must be ...``: a class
    names its own field) named by its full config key (``data.sampling.temperature=...``), where exactly one of
    ``keys`` (the config's dotted keys) ends with it; else ``error`` itself."""
    match = _LEADING_SETTING.match(str(error))
    if match is None:
        return error
    name = match.group(1)
    owners = [key for key in keys if key.endswith("." + name)]
    if len(owners) != 1 or name in keys:
        return error
    return ValueError(owners[0] + str(error)[len(name):])


#: jsonargparse's account of a value no type of an optional setting's Union takes (``reference_sync:
#: ReferenceSync | None``): this line, the subtypes, then each type's reason as an indented list, then the value.
_UNION_FAILURE = "Does not validate against any of the Union subtypes"
#: A reason that says what type was expected but not what was given (an optional number's).
_BARE_TYPE = re.compile(r"Expected a <class '[\w.]+'>")
#: Any type's reason that names only the type expected (an int's, a Literal's).
_EXPECTED = re.compile(r"Expected a (.+)")
_NOT_NONE = "Expected a <class 'NoneType'>"
#: The list's reason where the value given is no list (one class spec, or a string that is not one).
_NOT_LIST = "Expected a <class 'list'>"
#: A list of classes or one of them (``trainer.callbacks``): a list given fails for its own reason; anything else
#: fails as the lone class, whose reason names the class spec and the option at fault.
_LIST_OR_ITEM = re.compile(r"Subtypes: \[list\[([\w.]+)\], <class '\1'>, <class 'NoneType'>\]")
#: One class or several of them, or a switch (``trainer.logger``): the lone class's reason applies, or the iterable's
#: where a list is given.
_ITEM_OR_ITERABLE = re.compile(r"Subtypes: \[<class '([\w.]+)'>, collections\.abc\.Iterable\[\1\], <class 'bool'>, "
                               r"<class 'NoneType'>\]")
_CLASS_PATH_PROBLEM = re.compile(r"Problem with given class_path '([\w.]+)':")


#: jsonargparse's refusal of one setting's value: its key on a line of its own, then the reason.
_KEY_THEN_REASON = re.compile(r'Parser key "([\w.]+)":\n\s+(Expected [^\n]*)')


#: jsonargparse's refusal of a ``--config`` path: nothing there, or no file.
_CONFIG_NOT_FOUND = re.compile(r"Parser key \"config\": (File does not exist|Path is not a file): '(.*)'", re.DOTALL)


def one_line_reason(message: str) -> str:
    """``KEY: REASON`` for jsonargparse's two-line refusal of one setting's value (``Parser key "KEY":`` then the
    reason), and ``--config FILE: no such file`` for its refusal of a config path, as the other refusals are said;
    any other ``message`` as it is."""
    if missing := _CONFIG_NOT_FOUND.fullmatch(message):
        path, found = Path(missing.group(2)).resolve(), "no such file" if "exist" in missing.group(1) else "not a file"
        where = "" if shown_path(path) == str(path) else f" ({path})"  # a relative path: where it was looked for
        return f"--config {shown_path(path)}: {found}{where}; --config takes a YAML file of settings"
    refused = _KEY_THEN_REASON.fullmatch(message)
    return f"{refused.group(1)}: {refused.group(2)}" if refused else message


def optional_group_reason(message: str, keys: Sequence[str] = (), building: bool = False) -> str:
    """The group's own reason for refusing a value, from jsonargparse's message for an optional settings group,
    which lists a reason for each type of the Union, the value's repr and the Union's spelling, the one line that
    names the bad setting and what is allowed lost among them; any other ``message`` as it is. ``keys``: the
    config's dotted keys, which name the setting in full (``qualified_error``). ``building``: the message is a
    class's refusal while the classes are built, not the parser's."""
    found = _own_reason(message, keys, building)
    if found is None:
        return message
    key, reason, nullable = found
    return f"{key + ': ' if key else ''}{reason}" + (f" (or {nullable}: null)" if nullable else "")


def _own_reason(message: str, keys: Sequence[str], building: bool = False) -> tuple[str | None, str, str | None] | None:
    """(the bad setting's key, its reason, the key that may be null instead) from the first optional Union's failure
    in ``message``; None where there is none, or its reasons are not one type's besides None's. An optional setting
    inside an optional group fails in the group's type's reason: read there, its key is the group's and its own."""
    failure = _union_failure(message.splitlines())
    if failure is None:
        return None
    group, subtypes, reasons, value = failure
    own = [lines for lines in reasons if lines != [_NOT_NONE]]
    classes = _LIST_OR_ITEM.fullmatch(subtypes) or _ITEM_OR_ITERABLE.fullmatch(subtypes)
    listed = classes is not None
    own_types = [lines for lines in own if len(lines) == 1 and _EXPECTED.fullmatch(lines[0])]
    if listed:  # the reason of the form given: the list's, or the lone class's where it is no list
        if _ITEM_OR_ITERABLE.fullmatch(subtypes):  # the lone class first, then the iterable
            own = own[1:2] if (value or "").startswith("[") and len(own) > 1 else own[:1]
        else:
            own = own[1:2] if own[0] == [_NOT_LIST] and len(own) > 1 else own[:1]
    elif len(own) == len(reasons) - 1 and len(own_types) == len(own) > 1:  # each type says only what it expects
        own = [["Expected a " + " or ".join(_EXPECTED.fullmatch(lines[0]).group(1) for lines in own_types)]]
    elif len(own) != 1 or len(reasons) != 2:
        return None
    head, rest = own[0][0], own[0][1:]
    class_path = _CLASS_PATH_PROBLEM.fullmatch(head)
    if rest and class_path:  # the group's own parser's message
        nested = _own_reason(textwrap.dedent("\n".join(rest)), keys, building)
        if nested is not None and nested[0] is not None and group is not None:
            key, reason, nullable = nested
            if listed:  # a setting of one class of the list: named inside its class
                named = f"{class_path.group(1)}."
                return group, f"{named}{key}: {reason}" + (f" (or {named}{nullable}: null)" if nullable else ""), None
            return f"{group}.{key}", reason, nullable and f"{group}.{nullable}"
    reason = re.sub(r"^Problem with given class_path '[\w.]+': ", "", " ".join(line.strip() for line in own[0]))
    if class_path:
        reason += class_path_hint(class_path.group(1), reason)
    elif listed:
        reason += short_name_hint(classes.group(1), reason)
    if listed:  # one class of several: named; a list given with a bad class is not meant to be null
        if class_path:
            reason = in_class(class_path.group(1), reason)
        elif building and (spec := re.search(r"Namespace\(class_path='([\w.]+)'", value or "")):
            # the first not yet built (those built show as objects); while parsing, a Namespace is an entry read
            # well, and the reason names the entry at fault by its value
            reason = in_class(spec.group(1), reason)
        return group, reason, None
    key = group
    if group and (inner := _PARSER_KEY.match(reason)):  # a setting inside the group
        key, reason = f"{group}.{inner.group(1)}", reason[inner.end():]
    elif group is None:  # the group's own check names its setting
        reason = str(qualified_error(ValueError(reason), keys))
        if (setting := _LEADING_SETTING.match(reason)) and "." in setting.group(1):
            group = setting.group(1).rsplit(".", 1)[0]
    if _BARE_TYPE.fullmatch(reason) or len(own_types) > 1:  # as jsonargparse says it where the value is not optional
        reason += f". Got value: {value}"
    if reason == f"{_NOT_LIST}. Got value: {value}" and value and not value.startswith("["):
        reason += f"; for one item, write [{value}]"  # TRL's reward_funcs=fn, a list of one here
    return key, reason, group


#: jsonargparse's name for the setting of a class or group it refuses, before the reason.
_PARSER_KEY = re.compile(r'Parser key "([\w.]+)": ')


def in_class(class_path: str, reason: str) -> str:
    """``reason`` for refusing a setting of the class ``class_path`` (jsonargparse's ``Parser key "stop": ...``, or
    the class's own ``patience=0 must be ...``) naming it inside the class: ``lit_grpo.callbacks.RewardForecast.stop:
    ...``; a reason that names no setting follows the class's name."""
    if inner := _PARSER_KEY.match(reason):
        return f"{class_path}.{inner.group(1)}: {reason[inner.end():]}"
    if _LEADING_SETTING.match(reason):
        return f"{class_path}.{reason}"
    return f"{class_path}: {reason}"


def configured_class_key(config: Namespace, message: str) -> str | None:
    """The key of ``config`` (a subcommand's) that lists the class whose path ``message`` starts with
    (``trainer.callbacks`` for ``lit_grpo.callbacks.RewardForecast.patience=0 ...``); None where none does."""
    for key, value in config.items(branches=True):
        for spec in value if isinstance(value, list) else [value]:
            path = spec.get("class_path") if isinstance(spec, Namespace) else None
            if isinstance(path, str) and re.match(rf"{re.escape(path)}[.:]", message):
                return key
    return None


def _union_failure(lines: list[str]) -> tuple[str | None, str, list[list[str]], str | None] | None:
    """The first optional Union's failure in a message's ``lines``: the key the parser names before it (None if
    none), its ``Subtypes: [...]`` line, each type's reason (its lines, the first without its ``- ``, the others as
    indented), the value given."""
    at = next((i for i, line in enumerate(lines) if line.strip().removeprefix("- ") == _UNION_FAILURE), None)
    if at is None or at + 2 >= len(lines):
        return None
    subtypes, errors = lines[at + 1].strip(), lines[at + 2].strip()
    if not (subtypes.startswith("Subtypes: [") and "NoneType" in subtypes and errors == "Errors:"):
        return None
    # the nearest key named before it: a group's message names the group, then the setting in it that is bad
    named = next((match for line in reversed(lines[:at]) if (match := re.search(r'Parser key "([\w.]+)":', line))),
                 None)
    indent = _indent(lines[at])
    reasons: list[list[str]] = []
    end, item_indent = at + 3, 0
    while end < len(lines) and _indent(lines[end]) > indent:
        line = lines[end]
        if line.lstrip().startswith("- ") and (not reasons or _indent(line) <= item_indent):
            item_indent = _indent(line)
            reasons.append([line.lstrip()[2:]])
        elif reasons:
            reasons[-1].append(line)
        end += 1
    given = [line.strip().removeprefix("Given value: ") for line in lines[end:end + 2]
             if line.strip().startswith("Given value: ")]
    return (named.group(1) if named else None), subtypes, reasons, (given[0] if given else None)


def class_path_hint(class_path: str, reason: str) -> str:
    """`` (did you mean 'NAME'?)`` for jsonargparse's ``reason`` why ``class_path`` failed, where it names an option
    the class does not take or a class its module lacks, and a close name exists; else an empty string."""
    if option := re.fullmatch(r"Option '(\w+)' is not accepted", reason):
        module_name, _, name = class_path.rpartition(".")
        try:
            known = list(inspect.signature(getattr(importlib.import_module(module_name), name)).parameters)
        except (ImportError, AttributeError, TypeError, ValueError):
            return ""
        close = difflib.get_close_matches(option.group(1), known, n=1, cutoff=0.6)
        return f" (did you mean '{close[0]}'?)" if close else ""
    if missing := re.fullmatch(r"module '([\w.]+)' has no attribute '(\w+)'", reason):
        module_name = missing.group(1)
        try:
            known = [name for name in dir(importlib.import_module(module_name)) if not name.startswith("_")]
        except ImportError:
            return ""
        close = difflib.get_close_matches(missing.group(2), known, n=1, cutoff=0.6)
        return f" (did you mean '{module_name}.{close[0]}'?)" if close else ""
    return ""


def short_name_hint(base: str, reason: str) -> str:
    """`` (did you mean 'NAME'?)`` for jsonargparse's ``reason`` why a class named without its module
    (``RewardForcast``) is not one of the subclasses of ``base`` (a class path) it resolves such names among, where a
    close name exists; else an empty string."""
    given = re.fullmatch(r"Expected a dot import path string: (\w+)", reason)
    module_name, _, name = base.rpartition(".")
    try:
        base_class = getattr(importlib.import_module(module_name), name) if given else None
    except (ImportError, AttributeError):
        return ""
    if not isinstance(base_class, type):
        return ""
    close = difflib.get_close_matches(given.group(1), sorted(_short_names(base_class)), n=1, cutoff=0.6)
    return f" (did you mean '{close[0]}'?)" if close else ""


def _short_names(base: type) -> set[str]:
    """The names of ``base``'s subclasses (imported ones, at any depth) that a config may give without their module,
    as jsonargparse finds them: not defined inside a function, nor in a private module."""
    names, pending = set(), [base]
    while pending:
        cls = pending.pop()
        if "<locals>" not in cls.__qualname__ and "._" not in f"{cls.__module__}.{cls.__qualname__}":
            names.add(cls.__name__)
        pending.extend(cls.__subclasses__())
    return names


def _indent(line: str) -> int:
    return len(line) - len(line.lstrip())


def _option_names(parser: argparse.ArgumentParser) -> list[str]:
    """Every option ``parser`` takes, its subcommands' included (argparse keeps those in ``_name_parser_map``)."""
    names = []
    for action in parser._actions:
        names.append(action.dest)
        for subparser in getattr(action, "_name_parser_map", {}).values():
            names.extend(_option_names(subparser))
    return names


#: An unknown config key in jsonargparse's messages (a group's keys are named relative to it).
_UNKNOWN_KEY = re.compile(r"(?:Group '([\w.]+)'|Subcommand '\w+') does not accept option '([\w.]+)'")


#: TRL GRPOConfig's names of settings lit_grpo names otherwise (docs/training.md maps them all).
TRL_NAMES = {"num_generations": "data.sampling.group_size", "max_completion_length": "data.sampling.max_new_tokens",
             "learning_rate": "model.lr", "per_device_train_batch_size": "model.train_micro_batch_size",
             "epsilon": "model.loss.epsilon_low", "use_bias_correction_kl": "model.loss.kl_bias_correction",
             "reward_weights": "data.reward_funcs", "adam_beta1": "model.betas", "adam_beta2": "model.betas",
             "lr_scheduler_type": "model.lr_schedule", "lr_scheduler_kwargs": "model.min_lr_ratio",
             "logging_steps": "trainer.log_every_n_steps", "num_train_epochs": "trainer.max_epochs",
             "sync_ref_model": "model.reference_sync", "ref_model_sync_steps": "model.reference_sync",
             "ref_model_mixup_alpha": "model.reference_sync",
             "vllm_importance_sampling_correction": "model.sampler_correction.mode",
             "vllm_importance_sampling_mode": "model.sampler_correction.mode",
             "vllm_importance_sampling_clip_max": "model.sampler_correction.clip_max",
             "vllm_importance_sampling_cap": "model.sampler_correction.clip_max",
             "vllm_importance_sampling_clip_min": "model.sampler_correction.clip_min",
             "shuffle_dataset": "data.curriculum", "num_generations_eval": "data.val_num_samples",
             "model_init_kwargs": "model.dtype", "torch_dtype": "model.dtype", "bf16": "trainer.precision",
             "fp16": "trainer.precision", "warmup_ratio": "model.warmup_steps",
             "output_dir": "trainer.default_root_dir", "eval_steps": "trainer.val_check_interval",
             "report_to": "trainer.logger",
             "per_device_eval_batch_size": "data.val_batch_size",
             # TRL's ModelConfig and ScriptArguments, which `trl grpo --config` reads from the same flat YAML
             "model_name_or_path": "model.model", "dataset_name": "data.dataset", "dataset_train_split": "data.split",
             "reward_model_name_or_path": "data.reward_funcs", "seed": "seed_everything",
             "logging_dir": "trainer.default_root_dir", "resume_from_checkpoint": "ckpt_path",
             # Unsloth's get_peft_model's, which its GRPO notebooks set beside GRPOConfig
             "random_state": "seed_everything",
             **dict.fromkeys(["use_peft", "lora_r", "lora_alpha", "lora_dropout", "lora_target_modules",
                              "lora_target_parameters", "lora_modules_to_save", "lora_task_type", "use_rslora",
                              "use_dora"], "model.peft_config")}
#: TRL's settings that mean more than their key in TRL_NAMES: the rest, said with it.
_IN_TRAINING_STEPS = "training steps: {0} / (model.num_mini_batches x model.num_iterations)"
TRL_ALSO = {"per_device_train_batch_size": "TRL's per_device_train_batch_size also sets how many prompts a "
                                           "generation draws, per_device_train_batch_size x steps_per_generation "
                                           "(gradient_accumulation_steps when unset) x processes / num_generations: "
                                           "here a step's rollout is data.prompts_per_step prompts x "
                                           "data.sampling.group_size completions on each process, cut into "
                                           "model.num_mini_batches optimizer steps",
            "eval_steps": "TRL's eval_steps counts optimizer steps, trainer.val_check_interval "
                          f"{_IN_TRAINING_STEPS.format('eval_steps')}, with trainer.check_val_every_n_epoch: null",
            "logging_steps": "TRL's logging_steps counts optimizer steps, trainer.log_every_n_steps "
                             f"{_IN_TRAINING_STEPS.format('logging_steps')}",
            "report_to": "TRL's report_to names integrations, trainer.logger takes Lightning loggers: TensorBoard's "
                         "under trainer.default_root_dir by default, false for none",
            "warmup_ratio": "TRL's warmup_ratio is a share of the optimizer steps, model.warmup_steps a count of "
                            "them: warmup_ratio x trainer.max_steps",
            **{name: f"TRL's {name} is {what}, peft's LoraConfig fields: {{r: 16, lora_alpha: 32, lora_dropout: "
                     "0.0, target_modules: [q_proj, v_proj]}"
               for name, what in [("use_peft", "a model.peft_config given"),
                                  *((name, f"{field} in model.peft_config") for name, field in [
                                      ("lora_r", "r"), ("lora_alpha", "lora_alpha"), ("lora_dropout", "lora_dropout"),
                                      ("lora_target_modules", "target_modules"),
                                      ("lora_target_parameters", "target_parameters"),
                                      ("lora_modules_to_save", "modules_to_save"), ("lora_task_type", "task_type"),
                                      ("use_rslora", "use_rslora"), ("use_dora", "use_dora")])]}}
#: TRL's settings with no key of lit_grpo's to name instead: what takes their place.
TRL_ELSEWHERE = {
    "use_vllm": "has no counterpart: rollouts run on lit_grpo's own engine, data.sampling",
    "generation_batch_size": "has no counterpart: a rollout is data.prompts_per_step prompts x "
                             "data.sampling.group_size completions on each process, cut into model.num_mini_batches "
                             "optimizer steps",
    "steps_per_generation": "is model.num_mini_batches here, counted otherwise: steps_per_generation / "
                            "gradient_accumulation_steps optimizer steps on each rollout",
    "gradient_accumulation_steps": "has no counterpart: a mini-batch's micro-batches, model.train_micro_batch_size "
                                   "completions each, all accumulate into its optimizer step; model.num_mini_batches "
                                   "is steps_per_generation / gradient_accumulation_steps",
    "save_steps": "is RunCheckpoint's every_n_train_steps here, in trainer.callbacks",
    "log_completions": "is the CompletionLogger callback here, in trainer.callbacks",
    "num_completions_to_print": "is the CompletionLogger callback's num_completions here, in trainer.callbacks",
    "generation_kwargs": "has no counterpart but its stop strings: data.sampling.stop_strings",
    "remove_unused_columns": "has no counterpart: every column but the prompt reaches the reward functions",
    "push_to_hub": "has no counterpart: lit-grpo export writes a model directory to upload",
    "trust_remote_code": "has no counterpart: a model is loaded without code of its own",
    "dataset_config": "has no counterpart: data.dataset reads local files or a saved dataset, nothing from the Hub",
    "optim": "has no counterpart: the optimizer is torch's AdamW (fused on a GPU), from model.lr, model.betas and "
             "model.weight_decay; no 8-bit or paged one",
}
#: Settings of verl's and TRL's alike with no key of lit_grpo's, said as both peers' (a flat config is TRL's way,
#: verl's is nested, but either may be ported into the other's place): what takes their place.
SHARED_ELSEWHERE = {
    "max_prompt_length": "verl's and TRL's max_prompt_length (an older TRL GRPOConfig's, which Unsloth's notebooks "
                         f"set; TRL 1.16 has none) has no counterpart: {NO_PROMPT_LENGTH_LIMIT}",
}
#: Unsloth's settings (``FastLanguageModel.from_pretrained`` and ``get_peft_model``'s, which its GRPO notebooks set
#: beside TRL's GRPOConfig) with no key of lit_grpo's: what takes their place.
UNSLOTH_ELSEWHERE = {
    "max_seq_length": f"has no counterpart: {NO_PROMPT_LENGTH_LIMIT}",
    "load_in_4bit": "has no counterpart: the weights load in model.dtype, unquantized",
    "fast_inference": TRL_ELSEWHERE["use_vllm"],  # Unsloth's vLLM
    "gpu_memory_utilization": "has no counterpart: the rollout's KV cache holds data.sampling.micro_group_size "
                              "slots (auto: as many as fit data.sampling.kv_budget_bytes, or the GPU's free memory)",
    "max_lora_rank": "has no counterpart: the adapter's rank is model.peft_config's r",
}


#: verl's settings (``ppo_trainer.yaml``'s last key parts) that a lit_grpo key does, for a setting written with
#: verl's name: ``data.train_batch_size`` -> ``data.prompts_per_step`` (docs/training.md's verl table says how).
VERL_NAMES = {"train_batch_size": "data.prompts_per_step", "max_response_length": "data.sampling.max_new_tokens",
              "n": "data.sampling.group_size", "ppo_micro_batch_size_per_gpu": "model.train_micro_batch_size",
              "ppo_epochs": "model.num_iterations", "clip_ratio": "model.loss.epsilon_low",
              "clip_ratio_low": "model.loss.epsilon_low", "clip_ratio_high": "model.loss.epsilon_high",
              "clip_ratio_c": "model.loss.delta", "loss_agg_mode": "model.loss.loss_type",
              "use_kl_loss": "model.loss.beta", "kl_loss_coef": "model.loss.beta",
              "entropy_coeff": "model.loss.entropy_coef", "norm_adv_by_std_in_grpo": "model.scale_rewards",
              "grad_clip": "model.max_grad_norm", "lr_warmup_steps": "model.warmup_steps",
              "enable_gradient_checkpointing": "model.gradient_checkpointing", "train_files": "data.dataset",
              "prompt_key": "data.prompt_column", "total_training_steps": "trainer.max_steps",
              "total_epochs": "trainer.max_epochs", "test_freq": "trainer.val_check_interval",
              "n_gpus_per_node": "trainer.devices", "nnodes": "trainer.num_nodes"}
#: verl's settings in VERL_NAMES that count otherwise than their key here: how, said with it.
_OPTIMIZER_STEPS = "optimizer steps: rollouts x model.num_iterations x model.num_mini_batches"
VERL_ALSO = {"total_training_steps": "verl's total_training_steps counts rollouts, trainer.max_steps "
                                     f"{_OPTIMIZER_STEPS}",
             "lr_warmup_steps": f"verl's lr_warmup_steps counts rollouts, model.warmup_steps {_OPTIMIZER_STEPS}",
             "train_batch_size": "verl's train_batch_size counts the prompts of every GPU, data.prompts_per_step "
                                 "those of one rank: train_batch_size / ranks"}
#: verl's settings with no key of lit_grpo's to name instead: what takes their place.
VERL_ELSEWHERE = {
    "adv_estimator": "has no counterpart: GRPO's group advantages are the only estimator",
    "ppo_mini_batch_size": "is model.num_mini_batches here, counted otherwise: train_batch_size / "
                           "ppo_mini_batch_size optimizer steps on each rollout",
    "kl_loss_type": "has no counterpart: model.loss.beta's KL is verl's low_var_kl (k3)",
    "filter_overlong_prompts": "has no counterpart: a prompt too long for the model is refused before the first "
                               "step, naming its row",
    "val_files": "has no counterpart: validation holds out data.val_size prompts of data.dataset's split",
    "save_freq": "is RunCheckpoint's every_n_train_steps here, in trainer.callbacks, counting optimizer steps: "
                 "verl's rollouts x model.num_iterations x model.num_mini_batches",
    "custom_reward_function": "is an entry of data.reward_funcs here: {name: my_reward:compute_score, kwargs: {...}}, "
                              "called as verl calls it",
    "use_kl_in_reward": "has no counterpart: no KL penalty in the reward (model.loss.beta puts it in the loss)",
}

#: TRL GRPOConfig's (and verl's) values of a setting lit_grpo spells otherwise (by the setting's last key part, then
#: the value lowercased, as the parser shows it): what the value is here.
PEER_VALUES = {
    "scale_rewards": {"true": "TRL's scale_rewards: true is 'group' here",
                      "false": "TRL's scale_rewards: false is 'none' here"},
    "lr_schedule": {"constant_with_warmup": "TRL's lr_scheduler_type constant_with_warmup is 'constant' here, "
                                            "after model.warmup_steps",
                    "cosine_with_min_lr": "TRL's lr_scheduler_type cosine_with_min_lr is 'cosine' here, down to "
                                          "model.min_lr_ratio"},
    # verl's loss_agg_mode, written as lit_grpo's loss_type
    "loss_type": {"token-mean": "verl's loss_agg_mode token-mean is 'bnpo' here",
                  "seq-mean-token-mean": "verl's loss_agg_mode seq-mean-token-mean is 'grpo' here",
                  "seq-mean-token-sum": "verl's loss_agg_mode seq-mean-token-sum is 'luspo' here, with "
                                        "model.loss.importance_sampling_level: token",
                  "seq-mean-token-sum-norm": "verl's loss_agg_mode seq-mean-token-sum-norm is 'dr_grpo' here, "
                                             "whose loss is verl's over the completions of a micro-batch"},
}
#: Counts that TRL also takes as a share (a float below 1): what the count is, for such a value.
PEER_SHARES = {"warmup_steps": f"model.warmup_steps is {WARMUP_STEPS_COUNT}"}
#: jsonargparse's refusal of a value none of a setting's choices is, and of a value that is not an int.
_NOT_A_CHOICE = re.compile(r'Parser key "([\w.]+)":\s+Expected a typing\.Literal\[.*\]\. Got value: (\S+)\s*')
_NOT_AN_INT = re.compile(r'Parser key "([\w.]+)":\s+Expected a <class \'int\'>\. Got value: (\S+)\s*')


def peer_value_hint(message: str) -> str:
    """`` (TRL's ...)`` where the parser's ``message`` refuses a value of TRL's (or verl's) for a setting that lit_grpo
    spells otherwise (``PEER_VALUES``), or a share of TRL's for a count (``PEER_SHARES``), saying what it is here;
    else an empty string."""
    if (refused := _NOT_AN_INT.fullmatch(message)) is not None:
        meaning = PEER_SHARES.get(refused.group(1).rsplit(".", 1)[-1])
        return f" ({meaning})" if meaning and _is_share(refused.group(2)) else ""
    refused = _NOT_A_CHOICE.fullmatch(message)
    if refused is None:
        return ""
    meaning = PEER_VALUES.get(refused.group(1).rsplit(".", 1)[-1], {}).get(refused.group(2).lower())
    return f" ({meaning})" if meaning else ""


def _is_share(value: str) -> bool:
    """Whether the parser's shown ``value`` is the text of a share of the steps (:func:`is_share`)."""
    try:
        return is_share(float(value))
    except ValueError:
        return False


def _meant_key(name: str, known: Sequence[str]) -> str | None:
    """The known option ``name`` most likely means: one with the same last part (``model.beta`` ->
    ``model.loss.beta``, not ``model.betas``), TRL's or verl's name's counterpart (``TRL_NAMES``, ``VERL_NAMES``),
    else the closest spelling; failing all three, the same for the key of a mapping put in the wrong place
    (``chat_template_kwargs.enable_thinking`` -> ``data.chat_template_kwargs``)."""
    meant = _meant_whole_key(name, known)
    groups = {key.rsplit(".", 1)[0] for key in known} | set(known)
    parts = name.split(".")
    for end in range(len(parts) - 1, 0, -1):
        if meant is not None or ".".join(parts[:end]) in groups:  # a known group's own key is what is wrong
            break
        meant = _meant_whole_key(".".join(parts[:end]), known)
    return meant


def _meant_whole_key(name: str, known: Sequence[str]) -> str | None:
    last = name.rsplit(".", 1)[-1]
    if name in TRL_NAMES and TRL_NAMES[name] in known:  # TRL's flat name, before a nested key that shares it
        return TRL_NAMES[name]
    same_last = [key for key in known if key.rsplit(".", 1)[-1] == last]
    if same_last:
        return max(same_last, key=lambda key: difflib.SequenceMatcher(None, name, key).ratio())
    for names in (TRL_NAMES, VERL_NAMES):
        if last in names and names[last] in known:
            return names[last]
    if any(last in notes for notes in (TRL_ELSEWHERE, VERL_ELSEWHERE, UNSLOTH_ELSEWHERE, SHARED_ELSEWHERE)):
        return None  # said in its note, not taken for a key spelled alike
    close = difflib.get_close_matches(name, known, n=1, cutoff=0.8)
    return close[0] if close else None


def config_paths(args: Sequence[str]) -> list[str]:
    """The files given with ``--config`` in ``args`` (``--config F`` or ``--config=F``), in order."""
    paths = [arg.split("=", 1)[1] for arg in args if arg.startswith("--config=")]
    paths += [args[i + 1] for i, arg in enumerate(args[:-1]) if arg == "--config"]
    return paths


#: Keys inside a setting that take a class or a mapping: their contents are that class's, not options.
_OPAQUE_KEYS = {"class_path", "init_args", "dict_kwargs"}


def unknown_config_keys(config: Any, known: Sequence[str], prefix: str = "") -> list[str]:
    """The dotted keys of a loaded YAML ``config`` that no option in ``known`` takes: a known option's value is
    taken whole; a key that only begins known options (a section) is looked into, and so is an unknown mapping
    (verl's ``actor_rollout_ref.actor``), whose keys the parser names one by one, as it does its first."""
    known_set = set(known)
    sections = {key.rsplit(".", n)[0] for key in known for n in range(1, key.count(".") + 1)}
    unknown = []
    for key, value in (config.items() if isinstance(config, dict) else ()):
        name = f"{prefix}{key}"
        if key in _OPAQUE_KEYS or (name in known_set and name not in sections):
            continue
        unknown_mapping = name not in known_set and isinstance(value, dict) and value and \
            not _OPAQUE_KEYS & value.keys()
        if (name in sections and isinstance(value, dict)) or unknown_mapping:
            unknown += unknown_config_keys(value, known, f"{name}.")
        elif name not in known_set:
            unknown.append(name)
    return unknown


def other_unknown_keys(message: str, paths: Sequence[str], known: Sequence[str]) -> str:
    """Where ``message`` refuses one unknown key of a config file in ``paths`` (the parser stops at the first), the
    file's other unknown keys, one a line, each with the option it likely means; else an empty string. A port of
    TRL's flat config gets all its renames at once."""
    refused = _UNKNOWN_KEY.search(message)
    if refused is None:
        return ""
    first = f"{refused.group(1)}.{refused.group(2)}" if refused.group(1) else refused.group(2)
    for path in paths:
        try:
            unknown = unknown_config_keys(yaml.safe_load(Path(path).read_text()), known)
        except (OSError, yaml.YAMLError):
            continue
        if first not in unknown:
            continue
        others = [name for name in unknown if name != first]
        if not others:
            return ""
        shown = [f"'{name}'" + did_you_mean(f"unrecognized arguments: --{name}", known) for name in others]
        return f"\n{path} also holds these unknown keys:\n  " + "\n  ".join(shown)
    return ""


def _peer_note(name: str) -> str | None:
    """What takes the place of TRL's, verl's or Unsloth's setting ``name`` (its last part, or the verl section it is
    in: ``custom_reward_function.path``; one both peers have is said as both's), where lit_grpo has no key for it."""
    last = name.rsplit(".", 1)[-1]
    if last in SHARED_ELSEWHERE:
        return SHARED_ELSEWHERE[last]
    section = next((part for part in reversed(name.split(".")) if part in VERL_ELSEWHERE), None)
    if section is not None:
        return f"verl's {section} {VERL_ELSEWHERE[section]}"
    if last.startswith("vllm_") and last not in TRL_ELSEWHERE:
        return f"TRL's {last} {TRL_ELSEWHERE['use_vllm']}"
    if last in UNSLOTH_ELSEWHERE:
        return f"Unsloth's {last} {UNSLOTH_ELSEWHERE[last]}"
    return f"TRL's {last} {TRL_ELSEWHERE[last]}" if last in TRL_ELSEWHERE else None


def did_you_mean(message: str, known: Sequence[str]) -> str:
    """`` (did you mean 'KEY'?)`` for the unknown option(s) of a parser's ``message``, each with the one of
    ``known`` closest to it (where one is close), else an empty string."""
    if match := _UNKNOWN_KEY.search(message):
        unknown = [f"{match.group(1)}.{match.group(2)}" if match.group(1) else match.group(2)]
    elif "unrecognized arguments:" in message:
        unknown = [token[2:] for token in message.split("unrecognized arguments:", 1)[1].split()
                   if token.startswith("--")]
    else:
        return ""
    unknown = [name.split("=", 1)[0] for name in unknown]
    pairs = [(name, meant) for name in unknown if (meant := _meant_key(name, known))]
    notes = [note for name in unknown if name not in dict(pairs) and (note := _peer_note(name))]
    notes += [also[last] for name, meant in pairs for also, names in ((TRL_ALSO, TRL_NAMES), (VERL_ALSO, VERL_NAMES))
              if (last := name.rsplit(".", 1)[-1]) in also and meant == names[last]]
    hint = "".join(f" ({note})" for note in notes)
    if not pairs:
        return hint
    if len(unknown) == 1:
        return f" (did you mean '{pairs[0][1]}'?{''.join(f' {note}' for note in notes)})"
    return " (did you mean " + ", ".join(f"'{meant}' for '{name}'" for name, meant in pairs) + "?)" + hint
