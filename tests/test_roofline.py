"""The roofline (tools/roofline.py): costs from a config against hand counts, the bound chosen, the machine measured."""

import re

import pytest
import torch
from transformers import GPT2Config, LlamaConfig

from lit_grpo.runtime.models import load_model_and_tokenizer
from tools import roofline

# L 2, H 8, n_h 2, n_kv 1, d 4, I 16, V 10:
# W_layer = 8·2·4 (q) + 2·8·1·4 (k, v) + 2·4·8 (o) + 3·8·16 (gate, up, down) = 64 + 64 + 64 + 384 = 576
# W = 2·576 + 10·8 = 1232
HAND = dict(hidden_size=8, intermediate_size=16, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1,
            vocab_size=10)


def test_decode_step_cost_matches_a_hand_count():
    cost = roofline.decode_step_cost(LlamaConfig(**HAND), rows=3, context_len=5, dtype="float32")
    # 2·3·1232 + 4·3·(L n_h d c = 2·2·4·5 = 80)
    assert cost.flops == 7392 + 960
    # 4 bytes · (1232 weights + 3·8 embedding rows + 3 rows · 2·(L n_kv d c = 2·1·4·5 = 40) K and V)
    assert cost.bytes == 4 * (1232 + 24 + 240)
    assert roofline.decode_step_cost(LlamaConfig(**HAND), 3, 5, torch.bfloat16).bytes == 2 * (1232 + 24 + 240)


def test_prefill_cost_matches_a_hand_count():
    config = LlamaConfig(**HAND)
    cost = roofline.prefill_cost(config, tokens=4, dtype="float32")
    # 2·4·L·W_layer + 2·V·H (the last token's logits) + 4·L·n_h·d·(1 + 2 + 3 + 4)
    assert cost.flops == 2 * 4 * 2 * 576 + 2 * 10 * 8 + 4 * 2 * 2 * 4 * 10
    # 4 bytes · (W + 4 embedding rows + each layer's K and V of the 4 positions: 2·L·n_kv·d·4)
    assert cost.bytes == 4 * (1232 + 32 + 64)
    after = roofline.prefill_cost(config, tokens=2, dtype="float32", cached=3)  # token i attends 3 + i
    assert after.flops == 2 * 2 * 2 * 576 + 160 + 4 * 2 * 2 * 4 * (4 + 5)
    assert after.bytes == 4 * (1232 + 16 + 2 * 2 * 1 * 4 * 5)
    per_token = roofline.prefill_token_cost(config, 4, "float32")
    assert per_token.flops == pytest.approx(cost.flops / 4) and per_token.bytes == pytest.approx(cost.bytes / 4)


def test_a_batched_prefill_adds_the_work_and_reads_the_weights_once():
    config = LlamaConfig(**HAND)
    four, two = roofline.prefill_cost(config, 4, "float32"), roofline.prefill_cost(config, 2, "float32")
    batch = roofline.prefill_batch_cost(config, [4, 2], "float32")
    assert batch.flops == four.flops + two.flops
    assert batch.bytes == four.bytes + two.bytes - 4 * 1232  # W read once
    assert roofline.prefill_batch_cost(config, [4], "float32") == four
    with pytest.raises(ValueError, match=re.escape("token_counts=[] must name at least one sequence")):
        roofline.prefill_batch_cost(config, [], "float32")
    machine = {"matmul_flops_per_s": 1e6, "read_bytes_per_s": 1e9}  # compute-bound: the weights' reads don't count
    ms, bound = roofline.prefill_floor(config, "float32", [[1] * 5, [1] * 3, [9]], machine)
    assert bound == "compute" and ms == pytest.approx(1000 * batch.flops / 1e6 / 6)  # per prefix token
    slow_memory = {"matmul_flops_per_s": 1e12, "read_bytes_per_s": 1e3}
    ms, bound = roofline.prefill_floor(config, "float32", [[1] * 5, [1] * 3], slow_memory)
    assert bound == "memory" and ms == pytest.approx(1000 * batch.bytes / 1e3 / 6)
    assert roofline.prefill_floor(config, "float32", [[9], [8]], machine) is None


def test_weights_are_every_linear_layer_and_the_head_read_once_tied_or_not(tiny_llama):
    model, _ = tiny_llama
    linear = sum(m.weight.numel() for m in model.modules() if isinstance(m, torch.nn.Linear))
    assert roofline.model_shape(model.config).weights == linear  # q, k, v, o, gate, up, down and lm_head
    tied = LlamaConfig(**HAND, tie_word_embeddings=True)
    assert roofline.model_shape(tied).weights == roofline.model_shape(LlamaConfig(**HAND)).weights == 1232


def test_floor_takes_the_longer_bound():
    machine = {"matmul_flops_per_s": 100.0, "read_bytes_per_s": 10.0}
    assert roofline.floor_s(roofline.Cost(flops=300, bytes=20), machine) == (3.0, "compute")
    assert roofline.floor_s(roofline.Cost(flops=100, bytes=50), machine) == (5.0, "memory")
    assert roofline.floor_ms(roofline.Cost(flops=100, bytes=50), machine) == (5000.0, "memory")
    # a machine doing 10 FLOPs per byte; at context 1 the step does 2528·rows FLOPs on 4·(1232 + 24·rows) bytes:
    # memory-bound up to 31 rows, compute-bound from 32
    config = LlamaConfig(**HAND)
    assert roofline.floor_s(roofline.decode_step_cost(config, 31, 1, "float32"), machine)[1] == "memory"
    assert roofline.floor_s(roofline.decode_step_cost(config, 32, 1, "float32"), machine)[1] == "compute"
    assert roofline.ratio(6.0, 2.0) == 3.0 and roofline.ratio(None, 2.0) is None and roofline.ratio(1.0, None) is None


def test_mean_decode_context_averages_every_step_of_every_sample():
    # prompt 3, 2 tokens: attends 3 then 4; prompt 5, 4 tokens: 5, 6, 7, 8; (7 + 26) / 6
    assert roofline.mean_decode_context([3, 5], [2, 4]) == pytest.approx(33 / 6)
    assert roofline.mean_decode_context([3, 5], [0, 1]) == 5
    with pytest.raises(ValueError, match="2 prompt lengths for 1 completions"):
        roofline.mean_decode_context([3, 5], [2])
    with pytest.raises(ValueError, match="every length is 0"):
        roofline.mean_decode_context([3], [0])


@pytest.mark.parametrize("call, match", [
    (lambda c: roofline.decode_step_cost(c, 0, 5, "float32"), "rows=0 must be an integer >= 1"),
    (lambda c: roofline.decode_step_cost(c, 2, 0.5, "float32"), "context_len=0.5 must be a number >= 1"),
    (lambda c: roofline.decode_step_cost(c, 2, 5, "float33"), "dtype='float33' is not a torch dtype"),
    (lambda c: roofline.decode_step_cost(c, 2, 5, "f" * 500), rf"^dtype='{'f' * 99} is not a torch dtype"),  # cut
    (lambda c: roofline.prefill_cost(c, 0, "float32"), "tokens=0 must be an integer >= 1"),
    (lambda c: roofline.prefill_cost(c, 3, "float32", cached=-1), "cached=-1 must be an integer >= 0"),
])
def test_bad_cost_arguments_are_named(call, match):
    with pytest.raises(ValueError, match=match):
        call(LlamaConfig(**HAND))


def test_a_config_without_a_gated_mlp_is_refused_by_name():
    with pytest.raises(ValueError, match=r"GPT2Config has no \['intermediate_size'\]; the roofline needs a decoder "
                                         "with a gated MLP"):
        roofline.model_shape(GPT2Config(n_layer=2, n_head=2, n_embd=8))


def test_measure_machine_records_rates_device_and_method_once_per_process():
    machine = roofline.measure_machine("cpu", "float32", seconds_budget=0.2)
    assert machine["matmul_flops_per_s"] > 1e8 and machine["read_bytes_per_s"] > 1e8
    assert machine["device"] == "cpu" and machine["dtype"] == "float32"
    assert machine["threads"] == torch.get_num_threads()
    assert machine["device_name"] == roofline.device_name(torch.device("cpu")) != ""
    assert "torch.mm" in machine["method"]["matmul"] and "torch.sum" in machine["method"]["read"]
    # float32 on a CPU: the faster of torch.mm and oneDNN's kernel (the engine's linears run on either)
    assert ("onednn" in machine["method"]["matmul"]) == torch.backends.mkldnn.is_available()
    assert machine["matmul_kernel"] in ("torch.mm", "onednn")
    assert machine["matmul_kernel"] in machine["method"]["matmul"]
    again = roofline.measure_machine(torch.device("cpu"), torch.float32, seconds_budget=0.2)
    assert again == machine  # kept, not measured twice
    for kwargs, match in [(dict(device="meta"), "device='meta'"), (dict(dtype="float33"), "float33"),
                          (dict(seconds_budget=0), "seconds_budget=0 must be a number > 0")]:
        with pytest.raises(ValueError, match=match):
            roofline.measure_machine(**{"device": "cpu", "dtype": "float32", **kwargs})


def test_the_smollm2_decode_step_reads_its_weights_once():
    """The issue's figures: SmolLM2-135M reads about 540 MB of float32 weights per step and does 2 x ~135M FLOPs
    per row (its own parameters, embedding tied to the head, counted by the model)."""
    model, _ = load_model_and_tokenizer("HuggingFaceTB/SmolLM2-135M-Instruct")
    params = sum(p.numel() for p in model.parameters())
    cost = roofline.decode_step_cost(model.config, 16, 64, "float32")
    weights = roofline.model_shape(model.config).weights
    norms = sum(p.numel() for name, p in model.named_parameters() if "norm" in name)
    assert weights == params - norms  # every parameter but the norms: the tied head once
    assert 530e6 < 4 * weights < 545e6
    # the linear layers, and attention over 64 positions: 4·16 rows·30 layers·9 heads·64 dims·64 positions
    assert cost.flops == 2 * 16 * weights + 4 * 16 * 30 * 9 * 64 * 64


def test_the_floor_is_the_bytes_read_over_the_bandwidth():
    from lit_grpo.sampling.roofline import floor_ms

    assert floor_ms(2e9, 1e12) == pytest.approx(2.0)  # 2 GB at 1 TB/s
    assert floor_ms(0, 5e9) == 0.0
    with pytest.raises(ValueError, match=r"read_bytes=-1 must be a number >= 0"):
        floor_ms(-1, 1e9)
    # a repr of an int of more than 4300 digits failed in place of the refusal
    with pytest.raises(ValueError, match=r"^read_bytes=\(a negative int of 5001 digits\) must be a number >= 0$"):
        floor_ms(-10**5000, 1e9)
    with pytest.raises(ValueError, match=r"^read_bytes_per_s=\(a negative int of 5001 digits\) must be a finite "):
        floor_ms(1, -10**5000)
    for bad in (0, -3.0, float("inf"), None):
        with pytest.raises(ValueError, match=rf"read_bytes_per_s={bad!r} must be a finite number > 0"):
            floor_ms(1, bad)


def test_the_library_decode_reads_are_the_tools_decode_bytes():
    from lit_grpo.sampling.roofline import decode_reads

    reads = decode_reads(LlamaConfig(**HAND), "float32")
    assert (reads.weights, reads.per_row, reads.per_position) == (4 * 1232, 4 * 8, 4 * 2 * 2 * 1 * 4)
    assert reads.step_bytes(3, 15) == roofline.decode_step_cost(LlamaConfig(**HAND), 3, 5, "float32").bytes


def test_the_engine_counts_the_bytes_its_decode_steps_read(tiny_llama):
    """Every step reads the weights once, an embedding row per running row and the positions each row attends: a
    sample of a P-token prompt attends P + j positions at its j-th step."""
    from lit_grpo import RolloutEngine
    from lit_grpo.sampling.roofline import decode_reads

    model, tokenizer = tiny_llama
    engine = RolloutEngine(model, tokenizer, group_size=3, micro_group_size=2, strategy="continuous",
                           max_new_tokens=7, seed=3)
    result = engine.generate(["one two", "three four five six"])
    reads, stats = decode_reads(model.config, torch.float32), result.stats
    attended = sum(len(prompt) + j for prompt, group in zip(result.prompt_ids, result.completion_ids)
                   for ids in group for j in range(len(ids)))
    rows = sum(len(ids) for group in result.completion_ids for ids in group)
    assert stats.decode_read_bytes == (stats.decode_steps * reads.weights + rows * reads.per_row
                                       + attended * reads.per_position)
    assert stats.read_bytes_per_step == stats.decode_read_bytes / stats.decode_steps


def test_the_bandwidth_is_measured_once_per_process_or_given(monkeypatch):
    from lit_grpo.sampling import roofline as library

    measured = []
    monkeypatch.setattr(library, "_BANDWIDTH", {})
    monkeypatch.setattr(library, "measure_read_bandwidth", lambda device: measured.append(device) or 5e9)
    assert library.read_bandwidth("cpu") == library.read_bandwidth(torch.device("cpu")) == 5e9
    assert measured == ["cpu"]
    library.set_read_bandwidth("cpu", 2e9)
    assert library.read_bandwidth("cpu") == 2e9 and measured == ["cpu"]
    with pytest.raises(ValueError, match=r"read_bytes_per_s=0 must be a finite number > 0"):
        library.set_read_bandwidth("cpu", 0)


def test_a_bare_cuda_device_is_the_current_one_in_every_per_device_cache(monkeypatch):
    """``indexed_device`` names a device as a tensor's ``.device`` does, so "cuda" and "cuda:N" (N current) share
    one entry of the bandwidth record (and of the float32-scores probe, keyed the same way)."""
    from lit_grpo.sampling import roofline as library
    from lit_grpo.sampling.devices import indexed_device

    monkeypatch.setattr(torch.cuda, "current_device", lambda: 3)
    assert indexed_device("cuda") == indexed_device(torch.device("cuda")) == torch.device("cuda", 3)
    assert indexed_device("cuda:1") == torch.device("cuda", 1)
    assert indexed_device("cpu") == torch.device("cpu")
    monkeypatch.setattr(library, "_BANDWIDTH", {})
    library.set_read_bandwidth("cuda", 7e11)
    assert library._BANDWIDTH == {"cuda:3": 7e11} and library.read_bandwidth("cuda:3") == 7e11


def _resident_peak_bytes() -> int:
    """This process's VmHWM (the kernel's resident high-water mark), in bytes."""
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) * 1024 for line in status if line.startswith("VmHWM:"))


def test_a_cpu_bandwidth_probe_leaves_this_process_resident_peak_alone():
    """The probe's buffer (at least 4 x the last-level cache: GiBs on a CPU with a large one) is filled by a process
    this one never reaps, so a run's peak resident memory is its own work, not the probe's: its VmHWM, and the
    ``ru_maxrss`` its parent's ``wait4`` reads (the largest of the process and of the children it reaped)."""
    import resource

    from lit_grpo.sampling import roofline as library

    buffer_bytes = library.bandwidth_buffer_bytes(torch.device("cpu"))
    with open("/proc/self/clear_refs", "w") as clear_refs:
        clear_refs.write("5")  # the high-water mark restarts from the present resident size
    before, children_before = _resident_peak_bytes(), resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024
    assert library.measure_read_bandwidth("cpu", budget_s=0.02) > 1e8  # bytes/s: some memory, read
    assert _resident_peak_bytes() - before < buffer_bytes // 4
    # a child started here holds at most this process's own peak (exec keeps the high-water mark it forked with)
    own_peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    assert resource.getrusage(resource.RUSAGE_CHILDREN).ru_maxrss * 1024 <= max(children_before, own_peak)


def test_a_cpu_probe_whose_child_cannot_run_is_measured_here_with_a_warning(monkeypatch):
    import sys

    from lit_grpo.sampling import read_probe, roofline as library

    monkeypatch.setattr(sys, "executable", "/nonexistent/python")
    with pytest.raises(RuntimeError, match="the read-bandwidth probe's child did not run"):
        read_probe.sum_seconds_in_child(2**20, 0.01, 1)
    with pytest.warns(RuntimeWarning, match=r"did not run.*measured in this process instead, its 1 MiB buffer"):
        assert library.measure_read_bandwidth("cpu", buffer_bytes=2**20, budget_s=0.01) > 1e6


@pytest.mark.parametrize("executable", [None, ""])
def test_a_cpu_probe_without_an_interpreter_to_start_is_measured_here_with_a_warning(monkeypatch, executable):
    """An embedded Python's sys.executable may be None or empty (no interpreter to start): the probe is measured in
    this process with the warning, as where the child cannot run; None failed with subprocess's TypeError."""
    import sys

    from lit_grpo.sampling import read_probe, roofline as library

    monkeypatch.setattr(sys, "executable", executable)
    with pytest.raises(RuntimeError, match="the read-bandwidth probe's child did not run"):
        read_probe.sum_seconds_in_child(2**20, 0.01, 1)
    with pytest.warns(RuntimeWarning, match=r"did not run.*measured in this process instead, its 1 MiB buffer"):
        assert library.measure_read_bandwidth("cpu", buffer_bytes=2**20, budget_s=0.01) > 1e6


def test_a_failing_probe_child_is_reported_with_its_error():
    from lit_grpo.sampling import read_probe

    with pytest.raises(RuntimeError, match=r"(?s)printed no seconds: .*negative dimension"):
        read_probe.sum_seconds_in_child(-4, 0.01, 1)  # a buffer of -1 elements: torch refuses it in the child
