"""The decode step is capturable as a CUDA graph: checked on CPU by running it on the meta device.

A CUDA graph replays kernels only; a step that read a device value on the host (``.item()``, ``bool(tensor)``,
``.tolist()``, ``nonzero``, a data-dependent branch in the model's masking code) would either break the capture or
synchronise every step. Meta tensors have shapes but no data, and every such read raises on them, so a step that
runs on the meta device has none, for the whole forward (transformers' own code included) and the sampling. The
other way round, a tensor built on the host inside the step (``torch.tensor(...)`` moved to the device) would be a
host-to-device copy, which a capture refuses: on the meta device it would show as an op taking a CPU tensor, and
none does.
"""

import functools

import warnings

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_flatten

from lit_grpo.runtime.models import load_model_and_tokenizer
from lit_grpo.sampling import decode_step
from lit_grpo.sampling.decode_step import DecodeStep, StepSettings
from lit_grpo.sampling.kv_cache import SlotKVCache
from scheduler_helpers import trust_predictions

META = torch.device("meta")
SETTINGS = [
    StepSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, force_lengths=False, hidden_states=False,
                 cuda_graph=False),
    StepSettings(temperature=0.7, top_k=5, top_p=0.9, min_p=0.05, force_lengths=True, hidden_states=True,
                 cuda_graph=False),
    StepSettings(temperature=0.0, top_k=0, top_p=1.0, min_p=0.0, force_lengths=False, hidden_states=True,
                 cuda_graph=False),
    StepSettings(temperature=0.7, top_k=5, top_p=1.0, min_p=0.0, force_lengths=False, hidden_states=False,
                 cuda_graph=False, repetition_penalty=1.3),
]


class _HostTensorSpy(TorchDispatchMode):
    """Records every op run under it, and those that take a tensor living on the CPU."""

    def __init__(self):
        super().__init__()
        self.ops, self.host_inputs = [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        inputs, _ = tree_flatten((args, kwargs or {}))
        if any(isinstance(t, torch.Tensor) and t.device.type == "cpu" for t in inputs):
            self.host_inputs.append(str(func))
        return func(*args, **(kwargs or {}))


def test_the_spy_sees_a_host_tensor_moved_into_a_step():
    with _HostTensorSpy() as spy:
        torch.zeros(3, device=META) + torch.tensor([1.0, 2.0, 3.0]).to(META)
    assert spy.host_inputs


def test_the_meta_device_refuses_every_host_read():
    probe = torch.zeros(3, device=META)
    for read in (lambda: probe.sum().item(), lambda: bool(probe[0]), lambda: probe.tolist()):
        with pytest.raises((RuntimeError, NotImplementedError)):
            read()


@pytest.mark.parametrize("name, dtype", [("tiny-llama", "float32"), ("tiny-qwen2", "float32"),
                                         ("random:qwen3-0.6b", "bfloat16"), ("random:llama3.2-1b", "bfloat16")])
@pytest.mark.parametrize("settings", SETTINGS, ids=["sample", "top-k-p-forced-hidden", "greedy-hidden",
                                                    "repetition-penalty"])
def test_the_decode_step_never_reads_a_device_value_on_the_host(name, dtype, settings):
    model, tokenizer = load_model_and_tokenizer(name, dtype=dtype, device=META)
    cache = SlotKVCache(model.config, num_slots=3, width=16, dtype=model.dtype, device=META)
    step = DecodeStep(model.eval(), cache, settings, eos_token_ids=[tokenizer.eos_token_id])
    buffers = [step.input_ids, step.tokens, step.logprobs, cache.lengths, cache.layers[0].keys]
    with torch.inference_mode(), _HostTensorSpy() as spy:
        step._run()
        step._run()
    assert spy.ops and spy.host_inputs == []
    # the step wrote its outputs in place: the same tensors a captured graph would read and write
    assert [t.shape for t in buffers] == [(3, 1), (3,), (3,), (3,), cache.layers[0].keys.shape]
    assert step.tokens is buffers[1] and cache.layers[0].keys is buffers[4]
    if settings.hidden_states:
        assert step.hidden.shape == (3, model.config.hidden_size) and step.hidden.device == META


def _failing_capture(attempts, error=None):
    """A stand-in for ``torch.cuda.Stream``, the first CUDA call of ``DecodeStep.capture``: it raises what a real
    capture raises for an op it refuses (and DecodeStep.capture must raise that one, not its aftermath). Patching
    torch's public API keeps the test off the step's private methods."""
    def stream(device=None, *args, **kwargs):
        attempts.append(device)
        raise error or RuntimeError("operation not permitted when stream is capturing")
    return stream


def test_a_failed_automatic_capture_warns_once_and_runs_the_same_step_eagerly(tiny_llama, prompt_ids, monkeypatch):
    """CUDA is not needed to check the fallback's logic: the capture is made to fail as a real one would."""
    from lit_grpo.sampling import RolloutEngine, engine as engine_module

    model, tokenizer = tiny_llama
    settings = dict(group_size=3, micro_group_size=2, strategy="continuous", max_new_tokens=6, seed=4)
    reference = RolloutEngine(model, tokenizer, **settings).generate(prompt_ids)
    attempts = []
    monkeypatch.setattr(engine_module, "_graphs_available", lambda device: True)
    monkeypatch.setattr(torch.cuda, "Stream", _failing_capture(attempts))
    engine = RolloutEngine(model, tokenizer, **settings)
    with pytest.warns(RuntimeWarning, match="CUDA graph failed .*operation not permitted.*runs it without a graph"):
        first = engine.generate(prompt_ids)
    assert len(attempts) == 1 and engine._step.graph is None and not engine._step.settings.cuda_graph
    assert "operation not permitted" in engine.graph_failure
    # exact: the same eager step on the same shapes and inputs in one process (a determinism claim)
    assert first.completion_ids == reference.completion_ids and first.logprobs == reference.logprobs
    assert first.stats.capture_s > 0  # the failed attempt's time is the capture's, not the decode steps'
    engine.release()
    engine.generate(prompt_ids)  # a new cache and step, but no second attempt (and so no second warning)
    assert len(attempts) == 1


@pytest.mark.parametrize("compiles", [True, False])
def test_a_failed_capture_of_a_compiled_step_compiles_it_without_a_graph_or_gives_the_compiler_up(
        tiny_llama, prompt_ids, monkeypatch, compiles):
    """A compiled step is first compiled inside its capture's warm-up, so a failed capture may be the compiler's:
    the step is compiled again without a graph, and runs so where that works; where it fails too, the step runs
    eagerly and uncompiled, in this rollout and the engine's later ones. The compiler is a stand-in here."""
    from lit_grpo.sampling import RolloutEngine, decode_step as decode_step_module, engine as engine_module

    model, tokenizer = tiny_llama
    # torch's linears throughout: a compiled rollout keeps oneDNN's off, and the reference must run the same ones
    settings = dict(group_size=3, micro_group_size=2, strategy="continuous", max_new_tokens=6, seed=4,
                    cpu_linear="torch")
    eager = RolloutEngine(model, tokenizer, **settings)
    reference, reference_second = eager.generate(prompt_ids), eager.generate(prompt_ids)
    compiled = []

    def compiler(run, shape):
        def compiled_run(step):
            compiled.append(shape)
            if not compiles:
                raise RuntimeError("InductorError: a lowering failed")  # what a compiler that cannot compile raises
            run(step)
        return compiled_run

    monkeypatch.setattr(engine_module, "_graphs_available", lambda device: True)
    monkeypatch.setattr(engine_module, "resolve_compile", lambda setting, device, sharded: bool(setting))
    monkeypatch.setattr(decode_step_module, "compiled_step", compiler)
    monkeypatch.setattr(torch.cuda, "Stream", _failing_capture([]))
    engine = RolloutEngine(model, tokenizer, compile=True, **settings)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        first = engine.generate(prompt_ids)
    said = [str(w.message) for w in caught if issubclass(w.category, RuntimeWarning)]
    assert len(said) == (1 if compiles else 2) and "CUDA graph failed" in said[0] and "without a graph" in said[0]
    assert compiles or ("compiling the decode step of LlamaForCausalLM failed (RuntimeError: InductorError"
                        in said[1] and "runs it uncompiled" in said[1])
    assert not engine._step.settings.cuda_graph and engine._step.settings.compile == compiles
    assert (engine.compile_failure is None) == compiles
    assert len(compiled) == (first.stats.decode_steps + 1 if compiles else 1)  # each step (and the compilation's)
    assert first.completion_ids == reference.completion_ids and first.logprobs == reference.logprobs
    engine.release()
    tried = len(compiled)
    second = engine.generate(prompt_ids)  # a new step: no graph asked for; compiled only where it compiled
    assert not engine._step.settings.cuda_graph and engine._step.settings.compile == compiles
    assert (len(compiled) > tried) == compiles and second.logprobs == reference_second.logprobs


def test_a_failed_capture_asked_for_explicitly_raises(tiny_llama, prompt_ids, monkeypatch):
    from lit_grpo.sampling import RolloutEngine, engine as engine_module

    model, tokenizer = tiny_llama
    monkeypatch.setattr(engine_module, "_graphs_available", lambda device: True)
    monkeypatch.setattr(torch.cuda, "Stream", _failing_capture([]))
    engine = RolloutEngine(model, tokenizer, group_size=2, max_new_tokens=4, cuda_graph=True)
    with pytest.raises(RuntimeError, match="cuda_graph=True, but capturing the decode step of LlamaForCausalLM"):
        engine.generate(prompt_ids)


class _StorageSpy(TorchDispatchMode):
    """The storages a step reads without having made them: what a captured graph would read on every replay."""

    def __init__(self):
        super().__init__()
        self.made, self.read = set(), set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        for t in tree_flatten((args, kwargs or {}))[0]:
            if isinstance(t, torch.Tensor) and t.untyped_storage().data_ptr() not in self.made:
                self.read.add(t.untyped_storage().data_ptr())
        out = func(*args, **(kwargs or {}))
        for t in tree_flatten(out)[0]:
            if isinstance(t, torch.Tensor):
                self.made.add(t.untyped_storage().data_ptr())
        return out


@pytest.mark.parametrize("strategy", ["full", "continuous", "infinite"])
def test_every_decode_step_reads_the_same_memory_as_a_replayed_graph_would(tiny_llama, prompt_ids, monkeypatch,
                                                                           strategy):
    """A CUDA graph replays the kernels of its capture on the same addresses, so whatever the host does between
    steps (refills, removals, parking, a new rollout on the kept cache) must update the step's inputs in place. On
    CPU the eager step shows which storages it reads; every step of two rollouts must read the very same ones (the
    first step of an engine may allocate the hidden-state buffer, as the warm-up before a capture does)."""
    model, tokenizer = tiny_llama
    reads = []
    run = DecodeStep._run

    def spied_run(self, hidden_states=True):
        with _StorageSpy() as spy:
            run(self)  # as the graph does: the hidden states every step, whatever this step asked
        reads.append(frozenset(spy.read))

    monkeypatch.setattr(DecodeStep, "_run", spied_run)
    from lit_grpo.sampling import RolloutEngine

    # cpu_linear "onednn": packed weights are copies made afresh for each CPU rollout, where no graph replays
    engine = RolloutEngine(model, tokenizer, group_size=5, micro_group_size=2, strategy=strategy, max_new_tokens=12,
                           seed=1, cpu_linear="onednn",
                           **({"probe_tokens": 3, "park_budget": None} if strategy == "infinite" else {}))
    if strategy == "infinite":
        trust_predictions(engine.scheduler)
    lengths = [[12, 3, 7, 1, 9]] * len(prompt_ids)  # forced: the step's replay branch, rows ending at set steps
    first = engine.generate(prompt_ids, lengths=lengths)
    second = engine.generate(prompt_ids, lengths=lengths)  # the same cache and step, reused
    assert engine._step is not None and len(reads) == first.stats.decode_steps + second.stats.decode_steps
    assert reads[0] <= reads[1] and len(set(reads[1:])) == 1
    if strategy == "infinite":
        assert engine.scheduler.parked_samples > 0  # parked samples' KV went aside and came back into rows


def test_running_out_of_memory_while_capturing_is_raised_not_taken_for_an_uncapturable_model(tiny_llama, prompt_ids,
                                                                                            monkeypatch):
    from lit_grpo.sampling import RolloutEngine, engine as engine_module

    model, tokenizer = tiny_llama

    out_of_memory = torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 1.00 GiB")
    monkeypatch.setattr(engine_module, "_graphs_available", lambda device: True)
    monkeypatch.setattr(torch.cuda, "Stream", _failing_capture([], out_of_memory))
    engine = RolloutEngine(model, tokenizer, group_size=2, max_new_tokens=4)
    with pytest.raises(torch.cuda.OutOfMemoryError, match="Tried to allocate"):
        engine.generate(prompt_ids)
    assert engine.graph_failure is None and engine._cache is None  # nothing half-built is kept
    monkeypatch.setattr(engine_module, "_graphs_available", lambda device: False)
    assert engine.generate(prompt_ids).stats.decode_steps > 0  # and the engine still works


def test_the_eager_step_asks_for_hidden_states_only_on_the_steps_that_probe(tiny_llama, prompt_ids, monkeypatch):
    """Without a graph the model returns hidden states only when some row's token is its probe; a graph (and the
    compiled step) computes them every step."""
    from lit_grpo.sampling import RolloutEngine

    model, tokenizer = tiny_llama
    asked, steps_probing = [], []
    forward, step = type(model).forward, DecodeStep.step

    @functools.wraps(forward)  # the engine reads the forward's signature for its cache keyword
    def spied_forward(self, *args, **kwargs):
        if kwargs["input_ids"].shape[-1] == 1 and kwargs.get("attention_mask") is not None:  # a decode step
            asked.append(bool(kwargs.get("output_hidden_states")))
        return forward(self, *args, **kwargs)

    def spied_step(self, hidden_slots):
        steps_probing.append(bool(hidden_slots))
        return step(self, hidden_slots)

    monkeypatch.setattr(type(model), "forward", spied_forward)
    monkeypatch.setattr(DecodeStep, "step", spied_step)
    engine = RolloutEngine(model, tokenizer, group_size=4, micro_group_size=2, strategy="infinite", max_new_tokens=8,
                           seed=0, probe_tokens=3)
    result = engine.generate(prompt_ids)
    assert len(asked) == result.stats.decode_steps and asked == steps_probing
    assert 0 < sum(asked) < len(asked)


def test_a_compiled_step_that_keeps_hidden_states_is_one_graph_on_a_fresh_model(monkeypatch):
    """transformers installs its hidden-state hooks on a model's first forward that asks for them, under a lock
    torch.compile cannot trace; the step installs them eagerly first, so its compiled forward (which asks every
    step) is one graph with no break, rather than a graph break and the model's frames compiled one by one (each
    layer's attention apart, past the recompile limit on a deep model). Counted by dynamo's counters with the
    "eager" backend: tracing is what breaks, and it spares Inductor's time."""
    from torch._dynamo.utils import counters

    from lit_grpo.sampling import RolloutEngine

    model, tokenizer = load_model_and_tokenizer("tiny-qwen2")  # fresh: no hooks installed yet
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: compile_(*args, **kwargs, backend="eager"))
    monkeypatch.setattr(decode_step, "compiler_problem", lambda device_type: None)  # "eager" needs no C++ compiler
    breaks, graphs, frames = sum(counters["graph_break"].values()), counters["stats"]["unique_graphs"], \
        counters["frames"]["total"]
    engine = RolloutEngine(model.eval(), tokenizer, group_size=4, micro_group_size=2, strategy="infinite",
                           max_new_tokens=6, seed=0, probe_tokens=3, compile=True)
    engine.generate([[5, 6, 7, 8], [9, 10, 11]])
    assert engine._step.settings.hidden_states and engine._step._compiled_run is not None
    assert sum(counters["graph_break"].values()) == breaks
    assert counters["stats"]["unique_graphs"] - graphs == 1 and counters["frames"]["total"] - frames == 1


@pytest.mark.parametrize("began, routing, ended, released", [
    (True, True, False, True),     # the capture broke: ending it failed before it stopped the routing
    (True, False, False, True),    # torch stopped the routing, then found the capture invalid
    (True, False, True, False),    # the capture ended (the error came after): the graph drops its own hold
    (False, True, False, True),    # the routing began, the capture did not
    (False, False, False, False),  # nothing began: no hold was taken
])
def test_a_failed_capture_puts_the_stream_back_and_drops_its_hold_on_the_pool_once(monkeypatch, began, routing, ended,
                                                                                   released):
    """``torch.cuda.graph``'s exit raises before it restores the current stream when ending a capture fails; the
    step restores it, ends the pool's allocation where torch did not, and drops the hold the capture took on the
    pool (shared by the step's graphs), where the capture began and did not end, which is when no graph will: once,
    as a second drop would free memory the other graphs replay into. The CUDA calls are stand-ins here;
    tests/test_cuda_graph.py breaks a real capture."""
    calls = []

    def end_allocation(device_index, pool):
        calls.append(("end", device_index, pool))
        if not routing:
            raise RuntimeError("endAllocatePool: not currently recording to mempool_id")

    class Graph:
        def pool(self):
            if not ended:
                raise RuntimeError("Called CUDAGraph::pool() without a preceding successful capture.")
            return (0, 7)

    monkeypatch.setattr(torch.cuda, "set_stream", lambda stream: calls.append(("stream", stream)))
    monkeypatch.setattr(torch._C, "_cuda_endAllocateToPool", end_allocation, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_releasePool", lambda index, pool: calls.append(("release", index, pool)),
                        raising=False)
    decode_step._end_failed_capture(Graph(), torch.device("cuda", 1), "previous stream", (0, 7), began)
    assert calls == [("stream", "previous stream"), ("end", 1, (0, 7))] + [("release", 1, (0, 7))] * released
