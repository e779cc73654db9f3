"""``lit-grpo export`` and ``ExportModel``: checkpoints to transformers model directories that load and generate
token for token like lit_grpo's engine, in a process without lit_grpo (tiny models, CPU, float32)."""

import os
from pathlib import Path

import forked_cli
import pytest
import torch
from safetensors.torch import load_file

from lit_grpo.cli import main as cli_main
from lit_grpo.cli.resume import export_command
from lit_grpo.export import export_checkpoint, export_policy
from lit_grpo.update.module import GRPOModule
from precision_helpers import assert_greedy_margin
from tools.check_export import engine_greedy, perturb, prompt_ids_for, transformers_greedy

ROOT = Path(__file__).resolve().parents[1]
LORA = {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "v_proj"]}


def trained_module(model: str, peft_config=None) -> GRPOModule:
    """A GRPOModule whose policy differs from its base (seeded noise stands in for training)."""
    module = GRPOModule(model=model, peft_config=peft_config, max_grad_norm=None)
    module.configure_model()
    perturb(module.policy, scale=0.05)
    return module


def save_checkpoint(module: GRPOModule, path: Path) -> Path:
    """What Lightning's checkpoint holds for export: the module's state_dict and its init arguments."""
    torch.save({"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}, path)
    return path


@pytest.fixture(scope="module")
def tiny_checkpoint(tmp_path_factory):
    module = trained_module("tiny-llama")
    return module, save_checkpoint(module, tmp_path_factory.mktemp("ckpt") / "last.ckpt")


def test_export_round_trip_tiny(tiny_checkpoint, tmp_path, capsys):
    """The exported directory, loaded by transformers alone, generates greedily what lit_grpo's engine generates
    from the same weights; it holds exactly the trained weights, the chat template and the engine's stop ids."""
    module, ckpt = tiny_checkpoint
    out = tmp_path / "model"
    cli_main(["export", "--ckpt_path", str(ckpt), "--out", str(out)])
    assert f"exported {out}" in capsys.readouterr().out
    assert {"config.json", "generation_config.json", "model.safetensors", "tokenizer.json",
            "tokenizer_config.json"} <= {p.name for p in out.iterdir()}
    saved = load_file(out / "model.safetensors")
    for name, value in module.policy.state_dict().items():
        assert torch.equal(saved[name], value), name  # saved copies: exact

    ids = prompt_ids_for(module.tokenizer)
    theirs = transformers_greedy(out, ids, max_new_tokens=12)
    assert not theirs["lit_grpo_imported"]
    for prompt, completion in zip(ids, theirs["completions"]):  # float32, other kernels: no step is a near tie
        assert_greedy_margin(module.policy.eval(), prompt, completion)
    assert theirs["completions"] == engine_greedy(module.policy, module.tokenizer, ids, 12)
    expected = module.tokenizer.apply_chat_template([{"role": "user", "content": "x"}], add_generation_prompt=True,
                                                    tokenize=False)
    assert theirs["templated"] == expected
    assert module.tokenizer.eos_token_id in theirs["eos"]


def test_a_tool_calling_runs_export_stops_at_its_templates_end_of_turn_too(tiny_checkpoint, tmp_path, monkeypatch):
    """A run with data.tools stopped its rollouts at the chat template's end-of-turn token too
    (``ToolBox.stop_token_ids``): the exported generation config's EOS ids hold it, read through the checkpoint's data
    settings, here with the tool-calling tests' template made to end a calling turn with a token that is no EOS."""
    import json

    from datamodule_helpers import datamodule_arguments
    from test_tool_calling import TOOLS_TEMPLATE, add

    import lit_grpo.export as export
    from lit_grpo.datamodules.rollout import RolloutDataModule

    template = TOOLS_TEMPLATE.replace("</tool_call>{% endfor %}<|im_end|>", "</tool_call>{% endfor %}<|endoftext|>")
    assert template != TOOLS_TEMPLATE
    load = export.load_model_and_tokenizer

    def with_template(*args, **kwargs):  # the run's model, whose own tokenizer has this template
        model, tokenizer = load(*args, **kwargs)
        tokenizer.chat_template = template
        return model, tokenizer

    monkeypatch.setattr(export, "load_model_and_tokenizer", with_template)
    module, _ = tiny_checkpoint
    turn_end = module.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    checkpoint = {"state_dict": module.state_dict(), "hyper_parameters": dict(module.hparams)}
    eos = {}
    for tools in (None, [add]):
        data = RolloutDataModule(**datamodule_arguments({"tools": tools}))
        ckpt = tmp_path / f"tools-{bool(tools)}.ckpt"
        torch.save({**checkpoint, "datamodule_hyper_parameters": dict(data.hparams)}, ckpt)
        out = export_checkpoint(ckpt, tmp_path / f"model-{bool(tools)}").out
        eos[bool(tools)] = json.loads((out / "generation_config.json").read_text())["eos_token_id"]
    assert eos[False] == [module.tokenizer.eos_token_id]  # a run without tools: its EOS alone
    assert sorted(eos[True]) == sorted({module.tokenizer.eos_token_id, turn_end})


def test_export_model_of_a_tool_calling_fit_stops_at_its_templates_end_of_turn_too(tmp_path):
    """ExportModel, exporting the live policy when a fit with data.tools ends, adds the rollouts' end-of-turn token
    (``ToolBox.stop_token_ids``) to the EOS ids as ``lit-grpo export`` does."""
    import json
    from types import SimpleNamespace

    from test_module import make_datamodule, make_module
    from test_tool_calling import TOOLS_TEMPLATE, add

    from lit_grpo.callbacks import ExportModel

    module = make_module()
    module.tokenizer.chat_template = TOOLS_TEMPLATE.replace("</tool_call>{% endfor %}<|im_end|>",
                                                            "</tool_call>{% endfor %}<|endoftext|>")
    data = make_datamodule(module, tools=[add])
    data._require_builder()  # built at the first rollout
    turn_end = module.tokenizer.convert_tokens_to_ids("<|endoftext|>")
    callback = ExportModel(dirpath=str(tmp_path / "model"))
    callback.on_train_end(SimpleNamespace(datamodule=data, is_global_zero=True), module)
    eos = json.loads((tmp_path / "model" / "generation_config.json").read_text())["eos_token_id"]
    assert sorted(eos) == sorted({module.tokenizer.eos_token_id, turn_end})


def test_export_lora_merged_and_adapter_only(tmp_path):
    """A LoRA run exports merged by default (round trip token for token) or as peft's adapter alone, which peft
    loads onto the base model with the same logits."""
    from peft import PeftModel

    from lit_grpo.runtime.models import load_model_and_tokenizer

    module = trained_module("tiny-qwen2", LORA)
    ckpt = save_checkpoint(module, tmp_path / "lora.ckpt")
    merged = export_checkpoint(ckpt, tmp_path / "merged")
    assert not merged.adapter_only and not (tmp_path / "merged" / "adapter_config.json").exists()
    saved = load_file(tmp_path / "merged" / "model.safetensors")
    assert not any("lora" in name for name in saved)
    ids = prompt_ids_for(module.tokenizer)
    theirs = transformers_greedy(tmp_path / "merged", ids, max_new_tokens=12)
    for prompt, completion in zip(ids, theirs["completions"]):  # merged and unmerged round apart: no near tie
        assert_greedy_margin(module.policy.eval(), prompt, completion)
    assert theirs["completions"] == engine_greedy(module.policy, module.tokenizer, ids, 12)
    from transformers import AutoModelForCausalLM  # the logits too: merged and unmerged round apart, no more

    reloaded = AutoModelForCausalLM.from_pretrained(tmp_path / "merged").eval()
    with torch.no_grad():
        x = torch.tensor([ids[0]])
        torch.testing.assert_close(reloaded(x).logits, module.policy.eval()(x).logits, rtol=1e-4, atol=1e-5)

    adapter = export_checkpoint(ckpt, tmp_path / "adapter", adapter_only=True)
    assert adapter.adapter_only
    names = {p.name for p in (tmp_path / "adapter").iterdir()}
    assert {"adapter_config.json", "adapter_model.safetensors", "tokenizer.json"} <= names
    assert "model.safetensors" not in names and adapter.bytes < merged.bytes
    base, _ = load_model_and_tokenizer("tiny-qwen2")
    loaded = PeftModel.from_pretrained(base, tmp_path / "adapter").eval()
    x = torch.tensor([ids[0]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, module.policy.eval()(x).logits)


def test_an_adapter_is_exported_as_it_trained(tmp_path):
    """LoRA over a bf16 base: peft trains the adapter in float32, and "auto" writes it so, exactly, without casting
    the live policy; a dtype asked for is what is written."""
    module = GRPOModule(model="tiny-qwen2", dtype="bfloat16", peft_config=LORA, max_grad_norm=None)
    module.configure_model()
    perturb(module.policy, scale=0.05)
    trained = {name: p.detach().clone() for name, p in module.policy.named_parameters() if "lora_" in name}
    assert trained and {p.dtype for p in trained.values()} == {torch.float32}
    export_policy(module.policy, module.tokenizer, tmp_path / "auto", adapter_only=True)
    saved = load_file(tmp_path / "auto" / "adapter_model.safetensors")
    assert {t.dtype for t in saved.values()} == {torch.float32}
    assert sorted(torch.cat([t.flatten() for t in saved.values()]).tolist()) == sorted(
        torch.cat([t.flatten() for t in trained.values()]).tolist())  # the same numbers, not rounded to bf16
    assert all(p.dtype == torch.float32 for name, p in module.policy.named_parameters() if "lora_" in name)
    export_policy(module.policy, module.tokenizer, tmp_path / "bf16", adapter_only=True, dtype="bfloat16")
    assert {t.dtype for t in load_file(tmp_path / "bf16" / "adapter_model.safetensors").values()} == {torch.bfloat16}


def test_exported_files_follow_the_umask(tiny_checkpoint, tmp_path):
    """safetensors writes its files 0600: an export shared with another user (or a container under another uid)
    could not be read. Every file takes the mode any file written under the umask has."""
    module, _ = tiny_checkpoint
    before = os.umask(0o002)
    try:
        export_policy(module.policy, module.tokenizer, tmp_path / "out")
    finally:
        os.umask(before)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (tmp_path / "out").iterdir()}
    assert "model.safetensors" in modes and set(modes.values()) == {0o664}, modes


def test_an_overwritten_exports_other_files_keep_their_modes(tiny_checkpoint, tmp_path):
    """--overwrite replaces the model files alone: a file of the user's in the folder keeps its mode, 0600 too."""
    module, _ = tiny_checkpoint
    out = tmp_path / "out"
    out.mkdir()
    private = out / "reward_model.safetensors"
    private.write_bytes(b"{}")
    private.chmod(0o600)
    before = os.umask(0o002)
    try:
        export_policy(module.policy, module.tokenizer, out, overwrite=True)
    finally:
        os.umask(before)
    modes = {p.name: p.stat().st_mode & 0o777 for p in (private, out / "model.safetensors")}
    assert modes == {"reward_model.safetensors": 0o600, "model.safetensors": 0o664}, modes


def test_export_dtype_halves_the_weights(tiny_checkpoint, tmp_path):
    _, ckpt = tiny_checkpoint
    full = export_checkpoint(ckpt, tmp_path / "fp32")
    half = export_checkpoint(ckpt, tmp_path / "bf16", dtype="bf16")  # the short form, as model.dtype takes it
    assert {t.dtype for t in load_file(tmp_path / "bf16" / "model.safetensors").values()} == {torch.bfloat16}
    weights = lambda d: (d / "model.safetensors").stat().st_size  # noqa: E731
    assert weights(tmp_path / "bf16") == pytest.approx(weights(tmp_path / "fp32") / 2, rel=0.02)
    assert half.bytes < full.bytes


def test_export_auto_writes_the_dtype_a_bf16_true_run_saved(tmp_path):
    """Under ``bf16-true`` Lightning converts the float32-built policy to bf16 and ``model.dtype`` stays null:
    "auto" writes the bf16 weights the checkpoint holds, not the rebuilt model's float32."""
    module = trained_module("tiny-llama")
    module.to(torch.bfloat16)  # what bf16-true's convert_module does
    assert module.hparams["dtype"] is None
    ckpt = save_checkpoint(module, tmp_path / "last.ckpt")
    result = export_checkpoint(ckpt, tmp_path / "model")
    saved = load_file(tmp_path / "model" / "model.safetensors")
    assert result.dtype == torch.bfloat16 and {t.dtype for t in saved.values()} == {torch.bfloat16}
    for name, value in module.policy.state_dict().items():
        assert torch.equal(saved[name], value), name


def test_export_auto_keeps_the_layers_a_model_holds_in_float32(tmp_path):
    """DeepSeek-V3 keeps its MoE router in float32 beside bf16 weights (as transformers loads it): "auto" writes
    every weight in the dtype it has, and so copies nothing; an asked dtype casts them all."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from lit_grpo.runtime import models

    config = AutoConfig.for_model(
        "deepseek_v3", vocab_size=384, hidden_size=64, intermediate_size=128, moe_intermediate_size=32,
        num_hidden_layers=2, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
        n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1, q_lora_rank=16, kv_lora_rank=16,
        qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8, n_shared_experts=1)
    AutoModelForCausalLM.from_config(config).save_pretrained(tmp_path / "saved")
    models.tiny_tokenizer().save_pretrained(tmp_path / "saved")
    policy, tokenizer = models.load_model_and_tokenizer(str(tmp_path / "saved"), "bfloat16")
    own = {name: tensor.dtype for name, tensor in policy.state_dict().items()}
    if set(own.values()) != {torch.bfloat16, torch.float32}:
        pytest.skip(f"this transformers keeps no deepseek_v3 layer in float32 under bf16: {set(own.values())}")
    export_policy(policy, tokenizer, tmp_path / "auto")
    written = load_file(tmp_path / "auto" / "model.safetensors")
    kept = {name for name, dtype in own.items() if dtype == torch.float32}
    assert kept <= set(written)  # (the experts are written one by one, under other names than the fused ones)
    assert {name: written[name].dtype for name in own.keys() & written.keys()} == {
        name: own[name] for name in own.keys() & written.keys()}
    export_policy(policy, tokenizer, tmp_path / "bf16", dtype="bfloat16")
    assert {t.dtype for t in load_file(tmp_path / "bf16" / "model.safetensors").values()} == {torch.bfloat16}


def test_export_auto_of_a_tied_model_with_a_float32_head_is_the_layers_dtype(tmp_path):
    """``cast_lm_head_to_fp32`` on a bfloat16 model whose head is tied to the embedding makes their one weight
    float32, the model's first: the exported config (and the dtype said) is still the layers' bfloat16, so that
    transformers loads the model as it trained, not every layer in float32; the weight itself is written as it
    trained, in float32, from the checkpoint and from the live policy alike."""
    import json

    from lit_grpo.runtime.models import load_model_and_tokenizer

    base, tokenizer = load_model_and_tokenizer("tiny-llama")
    base.config.tie_word_embeddings = True
    type(base)(base.config).save_pretrained(tmp_path / "tied")
    tokenizer.save_pretrained(tmp_path / "tied")
    module = GRPOModule(model=str(tmp_path / "tied"), dtype="bfloat16", cast_lm_head_to_fp32=True, max_grad_norm=None)
    module.configure_model()
    perturb(module.policy, scale=0.05)
    embedding = module.policy.get_input_embeddings().weight
    assert embedding is module.policy.get_output_embeddings().weight and embedding.dtype == torch.float32
    checkpoint = export_checkpoint(save_checkpoint(module, tmp_path / "last.ckpt"), tmp_path / "from-ckpt")
    live = export_policy(module.policy, module.tokenizer, tmp_path / "live")
    for result in (checkpoint, live):
        assert result.dtype == torch.bfloat16
        assert json.loads((result.out / "config.json").read_text())["dtype"] == "bfloat16"
        written = load_file(result.out / "model.safetensors")
        assert written["model.embed_tokens.weight"].dtype == torch.float32
        assert torch.equal(written["model.embed_tokens.weight"], embedding.detach())
        assert written["model.layers.0.mlp.up_proj.weight"].dtype == torch.bfloat16


def test_export_of_a_live_policy_leaves_it_as_it_was(tmp_path):
    """ExportModel exports the policy being trained: casting, merging and the exported settings go to copies."""
    module = trained_module("tiny-llama", LORA)
    policy = module.policy
    before = {k: v.clone() for k, v in policy.state_dict().items()}
    use_cache, eos = policy.config.use_cache, policy.generation_config.eos_token_id
    export_policy(policy, module.tokenizer, tmp_path / "bf16", dtype="bfloat16")
    assert module.policy is policy and hasattr(policy, "peft_config")  # still the LoRA model, unmerged
    after = policy.state_dict()
    assert after.keys() == before.keys() and all(torch.equal(after[k], before[k]) for k in before)
    assert (policy.config.use_cache, policy.generation_config.eos_token_id) == (use_cache, eos)


def test_an_overwrite_replaces_an_earlier_exports_model_files(tmp_path):
    """A merged model written over an adapter-only export: transformers would load the directory as the old
    adapter (its adapter_config.json wins), so the earlier export's model files go; other files stay."""
    from transformers import AutoModelForCausalLM

    module = trained_module("tiny-qwen2", LORA)
    out = tmp_path / "model"
    export_policy(module.policy, module.tokenizer, out, adapter_only=True)
    (out / "notes.txt").write_text("mine")
    perturb(module.policy, seed=1, scale=0.5)  # trained on since
    export_policy(module.policy, module.tokenizer, out, overwrite=True)
    names = {p.name for p in out.iterdir()}
    assert not {"adapter_config.json", "adapter_model.safetensors"} & names and "notes.txt" in names
    loaded = AutoModelForCausalLM.from_pretrained(out).eval()
    x = torch.tensor([prompt_ids_for(module.tokenizer)[0]])
    with torch.no_grad():
        torch.testing.assert_close(loaded(x).logits, module.policy.eval()(x).logits)


def test_export_last_without_a_last_ckpt_names_the_checkpoints_it_found(tmp_path, capsys):
    """A run of one's own Lightning script keeps Lightning's ModelCheckpoint's files, no last.ckpt: they are named."""
    folder = tmp_path / "lightning_logs" / "version_0" / "checkpoints"
    folder.mkdir(parents=True)
    for age, name in enumerate(["epoch=2-step=12.ckpt", "epoch=1-step=8.ckpt"]):  # newest first, not by name
        (folder / name).write_bytes(b"")
        os.utime(folder / name, (1e9 - age, 1e9 - age))
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["export", "--ckpt_path", "last", "--root", str(tmp_path), "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2, err
    assert (f"; the checkpoints there, newest first: {folder / 'epoch=2-step=12.ckpt'}, "
            f"{folder / 'epoch=1-step=8.ckpt'} (give one as --ckpt_path)") in err, err


def test_export_last_takes_the_newest_run_checkpoint_under_its_root(tiny_checkpoint, tmp_path, capsys):
    """``--ckpt_path last`` finds what ``fit --ckpt_path last`` would resume: the newest last.ckpt of a run."""
    import shutil

    _, ckpt = tiny_checkpoint
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["export", "--ckpt_path", "last", "--root", str(tmp_path), "--out", str(tmp_path / "a")])
    err = capsys.readouterr().err
    assert exit_info.value.code == 2 and "--ckpt_path last: no last.ckpt in a checkpoints folder" in err
    folder = tmp_path / "lightning_logs" / "version_3" / "checkpoints"
    folder.mkdir(parents=True)
    shutil.copy(ckpt, folder / "last.ckpt")
    cli_main(["export", "--ckpt_path", "last", "--root", str(tmp_path), "--out", str(tmp_path / "model")])
    assert f"exporting {folder / 'last.ckpt'}" in capsys.readouterr().out
    assert (tmp_path / "model" / "model.safetensors").is_file()
    named = tmp_path / "lightning_logs" / "qwen3_grpo" / "version_0" / "checkpoints"  # a logger given a name
    named.mkdir(parents=True)
    shutil.copy(ckpt, named / "last.ckpt")
    cli_main(["export", "--ckpt_path", "last", "--root", str(tmp_path), "--out", str(tmp_path / "m2")])
    assert f"exporting {named / 'last.ckpt'}" in capsys.readouterr().out
    with pytest.raises(SystemExit):  # no abbreviations: --ckpt is not --ckpt_path
        cli_main(["export", "--ckpt", str(ckpt), "--out", str(tmp_path / "m3")])
    assert "the following arguments are required: --ckpt_path" in capsys.readouterr().err


def test_export_errors_name_the_bad_value(tiny_checkpoint, tmp_path, capsys, monkeypatch):
    _, ckpt = tiny_checkpoint
    import lit_grpo.export as export

    loaded = []
    load = export.load_model_and_tokenizer
    monkeypatch.setattr(export, "load_model_and_tokenizer", lambda *args: loaded.append(args) or load(*args))

    def error(*args) -> str:
        with pytest.raises(SystemExit) as exit_info:
            cli_main(["export", *args])
        assert exit_info.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith("error: ") and err.endswith("tip: lit-grpo export --help lists the options\n")  # as fit
        return err

    assert "'missing.ckpt' does not exist" in error("--ckpt_path", "missing.ckpt", "--out", str(tmp_path / "a"))
    assert "is a directory" in error("--ckpt_path", str(tmp_path), "--out", str(tmp_path / "a"))
    foreign = tmp_path / "foreign.ckpt"
    torch.save({"weights": torch.zeros(2)}, foreign)
    assert "not a lit_grpo training checkpoint" in error("--ckpt_path", str(foreign), "--out", str(tmp_path / "a"))
    garbage = tmp_path / "garbage.ckpt"
    garbage.write_bytes(b"not a checkpoint")
    assert "not a readable PyTorch checkpoint" in error("--ckpt_path", str(garbage), "--out", str(tmp_path / "a"))
    assert "--dtype='int8' is not known" in error("--ckpt_path", str(ckpt), "--out", str(tmp_path / "a"),
                                                      "--dtype", "int8")
    assert "--adapter_only needs a LoRA run" in error("--ckpt_path", str(ckpt), "--out", str(tmp_path / "a"),
                                                      "--adapter_only")
    assert not loaded  # every refusal so far came before a model was built
    (tmp_path / "full").mkdir()
    (tmp_path / "full" / "notes.txt").write_text("mine")
    assert "is not empty; pass --overwrite" in error("--ckpt_path", str(ckpt), "--out", str(tmp_path / "full"))
    assert "--ckpt_path" in error("--out", str(tmp_path / "a"))  # argparse names the missing option
    # an --out that cannot be a folder, or none at all (it wrote into the working directory)
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    assert f"--out {blocker / 'sub'} cannot be written (" in error("--ckpt_path", str(ckpt), "--out",
                                                                   str(blocker / "sub"))
    assert "--out '.' names no new directory" in error("--ckpt_path", str(ckpt), "--out", "", "--overwrite")
    assert "--torch_num_threads=100000 must be in [1, " in error("--ckpt_path", str(ckpt), "--out",
                                                                 str(tmp_path / "a"), "--torch_num_threads", "100000")
    # checkpoints whose settings or weights are not GRPOModule's are named, not a traceback
    saved = torch.load(ckpt, weights_only=False)
    odd = tmp_path / "odd.ckpt"
    torch.save({**saved, "hyper_parameters": None}, odd)
    assert "its hyper_parameters are NoneType, not the settings GRPOModule saves" in error(
        "--ckpt_path", str(odd), "--out", str(tmp_path / "a"))
    key = next(k for k in saved["state_dict"] if k.startswith("policy.") and k.endswith("embed_tokens.weight"))
    torch.save({**saved, "state_dict": {**saved["state_dict"], key: torch.zeros(1)}}, odd)
    assert f"its weights do not fit model='tiny-llama': {key[len('policy.'):]} (1,) (the model's" in error(
        "--ckpt_path", str(odd), "--out", str(tmp_path / "a"))
    with pytest.raises(ValueError, match="dtype='int4'"):
        export_policy(torch.nn.Linear(1, 1), None, tmp_path / "b", dtype="int4")


def test_export_help_lists_every_option(capsys):
    with pytest.raises(SystemExit) as exit_info:
        cli_main(["export", "--help"])
    assert exit_info.value.code == 0
    text = capsys.readouterr().out
    for option in ("--ckpt_path", "--out", "--dtype", "--adapter_only", "--overwrite", "bfloat16"):
        assert option in text


def test_fit_with_export_model_callback(tmp_path):
    """A real fit with ExportModel writes version_0/model, prints it under the summary, and it equals what
    lit-grpo export writes from the run's last.ckpt."""
    argv = ["fit", "--config", str(ROOT / "configs" / "tiny.yaml"), "--trainer.max_steps", "1",
            "--torch_num_threads", "1", "--trainer.limit_val_batches", "0",
            "--trainer.callbacks+=lit_grpo.callbacks.ExportModel"]
    proc = forked_cli.run(argv, tmp_path, {**os.environ, "OMP_NUM_THREADS": "1"})
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    run = tmp_path / "lightning_logs" / "version_0"
    assert "model          lightning_logs/version_0/model (transformers model, float32" in proc.stdout
    assert "AutoModelForCausalLM.from_pretrained('lightning_logs/version_0/model')" in proc.stdout
    assert "  export " not in proc.stdout  # the command is named only when nothing was exported
    exported = export_checkpoint(run / "checkpoints" / "last.ckpt", tmp_path / "again")
    ours, theirs = load_file(run / "model" / "model.safetensors"), load_file(exported.out / "model.safetensors")
    # exact: the same weights, copied (no arithmetic on them in either export)
    assert ours.keys() == theirs.keys() and all(torch.equal(ours[k], theirs[k]) for k in ours)


def test_export_command_names_the_run_folder(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    ckpt = tmp_path / "lightning_logs" / "version_3" / "checkpoints" / "last.ckpt"
    assert export_command(ckpt) == ("lit-grpo export --ckpt_path lightning_logs/version_3/checkpoints/last.ckpt "
                                    "--out lightning_logs/version_3/model")


def test_export_model_refuses_a_module_without_a_policy_before_training(tmp_path):
    import lightning.pytorch as pl

    from lit_grpo.callbacks import ExportModel

    class Plain(pl.LightningModule):
        def __init__(self):
            super().__init__()
            self.layer = torch.nn.Linear(2, 1)

        def training_step(self, batch, batch_idx):
            raise AssertionError("no step may run: the callback refuses at setup")

        def train_dataloader(self):
            return torch.utils.data.DataLoader(torch.zeros(4, 2))

        def configure_optimizers(self):
            return torch.optim.SGD(self.parameters(), lr=0.1)

    trainer = pl.Trainer(max_steps=1, callbacks=[ExportModel(dirpath=str(tmp_path / "m"))], logger=False,
                         enable_checkpointing=False, enable_progress_bar=False, enable_model_summary=False)
    with pytest.raises(ValueError, match="ExportModel exports a module's policy and tokenizer .*Plain has no policy "
                                         "or tokenizer"):
        trainer.fit(Plain())


def test_export_model_refuses_a_folder_it_cannot_write_before_training(tmp_path):
    from types import SimpleNamespace

    from lit_grpo.callbacks import ExportModel

    blocker = tmp_path / "a_file"
    blocker.write_text("")
    module = SimpleNamespace(policy=None, tokenizer=None, hparams=SimpleNamespace(fsdp=False, peft_config=None))
    with pytest.raises(ValueError, match=r"ExportModel dirpath .*a_file/model cannot be written \(.*\): give it a "
                                         r"writable folder"):
        ExportModel(dirpath=str(blocker / "model")).setup(SimpleNamespace(), module, "fit")


def test_export_model_resolves_its_folder_on_every_rank():
    """``trainer.log_dir`` broadcasts from rank 0, so every rank reads it, and rank 0 alone exports."""
    from types import SimpleNamespace

    from lit_grpo.callbacks import ExportModel

    read = []

    class Trainer(SimpleNamespace):
        @property
        def log_dir(self):
            read.append(self.is_global_zero)
            return "/nowhere"

    callback = ExportModel()
    callback.on_train_end(Trainer(is_global_zero=False, default_root_dir="."), None)  # rank 1 of 2: no export
    assert read == [False] and callback.result is None


def test_export_model_forgets_an_earlier_fits_export_when_a_fit_starts():
    """A callback object reused for a second fit that fails before exporting reports no export, not the first's."""
    from types import SimpleNamespace

    from lit_grpo.callbacks import ExportModel

    callback = ExportModel()
    callback.result = "the first fit's export"
    module = SimpleNamespace(policy=None, tokenizer=None, hparams=SimpleNamespace(fsdp=False, peft_config=None))
    callback.setup(SimpleNamespace(), module, "fit")
    assert callback.result is None


@pytest.mark.parametrize("omp", [None, "2"])
def test_export_takes_the_cores_this_process_may_use_by_default(tmp_path, monkeypatch, omp):
    """torch's own default thread count is the host's cores; in a 3-CPU container (a cgroup quota) export takes 3,
    and OMP_NUM_THREADS, where set, is left to decide (torch read it when it started)."""
    import lit_grpo.export as export
    import lit_grpo.runtime.validation as validation

    monkeypatch.setattr(validation, "available_cores", lambda: 3)
    if omp is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", omp)
    before = torch.get_num_threads()
    try:
        torch.set_num_threads(5)
        with pytest.raises(SystemExit):  # no such checkpoint: after the threads are settled
            export.main(["--ckpt_path", str(tmp_path / "none.ckpt"), "--out", str(tmp_path / "out")])
        assert torch.get_num_threads() == (3 if omp is None else 5)
    finally:
        torch.set_num_threads(before)
