"""The policy's linears on oneDNN (sampling.cpu_linear): a rollout's, on the plain weights or on copies packed for
the decode step's rows (sibling projections stacked into one), and an update's, forward and backward. Same products
and gradients up to rounding, restored after, chosen where they apply and refused by name where they do not."""

from __future__ import annotations

import copy
import functools
import warnings
import weakref

import pytest
import torch

from lit_grpo.sampling import RolloutEngine, SamplingConfig
from lit_grpo.sampling import cpu_linear
from lit_grpo.sampling.cpu_linear import OneDNNLinear, onednn_linears, resolve_cpu_linear, resolve_update_linear

needs_onednn = pytest.mark.skipif(not torch.backends.mkldnn.is_available(), reason="this torch has no oneDNN")


def _linears(model):
    return [m for m in model.modules() if type(m) is torch.nn.Linear]


@needs_onednn
@pytest.mark.parametrize("kernel", ["onednn", "packed"])
def test_a_model_computes_the_same_logits_on_onednn_and_is_restored_after(tiny_llama, kernel):
    model, _ = tiny_llama
    ids = torch.randint(0, model.config.vocab_size, (3, 7))
    with torch.inference_mode():
        reference = model(input_ids=ids).logits
        with onednn_linears(model, kernel, rows=3):  # 3 rows: the decode step's shape [3, 1]
            assert all("forward" in m.__dict__ for m in _linears(model))
            routed = model(input_ids=ids).logits
            stepped = model(input_ids=ids[:, :1]).logits
        step_reference = model(input_ids=ids[:, :1]).logits
    torch.testing.assert_close(routed, reference, rtol=1e-4, atol=1e-4)
    torch.testing.assert_close(stepped, step_reference, rtol=1e-4, atol=1e-4)
    assert all("forward" not in m.__dict__ for m in _linears(model))


@needs_onednn
def test_packed_copies_serve_exactly_the_decode_steps_rows_and_a_shared_weight_is_packed_once(monkeypatch):
    head = torch.nn.Linear(64, 96, bias=False)
    tied = torch.nn.Linear(64, 96, bias=False)
    tied.weight = head.weight
    model = torch.nn.Sequential(head, tied)
    reorders, weights_read = [], []
    reorder = torch.ops.mkldnn._reorder_linear_weight

    def linear(x, weight, bias=None):
        weights_read.append(weight.is_mkldnn)  # the packed copy is a oneDNN tensor
        return x.new_zeros(*x.shape[:-1], 96)

    monkeypatch.setattr(cpu_linear, "onednn_linear", linear)
    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight",
                        lambda weight, rows: reorders.append(rows) or reorder(weight, rows), raising=False)
    with torch.inference_mode(), onednn_linears(model, "packed", rows=8):
        head(torch.randn(8, 1, 64))   # the decode step: 8 rows of one token
        head(torch.randn(2, 4, 64))   # 8 rows too
        head(torch.randn(1, 12, 64))  # a prefill chunk of 12 tokens: the plain weight
    assert reorders == [8]
    assert weights_read == [True, True, False]


def test_bad_kernels_and_rows_are_refused_by_name():
    linear = torch.nn.Linear(4, 4)
    with pytest.raises(ValueError, match=r"kernel='mkl' is not known; use one of \['packed', 'onednn', 'torch'\]"):
        with onednn_linears(linear, "mkl"):
            pass
    for rows in (0, None, True):
        with pytest.raises(ValueError, match=rf"rows={rows!r} must be an integer >= 1"):
            with onednn_linears(linear, "packed", rows=rows):
                pass


@needs_onednn
def test_the_modules_are_restored_when_the_block_raises(tiny_llama):
    model, _ = tiny_llama
    with pytest.raises(RuntimeError, match="inside"):
        with onednn_linears(model, "packed", rows=2):
            raise RuntimeError("inside")
    assert all("forward" not in m.__dict__ for m in _linears(model))


@needs_onednn
def test_a_forward_set_on_a_module_before_the_block_comes_back_after_it():
    """An instance's own forward (a hook's, an outer block's) is shadowed inside the block and restored on exit."""
    linear = torch.nn.Linear(4, 3)
    linear.forward = lambda x: torch.full((1,), 123.0)
    with onednn_linears(linear, "onednn", rows=1):
        assert linear(torch.ones(1, 4)).shape == (1, 3)  # oneDNN's forward inside
    assert linear(torch.ones(1, 4)).item() == 123.0
    with onednn_linears(linear, "onednn", rows=1):  # nested blocks: the outer patch survives the inner one
        outer = linear.__dict__["forward"]
        with onednn_linears(linear, "onednn", rows=1):
            pass
        assert linear.__dict__["forward"] is outer


@needs_onednn
@pytest.mark.parametrize("kernel", ["onednn", "packed"])
@pytest.mark.parametrize("rows", [2, 5, 16, 33])
def test_each_row_is_computed_alone_so_schedules_stay_bit_identical(kernel, rows):
    """At a given row count, a row's result depends neither on the other rows nor on its position: what same-g
    schedule invariance needs (a rollout's decode steps all have its slots' row count).

    Bit-identical by the kernel's structure, not by numerical luck: oneDNN reduces each output over K in one order
    whatever the other rows hold; it was checked with oneDNN held to AVX2 (ONEDNN_MAX_CPU_ISA=AVX2) as well. Across
    row counts a row may round differently (oneDNN picks its kernel by the count, and builds differ: torch 2.11's at
    every count below 16 on an AVX2 CPU, 2.13's at one row), so that is not asserted."""
    linear = torch.nn.Linear(64, 96)
    x = torch.randn(rows, 1, 64)
    permutation = torch.randperm(rows)
    other = x.clone()
    other[1:] = torch.randn(rows - 1, 1, 64)
    with torch.inference_mode(), onednn_linears(linear, kernel, rows=rows):
        full = linear(x)
        assert torch.equal(linear(x[permutation]), full[permutation])
        assert torch.equal(linear(other)[0], full[0])


@needs_onednn
def test_a_rollout_runs_its_linears_on_onednn_only_when_chosen(tiny_llama, monkeypatch):
    model, tokenizer = tiny_llama
    weights_read = []
    original = cpu_linear.onednn_linear

    def recorded(x, weight, bias=None):
        weights_read.append(weight.is_mkldnn)  # a packed copy is a oneDNN tensor
        return original(x, weight, bias)

    monkeypatch.setattr(cpu_linear, "onednn_linear", recorded)
    outputs = {}
    for setting in ("torch", "onednn", "packed", "auto"):
        weights_read.clear()
        engine = RolloutEngine(model, tokenizer, group_size=4, micro_group_size=2, strategy="continuous",
                               max_new_tokens=6, temperature=0.0, cpu_linear=setting)
        result = engine.generate([[5, 6, 7, 8]])
        outputs[setting] = result
        # packed: the prompt's prefill reads the plain weights, the decode steps the packed copies
        assert set(weights_read) == {"torch": set(), "onednn": {False}}.get(setting, {False, True}), setting
        assert all("forward" not in m.__dict__ for m in _linears(model))  # the update gets torch's kernels back
    for setting in ("onednn", "packed", "auto"):
        for ours, theirs in zip(outputs[setting].logprobs, outputs["torch"].logprobs):
            torch.testing.assert_close(torch.tensor(ours), torch.tensor(theirs), rtol=1e-4, atol=1e-4)


@needs_onednn
def test_a_rollouts_packed_copies_are_freed_when_it_ends_so_none_reach_the_update_or_the_next_rollout(
        tiny_llama, monkeypatch):
    # a CPU step's host memory (docs/benchmarks.md) counts one packed copy of the linears, alive only in a rollout
    model, tokenizer = tiny_llama
    alive: list[weakref.ref] = []
    reorder = torch.ops.mkldnn._reorder_linear_weight

    def recorded(weight, rows):
        packed = reorder(weight, rows)
        alive.append(weakref.ref(packed))
        return packed

    monkeypatch.setattr(torch.ops.mkldnn, "_reorder_linear_weight", recorded, raising=False)
    engine = RolloutEngine(model, tokenizer, group_size=4, micro_group_size=2, strategy="continuous",
                           max_new_tokens=6, temperature=0.0, cpu_linear="packed")
    stacked = sum(len(members) - 1 for _, members in cpu_linear._shared_input_siblings(model))
    for _ in range(2):
        alive.clear()
        engine.generate([[5, 6, 7, 8]])
        assert len(alive) == len({id(m.weight) for m in _linears(model)}) - stacked  # one copy per weight or stack
        assert [ref for ref in alive if ref() is not None] == []


def test_auto_takes_packed_onednn_only_for_a_float32_cpu_policy_and_an_uncompiled_step(tiny_llama):
    model, _ = tiny_llama
    onednn = torch.backends.mkldnn.is_available()
    assert resolve_cpu_linear("torch", model, compiled=False, sharded=False) == "torch"
    assert resolve_cpu_linear("auto", model, compiled=False, sharded=False) == ("packed" if onednn else "torch")
    assert resolve_cpu_linear("onednn", model, compiled=False, sharded=False) == ("onednn" if onednn else "torch")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_cpu_linear("auto", model, compiled=True, sharded=False) == "torch"
        # a sharded policy's whole weights exist only inside its forward: oneDNN, unpacked
        assert resolve_cpu_linear("auto", model, compiled=False, sharded=True) == ("onednn" if onednn else "torch")
    half = torch.nn.Linear(4, 4).to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_cpu_linear("auto", half, compiled=False, sharded=False) == "torch"  # auto stays quiet


def test_onednn_asked_for_where_it_cannot_run_warns_once_naming_why(tiny_llama):
    half = torch.nn.Linear(4, 4).to(torch.bfloat16)
    cpu_linear._warned.clear()
    with pytest.warns(RuntimeWarning, match="cpu_linear='onednn', but the policy's weights are bfloat16, not float32"):
        assert resolve_cpu_linear("onednn", half, compiled=False, sharded=False) == "torch"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_cpu_linear("onednn", half, compiled=False, sharded=False) == "torch"  # once
    with pytest.warns(RuntimeWarning, match="cpu_linear='packed', but the decode step is compiled"):
        assert resolve_cpu_linear("packed", half, compiled=True, sharded=False) == "torch"


@needs_onednn
def test_packed_asked_for_on_a_sharded_policy_warns_once_and_runs_unpacked(tiny_llama):
    model, _ = tiny_llama
    cpu_linear._warned.clear()
    with pytest.warns(RuntimeWarning, match=r"cpu_linear='packed', but the policy is FSDP-sharded .*; the rollout uses "
                                            r"oneDNN on the gathered weights, unpacked"):
        assert resolve_cpu_linear("packed", model, compiled=False, sharded=True) == "onednn"
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert resolve_cpu_linear("packed", model, compiled=False, sharded=True) == "onednn"  # once


def test_an_unknown_cpu_linear_is_refused_naming_the_choices():
    with pytest.raises(ValueError, match=r"sampling.cpu_linear='mkl' is not known; use one of \['auto', 'packed', "
                                         r"'onednn', 'torch'\]"):
        SamplingConfig(cpu_linear="mkl")


@needs_onednn
def test_sibling_projections_of_a_decoder_layer_are_one_product_over_their_stacked_weights(tiny_llama, monkeypatch):
    """Queries, keys and values (and gate and up) read one packed copy of their stacked weights in a decode step:
    4 products per layer instead of 7, and the head's; the logits are those of the plain weights."""
    model, _ = tiny_llama
    layers = model.config.num_hidden_layers
    products = []
    original = cpu_linear.onednn_linear
    monkeypatch.setattr(cpu_linear, "onednn_linear",
                        lambda x, weight, bias=None: products.append(weight.is_mkldnn) or original(x, weight, bias))
    ids = torch.randint(0, model.config.vocab_size, (3, 1))
    with torch.inference_mode():
        reference = model(input_ids=ids).logits
        with onednn_linears(model, "packed", rows=3):
            stacked = model(input_ids=ids).logits
    assert products == [True] * (4 * layers + 1)
    torch.testing.assert_close(stacked, reference, rtol=1e-4, atol=1e-4)
    assert not any(m._forward_pre_hooks for m in model.modules())  # the stacks' hooks go with the block


class _Attention(torch.nn.Module):
    """Three sibling projections; ``forward`` calls those named, in turn, on one input."""

    def __init__(self):
        super().__init__()
        self.q_proj = torch.nn.Linear(64, 48)
        self.k_proj, self.v_proj = torch.nn.Linear(64, 16), torch.nn.Linear(64, 16)

    def forward(self, x, names=("q_proj", "k_proj", "v_proj")):
        return [getattr(self, name)(x) for name in names]

    def reference(self, x, name):
        return torch.nn.functional.linear(x, getattr(self, name).weight, getattr(self, name).bias)


@needs_onednn
def test_stacked_projections_compute_once_per_shared_input_and_again_for_another(monkeypatch):
    attention = _Attention()
    products = []
    original = cpu_linear.onednn_linear
    monkeypatch.setattr(cpu_linear, "onednn_linear",
                        lambda x, weight, bias=None: products.append(1) or original(x, weight, bias))
    x, y = torch.randn(4, 1, 64), torch.randn(4, 1, 64)
    close = functools.partial(torch.testing.assert_close, rtol=1e-5, atol=1e-5)
    with torch.inference_mode(), onednn_linears(attention, "packed", rows=4):
        for ours, name in zip(attention(x), ("q_proj", "k_proj", "v_proj")):
            close(ours, attention.reference(x, name))
        assert len(products) == 1  # one product for the three
        attention.q_proj(x)
        attention.q_proj(x)  # the same member twice: its second call is another input's
        close(attention.k_proj(y), attention.reference(y, "k_proj"))  # another input
        assert len(products) == 4
        w = torch.randn(4, 1, 64)  # made in inference mode: no version counter
        attention(w, names=("q_proj",))
        w.mul_(2)  # in place between the parent's calls
        close(attention(w, names=("k_proj",))[0], attention.reference(w, "k_proj"))  # the parent's call forgot w
        assert len(products) == 6
    z = torch.randn(4, 1, 64)
    with torch.no_grad(), onednn_linears(attention, "packed", rows=4):
        attention.q_proj(z)
        z.mul_(2)  # in place inside the parent's forward: a tensor with a version counter is computed again
        close(attention.k_proj(z), attention.reference(z, "k_proj"))
        assert len(products) == 8


@needs_onednn
def test_a_stacked_products_rows_do_not_depend_on_each_other():
    """What same-g schedule invariance needs of the stacked path: a row's result does not depend on its position or
    on the other rows (bit-identical by the kernel's structure, as in the test of a single linear above)."""
    attention = _Attention()
    x = torch.randn(16, 1, 64)
    permutation = torch.randperm(16)
    other = x.clone()
    other[1:] = torch.randn(15, 1, 64)
    with torch.inference_mode(), onednn_linears(attention, "packed", rows=16):
        full = attention(x)
        for ours, theirs in zip(attention(x[permutation]), full):
            assert torch.equal(ours, theirs[permutation])
        for ours, theirs in zip(attention(other), full):
            assert torch.equal(ours[0], theirs[0])


@needs_onednn
def test_sibling_projections_are_found_by_name_under_one_parent_and_through_peft_adapters(tiny_llama):
    from peft import LoraConfig, get_peft_model

    model, _ = tiny_llama
    names = {id(m): n for n, m in model.named_modules()}
    found = [[names[id(m)] for m in members] for _, members in cpu_linear._shared_input_siblings(model)]
    assert [[n.rsplit(".", 1)[-1] for n in members] for members in found] == \
        [["q_proj", "k_proj", "v_proj"], ["gate_proj", "up_proj"]] * model.config.num_hidden_layers
    adapted = get_peft_model(copy.deepcopy(model), LoraConfig(r=2, target_modules=["q_proj", "v_proj", "up_proj"]))
    for name, parameter in adapted.named_parameters():
        if "lora_B" in name:  # LoRA starts at zero; an adapter that counts changes the logits
            torch.nn.init.normal_(parameter, std=0.5)
    parent, members = cpu_linear._shared_input_siblings(adapted)[0]
    names = {id(m): n for n, m in adapted.named_modules()}
    assert names[id(parent)].endswith("layers.0.self_attn")
    assert [names[id(m)].split("self_attn.")[1] for m in members] == \
        ["q_proj.base_layer", "k_proj", "v_proj.base_layer"]
    ids = torch.randint(0, model.config.vocab_size, (3, 1))
    with torch.inference_mode():
        reference = adapted(input_ids=ids).logits
        with onednn_linears(adapted, "packed", rows=3):
            stacked = adapted(input_ids=ids).logits
    assert not torch.allclose(reference, model(input_ids=ids).logits, rtol=1e-3, atol=1e-3)
    torch.testing.assert_close(stacked, reference, rtol=1e-4, atol=1e-4)
    mixed = torch.nn.Module()  # an input size or a bias that differs keeps a set apart
    mixed.q_proj, mixed.k_proj, mixed.v_proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 4), torch.nn.Linear(6, 4)
    mixed.gate_proj, mixed.up_proj = torch.nn.Linear(8, 8), torch.nn.Linear(8, 8, bias=False)
    assert cpu_linear._shared_input_siblings(mixed) == []


# ---------------------------------------------------------------------------------------------------- the update
@needs_onednn
@pytest.mark.parametrize("shape, bias, wanted", [((5, 64), True, (True, True, True)), ((2, 3, 64), False, (True, True)),
                                                 ((4, 1, 64), True, (False, True, True)),
                                                 ((6, 64), True, (True, False, False))])
def test_the_update_linear_has_torchs_gradients_to_rounding(shape, bias, wanted):
    torch.manual_seed(0)
    x, weight = torch.randn(*shape), torch.randn(48, 64) * 0.1
    inputs = [x, weight] + ([torch.randn(48)] if bias else [])
    grads = {}
    for name, linear in (("onednn", OneDNNLinear.apply), ("torch", torch.nn.functional.linear)):
        leaves = [t.clone().requires_grad_(w) for t, w in zip(inputs, wanted)]
        out = linear(*leaves) if bias else linear(*leaves, None)
        out.backward(torch.linspace(-1, 1, out.numel()).view(out.shape))
        grads[name] = (out.detach(), [leaf.grad for leaf in leaves])
    torch.testing.assert_close(grads["onednn"][0], grads["torch"][0], rtol=1e-5, atol=1e-5)
    for ours, theirs, w in zip(grads["onednn"][1], grads["torch"][1], wanted):
        assert (ours is None) == (not w)  # only what needs a gradient gets one
        if w:
            torch.testing.assert_close(ours, theirs, rtol=1e-5, atol=1e-5)


@needs_onednn
def test_a_models_backward_under_onednn_linears_equals_torchs_and_a_tied_head_gets_both_parts(tiny_llama):
    model = copy.deepcopy(tiny_llama[0]).train()
    ids = torch.randint(0, model.config.vocab_size, (2, 9))
    grads = {}
    for kernel in ("torch", "onednn"):
        model.zero_grad(set_to_none=True)
        with onednn_linears(model, kernel):
            model(input_ids=ids, labels=ids).loss.backward()
        grads[kernel] = {name: p.grad.clone() for name, p in model.named_parameters() if p.grad is not None}
    assert grads["onednn"].keys() == grads["torch"].keys() and len(grads["torch"]) == len(list(model.parameters()))
    for name, theirs in grads["torch"].items():
        torch.testing.assert_close(grads["onednn"][name], theirs, rtol=1e-4, atol=1e-5, msg=name)
    assert all("forward" not in m.__dict__ for m in _linears(model))


def test_the_update_takes_onednn_for_a_float32_unsharded_policy_off_intel_and_torch_elsewhere(tiny_llama,
                                                                                              monkeypatch):
    model, _ = tiny_llama
    onednn = torch.backends.mkldnn.is_available()
    monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda: "AuthenticAMD")
    assert resolve_update_linear("auto", model, sharded=False) == ("onednn" if onednn else "torch")
    assert resolve_update_linear("torch", model, sharded=False) == "torch"
    monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda: "GenuineIntel")  # MKL, torch's kernel, at full width
    assert resolve_update_linear("auto", model, sharded=False) == "torch"
    assert resolve_update_linear("onednn", model, sharded=False) == ("onednn" if onednn else "torch")
    monkeypatch.setattr(cpu_linear, "cpu_vendor", lambda: "AuthenticAMD")
    half = torch.nn.Linear(4, 4).to(torch.bfloat16)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # auto stays quiet where oneDNN does not apply
        assert resolve_update_linear("auto", model, sharded=True) == "torch"
        assert resolve_update_linear("auto", half, sharded=False) == "torch"
    cpu_linear._warned.clear()
    with pytest.warns(RuntimeWarning, match=r"model.cpu_linear='onednn', but the policy is FSDP-sharded .*; the "
                                            r"update uses torch's F.linear"):
        assert resolve_update_linear("onednn", model, sharded=True) == "torch"
    with pytest.raises(ValueError, match=r"cpu_linear='packed' is not known; use one of \['auto', 'onednn', 'torch'\]"):
        resolve_update_linear("packed", model, sharded=False)


def test_the_cpu_vendor_is_read_from_cpuinfo():
    from pathlib import Path

    vendor = cpu_linear.cpu_vendor()
    try:
        listed = Path("/proc/cpuinfo").read_text()
    except OSError:
        assert vendor == ""
    else:
        assert (f": {vendor}\n" in listed) if "vendor_id" in listed else vendor == ""
