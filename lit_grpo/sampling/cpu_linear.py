"""The policy's linear layers on a CPU: oneDNN's inner product instead of torch's ``F.linear``.

Owns: nothing past a rollout or an update. ``onednn_linears`` routes every plain ``nn.Linear`` of the policy to
oneDNN for the block it wraps and restores the modules when it ends: a rollout's prefills and decode steps
(``SamplingConfig.cpu_linear``), or an update's forward and backward (``GRPOModule``'s ``cpu_linear``, through
``OneDNNLinear``, whose gradients are oneDNN's inner products too). With the kernel "packed" it also holds, for the
rollout's length, a copy of each weight reordered into oneDNN's blocked layout for the decode step's row count, the
weights of sibling projections that read one input (``SHARED_INPUT_PROJECTIONS``) stacked into one copy.

Why: torch's float32 ``F.linear`` and its backward on an x86 CPU are MKL's sgemm, which for the few rows of a decode
step (one per slot) runs far below the machine's matmul rate, and on AMD CPUs takes a narrower code path than the CPU
has at any row count; oneDNN's inner product, the kernel torch already uses for bfloat16, computes the same products
faster for a decode step and, on AMD CPUs, for an update's (docs/benchmarks.md). On an Intel CPU MKL runs at the CPU's
full width and an update's products of hundreds of rows are faster on it than on oneDNN, so there ``auto`` leaves the
update on torch's kernel (a decode step's few rows still go to oneDNN's packed weights, which read them faster than
MKL's sgemm). On a plain ``[out, in]`` weight oneDNN streams it in a layout its kernel does not read at full speed; the
blocked copy costs one pass over the weights per rollout (the policy changes between rollouts), which the rollout's
decode steps win back. A decode step's small products are bound by reading their weights, and one pass over a stacked
weight (queries, keys and values; gate and up) reads faster than a pass over each. Every output, stacked or not, is one
row's inner product with one weight column: at a given row count a row's result does not depend on the other rows, and
every decode step of a rollout has its slots' row count, so strategies of the same g stay bit-identical (across row
counts oneDNN may pick another kernel, which rounds differently); against torch's kernel the results differ by float32
rounding (a few units in the last place), as any other GEMM's would.
"""

from __future__ import annotations

import contextlib
import functools
import warnings
from collections import defaultdict
from collections.abc import Iterator, Sequence
from typing import Literal, get_args

import torch

from lit_grpo.runtime.head_precision import layers_dtype
from lit_grpo.runtime.validation import check_choice, check_int

CpuLinear = Literal["auto", "packed", "onednn", "torch"]
#: What a rollout's linears run on: ``CpuLinear`` with "auto" resolved.
LinearKernel = Literal["packed", "onednn", "torch"]
#: The update's setting (``GRPOModule(cpu_linear=...)``): its weights change at every step, so nothing is packed.
UpdateLinear = Literal["auto", "onednn", "torch"]

#: Sibling projections (by module name, under one parent) that transformers' decoder layers compute from one input
#: tensor: self-attention's queries, keys and values, and the gated MLP's gate and up. A PEFT adapter's
#: ``base_layer`` of such a projection counts as the projection. Siblings called with different inputs (a
#: cross-attention's keys and values) still compute right, each call then paying for the whole stacked product.
SHARED_INPUT_PROJECTIONS = (frozenset({"q_proj", "k_proj", "v_proj"}), frozenset({"gate_proj", "up_proj"}))
_SET_OF_PROJECTION = {leaf: index for index, leaves in enumerate(SHARED_INPUT_PROJECTIONS) for leaf in leaves}

_warned: set[tuple[str, str]] = set()


def onednn_problem(model: torch.nn.Module) -> str | None:
    """Why the policy's linears cannot run on oneDNN here (None: they can)."""
    if not torch.backends.mkldnn.is_available():
        return "this torch build has no oneDNN (torch.backends.mkldnn)"
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type != "cpu":
        return f"the policy is on {None if parameter is None else parameter.device}, not the CPU"
    if (dtype := layers_dtype(model)) != torch.float32:  # a float32 head's weight says nothing of the layers'
        return f"the policy's weights are {str(dtype).removeprefix('torch.')}, not float32"
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
    if _kept_from_onednn("sampling.cpu_linear", setting, problem, "the rollout"):
        return "torch"
    if sharded:
        if setting == "packed":
            _warn_once("sampling.cpu_linear", setting,
                       "the policy is FSDP-sharded (its whole weights exist only inside its forward)",
                       "the rollout uses oneDNN on the gathered weights, unpacked")
        return "onednn"
    return "packed" if setting == "auto" else setting


def resolve_update_linear(setting: UpdateLinear, model: torch.nn.Module, sharded: bool) -> LinearKernel:
    """The kernel of an update's linears: ``setting`` is ``GRPOModule``'s ``cpu_linear``. "auto" is "onednn" wherever
    oneDNN can run, the policy is not FSDP-sharded (FSDP frees a layer's gathered weights after its forward, and
    a backward must not keep them) and the CPU is not Intel's (module docstring), "torch" elsewhere; "onednn" warns
    once where it cannot run and falls back."""
    check_choice("cpu_linear", setting, get_args(UpdateLinear))
    if setting == "torch" or (setting == "auto" and cpu_vendor() == "GenuineIntel"):
        return "torch"
    problem = "the policy is FSDP-sharded (its gathered weights are freed after each forward)" if sharded \
        else onednn_problem(model)
    return "torch" if _kept_from_onednn("model.cpu_linear", setting, problem, "the update") else "onednn"


@functools.cache
def cpu_vendor() -> str:
    """The CPU's vendor as ``/proc/cpuinfo`` names it ("GenuineIntel", "AuthenticAMD", ...); "" where unknown."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("vendor_id"):
                    return line.partition(":")[2].strip()
    except OSError:
        pass
    return ""


def _kept_from_onednn(name: str, setting: str, problem: str | None, user: str) -> bool:
    """Whether ``problem`` keeps ``user`` ("the rollout", "the update") on torch's kernel; a setting ``name`` that
    asked for oneDNN by name (not "auto") is told why, once."""
    if problem is None:
        return False
    if setting != "auto":
        _warn_once(name, setting, problem, f"{user} uses torch's F.linear")
    return True


def _warn_once(name: str, setting: str, problem: str, instead: str) -> None:
    """Warn that the setting ``name`` cannot have its way because of ``problem``, once per (setting, problem)."""
    if (name, problem) not in _warned:
        _warned.add((name, problem))
        warnings.warn(f"{name}={setting!r}, but {problem}; {instead}", RuntimeWarning, stacklevel=5)


@contextlib.contextmanager
def onednn_linears(model: torch.nn.Module, kernel: LinearKernel = "onednn", rows: int | None = None) -> Iterator[None]:
    """Within the block, every ``nn.Linear`` of ``model`` (the class itself, not subclasses, which may compute
    otherwise) computes with oneDNN, and where grad mode is on its backward too (``OneDNNLinear``). ``kernel``
    "packed" (inference only) first reorders each weight for inputs of ``rows`` rows (all leading dimensions
    together: the decode step's ``[slots, 1, in]`` is ``slots`` rows), which then read the copy, one copy for each
    set of sibling projections that read one input (``StackedProjections``); inputs of other row counts (prefill
    chunks) read the plain weight. Nothing happens when ``kernel`` is "torch"."""
    check_choice("kernel", kernel, get_args(LinearKernel))
    if kernel == "packed":
        rows = check_int("rows", rows, 1)
    if kernel == "torch":
        yield
        return
    patched = [module for module in model.modules() if type(module) is torch.nn.Linear]
    stacked: dict[int, tuple[StackedProjections, int]] = {}  # a member's id: its stack, its index in it
    packed: dict[int, torch.Tensor] = {}
    hooks = []
    if kernel == "packed":
        for parent, members in _shared_input_siblings(model):
            stack = StackedProjections(members, rows)
            stacked.update({id(module): (stack, index) for index, module in enumerate(members)})
            hooks.append(parent.register_forward_pre_hook(stack.forget))
        for module in patched:  # a weight two modules share (tied heads) is reordered once
            if id(module) not in stacked and id(module.weight) not in packed:
                packed[id(module.weight)] = torch.ops.mkldnn._reorder_linear_weight(module.weight.detach(), rows)
    # a forward already set on an instance (a hook's, an outer block's) comes back on exit
    shadowed = {id(module): module.__dict__["forward"] for module in patched if "forward" in module.__dict__}
    for module in patched:  # shadows the class's forward on this instance
        if id(module) in stacked:
            module.forward = functools.partial(_stacked_linear, module, *stacked[id(module)], rows)
        else:
            module.forward = functools.partial(_onednn_linear, module, packed.get(id(module.weight)), rows)
    try:
        yield
    finally:
        for module in patched:
            if id(module) in shadowed:
                module.forward = shadowed[id(module)]
            else:
                module.__dict__.pop("forward", None)
        for hook in hooks:
            hook.remove()


class StackedProjections:
    """Sibling linears that read one input (``SHARED_INPUT_PROJECTIONS``), computed as one oneDNN product over their
    weights stacked and packed for ``rows`` rows.

    Owns: the stacked copy, for the rollout's length; between the siblings' calls, the input they share and its
    outputs. The first member called with an input computes every member's output; the others, called with that same
    tensor, take theirs (a view) without computing; a member called with another input, or a second time, computes
    them all again for it. What is held goes when every member has taken its own, or at ``forget``, which runs
    before each call of the siblings' parent: inference tensors carry no version counter, so a change in place to
    the input between two siblings' calls would go unseen, and the parent's forward, which calls them in turn, is
    the window in which they may share it."""

    def __init__(self, members: Sequence[torch.nn.Linear], rows: int) -> None:
        self.weight = torch.ops.mkldnn._reorder_linear_weight(torch.cat([m.weight.detach() for m in members]), rows)
        self.bias = None if members[0].bias is None else torch.cat([m.bias.detach() for m in members])
        self.sizes = [m.out_features for m in members]
        self.forget()

    def forget(self, *hook_args) -> None:
        """Drop the held input and outputs (``hook_args``: a forward pre-hook's, unused)."""
        self._input: torch.Tensor | None = None
        self._version: int | None = None
        self._outputs: tuple[torch.Tensor, ...] = ()
        self._pending: set[int] = set()

    def output(self, index: int, x: torch.Tensor) -> torch.Tensor:
        """Member ``index``'s output for ``x`` ``[..., in] -> [..., out_index]``."""
        version = None if x.is_inference() else x._version
        if x is not self._input or version != self._version or index not in self._pending:
            self._input, self._version = x, version
            self._outputs = onednn_linear(x, self.weight, self.bias).split(self.sizes, dim=-1)
            self._pending = set(range(len(self.sizes)))
        self._pending.discard(index)
        output = self._outputs[index]
        if not self._pending:
            self.forget()
        return output


def _shared_input_siblings(model: torch.nn.Module) -> list[tuple[torch.nn.Module, list[torch.nn.Linear]]]:
    """Each set of ``SHARED_INPUT_PROJECTIONS`` in ``model`` that can be stacked (``_stackable``), with the parent
    module whose forward calls them."""
    found: dict[tuple[str, int], list[torch.nn.Linear]] = defaultdict(list)
    for name, module in model.named_modules():
        parent, _, leaf = name.removesuffix(".base_layer").rpartition(".")
        if type(module) is torch.nn.Linear and leaf in _SET_OF_PROJECTION:
            found[parent, _SET_OF_PROJECTION[leaf]].append(module)
    return [(model.get_submodule(parent), members) for (parent, _), members in found.items() if _stackable(members)]


def _stackable(members: Sequence[torch.nn.Linear]) -> bool:
    """Whether ``members`` can share one stacked weight: two or more, with one input size, dtype and device, and a
    bias on all or on none."""
    return len(members) > 1 and len(
        {(m.in_features, m.weight.dtype, m.weight.device, m.bias is None) for m in members}) == 1


def onednn_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
    """``F.linear(x, weight, bias)`` ``[..., in] -> [..., out]`` by oneDNN's inner product (``weight``:
    ``[out, in]``)."""
    return torch.ops.mkldnn._linear_pointwise(x, weight, bias, "none", [], "")


class OneDNNLinear(torch.autograd.Function):
    """``onednn_linear`` with a backward by oneDNN's inner product too. Both gradients are products over transposed
    views, which oneDNN reads as strided inputs, so no weight or activation is copied for them."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        ctx.save_for_backward(x, weight)
        ctx.has_bias = bias is not None
        return onednn_linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        x, weight = ctx.saved_tensors
        grad_rows = grad.reshape(-1, grad.shape[-1])                                          # [N, out]
        grad_x = grad_weight = grad_bias = None
        if ctx.needs_input_grad[0]:
            grad_x = onednn_linear(grad_rows, weight.t()).view(x.shape)                     # [N, in] -> x's shape
        if ctx.needs_input_grad[1]:
            grad_weight = onednn_linear(grad_rows.t(), x.reshape(-1, x.shape[-1]).t())     # [out, in]
        if ctx.has_bias and ctx.needs_input_grad[2]:
            grad_bias = grad_rows.sum(0)
        return grad_x, grad_weight, grad_bias


def _onednn_linear(module: torch.nn.Linear, packed_weight: torch.Tensor | None, rows: int | None,
                   x: torch.Tensor) -> torch.Tensor:
    if torch.is_grad_enabled():
        return OneDNNLinear.apply(x, module.weight, module.bias)
    use_packed = packed_weight is not None and _decode_rows(x, rows)
    return onednn_linear(x, packed_weight if use_packed else module.weight, module.bias)


def _stacked_linear(module: torch.nn.Linear, stack: StackedProjections, index: int, rows: int,
                    x: torch.Tensor) -> torch.Tensor:
    """``module``'s forward as member ``index`` of ``stack``: the stacked product for the decode step's rows, its
    own weight (unpacked) for any other input or under grad mode."""
    if torch.is_grad_enabled() or not _decode_rows(x, rows):
        return _onednn_linear(module, None, None, x)
    return stack.output(index, x)


def _decode_rows(x: torch.Tensor, rows: int) -> bool:
    """Whether ``x`` ``[..., in]`` has the decode step's ``rows`` rows (all leading dimensions together), the rows the
    packed copies were reordered for."""
    return x.numel() == rows * x.shape[-1]
