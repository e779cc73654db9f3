"""``data.chat_template_kwargs`` (TRL's ``chat_template_kwargs``): more variables for the chat template, each one
the template reads; a name it does not read, lit_grpo's own arguments, or a tokenizer without a template are
refused by name."""

import copy

import pytest

from lit_grpo.datamodules.rollout import RolloutDataModule
from lit_grpo.rollout.prompts import render_prompt
from lit_grpo.runtime.models import load_model_and_tokenizer
from lit_grpo.runtime.validation import ConfigError

#: A Qwen3-like template: ``enable_thinking`` false opens and closes an empty think block.
THINKING = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n"
            "{% if enable_thinking is defined and enable_thinking is false %}<think>\n\n</think>\n\n{% endif %}"
            "{% endif %}")


@pytest.fixture(scope="module")
def thinking():
    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    tokenizer = copy.deepcopy(tokenizer)
    tokenizer.chat_template = THINKING
    return model, tokenizer


def test_the_templates_variables_reach_it(thinking):
    _, tokenizer = thinking
    plain = render_prompt(tokenizer, "What is 2+2?")
    closed = render_prompt(tokenizer, "What is 2+2?", chat_template_kwargs={"enable_thinking": False})
    assert tokenizer.decode(closed).endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert closed[:len(plain)] == plain and len(closed) > len(plain)
    assert render_prompt(tokenizer, "What is 2+2?", chat_template_kwargs={"enable_thinking": True}) == plain


@pytest.mark.parametrize("kwargs, message", [
    ({"enable_thinkin": False}, r"chat_template_kwargs names \['enable_thinkin'\], which this tokenizer's chat "
                                r"template never reads"),
    ({"add_generation_prompt": False}, r"chat_template_kwargs sets \['add_generation_prompt'\], which lit_grpo sets "
                                       r"itself"),
    ({"messages": []}, r"chat_template_kwargs sets \['messages'\], which lit_grpo sets itself"),
    ("enable_thinking", r"chat_template_kwargs='enable_thinking' must be a mapping"),
])
def test_a_bad_variable_is_refused_by_name(thinking, kwargs, message):
    _, tokenizer = thinking
    with pytest.raises(ValueError, match=message):
        render_prompt(tokenizer, "hi", chat_template_kwargs=kwargs)


def test_a_tokenizer_without_a_template_refuses_them(thinking):
    _, tokenizer = thinking
    plain = copy.deepcopy(tokenizer)
    plain.chat_template = None
    with pytest.raises(ValueError, match=r"chat_template_kwargs=\{'enable_thinking': False\} need a chat template"):
        render_prompt(plain, "hi", chat_template_kwargs={"enable_thinking": False})
    assert render_prompt(plain, "hi", chat_template_kwargs={}) == render_prompt(plain, "hi")


def test_the_datamodule_renders_every_prompt_with_them_and_names_the_setting(thinking):
    model, tokenizer = thinking
    prompts = [{"prompt": f"What is {i} + {i}?", "answer": str(2 * i)} for i in range(6)]
    data = RolloutDataModule(prompts=prompts, val_size=2, chat_template_kwargs={"enable_thinking": False})
    data.setup("fit")
    data.attach(model, tokenizer)
    assert all(tokenizer.decode(ids).endswith("</think>\n\n") for ids in data.train_prompt_ids + data.val_prompt_ids)
    with pytest.raises(ValueError, match=r"chat_template_kwargs sets \['tokenize'\]"):
        RolloutDataModule(prompts=prompts, chat_template_kwargs={"tokenize": False})
    typo = RolloutDataModule(prompts=prompts, val_size=2, chat_template_kwargs={"thinking": False})
    typo.setup("fit")
    with pytest.raises(ConfigError, match=r"^data.chat_template_kwargs names \['thinking'\]"):
        typo.attach(model, tokenizer)


def test_apply_chat_template_false_tokenizes_a_string_prompt_as_its_text_and_templates_a_chat_prompt(thinking):
    """TRL's standard format: a string prompt is the text the model reads, tokenized as the tokenizer does any text
    (``processing_class(text=prompts)``); a chat-format prompt goes through the template all the same."""
    model, tokenizer = thinking
    prompts = [{"prompt": f"Q: What is {i} + {i}?\nA:", "answer": str(2 * i)} for i in range(4)]
    prompts += [{"prompt": [{"role": "user", "content": f"What is {i} + {i}?"}], "answer": str(2 * i)}
                for i in range(4)]
    data = RolloutDataModule(prompts=prompts, val_size=0, prompt_template="{prompt}", apply_chat_template=False)
    data.setup("fit")
    data.attach(model, tokenizer)
    rendered = dict(zip(data.train_indices, data.train_prompt_ids))
    for i in range(4):
        assert rendered[i] == tokenizer(prompts[i]["prompt"])["input_ids"]
        assert tokenizer.decode(rendered[4 + i]).endswith("<|im_start|>assistant\n")
    templated = RolloutDataModule(prompts=prompts[:4], val_size=0)
    templated.setup("fit")
    templated.attach(model, tokenizer)
    assert all(tokenizer.decode(ids).endswith("<|im_start|>assistant\n") for ids in templated.train_prompt_ids)


@pytest.mark.parametrize("kwargs, message", [
    ({"apply_chat_template": "no"}, r"apply_chat_template='no' must be"),
    ({"apply_chat_template": False, "tools": ["math"]}, r"apply_chat_template=False tokenizes string prompts as "
                                                         r"plain text, but tools .* drop one of the two"),
])
def test_a_bad_apply_chat_template_is_refused_by_name(kwargs, message):
    with pytest.raises(ValueError, match=message):
        RolloutDataModule(prompts=["1 + 1", "2 + 2"], **kwargs)
