"""``cast_lm_head_to_fp32`` (lit_grpo/runtime/head_precision.py, ``GRPOModule(cast_lm_head_to_fp32=True)``): every
place that computes the output head's logits, the update's log-probs (chunked and full), the reference's and the
rollout engine's prefill and decode steps, does so in float32 from float32 weights, under bf16 autocast over float32
master weights and in a bfloat16 model; a tied embedding keeps handing the layers the model's dtype."""

import copy

import pytest
import torch
from precision_helpers import WeightCasts
from torch.utils._python_dispatch import TorchDispatchMode

from lit_grpo import GRPOModule
from lit_grpo.runtime.distributed import CastWeights, cast_names
from lit_grpo.runtime.head_precision import (Float32Head, cast_lm_head_to_fp32, check_float32_head, layers_dtype)
from lit_grpo.runtime.models import load_model_and_tokenizer, with_lora
from lit_grpo.runtime.validation import ConfigError
from lit_grpo.sampling import RolloutEngine
from lit_grpo.sampling.cpu_linear import onednn_problem
from lit_grpo.sampling.kv_cache import kv_cache_dtype
from lit_grpo.update.logprobs import completion_logits, completion_logps, token_logps
from test_logprobs import micro_batch
from test_module import make_datamodule

#: The precisions lit_grpo trains in with a bfloat16 computation: bf16 autocast over float32 weights (bf16-mixed)
#: and a bfloat16 model (model.dtype: bfloat16).
PRECISIONS = ["bf16-mixed", "bf16-model"]


class HeadMatmuls(TorchDispatchMode):
    """The dtypes (operands', output's) of every matmul whose output is ``vocab`` wide: the head's forward products
    (none of the tiny models' other products is that wide)."""

    def __init__(self, vocab: int):
        super().__init__()
        self.vocab, self.dtypes = vocab, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func.overloadpacket.__name__
        if ("mm" in name or "linear" in name or "matmul" in name) and isinstance(out, torch.Tensor) \
                and out.dim() >= 1 and out.shape[-1] == self.vocab:
            operands = tuple(a.dtype for a in args if isinstance(a, torch.Tensor))
            self.dtypes.append((operands, out.dtype))
        return out

    def all_float32(self) -> bool:
        return bool(self.dtypes) and all(set(ops) == {torch.float32} and out == torch.float32
                                         for ops, out in self.dtypes)


def load(name: str, precision: str, tied: bool = False):
    """A tiny model in ``precision`` (float32 weights for bf16-mixed, bfloat16 ones for bf16-model), its head tied
    to the embedding when ``tied``."""
    model, tokenizer = load_model_and_tokenizer(name, "bfloat16" if precision == "bf16-model" else None)
    if tied:
        model.lm_head.weight = model.model.embed_tokens.weight
    return model, tokenizer


def autocast(precision: str):
    """Lightning's bf16-mixed autocast (no cast cache), or none."""
    return torch.autocast("cpu", dtype=torch.bfloat16, cache_enabled=False, enabled=precision == "bf16-mixed")


@pytest.mark.parametrize("precision", PRECISIONS)
@pytest.mark.parametrize("tied", [False, True])
def test_the_update_computes_the_head_in_float32_and_its_log_probs_are_a_float32_heads(precision, tied):
    """The chunked and the full-logits path: every head product in float32, and the log-probs those of the model's
    last hidden states times the float32 weight, where the head in the computation's dtype is visibly off."""
    model, _ = load("tiny-llama", precision, tied)
    cast_lm_head_to_fp32(model).train()
    head = model.get_output_embeddings()
    assert type(head) is Float32Head and head.weight.dtype == torch.float32
    micro = micro_batch(model.config.vocab_size, torch.Generator().manual_seed(0))
    mask = micro["completion_mask"].bool()
    with autocast(precision):
        matmuls = HeadMatmuls(model.config.vocab_size)
        with matmuls:
            chunked, _ = completion_logps(model, micro, 0.7, chunk_bytes=3 * 4 * model.config.vocab_size)
            full = token_logps(completion_logits(model, micro, 0.7), micro["completion_ids"]) * mask
        assert matmuls.all_float32(), matmuls.dtypes
        with torch.no_grad():
            hidden = model(input_ids=micro["input_ids"], attention_mask=micro["attention_mask"],
                           position_ids=micro["position_ids"], output_hidden_states=True).hidden_states[-1]
    hidden = hidden[:, -6:-1]  # the states predicting the 5 completion tokens
    assert hidden.dtype == (torch.bfloat16 if precision == "bf16-model" else torch.float32)

    def reference(weight_dtype: torch.dtype) -> torch.Tensor:
        logits = torch.nn.functional.linear(hidden.to(weight_dtype), head.weight.detach().to(weight_dtype)).float()
        return token_logps(logits / 0.7, micro["completion_ids"]) * mask

    float32_head = reference(torch.float32)
    torch.testing.assert_close(chunked.detach(), float32_head)
    torch.testing.assert_close(full.detach(), float32_head)
    assert (reference(torch.bfloat16) - float32_head).abs().max() > 100 * (chunked.detach() - float32_head).abs().max()
    chunked.sum().backward()
    assert head.weight.grad.dtype == torch.float32 and torch.isfinite(head.weight.grad).all()


@pytest.mark.parametrize("name", ["tiny-llama", "tiny-qwen2"])
def test_a_tied_embedding_shares_the_float32_weight_and_hands_the_layers_the_models_dtype(name, prompt_ids):
    """A bfloat16 model whose head is its embedding: the weight becomes float32 for both, the embedding's output
    stays bfloat16 (so the layers compute exactly as before), the KV cache and oneDNN's check read the layers'
    dtype, and a deep copy (the rollout's replicas) keeps it all."""
    model, tokenizer = load(name, "bf16-model", tied=True)
    model.eval()
    before = copy.deepcopy(model)
    cast_lm_head_to_fp32(model)
    embedding = model.get_input_embeddings()
    assert embedding.weight is model.lm_head.weight and embedding.weight.dtype == torch.float32
    assert layers_dtype(model) == torch.bfloat16 and kv_cache_dtype(model) == torch.bfloat16
    assert "weights are bfloat16, not float32" in onednn_problem(model)  # oneDNN's kernels are for float32 layers
    ids = torch.tensor([prompt_ids[0]])
    with torch.no_grad():
        for copied in (model, copy.deepcopy(model)):
            assert copied.get_input_embeddings()(ids).dtype == torch.bfloat16
            out = copied(ids, output_hidden_states=True)
            expected = before(ids, output_hidden_states=True)
            assert all(torch.equal(a, b) for a, b in zip(out.hidden_states, expected.hidden_states))
            assert out.logits.dtype == torch.float32
            weight = before.lm_head.weight.float()
            torch.testing.assert_close(out.logits, torch.nn.functional.linear(expected.hidden_states[-1].float(),
                                                                              weight))
    result = RolloutEngine(model, tokenizer, group_size=2, micro_group_size=2, strategy="continuous",
                           max_new_tokens=6, temperature=1.0, seed=0).generate(prompt_ids)
    assert result.stats.generated_tokens > 0


def test_a_packed_prefill_of_a_tied_float32_head_masks_in_the_layers_dtype():
    """An attention other than SDPA gets an additive block mask in the layers' dtype, not ``model.dtype`` (the tied
    float32 embedding, first among the weights, makes it float32)."""
    from lit_grpo.sampling.prefill import pack_chunk, packed_forward

    model, _ = load("tiny-llama", "bf16-model", tied=True)
    model.config._attn_implementation = "eager"
    cast_lm_head_to_fp32(model)
    assert model.dtype == torch.float32
    chunk = pack_chunk([[1, 2, 3], [4, 5]], torch.device("cpu"))
    with packed_forward(model, chunk) as inputs:
        assert inputs["attention_mask"].dtype == torch.bfloat16


def test_a_float32_or_float64_model_keeps_its_head_and_the_cast_is_idempotent():
    model, _ = load_model_and_tokenizer("tiny-llama")
    weight = model.lm_head.weight
    cast_lm_head_to_fp32(cast_lm_head_to_fp32(model))
    assert model.lm_head.weight is weight and weight.dtype == torch.float32
    wide = cast_lm_head_to_fp32(load_model_and_tokenizer("tiny-llama", "float64")[0])
    assert wide.lm_head.weight.dtype == torch.float64  # never narrowed
    assert wide(torch.tensor([[5, 6, 7]])).logits.dtype == torch.float64


@pytest.mark.parametrize("precision", PRECISIONS)
def test_the_rollout_samples_with_a_float32_head_from_the_master_weights(precision, prompt_ids):
    """The engine's prefill and decode steps compute the head in float32; under bf16 autocast the rollout weights
    (CastWeights) leave the head out of their casts and read its float32 master, with no weight cast inside the
    rollout, and sample exactly what the policy under per-step autocast samples; the sampled log-probs are the
    log-softmax of the float32 head's logits of the states the engine hands the head."""
    model, tokenizer = load("tiny-llama", precision, tied=True)
    cast_lm_head_to_fp32(model).eval()
    head = model.lm_head
    seen = []
    hook = head.register_forward_hook(lambda module, args, out: seen.append((args[0].detach(), out.detach())))
    settings = dict(group_size=3, micro_group_size=2, strategy="continuous", max_new_tokens=8, temperature=1.0,
                    seed=3)
    matmuls = HeadMatmuls(model.config.vocab_size)
    with torch.no_grad(), autocast(precision), matmuls:
        reference = RolloutEngine(model, tokenizer, **settings).generate(prompt_ids)
    hook.remove()
    assert matmuls.all_float32(), matmuls.dtypes
    with torch.no_grad():
        assert seen and all(torch.equal(out, torch.nn.functional.linear(states.float(), head.weight))
                            for states, out in seen)
    if precision == "bf16-model":
        return
    assert "lm_head.weight" not in cast_names(model, torch.bfloat16) and cast_names(model, torch.bfloat16)
    weights = CastWeights(model, torch.bfloat16)
    with weights.active() as replica, WeightCasts([*model.parameters(), *replica.parameters()]) as casts:
        assert replica.lm_head.weight is head.weight
        with torch.no_grad(), autocast(precision):
            result = RolloutEngine(replica, tokenizer, **settings).generate(prompt_ids)
    assert casts.count == 0
    assert result.completion_ids == reference.completion_ids and result.logprobs == reference.logprobs


@pytest.mark.parametrize("precision", PRECISIONS)
def test_a_grpo_step_computes_every_head_in_float32_and_the_sampler_agrees_with_the_update(precision):
    """The module's rollout, its update and its reference's log-probs (beta > 0): every head product in float32;
    the sampler's log-probs agree with the update's to the rounding of the bfloat16 layers. Without the setting the
    heads compute in bfloat16 (the count tells them apart)."""
    dtype = "bfloat16" if precision == "bf16-model" else None
    runs = {}
    for flag in (False, True):
        module = GRPOModule(model="tiny-llama", dtype=dtype, max_grad_norm=None, loss={"beta": 0.04},
                            cast_lm_head_to_fp32=flag)
        module.configure_model()
        assert module.ref_model is not None
        assert isinstance(module.ref_model.lm_head, Float32Head) == flag == isinstance(module.policy.lm_head,
                                                                                      Float32Head)
        dm = make_datamodule(module, reward_funcs=["char_fraction", "accuracy"])
        weights = CastWeights(module.policy, torch.bfloat16) if precision == "bf16-mixed" else None
        dm.attach(module.policy, module.tokenizer, precision_context=lambda: autocast(precision),
                  rollout_weights=weights)
        matmuls = HeadMatmuls(module.policy.config.vocab_size)
        with matmuls:
            batch = dm.build_train_batch()
            with autocast(precision):
                metrics = module.grpo_step(batch, torch.optim.SGD(module.policy.parameters(), lr=0.0))
        runs[flag] = matmuls, metrics
    assert runs[True][0].all_float32(), runs[True][0].dtypes
    assert any(out == torch.bfloat16 for _, out in runs[False][0].dtypes)
    assert runs[True][1]["sampling/sampling_logp_difference/max"] < 0.05


def test_a_lora_adapter_on_the_head_and_fsdp_are_refused():
    module = GRPOModule(model="tiny-llama", cast_lm_head_to_fp32=True,
                        peft_config={"r": 4, "lora_alpha": 8, "target_modules": ["q_proj", "lm_head"]})
    with pytest.raises(ConfigError, match=r"model.peft_config: cast_lm_head_to_fp32 does not support a LoRA adapter "
                                          r"on the output head .*remove the head"):
        module.configure_model()
    with pytest.raises(ValueError, match=r"cast_lm_head_to_fp32=True is not supported with fsdp=True"):
        GRPOModule(model="tiny-llama", cast_lm_head_to_fp32=True, fsdp=True)
    with pytest.raises(ValueError, match=r"cast_lm_head_to_fp32='true' must be True or False"):
        GRPOModule(model="tiny-llama", cast_lm_head_to_fp32="true")


_SHARDED_HEADS = """
import os, sys, torch, torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from lit_grpo.runtime.distributed import shard_decoder_layers
from lit_grpo.runtime.head_precision import Float32Head, cast_lm_head_to_fp32
from lit_grpo.runtime.models import load_model_and_tokenizer

os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=sys.argv[1])
dist.init_process_group("gloo", rank=0, world_size=1)
mesh = init_device_mesh("cpu", (1,))


def tied():
    model = load_model_and_tokenizer("tiny-llama")[0]
    model.lm_head.weight = model.model.embed_tokens.weight
    return model


def refused(call):
    try:
        call()
    except ValueError as error:
        return str(error)
    return "accepted"


sharded = tied()
shard_decoder_layers(sharded, mesh, torch.bfloat16)
print("CAST AFTER:", refused(lambda: cast_lm_head_to_fp32(sharded)))
print("SHARD AFTER:", refused(lambda: shard_decoder_layers(cast_lm_head_to_fp32(tied()), mesh, torch.bfloat16)))
model = cast_lm_head_to_fp32(tied())
shard_decoder_layers(model, mesh)  # gathered in the weights' own dtype: the head stays float32
seen = []
model.lm_head.register_forward_hook(lambda module, args, out: seen.append(module.weight.dtype))
with torch.autocast("cpu", dtype=torch.bfloat16):
    logits = model(input_ids=torch.tensor([[5, 6, 7]])).logits
print("OWN DTYPE:", seen, logits.dtype)
dist.destroy_process_group()
"""


def test_fsdp2_gathering_a_float32_head_in_bfloat16_is_refused_by_both_functions(tmp_path):
    """FSDP2 (gloo, one CPU rank: what is refused does not depend on the ranks) gathers a sharded weight in its
    mixed precision's param_dtype, the tied head's with the root's: a head cast after sharding, or sharded after
    the cast with a bfloat16 gather, would compute from bfloat16 weights. Gathered in its own dtype it stays
    float32."""
    import forked_cli
    from tools.harness import ROOT, free_port, repo_env

    script = tmp_path / "sharded_heads.py"
    script.write_text(_SHARDED_HEADS)
    # a process of its own for the process group, forked warm (an interpreter's start is most of the time)
    out = forked_cli.run([str(free_port())], ROOT, repo_env(), timeout=300, script=str(script))
    assert out.returncode == 0, out.stderr[-3000:]
    lines = dict(line.split(": ", 1) for line in out.stdout.splitlines() if ": " in line)
    assert lines["CAST AFTER"].startswith("cast_lm_head_to_fp32 needs an unsharded output head; FSDPLlamaForCausalLM's "
                                          "is sharded by FSDP2"), lines
    assert lines["SHARD AFTER"].startswith("fsdp: the output head 'lm_head' computes in float32 "
                                           "(cast_lm_head_to_fp32), but FSDP2 would gather its weight in "
                                           "torch.bfloat16"), lines
    assert lines["OWN DTYPE"] == "[torch.float32] torch.float32", lines


def test_an_adapter_elsewhere_and_a_trained_copy_of_the_head_keep_it_float32():
    """LoRA on the layers, the head trained whole (peft's ``modules_to_save``): the head that runs is a float32 one."""
    model = cast_lm_head_to_fp32(load_model_and_tokenizer("tiny-llama", "bfloat16")[0])
    policy = with_lora(model, {"r": 4, "lora_alpha": 8, "target_modules": ["q_proj"], "modules_to_save": ["lm_head"]})
    check_float32_head(policy)
    matmuls = HeadMatmuls(model.config.vocab_size)
    with matmuls:
        logits = policy(input_ids=torch.tensor([[5, 6, 7]])).logits
    assert logits.dtype == torch.float32 and matmuls.all_float32()


def test_a_head_other_than_a_plain_linear_is_refused():
    model, _ = load_model_and_tokenizer("tiny-llama")
    model.lm_head = torch.nn.Sequential(model.lm_head)
    with pytest.raises(ValueError, match=r"needs a plain torch.nn.Linear output head; LlamaForCausalLM has an output "
                                         r"head of type torch.nn.modules.container.Sequential"):
        cast_lm_head_to_fp32(model)
