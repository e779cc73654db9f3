"""Live-width buckets: the decode step attends the bucket of its longest live row, picked on the host.

On CUDA every step does (``StepSettings.live_width``, one graph and one compilation per bucket); on a CPU the
engine keeps the rollout's fixed width, so these tests build steps with ``live_width`` on by hand.
"""

from __future__ import annotations

import contextlib
import dataclasses
import functools

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from lit_grpo.sampling import RolloutEngine, decode_step as decode_step_module, engine as engine_module
from lit_grpo.sampling.decode_step import (MAX_BUCKETS, DecodeStep, StepSettings, bucket_for, width_buckets)
from lit_grpo.sampling.kv_cache import SlotKVCache
from lit_grpo.sampling.memory_budget import kv_geometry

LIVE = StepSettings(temperature=1.0, top_k=0, top_p=1.0, min_p=0.0, force_lengths=False, hidden_states=False,
                    cuda_graph=False, live_width=True)


# ------------------------------------------------------------------------------------------ the ladder
@pytest.mark.parametrize("width", [1, 63, 64, 96, 97, 128, 192, 300, 1088, 4160, 32768, 10**6])
def test_buckets_climb_by_doubling_to_the_cache_width_and_stay_few(width):
    buckets = width_buckets(width)
    assert buckets[-1] == width and len(buckets) <= MAX_BUCKETS
    assert list(buckets) == sorted(set(buckets))
    for bucket in buckets[:-1]:  # powers of two, at least the smallest, each saving a third of the width or more
        assert bucket & (bucket - 1) == 0 and 64 <= bucket and 3 * bucket <= 2 * width
    if len(buckets) < MAX_BUCKETS:  # none left out: the next power down would be under the smallest
        assert buckets[0] // 2 < 64 or len(buckets) == 1


def test_buckets_follow_count_and_smallest_and_name_bad_values():
    assert width_buckets(1088) == (64, 128, 256, 512, 1088)
    assert width_buckets(4160) == (128, 256, 512, 1024, 2048, 4160)  # the largest five powers kept
    assert width_buckets(1088, count=1) == (1088,)
    assert width_buckets(1088, count=3) == (256, 512, 1088)
    assert width_buckets(300, smallest=100) == (128, 300)
    assert width_buckets(64) == (64,)
    for bad, named in ((dict(width=0), "width=0"), (dict(width=64.0), "width=64.0"),
                       (dict(width=64, count=0), "count=0"), (dict(width=64, smallest=True), "smallest=True"),
                       # a repr of an int of more than 4300 digits failed in place of the refusal
                       (dict(width=-10**5000), r"width=\(a negative int of 5001 digits\)")):
        with pytest.raises(ValueError, match=rf"width_buckets: {named} must be an integer >= 1"):
            width_buckets(**bad)


def test_a_row_goes_to_the_smallest_bucket_that_holds_it():
    buckets = (64, 128, 300)
    assert [bucket_for(buckets, n) for n in (1, 64, 65, 128, 129, 300)] == [64, 64, 128, 128, 300, 300]
    with pytest.raises(ValueError, match=r"301 columns do not fit the widest bucket 300 \(buckets \[64, 128, 300\]\)"):
        bucket_for(buckets, 301)


# ------------------------------------------------------------------------------------------ the step
class _Ops(TorchDispatchMode):
    """Every op run under it."""

    def __init__(self):
        super().__init__()
        self.ops = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.ops.append(func)
        return func(*args, **(kwargs or {}))


def _step(model, width, settings=LIVE, slots=3):
    cache = SlotKVCache(model.config, num_slots=slots, width=width, dtype=model.dtype, device=torch.device("cpu"))
    return DecodeStep(model, cache, settings, eos_token_ids=[-1 % model.config.vocab_size])


def _prefix(model, length, seed):
    """A random cached prefix of ``length`` positions (its values do not matter here, only where they sit)."""
    layers, kv_heads, dim = kv_geometry(model.config)
    generator = torch.Generator().manual_seed(seed)
    return [(torch.randn(1, kv_heads, length, dim, generator=generator),
             torch.randn(1, kv_heads, length, dim, generator=generator)) for _ in range(layers)]


def test_each_step_attends_the_bucket_of_its_longest_live_row_without_reading_the_device(tiny_llama):
    model, _ = tiny_llama
    step = _step(model, width=300)
    assert step.buckets == (64, 128, 300)
    attended = []
    update = type(step.cache.layers[0]).update

    def spied_update(layer, *args, **kwargs):
        keys, values = update(layer, *args, **kwargs)
        if layer is step.cache.layers[0]:
            attended.append(keys.shape[2])
        return keys, values

    step.start_rollout(seed=0, width=300)
    expected = []
    with pytest.MonkeyPatch.context() as patch, torch.inference_mode(), _Ops() as spy:
        patch.setattr(type(step.cache.layers[0]), "update", spied_update)
        step.start_row(0, [_prefix(model, 60, 0)], stream=(0, 0), sample=0, generated=0, next_input=5)
        step.start_row(2, [_prefix(model, 10, 1)], stream=(0, 1), sample=0, generated=0, next_input=6)
        for _ in range(6):  # row 0 runs 60..65 cached positions: 61..66 columns, across the first bucket's edge
            expected.append(bucket_for(step.buckets, max(step.live_lengths.values()) + 1))
            step.step([])
        step.stop_row(0)  # the long row ends: back to the first bucket
        expected.append(64)
        step.step([])
        step.start_row(1, [_prefix(model, 200, 2)], stream=(0, 2), sample=1, generated=0, next_input=7)
        expected.append(300)
        step.step([])
    assert expected == [64, 64, 64, 64, 128, 128, 64, 300] and attended == expected
    assert step.live_lengths == {1: 201, 2: 18}
    assert step.cache.lengths.tolist() == [0, 201, 18]  # the host's copy is the device's
    # picked on the host: no op of the steps read a device value (a synchronisation on CUDA)
    assert spy.ops and torch.ops.aten._local_scalar_dense.default not in spy.ops
    assert torch.ops.aten.item.default not in spy.ops


def test_steps_run_inside_rows_kept_leave_the_rows_where_they_were(tiny_llama):
    """What a graph captured in the middle of a rollout relies on: its warm-up forwards advance nothing."""
    model, _ = tiny_llama
    runs = []
    for warm_up in (False, True):
        step = _step(model, width=128)
        step.start_rollout(seed=3, width=128)
        step.start_row(0, [_prefix(model, 20, 0)], stream=(0, 0), sample=0, generated=0, next_input=5)
        step.start_row(1, [_prefix(model, 70, 1)], stream=(0, 1), sample=1, generated=0, next_input=9)
        outputs = [step.step([]).tokens]
        state = [t.clone() for t in (step.cache.lengths, step.token_index, step.input_ids)]
        if warm_up:
            with torch.inference_mode(), step.rows_kept():
                step._forward()
                step._forward()
                # no row advances inside: a row one column short of the width is never written past it
                assert torch.equal(step.cache.lengths, state[0]) and not step.active.any()
            assert step.active[:2].tolist() == [1, 1] and all(torch.equal(t, kept) for t, kept in
                       zip((step.cache.lengths, step.token_index, step.input_ids), state))
        outputs += [step.step([]).tokens for _ in range(3)]
        runs.append((outputs, step.logprobs.clone()))
    assert runs[0][0] == runs[1][0] and torch.equal(runs[0][1], runs[1][1])


class _FakeGraph:
    """A stand-in for ``torch.cuda.CUDAGraph`` on a CPU: a capture records the step and its width (running nothing,
    as a real capture runs no kernel), a replay runs the step at that width."""

    captured: list[_FakeGraph] = []

    def __init__(self):
        self.step, self.width = None, None

    def replay(self):
        assert self.step.cache.attended == self.width
        self.step._forward()


def _fake_cuda(patch, pools):
    """Patch what ``DecodeStep._capture`` calls of torch.cuda so the capture logic runs on a CPU."""
    @contextlib.contextmanager
    def graph(fake, pool=None, stream=None):
        # the step's own stream: torch's default is made on the device current then
        assert stream is decode_step_module._side_stream(_capturing[-1].device)
        pools.append(pool)
        step = _capturing[-1]
        fake.step, fake.width = step, step.cache.attended
        _FakeGraph.captured.append(fake)
        with step.rows_kept():  # a real capture records kernels without running them
            yield

    class Stream:
        def __init__(self, *args, **kwargs):
            pass

        def wait_stream(self, other):
            pass

        def synchronize(self):
            pass

    patch.setattr(torch.cuda, "Stream", Stream)
    # a cache of its own: a stand-in stream must not outlive the test in the step's cache of real ones
    patch.setattr(decode_step_module, "_side_stream", functools.cache(decode_step_module._side_stream.__wrapped__))
    patch.setattr(torch.cuda, "stream", lambda stream: contextlib.nullcontext())
    patch.setattr(torch.cuda, "current_stream", lambda device=None: Stream())
    patch.setattr(torch.cuda, "graph_pool_handle", lambda: object())
    patch.setattr(torch.cuda, "CUDAGraph", _FakeGraph)
    patch.setattr(torch.cuda, "graph", graph)


_capturing: list[DecodeStep] = []


def test_one_graph_per_bucket_captured_when_first_needed_in_one_pool(tiny_llama, monkeypatch):
    """The capture logic on a CPU (torch.cuda's graph calls faked): graphs of only the buckets a rollout reaches,
    each captured once, mid-rollout, all in one memory pool, replaying what the eager live-width step samples."""
    model, tokenizer = tiny_llama
    live = engine_module.RolloutEngine._step_settings
    settings = dict(group_size=4, micro_group_size=2, strategy="continuous", max_new_tokens=160, seed=2)
    # width 39 + 160: buckets 64, 128, 199; the forced lengths keep rows under 100 columns, so 199 is never needed
    prompts, lengths = [list(range(5, 45)), list(range(50, 60))], [[60, 30, 45, 10], [5, 20, 60, 1]]

    def live_settings(engine, *args, graph=False):
        return dataclasses.replace(live(engine, *args), live_width=True, cuda_graph=graph)

    monkeypatch.setattr(engine_module.RolloutEngine, "_step_settings", live_settings)
    eager_engine = RolloutEngine(model, tokenizer, **settings)
    eager, eager_again = [eager_engine.generate(prompts, lengths=lengths) for _ in range(2)]
    assert not eager_engine._step.graphs
    pools = []
    capture = DecodeStep._capture
    monkeypatch.setattr(DecodeStep, "_capture", lambda step: (_capturing.append(step), capture(step))[1])
    monkeypatch.setattr(engine_module.RolloutEngine, "_step_settings",
                        lambda engine, *args: live_settings(engine, *args, graph=True))
    _fake_cuda(monkeypatch, pools)
    _FakeGraph.captured.clear()
    engine = RolloutEngine(model, tokenizer, **settings)
    first = engine.generate(prompts, lengths=lengths)
    step = engine._step
    assert step.buckets == eager_engine._step.buckets == (64, 128, 199)
    assert sorted(step.graphs) == [64, 128] and len(_FakeGraph.captured) == 2  # 199 never needed
    assert len(pools) == 2 and pools[0] is pools[1] is not None
    assert first.completion_ids == eager.completion_ids and first.logprobs == eager.logprobs
    assert first.stats.capture_s > 0
    second = engine.generate(prompts, lengths=lengths)  # the kept step replays its graphs: nothing captured again
    assert len(_FakeGraph.captured) == 2
    assert second.completion_ids == eager_again.completion_ids and second.logprobs == eager_again.logprobs
    assert second.stats.capture_s == 0


def test_a_failed_capture_gives_up_its_hold_and_a_pool_no_graph_holds_is_not_shared_again(tiny_llama, monkeypatch):
    """The capture logic on a CPU (torch.cuda's graph calls faked): a capture that fails inside its block tells
    ``_end_failed_capture`` it began, with the step's pool; while an earlier bucket's graph holds the pool the step
    keeps it, and once none does the next capture asks for a new one (torch refuses to share a pool nobody
    holds). ``_end_failed_capture``'s own bookkeeping: tests/test_decode_step.py."""
    model, _ = tiny_llama
    pools, ends = [], []
    _fake_cuda(monkeypatch, pools)
    monkeypatch.setattr(decode_step_module, "_end_failed_capture",
                        lambda graph, device, previous, pool, began: ends.append((pool, began)))
    forward, failing = DecodeStep._forward, []

    def broken_in_capture(step, hidden_states=True):
        if failing and len(_FakeGraph.captured) > failing[-1]:  # inside the block of a capture that fails
            raise RuntimeError("operation not permitted when stream is capturing")
        forward(step, hidden_states)

    monkeypatch.setattr(DecodeStep, "_forward", broken_in_capture)
    step = _step(model, width=300, settings=dataclasses.replace(LIVE, cuda_graph=True))
    _capturing.append(step)
    _FakeGraph.captured.clear()
    step.start_rollout(seed=0, width=300)
    step.start_row(0, [_prefix(model, 20, 0)], stream=(0, 0), sample=0, generated=0, next_input=5)
    step.capture()  # bucket 64: a graph holds the pool
    held = step._graph_pool
    step.start_row(1, [_prefix(model, 100, 1)], stream=(0, 1), sample=1, generated=0, next_input=9)
    failing.append(len(_FakeGraph.captured))
    with pytest.raises(RuntimeError, match="stream is capturing"):
        step.capture()  # bucket 128 fails
    assert ends == [(held, True)] and step._graph_pool is held and sorted(step.graphs) == [64]
    step.graphs.clear()  # no graph holds the pool any more
    failing.append(len(_FakeGraph.captured))
    with pytest.raises(RuntimeError, match="stream is capturing"):
        step.capture()
    assert ends[-1] == (held, True) and step._graph_pool is None
    failing.clear()
    step.capture()
    assert pools[-1] is not held and step._graph_pool is pools[-1]


def test_a_cpu_engine_keeps_the_rollouts_fixed_width(tiny_llama, prompt_ids):
    """On a CPU a row's rounding must not follow its neighbours' lengths (bit-identical schedules)."""
    model, tokenizer = tiny_llama
    engine = RolloutEngine(model, tokenizer, group_size=3, micro_group_size=2, strategy="continuous",
                           max_new_tokens=70, seed=1)
    engine.generate(prompt_ids)
    width = max(map(len, prompt_ids)) - 1 + 70
    assert engine._step.settings.live_width is False and engine._step.buckets == (engine._cache.width,)
    assert engine._cache.attended == width


def test_a_compiled_live_width_step_samples_what_the_eager_one_does_and_compiles_once_per_bucket(
        tiny_llama, monkeypatch):
    """Compiled with buckets on a CPU (as on CUDA): one compilation per bucket the rollout reaches, counted by a
    backend; the same completions as the eager step at the same buckets, log-probs within fusion rounding."""
    from torch._dynamo.utils import counters

    model, tokenizer = tiny_llama
    live = engine_module.RolloutEngine._step_settings
    monkeypatch.setattr(engine_module.RolloutEngine, "_step_settings",
                        lambda engine, *args: dataclasses.replace(live(engine, *args), live_width=True))
    # width 39 + 89 = 128, a multiple of the compiled step's alignment: buckets 64 and 128 for both steps
    prompts = [list(range(5, 45)), list(range(100, 107))]
    settings = dict(group_size=2, micro_group_size=2, strategy="continuous", max_new_tokens=89, seed=5,
                    temperature=0.0)
    eager = RolloutEngine(model, tokenizer, **settings).generate(prompts)
    graphs = counters["stats"]["unique_graphs"]
    engine = RolloutEngine(model, tokenizer, compile=True, **settings)
    result = engine.generate(prompts)
    assert engine._step.buckets == (64, 128) and engine._step.compiled_widths == {64, 128}
    assert counters["stats"]["unique_graphs"] - graphs == 2  # one whole-step graph per bucket, no graph break
    assert result.completion_ids == eager.completion_ids
    for expected, got in zip(eager.logprobs, result.logprobs):
        for e, g in zip(expected, got):
            torch.testing.assert_close(torch.tensor(g), torch.tensor(e), rtol=0, atol=1e-4)
    assert result.stats.capture_s > 0


def test_steps_of_many_shapes_each_compile_within_the_recompile_limit(tiny_llama, monkeypatch):
    """torch._dynamo recompiles one code object at most ``recompile_limit`` times, then runs it uncompiled. Each
    step shape has its own (``compiled_step``): two shapes of two buckets each compile four whole-step graphs
    under a limit of two, where one shared code object would stop compiling at its third. Counted by graphs
    traced (the "eager" backend: tracing is what the limit counts, and it spares Inductor's time)."""
    from torch._dynamo.utils import counters

    model, _ = tiny_llama
    compile_ = torch.compile
    monkeypatch.setattr(torch, "compile", lambda *args, **kwargs: compile_(*args, **kwargs, backend="eager"))
    graphs = counters["stats"]["unique_graphs"]
    compiled = dataclasses.replace(LIVE, compile=True)
    # torch's own patch: monkeypatch's undo of a dynamo config entry hides it under torch 2.11, so every later
    # compilation in the process failed reading it
    with torch._dynamo.config.patch(recompile_limit=2):
        for width in (136, 140):  # widths no other test compiles (compiled steps are kept per shape)
            step = _step(model, width=width, settings=compiled, slots=2)
            assert step.buckets == (64, width)
            step.start_rollout(seed=0, width=width)
            with torch.inference_mode():
                step.start_row(0, [_prefix(model, 10, 0)], stream=(0, 0), sample=0, generated=0, next_input=5)
                step.step([])
                step.start_row(1, [_prefix(model, 100, 1)], stream=(0, 1), sample=0, generated=0, next_input=6)
                step.step([])
            assert step.compiled_widths == {64, width}
    assert counters["stats"]["unique_graphs"] - graphs == 4


@pytest.mark.parametrize("autocast, kept_copy", [(False, False), (True, False), (True, True)])
def test_a_kept_graphs_pool_prices_the_weight_casts_its_captured_steps_make(tiny_llama, monkeypatch, autocast,
                                                                            kept_copy):
    """The capture logic on a CPU (torch.cuda's graph calls faked), under autocast over float32 weights: each step
    casts every linear weight, each cast freed before the next, and a captured graph's pool keeps a block for each
    cast larger than all before it, priced with its activations. On a CastWeights copy (the weights in the autocast
    dtype already), or without autocast, nothing is cast."""
    from lit_grpo.runtime.distributed import CastWeights
    from lit_grpo.sampling.decode_step import vocab_size
    from lit_grpo.sampling.memory_budget import decode_step_bytes

    model, tokenizer = tiny_llama
    casts = [m.weight.numel() * 2 for m in model.modules() if isinstance(m, torch.nn.Linear)]  # bfloat16 copies
    blocks = sum(size for i, size in enumerate(casts) if size > max(casts[:i], default=0))
    assert max(casts) < blocks < sum(casts)  # the layers' casts reuse their blocks; the larger head needs its own
    live = engine_module.RolloutEngine._step_settings
    monkeypatch.setattr(engine_module.RolloutEngine, "_step_settings",
                        lambda engine, *args: dataclasses.replace(live(engine, *args), cuda_graph=True))
    capture = DecodeStep._capture
    monkeypatch.setattr(DecodeStep, "_capture", lambda step: (_capturing.append(step), capture(step))[1])
    _fake_cuda(monkeypatch, [])
    weights = CastWeights(model, torch.bfloat16) if kept_copy else None
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=autocast), \
            (weights.active() if kept_copy else contextlib.nullcontext(model)) as module:
        engine = RolloutEngine(module, tokenizer, group_size=2, micro_group_size=2, strategy="continuous",
                               max_new_tokens=4, seed=0)
        engine.generate([[5, 6, 7]])
        assert engine._step.graphs
        assert engine._step.graph_cast_bytes == (blocks if autocast and not kept_copy else 0)
        activations = decode_step_bytes(model.config, torch.bfloat16 if autocast else torch.float32, 2,
                                        engine._cache.width, vocab_size(model))
        assert engine.graph_pool_bytes() == activations + engine._step.graph_cast_bytes
