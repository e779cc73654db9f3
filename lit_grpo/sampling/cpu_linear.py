"""The policy's linear layers during a rollout on a CPU: oneDNN's inner product instead of torch's ``F.linear``.

Owns: nothing past a rollout. ``onednn_linears`` routes every plain ``nn.Linear`` of the policy to oneDNN for the
rollout's prefills and decode steps and restores the modules when it ends; the update's forward and backward keep
torch's kernels. With the kernel "packed" it also holds, for the rollout's length, a copy of each weight reordered
into oneDNN's blocked layout for the decode step's row count.

Why: torch's float32 ``F.linear`` on an x86 CPU is MKL's sgemm, which for the few rows of a decode step (one per
slot) runs far below the machine's matmul rate (on AMD CPUs MKL also takes a narrower code path than the CPU has);
oneDNN's inner product, the kernel torch already uses for bfloat16, computes the same product several times faster
there. On a plain ``[out, in]`` weight oneDNN streams it in a layout its kernel does not read at full speed; the
blocked copy costs one pass over the weights per rollout (the policy changes between rollouts), which a rollout's
tens of decode steps win back. Each row's result does not depend on the other rows, so strategies of the same g stay
bit-identical; against torch's kernel the results differ by float32 rounding (a few units in the last place), as any
other GEMM's would.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Literal, get_args

import torch

from lit_grpo.runtime.validation import check_choice, check_int

CpuLinear = Literal["auto", "packed", "onednn", "torch"]
#: What a rollout's linears run on: ``CpuLinear`` with "auto" resolved.
LinearKernel = Literal["packed", "onednn", "torch"]

_warned: set[str] = set()


def onednn_problem(model: torch.nn.Module) -> str | None:
    """Why the policy's linears cannot run on oneDNN here (None: they can)."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn)"
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type != "cpu":
        return f"the policy is on {None if parameter is None else parameter.device}, not the CPU"
    if parameter.dtype != torch.float32:
        return f"the policy's weights are {str(parameter.dtype).removeprefix('torch.')}, not float32"
    if torch.is_autocast_enabled("cpu"):
        return "CPU autocast is on (its casts apply to F.linear, not to oneDNN's op)"
    return None


def resolve_cpu_linear(setting: CpuLinear, model: torch.nn.Module, compiled: bool, sharded: bool) -> LinearKernel:
    """The kernel of this rollout's linears: ``setting`` is ``SamplingConfig.cpu_linear``. "auto" is "packed" wherever
    oneDNN can run (a float32 policy on a CPU with oneDNN, the step not compiled), "onednn" for a policy FSDP shards
    (``sharded``: its whole weights exist only inside its forward, so there is nothing to pack beforehand), and
    "torch" elsewhere; "packed" and "onednn" warn once where they cannot run and fall back the same way."""
    if setting == "torch":
        return "torch"
    # Inductor lowers oneDNN's linear only for weights frozen into the graph, which a policy in training is not.
    problem = "the decode step is compiled (Inductor takes oneDNN's linear only with frozen weights)" if compiled \
        else onednn_problem(model)
    if problem is not None:
        if setting != "auto":
            _warn_once(setting, problem, "torch's F.linear")
        return "torch"
    if sharded:
        if setting == "packed":
            _warn_once(setting, "the policy is FSDP-sharded (its whole weights exist only inside its forward)",
                       "oneDNN on the gathered weights, unpacked")
        return "onednn"
    return "packed" if setting == "auto" else setting


def _warn_once(setting: CpuLinear, problem: str, instead: str) -> None:
    if problem not in _warned:
        _warned.add(problem)
        warnings.warn(f"sampling.cpu_linear={setting!r}, but {problem}; the rollout uses {instead}", RuntimeWarning,
                      stacklevel=4)


@contextlib.contextmanager
def onednn_linears(model: torch.nn.Module, kernel: LinearKernel = "onednn", rows: int | None = None) -> Iterator[None]:
    """Within the block, every ``nn.Linear`` of ``model`` (the class itself, not subclasses, which may compute
    otherwise) computes with oneDNN; inference only. ``kernel`` "packed" first reorders each weight for inputs of
    ``rows`` rows (all leading dimensions together: the decode step's ``[slots, 1, in]`` is ``slots`` rows), which
    then read the copy; inputs of other row counts (prefill chunks) read the plain weight. Nothing happens when
    ``kernel`` is "torch"."""
    check_choice("kernel", kernel, get_args(LinearKernel))
    if kernel == "packed":
        check_int("rows", rows, 1)
    if kernel == "torch":
        yield
        return
    patched = [module for module in model.modules() if type(module) is torch.nn.Linear]
    packed: dict[int, torch.Tensor] = {}
    if kernel == "packed":
        for module in patched:  # a weight two modules share (tied heads) is reordered once
            if id(module.weight) not in packed:
                packed[id(module.weight)] = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), rows)
    for module in patched:  # shadows the class's forward on this instance
        module.forward = functools.partial(_onednn_linear, module, packed.get(id(module.weight)), rows)
    try:
        yield
    finally:
        for module in patched:
            module.__dict__.pop("forward", None)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` ``[..., in] -> [..., out]`` by oneDNN's inner product (``weight``:
    ``[out, in]``)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _onednn_linear(module: torch.nn.Linear, packed_weight: torch.Tensor | None, rows: int | None,
                   x: torch.Tensor) -> torch.Tensor:
    use_packed = packed_weight is not None and x.numel() == rows * x.shape[-1]
    return onednn_linear(x, packed_weight if use_packed else module.weight, module.bias)
