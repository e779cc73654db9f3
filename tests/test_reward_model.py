"""A trained reward model as a reward function (``reward_model``, TRL's model entries of ``reward_funcs``): what it
reads, that batching and padding leave each score as the model's own, how a config names it, and its errors."""

from pathlib import Path

import pytest
import torch

from lit_grpo.rollout.reward_model import RewardModel
from lit_grpo.rollout.rewards import build_reward_funcs, score_rewards


def save_reward_model(path: Path, chat_template: bool = True) -> str:
    """A random tiny-llama sequence classifier with one label, and the tiny byte tokenizer, saved to ``path``."""
    from transformers import AutoModelForSequenceClassification

    from lit_grpo.runtime.models import load_model_and_tokenizer

    policy, tokenizer = load_model_and_tokenizer("tiny-llama")
    torch.manual_seed(0)
    policy.config.num_labels = 1
    model = AutoModelForSequenceClassification.from_config(policy.config)
    if not chat_template:
        tokenizer.chat_template = None
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def reward_model_path(tmp_path_factory) -> str:
    return save_reward_model(tmp_path_factory.mktemp("rm") / "tiny-rm")


def test_a_batch_scores_each_completion_as_the_model_alone_does(reward_model_path):
    """Completions of different lengths in one right-padded forward (and over batch_size chunks): each score is the
    model's logit on that conversation alone, unpadded."""
    reward = RewardModel(reward_model_path, batch_size=3)
    prompts = ["What is 2 + 2?"] * 4 + ["Name a colour."]
    completions = ["4", "It is four, since 2 + 2 = 4.", "", "five", "blue"]
    scores = reward(prompts, completions)
    texts = reward.texts(prompts, completions)
    assert texts[0] == reward.tokenizer.apply_chat_template(
        [{"role": "user", "content": "What is 2 + 2?"}, {"role": "assistant", "content": "4"}], tokenize=False)
    for text, score in zip(texts, scores):
        ids = reward.tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            alone = float(reward.model(**ids).logits[0, 0])
        assert score == pytest.approx(alone, rel=1e-5, abs=1e-5)
    assert len(set(scores)) == len(scores)  # the texts differ: so do their scores


def test_a_chat_prompts_messages_are_the_conversation_and_a_template_free_tokenizer_concatenates(reward_model_path,
                                                                                           tmp_path):
    reward = RewardModel(reward_model_path)
    history = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "2 + 2?"}]
    (text,) = reward.texts([history], [[{"role": "assistant", "content": "4"}]])  # a chat prompt's, as TRL's
    assert text == reward.tokenizer.apply_chat_template([*history, {"role": "assistant", "content": "4"}],
                                                        tokenize=False)
    plain = RewardModel(save_reward_model(tmp_path / "plain", chat_template=False))
    assert plain.texts(["Q: 2 + 2? A:"], [" 4"]) == ["Q: 2 + 2? A: 4"]
    # a chat prompt without a template: every turn's content, the system's too, none dropped
    assert plain.texts([history], [[{"role": "assistant", "content": "4"}]]) == ["Be brief.\n\n2 + 2?4"]
    # a completion with tool turns (data.tools): every turn is read, not only the last
    turns = [{"role": "assistant", "content": "let me add"}, {"role": "tool", "name": "add", "content": "4"},
             {"role": "assistant", "content": "4"}]
    (text,) = reward.texts([history], [turns])
    assert text == reward.tokenizer.apply_chat_template([*history, *turns], tokenize=False)


def save_bert_reward_model(path: Path, pad_token: str | None = "[PAD]") -> str:
    """A random tiny BERT sequence classifier with one label and a WordPiece tokenizer, saved to ``path``: an
    encoder reward model, whose tokenizer has a pad token (``pad_token``) and no EOS token."""
    from transformers import BertConfig, BertForSequenceClassification, BertTokenizerFast

    path.mkdir(parents=True)
    vocab = ["[PAD]", "[UNK]", "[CLS]", "[SEP]", "[MASK]", *"abcdefghijklmnopqrstuvwxyz0123456789?+=.,"]
    (path / "vocab.txt").write_text("\n".join(vocab) + "\n")
    tokenizer = BertTokenizerFast(vocab_file=str(path / "vocab.txt"), pad_token=pad_token)
    torch.manual_seed(0)
    model = BertForSequenceClassification(BertConfig(vocab_size=len(vocab), hidden_size=16, num_hidden_layers=1,
                                                     num_attention_heads=2, intermediate_size=32, num_labels=1))
    model.save_pretrained(path)
    tokenizer.save_pretrained(path)
    return str(path)


def test_an_encoder_reward_model_without_an_eos_token_scores(tmp_path):
    """A reward model's tokenizer only pads, it never ends a generation: one without an EOS token (BERT's) pads
    with its own pad token, as TRL loads it, and each score is the model's on its text alone."""
    reward = RewardModel(save_bert_reward_model(tmp_path / "bert-rm"), batch_size=2)
    assert reward.tokenizer.eos_token is None and reward.model.config.pad_token_id == reward.tokenizer.pad_token_id
    prompts, completions = ["what is 2+2?"] * 3, ["4", "it is four.", ""]
    scores = reward(prompts, completions)
    for text, score in zip(reward.texts(prompts, completions), scores):
        ids = reward.tokenizer(text, return_tensors="pt", add_special_tokens=False)
        with torch.no_grad():
            assert score == pytest.approx(float(reward.model(**ids).logits[0, 0]), rel=1e-5, abs=1e-5)
    with pytest.raises(ValueError, match=r"has a tokenizer with neither a pad token nor an EOS token"):
        RewardModel(save_bert_reward_model(tmp_path / "no-pad", pad_token=None))


def test_a_config_names_it_by_its_folder_or_as_the_built_in(reward_model_path):
    short, spelled = build_reward_funcs([reward_model_path, {"name": "reward_model", "log_name": "rm2",
                                                              "kwargs": {"model": reward_model_path,
                                                                         "batch_size": 2}}])
    assert isinstance(short.fn, RewardModel) and short.name == "tiny-rm"  # TRL's: the id's last part
    assert isinstance(spelled.fn, RewardModel) and spelled.fn.batch_size == 2 and spelled.name == "rm2"
    scores = score_rewards([short, spelled], ["2 + 2?"] * 2, ["4", "5"], group_size=2)
    torch.testing.assert_close(scores.components["tiny-rm"], scores.components["rm2"])
    torch.testing.assert_close(scores.total, 2 * scores.components["rm2"])


def test_a_folder_given_as_a_path_is_read_as_its_text_is(reward_model_path):
    """A ``pathlib.Path`` (a Python config's) names the folder its text names; it was refused as no hub id or
    folder."""
    by_path = RewardModel(Path(reward_model_path))
    assert by_path.__name__ == "tiny-rm"
    assert by_path(["2 + 2?"], ["4", "5"]) == RewardModel(reward_model_path)(["2 + 2?"], ["4", "5"])
    (func,) = build_reward_funcs([{"name": "reward_model", "kwargs": {"model": Path(reward_model_path)}}])
    assert func.fn(["2 + 2?"], ["4"]) == by_path(["2 + 2?"], ["4"])


def test_a_reward_specs_name_given_as_a_path_names_the_folder_its_text_names(reward_model_path, monkeypatch):
    """A reward spec's name given as a ``pathlib.Path`` (``[Path(folder)]``, ``{"name": Path(folder)}``) is the
    reward model its text names, logged and scored alike, and a run saves it as that text (which builds the same
    reward, and reads as no change on a resume); it was refused as no name, dict or callable. A path whose text
    without a '/' (pathlib drops a './') is that folder too, not a built-in of that name; one holding ':' is refused."""
    from lit_grpo.rollout.rewards import reward_changes, saved_reward_specs
    from lit_grpo.runtime.validation import plain_yaml_values

    folder = Path(reward_model_path)
    short, spelled = build_reward_funcs([folder, {"name": folder, "weight": 2.0, "log_name": "rm2"}])
    (by_text,) = build_reward_funcs([reward_model_path])
    assert isinstance(short.fn, RewardModel) and short.name == by_text.name == "tiny-rm"
    assert isinstance(spelled.fn, RewardModel) and spelled.name == "rm2" and spelled.weight == 2.0
    expected = by_text.fn(["2 + 2?"] * 2, ["4", "5"])
    assert short.fn(["2 + 2?"] * 2, ["4", "5"]) == spelled.fn(["2 + 2?"] * 2, ["4", "5"]) == expected
    saved = plain_yaml_values(saved_reward_specs([folder, {"name": folder, "weight": 2.0, "log_name": "rm2"}]))
    assert saved == [reward_model_path, {"name": reward_model_path, "weight": 2.0, "log_name": "rm2"}]
    assert [reward.name for reward in build_reward_funcs(saved)] == ["tiny-rm", "rm2"]
    assert reward_changes(saved, [folder, {"name": folder, "weight": 2.0, "log_name": "rm2"}]) == []
    # a bare relative path (pathlib drops "./") is the folder, never the built-in of that name
    monkeypatch.chdir(folder.parent)
    for spec in (Path("tiny-rm"), {"name": Path("./tiny-rm")}):
        (relative,) = build_reward_funcs([spec])
        assert isinstance(relative.fn, RewardModel) and relative.name == "tiny-rm"
        assert plain_yaml_values(saved_reward_specs([spec])) in (["./tiny-rm"], [{"name": "./tiny-rm"}])
    with pytest.raises(ValueError, match=r"^reward spec PosixPath\('a:b'\) is a path, which names a reward model's "
                                         r"folder; its text holds a ':'"):
        build_reward_funcs([Path("a:b")])


def test_a_folder_under_the_home_directory_is_read_from_there(reward_model_path, tmp_path, monkeypatch):
    """``~/name``, as the policy's model takes it: the tokenizer and the model are read from the same folder."""
    import shutil

    monkeypatch.setenv("HOME", str(tmp_path))
    shutil.copytree(reward_model_path, tmp_path / "my-rm")
    (func,) = build_reward_funcs(["~/my-rm"])
    assert func.name == "my-rm"
    assert func.fn(["2 + 2?"], ["4"]) == RewardModel(reward_model_path)(["2 + 2?"], ["4"])


@pytest.mark.parametrize("spec, match", [
    ("no/such/reward-model", r"reward_model: model='no/such/reward-model' cannot be loaded as a sequence classifier"),
    ({"name": "reward_model", "kwargs": {"model": "RM", "batch_size": 0}}, r"batch_size=0"),
    ({"name": "reward_model", "kwargs": {"model": "RM", "device": "gpu0"}}, r"device='gpu0' must be 'auto' or a "
                                                                             r"torch device name"),
    ({"name": "RM", "kwargs": {"model": "other"}}, r"names its reward model; its kwargs may not name another"),
    ({"name": "reward_model", "kwargs": {"model": ""}}, r"model='' must be a reward model's hub id or folder"),
    # shown as every check shows a value: a repr of an int of more than 4300 digits failed, and torch.device's
    # ValueError for one beyond a C long got out unnamed
    ({"name": "reward_model", "kwargs": {"model": 10**5000}}, r"^reward_model: model=\(an int of 5001 digits\) must "
                                                              r"be a reward model's hub id or folder$"),
    ({"name": "reward_model", "kwargs": {"model": "RM", "device": 10**5000}},
     r"^reward_model: device=\(an int of 5001 digits\) must be 'auto' or a torch device name"),
    ({"name": "reward_model", "kwargs": {"model": "RM", "device": 2**64}},
     r"^reward_model: device=18446744073709551616 must be 'auto' or a torch device name"),
    ({"name": "RM", "kwargs": {"model": 10**5000}}, r"names its reward model; its kwargs may not name another "
                                                    r"\(model=\(an int of 5001 digits\)\)$"),
])
def test_bad_reward_model_specs_are_refused_by_name(reward_model_path, spec, match):
    if isinstance(spec, dict):
        spec = {**spec, "name": spec["name"].replace("RM", reward_model_path),
                "kwargs": {k: v.replace("RM", reward_model_path) if isinstance(v, str) and v == "RM" else v
                           for k, v in spec["kwargs"].items()}}
    with pytest.raises(ValueError, match=match):
        build_reward_funcs([spec])


def test_a_bad_dtype_is_named_as_the_setting_it_is_not_the_models_load_failure(reward_model_path):
    """A dtype that names no torch dtype is refused before the model loads, as a dtype: wrapped in the load's error
    it read as a model that cannot be loaded as a sequence classifier."""
    with pytest.raises(ValueError, match=r"reward_model: dtype='bf32'") as error:
        build_reward_funcs([{"name": "reward_model", "kwargs": {"model": reward_model_path, "dtype": "bf32"}}])
    assert "cannot be loaded" not in str(error.value)


def test_a_bare_cuda_device_is_resolved_to_the_current_ones_index(monkeypatch):
    """``device: cuda`` names the current CUDA device with its index, as the model's own ``.device`` does: compared
    with ``cuda:0`` the bare name never matched, so every call moved the model again."""
    from lit_grpo.rollout import reward_model

    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(torch.cuda, "current_device", lambda: 1)
    assert reward_model._resolve_device("cuda") == torch.device("cuda", 1)
    assert reward_model._resolve_device("auto") == torch.device("cuda", 1)
    assert reward_model._resolve_device("cuda:0") == torch.device("cuda", 0)
    assert reward_model._resolve_device("cpu") == torch.device("cpu")
