"""tools/harness.py: model names, prompts, records and medians every tool shares."""

import argparse
from pathlib import Path

import pytest

from tools import harness


def test_model_aliases_resolve_and_other_names_pass_through(tmp_path):
    assert harness.resolve_model("tiny") == "tiny-llama"
    assert harness.resolve_model("smollm2") == "HuggingFaceTB/SmolLM2-135M-Instruct"
    for name in ("tiny-qwen2", "random:qwen3-1.7b", "owner/model", str(tmp_path)):
        assert harness.resolve_model(name) == name


@pytest.mark.parametrize("name", ["smolm2", "tiny-gpt", "gpt"])
def test_an_unknown_model_name_is_an_error_naming_the_allowed_forms(name):
    with pytest.raises(ValueError, match=rf"model '{name}' is not an alias \(tiny, smollm2\), a tiny model "
                                         r"\(tiny-llama, tiny-qwen2, tiny-gemma3\), random:NAME"):
        harness.resolve_model(name)


def test_an_unknown_random_architecture_is_an_error_naming_the_known_ones():
    with pytest.raises(ValueError, match=r"random:NAME takes one of \['qwen3-0.6b', 'qwen3-1.7b'"):
        harness.resolve_model("random:qwen9")


def test_the_model_argument_rejects_a_misspelt_alias_when_parsed(capsys):
    parser = argparse.ArgumentParser()
    harness.add_model_argument(parser, default="tiny")
    assert parser.parse_args([]).model == "tiny" and parser.parse_args(["--model", "smollm2"]).model == "smollm2"
    with pytest.raises(SystemExit):
        parser.parse_args(["--model", "smolm2"])
    assert "is not an alias (tiny, smollm2)" in capsys.readouterr().err


def test_random_models_default_to_synthetic_prompts():
    assert harness.default_task("random:qwen3-0.6b", None) == "synthetic"
    assert harness.default_task("tiny", None) == "basic_arithmetic"
    assert harness.default_task("tiny", None, real_task="gsm_symbolic") == "gsm_symbolic"
    assert harness.default_task("random:qwen3-0.6b", "gsm_symbolic") == "gsm_symbolic"


def test_synthetic_prompts_are_seeded_sums_with_their_answers():
    first, again, other = (harness.task_examples("synthetic", 5, seed) for seed in (3, 3, 4))
    assert [e.prompt for e in first] == [e.prompt for e in again] != [e.prompt for e in other]
    for example in first:
        a, b = example.prompt.removeprefix("What is ").split("?")[0].split(" + ")
        assert example.answer == str(int(a) + int(b))


def test_task_prompts_render_through_the_chat_template():
    from lit_grpo.rollout.prompts import render_prompt
    from lit_grpo.runtime.models import load_tokenizer

    tokenizer = load_tokenizer("tiny-llama")
    ids = harness.task_prompts(tokenizer, "synthetic", 2, 0)
    assert ids == [render_prompt(tokenizer, e.prompt) for e in harness.task_examples("synthetic", 2, 0)]
    assert ids[0] != tokenizer(harness.task_examples("synthetic", 1, 0)[0].prompt)["input_ids"]  # templated


def test_comma_names_gives_each_name_or_its_value_in_order():
    assert harness.comma_names(("shared", "unshared"))("unshared, Shared") == ["unshared", "shared"]
    assert harness.comma_names({"false": False, "true": True, "auto": "auto"})("true,auto") == [True, "auto"]


@pytest.mark.parametrize(("text", "message"), [
    ("shared,both", "'shared,both': ['both'] not known; use a comma list of ['shared', 'unshared']"),
    ("shared,unshared,shared", "'shared,unshared,shared': ['shared'] given more than once; give each once"),
    (" , ", "' , ': give at least one item, comma-separated"),
])
def test_comma_names_refuses_unknown_repeated_or_no_names_naming_them(text, message):
    with pytest.raises(argparse.ArgumentTypeError) as error:
        harness.comma_names(("shared", "unshared"))(text)
    assert str(error.value) == message


def test_comma_numbers_parses_each_kind_at_or_above_its_minimum():
    assert harness.comma_numbers(1)("1, 2,4") == [1, 2, 4]
    assert harness.comma_numbers(0)("0") == [0]
    assert harness.comma_numbers(1.0, float)("1.0,1.5") == [1.0, 1.5]


@pytest.mark.parametrize(("minimum", "kind", "text", "message"), [
    (1, int, "1,0", "'1,0': use a comma list of ints >= 1"),
    (1, int, "1,x", "'1,x': use a comma list of ints >= 1"),
    (1, int, "1.5", "'1.5': use a comma list of ints >= 1"),
    (1.0, float, "0.5,2", "'0.5,2': use a comma list of floats >= 1.0"),
    (1, int, "2,1,2", "'2,1,2': [2] given more than once; give each once"),
    (1, int, "", "'': give at least one item, comma-separated"),
])
def test_comma_numbers_refuses_bad_small_or_repeated_numbers_naming_them(minimum, kind, text, message):
    with pytest.raises(argparse.ArgumentTypeError) as error:
        harness.comma_numbers(minimum, kind)(text)
    assert str(error.value) == message


def test_comma_checked_keeps_the_items_its_check_accepts_and_refuses_the_rest_with_its_message():
    from lit_grpo.scheduling.length_aware.predictors import parse_predictor_name

    parse = harness.comma_checked(parse_predictor_name)
    assert parse("online, noisy:0.5,oracle") == ["online", "noisy:0.5", "oracle"]
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'online,noisy': length predictor 'noisy' needs its "
                                                         r"spread"):
        parse("online,noisy")
    with pytest.raises(argparse.ArgumentTypeError, match=r"^'online,history': length predictor='history'"):
        parse("online,history")  # a removed predictor is refused with the check's own message
    with pytest.raises(argparse.ArgumentTypeError) as error:
        parse("online,oracle,online")
    assert str(error.value) == "'online,oracle,online': ['online'] given more than once; give each once"


def test_a_comma_list_argument_names_its_flag_when_refused(capsys):
    parser = argparse.ArgumentParser()
    parser.add_argument("--threads", default="1", type=harness.comma_numbers(1))
    assert parser.parse_args([]).threads == [1]  # argparse parses a string default through the type too
    with pytest.raises(SystemExit):
        parser.parse_args(["--threads", "1,1"])
    assert "argument --threads: '1,1': [1] given more than once; give each once" in capsys.readouterr().err


def test_median_leaves_out_missing_values():
    assert harness.median([3.0, None, 1.0, 2.0]) == 2.0
    assert harness.median([4, 1, 2, 3]) == 2.5
    assert harness.median([None, None]) is None and harness.median([]) is None


def test_median_record_takes_each_field_over_the_repeats_and_keeps_them():
    records = [{"strategy": "full", "wall_s": 3.0, "steps": 10, "kv": None},
               {"strategy": "full", "wall_s": 1.0, "steps": 12, "kv": 5},
               {"strategy": "full", "wall_s": 2.0, "steps": 11, "kv": None}]
    out = harness.median_record(records, ("wall_s", "steps", "kv", "absent"))
    assert (out["strategy"], out["wall_s"], out["steps"], out["kv"], out["absent"]) == ("full", 2.0, 11, 5, None)
    assert out["repeats"] == [{"wall_s": r["wall_s"], "steps": r["steps"], "kv": r["kv"], "absent": None}
                              for r in records]
    with pytest.raises(ValueError, match="at least one record"):
        harness.median_record([], ("wall_s",))


def test_config_record_and_write_json(tmp_path):
    args = argparse.Namespace(json=Path("runs/x.json"), seed=3)
    assert harness.config_record(args, device="cpu") == {"json": "runs/x.json", "seed": 3, "device": "cpu"}
    out = tmp_path / "deep" / "er" / "out.json"
    harness.write_json(out, {"a": [1, 2]})
    assert out.read_text() == '{\n  "a": [\n    1,\n    2\n  ]\n}'
    harness.write_json(None, {"a": 1})  # no path: nothing written, no error


def test_repo_env_lets_a_child_import_the_tools():
    import subprocess

    proc = subprocess.run(harness.tool_command("harness"), cwd="/", env=harness.repo_env(), capture_output=True,
                          text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr  # imported from outside the repository
    assert harness.repo_env(EXTRA="1")["EXTRA"] == "1"


def test_the_lit_grpo_command_is_this_interpreters_not_paths_first(tmp_path, monkeypatch):
    """Another environment's ``lit-grpo`` first on PATH (another lit_grpo): the command stays this Python's."""
    import sys

    other = tmp_path / "lit-grpo"
    other.write_text("#!/bin/sh\nexit 1\n")
    other.chmod(0o755)
    monkeypatch.setenv("PATH", f"{tmp_path}:{Path(sys.executable).parent}")
    own = Path(sys.executable).with_name("lit-grpo")
    assert harness.lit_grpo_command() == ([str(own)] if own.is_file() else [sys.executable, "-m", "lit_grpo.cli"])
    assert harness.lit_grpo_script() == own


def test_an_alias_resolves_without_importing_torch():
    """A tool's --model is checked as its arguments are parsed: an alias (every tool's default) costs no torch."""
    import subprocess
    import sys

    check = "import sys; from tools import harness; harness.resolve_model('smollm2'); print('torch' in sys.modules)"
    proc = subprocess.run([sys.executable, "-c", check], env=harness.repo_env(), capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0 and proc.stdout == "False\n", proc.stderr
