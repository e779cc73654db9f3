"""Rollout weights under mixed precision: the linear layers' weights cast to the autocast dtype once per rollout.

Under bf16-mixed the policy keeps float32 master weights and autocast casts each linear's weight to bfloat16 at
every call, keeping no cast (Lightning's autocast has its cache off). The update pays that once per forward; a
rollout would pay it at every decode step, reading each float32 weight and writing its bfloat16 copy to then read
the copy, some three times the bytes of the bfloat16 weights the step needs, and a captured CUDA graph replays the
casts. ``CastWeights`` makes those copies once per rollout scope, so no weight is cast inside a decode step.

Only what autocast would cast is copied: the weights and biases of ``torch.nn.Linear`` layers (the LM head
included, untied from the embedding, which stays float32). Embeddings, norms and rotary buffers are the policy's
own, in the dtype the trainer's forward uses them in, so the rollout computes what the trainer computes: autocast
casts an already-bfloat16 weight to nothing, and the copy holds the very values its cast would give.
"""

from __future__ import annotations

import copy

import torch

from lit_grpo.runtime.distributed import RolloutWeights


def cast_names(policy: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """The names of ``policy``'s linear weights and biases that autocast to ``dtype`` would cast (floating, in
    another dtype); empty where there is nothing to cast (the policy is already in ``dtype``)."""
    return [f"{prefix}.{name}" if prefix else name
            for prefix, module in policy.named_modules(remove_duplicate=False) if isinstance(module, torch.nn.Linear)
            for name, tensor in module.named_parameters(recurse=False)
            if tensor.is_floating_point() and tensor.dtype != dtype]


def reads_weights_outside_linear(policy: torch.nn.Module) -> bool:
    """Whether a layer of ``policy`` reads a linear layer's weight itself: peft's DoRA computes its weight norm from
    the base weight, in float32 under the trainer's autocast, where a bfloat16 copy would change the result."""
    return any(any(getattr(module, "use_dora", {}).values()) for module in policy.modules()
               if isinstance(getattr(module, "use_dora", None), dict))


class CastWeights(RolloutWeights):
    """The policy with its linear layers' weights in ``dtype`` (the autocast dtype), cast from the master weights
    on entering ``active()``: a rollout decodes under autocast with no weight cast inside a step.

    ``module`` is a replica of the policy's modules sharing every parameter and buffer with it but the linear
    layers' weights and biases, which are its own tensors in ``dtype`` (module docstring): one per master weight,
    wherever it is used. Leaving ``active()`` frees their storage unless ``keep`` (the engines keep CUDA graphs that
    read them, at the same addresses); the parameter objects stay the same, with their shapes, so a compiled step is
    not recompiled. The replica runs in eval mode; rollouts run under no grad.

    Args:
        policy: the trained module (not FSDP2-sharded: ``GatheredWeights`` gathers in the autocast dtype already;
            no layer reading a linear weight outside ``F.linear``: ``reads_weights_outside_linear``).
        dtype: the autocast dtype its rollouts run under.
    """

    def __init__(self, policy: torch.nn.Module, dtype: torch.dtype):
        shared = {id(tensor): tensor for tensor in (*policy.parameters(), *policy.buffers())}
        super().__init__(copy.deepcopy(policy, shared).eval())
        self.policy, self.dtype = policy, dtype
        self._casts: dict[int, tuple[torch.nn.Parameter, torch.nn.Parameter]] = {}  # id(master): (master, cast)
        for name in cast_names(policy, dtype):
            master = policy.get_parameter(name)
            if id(master) not in self._casts:
                self._casts[id(master)] = master, torch.nn.Parameter(self._new(master), requires_grad=False)
            owner_name, _, leaf = name.rpartition(".")
            # set in this module only: an embedding tied to the head keeps its float32 master
            self.module.get_submodule(owner_name)._parameters[leaf] = self._casts[id(master)][1]
        self.release()

    def _new(self, master: torch.Tensor) -> torch.Tensor:
        return torch.empty(master.shape, dtype=self.dtype, device=master.device)

    def materialize(self) -> torch.nn.Module:
        """Copy every master weight into its ``dtype`` tensor (its storage allocated again where it was freed) and
        return the replica."""
        with torch.no_grad():
            for master, cast in self._casts.values():
                if cast.device != master.device:  # the policy moved since: a new tensor on its device
                    cast.data = self._new(master)
                elif cast.untyped_storage().size() == 0:
                    cast.untyped_storage().resize_(cast.numel() * cast.element_size())
                cast.copy_(master)
        return self.module

    def release(self) -> None:
        """Free the cast weights' storage (the parameter objects stay, storage-less, for the next cast)."""
        for _, cast in self._casts.values():
            cast.untyped_storage().resize_(0)

    def cast_bytes(self) -> int:
        """The bytes of the cast weights while allocated."""
        return sum(cast.numel() * cast.element_size() for _, cast in self._casts.values())

    def fits(self, share: float = 0.25) -> bool:
        """Whether the cast weights take at most ``share`` of the device's free memory (the rest is for the KV
        cache and the update); always on a CPU."""
        device = next(iter(self._casts.values()))[0].device if self._casts else torch.device("cpu")
        if device.type != "cuda":
            return True
        free, _ = torch.cuda.mem_get_info(device)
        return self.cast_bytes() <= share * free
