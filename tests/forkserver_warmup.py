"""Imported once by tests/forked_cli.py's fork server, never by a test: it does once what each forked
rank of a ``lit-grpo fit`` would otherwise do first (import the lazily imported packages, build the tiny model and
its tokenizer, run a forward, a backward and a short rollout, measure the read bandwidth of RolloutProfiler's decode
floor), so a forked rank starts warm. One thread: the server forks, and a thread pool does not survive a fork."""

import matplotlib
import torch

torch.set_num_threads(1)
matplotlib.use("Agg")

import math_verify  # noqa: E402
import matplotlib.pyplot  # noqa: E402,F401
import reasoning_gym  # noqa: E402
import torch.distributed.checkpoint  # noqa: E402,F401
import torch.distributed.fsdp  # noqa: E402,F401
import torch.utils.tensorboard  # noqa: E402,F401

from lit_grpo.runtime.models import load_model_and_tokenizer  # noqa: E402
from lit_grpo.sampling import RolloutEngine  # noqa: E402
from lit_grpo.sampling.roofline import read_bandwidth  # noqa: E402

_model, _tokenizer = load_model_and_tokenizer("tiny-llama")
_model(input_ids=torch.tensor([[1, 2, 3]]), labels=torch.tensor([[1, 2, 3]])).loss.backward()
with torch.no_grad():
    RolloutEngine(_model.eval(), _tokenizer, group_size=2, micro_group_size=2, max_new_tokens=4).generate([[1, 2, 3]])
reasoning_gym.create_dataset("basic_arithmetic", size=4, seed=0)
# The probe sums a buffer of 4 x the last-level cache (GiBs where that cache is large), seconds of every rank's
# first step; measured here, a forked rank reads it as its process's own (roofline.read_bandwidth keeps it).
read_bandwidth("cpu")
del _model, _tokenizer, math_verify  # imported to be warm in every forked rank, not used here
