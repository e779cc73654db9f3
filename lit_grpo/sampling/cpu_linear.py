"""The policy's linear layers during a rollout on a CPU: oneDNN's inner product instead of torch's ``F.linear``.

Owns: nothing past a rollout. ``onednn_linears`` routes every plain ``nn.Linear`` of the policy to oneDNN for the
rollout's prefills and decode steps and restores the modules when it ends; the update's forward and backward keep
torch's kernels.

Why: torch's float32 ``F.linear`` on an x86 CPU is MKL's sgemm, which for the few rows of a decode step (one per
slot) runs far below the machine's matmul rate (on AMD CPUs MKL also takes a narrower code path than the CPU has);
oneDNN's inner product, the kernel torch already uses for bfloat16, computes the same product several times faster
there. Each row's result does not depend on the other rows, so strategies of the same g stay bit-identical; against
torch's kernel the results differ by float32 rounding (a few units in the last place), as any other GEMM's would.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections.abc import Iterator
from typing import Literal

import torch

CpuLinear = Literal["auto", "onednn", "torch"]

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


def resolve_cpu_linear(setting: CpuLinear, model: torch.nn.Module, compiled: bool) -> bool:
    """Whether this rollout's linears run on oneDNN: ``setting`` is ``SamplingConfig.cpu_linear``. "auto" uses it
    wherever it can (a float32 policy on a CPU with oneDNN, the step not compiled); "onednn" warns once where it
    cannot and uses torch's kernel."""
    if setting == "torch":
        return False
    problem = "the decode step is compiled (torch.compile packs its own linears)" if compiled else onednn_problem(model)
    if problem is None:
        return True
    if setting == "onednn" and problem not in _warned:
        _warned.add(problem)
        warnings.warn(f"sampling.cpu_linear='onednn', but {problem}; the rollout uses torch's F.linear",
                      RuntimeWarning, stacklevel=3)
    return False


@contextlib.contextmanager
def onednn_linears(model: torch.nn.Module, enabled: bool = True) -> Iterator[None]:
    """Within the block, every ``nn.Linear`` of ``model`` (the class itself, not subclasses, which may compute
    otherwise) computes with oneDNN; inference only. Nothing happens when ``enabled`` is False."""
    if not enabled:
        yield
        return
    patched = [module for module in model.modules() if type(module) is torch.nn.Linear]
    for module in patched:
        module.forward = functools.partial(_onednn_linear, module)  # shadows the class's forward on this instance
    try:
        yield
    finally:
        for module in patched:
            module.__dict__.pop("forward", None)


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` ``[..., in] -> [..., out]`` by oneDNN's inner product (``weight``:
    ``[out, in]``)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


def _onednn_linear(module: torch.nn.Linear, x: torch.Tensor) -> torch.Tensor:
    return onednn_linear(x, module.weight, module.bias)
