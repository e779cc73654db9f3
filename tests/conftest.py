"""Shared fixtures: tiny random models (Llama and Qwen2) with the offline byte-level tokenizer."""

import os

# This project's CPU machines (dev and CI VMs) report AMX in cpuid without letting processes use it, and oneDNN's
# bfloat16 matmuls then die with SIGILL (the bf16-mixed tests); cap oneDNN at AVX-512 BF16. Set before torch loads.
os.environ.setdefault("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")

import pytest  # noqa: E402
import torch  # noqa: E402

from lit_grpo.runtime.models import load_model_and_tokenizer  # noqa: E402

# Tiny models run fastest on one thread, and one thread cannot be starved by a busy machine.
torch.set_num_threads(1)


@pytest.fixture(autouse=True)
def one_thread_again():
    """Building a CLI sets the thread count (lit_grpo.cli): the next test starts from one thread again."""
    yield
    torch.set_num_threads(1)


PROMPT_TEXTS = ["What is 2+3?", "Compute the sum of 7, 8 and 9. Think step by step.", "hi"]


@pytest.fixture(scope="session", params=["tiny-llama", "tiny-qwen2"])
def tiny(request):
    """(model, tokenizer) in float64. Schedules run different row counts, whose products may round differently,
    but in float64 the logits then differ by ~1e-16 relative, far below the float32 the sampler (token_sampler) and
    the decode attention's softmax work in: completions and float32 log-probs come out equal unless such a
    difference crosses a float32 rounding (then one ulp, ~1e-7 relative; a token flips only if its uniform is that
    close to a CDF boundary)."""
    model, tokenizer = load_model_and_tokenizer(request.param)
    return model.double().eval(), tokenizer


@pytest.fixture(scope="session")
def tiny_llama():
    model, tokenizer = load_model_and_tokenizer("tiny-llama")
    return model.eval(), tokenizer


@pytest.fixture(scope="session")
def prompt_ids(tiny_llama):
    _, tokenizer = tiny_llama
    return [tokenizer(text)["input_ids"] for text in PROMPT_TEXTS]


@pytest.fixture(scope="session")
def eos_model(tmp_path_factory) -> str:
    """A saved tiny-llama whose samples end at different steps (two_process_helpers.save_eos_model)."""
    from two_process_helpers import save_eos_model

    return save_eos_model(tmp_path_factory.mktemp("eos_model"))


@pytest.fixture(scope="session")
def ddp_run(eos_model, tmp_path_factory) -> str:
    """One 2-process ddp fit of the tiny config on ``eos_model`` (two_process_helpers.fit_two_processes), shared by
    the ddp and FSDP2 tests: the StepRecorder path. Lightning's launcher starts its second rank, as a user's
    ``--trainer.devices 2`` does."""
    from two_process_helpers import fit_two_processes

    return fit_two_processes(tmp_path_factory.mktemp("ddp"), "--model.model", eos_model, "--trainer.strategy", "ddp",
                             launcher=True)
