"""Several processes: FSDP2 sharding of a transformers model, the gradient norm over shards, and the weights a
rollout runs on (``RolloutWeights`` and its kinds, under FSDP2 and under mixed precision; used by ``GRPOModule``
and ``RolloutBuilder``)."""

from __future__ import annotations

import contextlib
import copy
import weakref
from typing import Callable, Iterable, Iterator

import torch

from lit_grpo.runtime.head_precision import computes_in_float32
from lit_grpo.runtime.known_warnings import ignore_warning
from lit_grpo.runtime.memory import device_memory


def shard_decoder_layers(model: torch.nn.Module, mesh, param_dtype: torch.dtype | None = None) -> None:
    """FSDP2 (``fully_shard``) on every ``*DecoderLayer`` of ``model``, then on the whole model.

    Args:
        mesh: the strategy's ``DeviceMesh``; with named dimensions its ``"data_parallel"`` one is used.
        param_dtype: gather the weights for forward and backward in this dtype (FSDP2's ``MixedPrecisionPolicy``;
            gradients are still reduced in float32); None gathers them in their own dtype.
    """
    from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard

    check_float32_head_gathered(model, param_dtype)
    mesh = data_parallel_mesh(mesh)
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not layers:
        raise ValueError(f"fsdp=True found no *DecoderLayer modules in {type(model).__name__} to shard")
    policy = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32 if param_dtype else None)
    for layer in layers:
        fully_shard(layer, mesh=mesh, mp_policy=policy)
    fully_shard(model, mesh=mesh, mp_policy=policy)
    # transformers' hidden_states[0] (the embeddings' output) is a view, which FSDP2 warns an in-place op on would
    # drop its pre-backward hook: lit_grpo reads hidden_states[-1] alone, out of place. For this model's class
    # (fully_shard's FSDP<Model> now) only.
    ignore_warning(rf"FSDP2-wrapped module \({type(model).__name__}\) returned a view tensor", UserWarning,
                   r"torch\.distributed\.fsdp")


def check_float32_head_gathered(model: torch.nn.Module, param_dtype: torch.dtype | None) -> None:
    """Raise where FSDP2 would gather ``model``'s float32 output head (``cast_lm_head_to_fp32``) in a narrower
    ``param_dtype``: the head, in the root's group (with the embedding it may be tied to), would then compute from
    a rounded weight, the cast undone without a word."""
    heads = [name for name, module in model.named_modules() if computes_in_float32(module)]
    if heads and param_dtype is not None and param_dtype.itemsize < 4:
        raise ValueError(f"fsdp: the output head {heads[0]!r} computes in float32 (cast_lm_head_to_fp32), but FSDP2 "
                         f"would gather its weight in {param_dtype} (the mixed precision's param_dtype), so it would "
                         "not compute from float32 weights; set cast_lm_head_to_fp32: false, or fsdp: false")


def data_parallel_only(strategy) -> None:
    """Make a ``ModelParallelStrategy``'s "auto" sizes mean what lit_grpo trains: data parallel over every rank.

    Lightning reads ``data_parallel_size="auto"`` as the node count and ``tensor_parallel_size="auto"`` as the
    processes per node (tensor parallelism inside a node), which lit_grpo does not do: its FSDP2 shards over the
    data-parallel dimension, so "auto" becomes every rank there and 1 for tensor parallelism. Call it after the
    trainer is built, before it sets up its processes (``GRPOCLI`` does). Sizes given as numbers are left alone
    (``GRPOModule`` refuses a data-parallel size other than the world size)."""
    from lightning.pytorch.strategies import ModelParallelStrategy

    if not isinstance(strategy, ModelParallelStrategy):
        return
    # Lightning resolves these private fields in setup_environment(); it has no public setter for them
    if strategy._tensor_parallel_size == "auto":
        strategy._tensor_parallel_size = 1
    if strategy._data_parallel_size == "auto" and strategy._tensor_parallel_size == 1:
        strategy._data_parallel_size = strategy.num_nodes * strategy.num_processes


def data_parallel_mesh(mesh):
    """The mesh's ``"data_parallel"`` dimension where it has named ones, else the mesh itself."""
    if mesh.mesh_dim_names and "data_parallel" in mesh.mesh_dim_names:
        return mesh["data_parallel"]
    return mesh


def gradient_norm(parameters: Iterable[torch.nn.Parameter]) -> float:
    """The total L2 norm of the parameters' gradients (0.0 when none has one); over all shards for DTensors."""
    from torch.distributed.tensor import DTensor

    norms = [torch.linalg.vector_norm(p.grad.detach().float()) for p in parameters if p.grad is not None]
    if not norms:
        return 0.0
    # a sharded gradient's norm is a partial DTensor: full_tensor() reduces it over the mesh
    norms = [norm.full_tensor() if isinstance(norm, DTensor) else norm for norm in norms]
    return float(torch.linalg.vector_norm(torch.stack(norms)))


def strategy_all_gather(strategy) -> Callable[[torch.Tensor], torch.Tensor]:
    """``tensor -> [world_size, *tensor.shape]`` through a Lightning strategy's ``all_gather``, the tensor moved to
    the strategy's device first (NCCL gathers CUDA tensors only). A collective: every rank calls it. Lightning's
    gather runs torch's deprecated autograd gather, warned of on every rank: ignored from Lightning's call only."""
    ignore_warning(r"torch\.distributed\.nn\.functional\.all_gather is deprecated", FutureWarning,
                   r"lightning\.fabric\.utilities\.distributed")
    return lambda tensor: strategy.all_gather(tensor.to(strategy.root_device))


def union_over_ranks(names: Iterable[str]) -> list[str]:
    """Every rank's ``names`` together, sorted: one ``all_gather_object``, so every rank calls it at the same point
    (``names`` itself where this process trains alone)."""
    names = sorted(set(names))
    if not is_multi_process():
        return names
    gathered: list[list[str] | None] = [None] * torch.distributed.get_world_size()
    torch.distributed.all_gather_object(gathered, names)
    return sorted({name for rank in gathered for name in rank or ()})


def is_multi_process() -> bool:
    """Whether this process trains with others (an initialized process group of more than one rank)."""
    return (torch.distributed.is_available() and torch.distributed.is_initialized()
            and torch.distributed.get_world_size() > 1)


def is_fsdp_sharded(model: torch.nn.Module) -> bool:
    """Whether FSDP2 shards the model: its forward hooks gather the weights (collectives), so such a model is not
    captured into a CUDA graph, and nothing reads its weights outside its own forward."""
    try:
        from torch.distributed.fsdp import FSDPModule
    except ImportError:  # pragma: no cover - old torch
        return False
    return isinstance(model, FSDPModule)


# ---------------------------------------------------------------------------------------------- rollout weights
#: How a rollout runs an FSDP2-sharded policy (``GRPOModule(fsdp_rollout=...)``): "gathered" (full weights gathered
#: once per rollout), "lockstep" (the sharded policy, every rank stepping until all are done), "auto" (gathered
#: where the full weights fit, see :meth:`GatheredWeights.fits`).
FSDP_ROLLOUTS = ("auto", "gathered", "lockstep")


def fits_free_memory(nbytes: int, device: torch.device, share: float) -> bool:
    """Whether ``nbytes`` take at most ``share`` of ``device``'s free memory (``device_memory``'s, the allocator's
    unused blocks included, as the KV budget reads it); always on a CPU."""
    memory = device_memory(device)
    return memory is None or nbytes <= share * memory[0]


class RolloutWeights:
    """The module a rollout runs (``module``) and the scope it runs in (``active()``: ``materialize()`` on entry,
    ``release()`` on exit); this class: the policy itself, nothing to do. Every rank enters ``active()`` the same
    number of times (once per training step's rollouts, once per validation batch): the sharded kinds below run
    collectives at its edges. ``keep``: the engines keep their CUDA graphs after the scope, so the weights they read
    must stay where they are. ``decodes_alone``: inside the scope a rank decodes with no collective, so it may stop
    decoding on its own (a stop signal abandons its rollout)."""

    decodes_alone = True

    def __init__(self, policy: torch.nn.Module):
        self.module = policy

    @contextlib.contextmanager
    def active(self, keep: bool = False) -> Iterator[torch.nn.Module]:
        try:
            yield self.materialize()
        finally:
            if not keep:
                self.release()

    def materialize(self) -> torch.nn.Module:
        """``module`` with the current weights in it (entering ``active()``); here it is the policy already."""
        return self.module

    def release(self) -> None:
        """Free what ``materialize`` allocated (leaving ``active()`` without ``keep``); here nothing."""

    def scope_bytes(self) -> int:
        """Bytes ``materialize`` allocates on this device while the scope lasts; here none."""
        return 0


class GatheredWeights(RolloutWeights):
    """The full weights of an FSDP2-sharded policy, gathered once per rollout scope into an unsharded replica.

    The replica has the policy's structure (LoRA adapters, tied weights and buffers included) and plain tensors in
    the dtype its units gather in: the decode loop runs on it with no collective inside, so ranks whose rollouts differ
    in length never wait on each other, and CUDA graphs and the compiled step serve as on one GPU. Entering
    ``active()`` gathers the weights once (FSDP2's own all-gather, one per unit, in its mixed-precision
    ``param_dtype`` where one is set: bf16 gathers half the bytes); leaving it frees the replica's storage unless
    ``keep`` (then the next gather copies into the same memory). The parameter objects stay the same, so a
    compiled step is not recompiled.

    Args:
        policy: the sharded policy (``fully_shard`` applied); it may still move to its device afterwards.
        skeleton: ``meta_replica(policy)`` taken before sharding: the structure, parameters on the meta device.
        dtype: the dtype the units gather in under mixed precision (the autocast dtype), for the size of the
            gathered weights (``weights_bytes``, ``fits``); None: the policy's own dtype when the size is asked
            (a "-true" precision converts the policy after this is built). The replica takes what the gather gives.
    """

    def __init__(self, policy: torch.nn.Module, skeleton: torch.nn.Module, dtype: torch.dtype | None):
        super().__init__(skeleton.requires_grad_(False).eval())
        self.sharded, self.dtype = policy, dtype
        self._allocated = False

    def gather(self) -> torch.nn.Module:
        """All-gather the policy's current weights into the replica: one collective per FSDP2 unit (a decoder
        layer, the root's own weights), each unit unsharded, copied and resharded in turn, so at most one
        unit's full weights exist beside the replica."""
        from torch.distributed.fsdp import FSDPModule
        from torch.distributed.tensor import DTensor

        with torch.no_grad():
            if not self._allocated:  # buffers (rotary frequencies, ...) are the policy's: FSDP2 shards none
                for (name, _), (_, source) in zip(self.module.named_buffers(), self.sharded.named_buffers(),
                                                  strict=True):
                    _set_tensor(self.module, name, source.detach().clone(), parameter=False)
            pending = dict(self.module.named_parameters())
            for prefix, unit in self.sharded.named_modules():
                if not isinstance(unit, FSDPModule):
                    continue
                unit.unshard()  # its own weights only (not its sub-units'), in FSDP2's param_dtype
                for name, source in unit.named_parameters(prefix=prefix):
                    if name in pending and not isinstance(source, DTensor):
                        self._copy(name, pending.pop(name), source)
                unit.reshard()
            for name, param in pending.items():  # outside any unit: plain tensors
                source = self.sharded.get_parameter(name)
                self._copy(name, param, source.full_tensor() if isinstance(source, DTensor) else source)
        self._allocated = True
        return self.module

    def _copy(self, name: str, param: torch.nn.Parameter, source: torch.Tensor) -> None:
        if not self._allocated:  # in the dtype the unit gathers in: the trainer's precision has set it by now
            _set_tensor(self.module, name, torch.empty_like(source.detach()))
            param = self.module.get_parameter(name)
        elif param.untyped_storage().size() == 0:
            param.untyped_storage().resize_(param.numel() * param.element_size())
        param.copy_(source.detach())

    def release(self) -> None:
        """Free the replica's weights (the parameter objects stay, storage-less, for the next gather)."""
        if self._allocated:
            for param in self.module.parameters():
                param.untyped_storage().resize_(0)

    def weights_bytes(self) -> int:
        """The replica's full weights in the dtype they are gathered in."""
        dtype = self.dtype or next(self.sharded.parameters()).dtype
        return sum(p.numel() for p in self.module.parameters()) * torch.empty(0, dtype=dtype).element_size()

    def scope_bytes(self) -> int:
        return self.weights_bytes()

    def fits(self, share: float = 0.5) -> bool:
        """Whether the gathered weights take at most ``share`` of the device's free memory (the rest is for the
        KV cache and the update); always on a CPU."""
        return fits_free_memory(self.weights_bytes(), next(self.sharded.parameters()).device, share)

    def materialize(self) -> torch.nn.Module:
        return self.gather()


def cast_names(policy: torch.nn.Module, dtype: torch.dtype) -> list[str]:
    """The names of ``policy``'s linear weights and biases that autocast to ``dtype`` would cast (floating, in
    another dtype); empty where there is nothing to cast (the policy is already in ``dtype``). A head cast to
    float32 (``cast_lm_head_to_fp32``) turns autocast off: its weight is not cast."""
    return [f"{prefix}.{name}" if prefix else name
            for prefix, module in policy.named_modules(remove_duplicate=False)
            if isinstance(module, torch.nn.Linear) and not computes_in_float32(module)
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

    Why: under bf16-mixed the policy keeps float32 master weights and autocast casts each linear's weight at every
    call, keeping no cast (Lightning's autocast has its cache off). The update pays that once per forward; a rollout
    would pay it at every decode step (reading each float32 weight and writing its bfloat16 copy to then read the
    copy), and a captured CUDA graph replays the casts.

    ``module`` is a replica of the policy's modules sharing every parameter and buffer with it but what autocast
    would cast: the weights and biases of ``torch.nn.Linear`` layers (the LM head included, untied from an embedding,
    which stays float32; not a head cast to float32, which computes from its master), its own tensors in ``dtype``,
    one per master weight wherever it is used. Embeddings, norms and rotary buffers stay the policy's, in the dtype
    the trainer's forward uses, so the rollout computes what the trainer computes: autocast casts an
    already-bfloat16 weight to nothing, and the copy holds the values its cast would give. Leaving ``active()``
    frees their storage unless ``keep`` (the engines keep CUDA graphs that read them, at the same addresses); the
    parameter objects stay the same, with their shapes, so a compiled step is not recompiled. The replica runs in
    eval mode; rollouts run under no grad.

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
                cast = torch.nn.Parameter(self._new(master), requires_grad=False)
                cast.untyped_storage().resize_(0)  # its shape now, its memory on entering active()
                self._casts[id(master)] = master, cast
            owner_name, _, leaf = name.rpartition(".")
            # set in this module only: an embedding tied to the head keeps its float32 master
            self.module.get_submodule(owner_name)._parameters[leaf] = self._casts[id(master)][1]

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

    def scope_bytes(self) -> int:
        return self.cast_bytes()

    def fits(self, share: float = 0.25) -> bool:
        """Whether the cast weights take at most ``share`` of the device's free memory (the rest is for the KV
        cache and the update); always on a CPU."""
        device = next(iter(self._casts.values()))[0].device if self._casts else torch.device("cpu")
        return fits_free_memory(self.cast_bytes(), device, share)


class RaisedOnEveryRank(Exception):
    """A mixin for errors that every rank raises at once, by agreement (a check on values reduced over the ranks):
    each rank's own error tells the whole story, none is another's consequence."""


class RankFailed(RuntimeError):
    """Another rank stopped with an error where this one would have waited for it (``ranks``: theirs, global)."""

    def __init__(self, ranks: list[int], where: str):
        self.ranks = ranks
        names = ", ".join(str(rank) for rank in ranks)
        super().__init__(f"rank {names} stopped with an error {where}; this rank stops with it (the output of rank "
                         f"{names} names the error)")


class LockstepWeights(RolloutWeights):
    """The sharded policy itself, with every rank forwarding until all ranks' rollouts are done.

    FSDP2's forward all-gathers each layer's shards, so every forward on one rank needs one on every other rank.
    Inside ``active()`` each forward of the policy first exchanges every rank's state, "working", "done" or
    "failed" (a forward pre-hook, ahead of FSDP2's own); leaving ``active()``, a rank whose rollouts are done keeps
    answering with a one-token forward while any rank still works, then all leave together. The collectives any
    forward runs depend on the module's structure, not on its inputs, so the sequences match: slower than
    ``GatheredWeights`` (a collective per layer per step), never a hang. For weights too large to gather on one
    device.

    An error inside the scope between two forwards (a reward function's, say) is sent as "failed" in one more
    exchange before it propagates, so the other ranks raise :class:`RankFailed` at their next exchange instead of
    waiting for a forward that never comes. An error inside a forward leaves the ranks' collectives out of step:
    nothing more is sent, and the peers' collectives fail once this process ends.

    Args:
        policy: the sharded policy; group: the process group its shards span (None: the default one).
    """

    WORKING, DONE, FAILED = 1.0, 0.0, -1.0
    decodes_alone = False  # every forward gathers shards from every rank

    def __init__(self, policy: torch.nn.Module, group=None):
        super().__init__(policy)
        self.group = group
        self._answering = False  # inside an idle rank's one-token forward: its state went out already
        self._between_forwards = True  # where an exchange may run without breaking the collectives' order

    def _exchange(self, state: float) -> bool:
        """Send this rank's state and receive every rank's (one all-reduce of ``[world]``); True when any rank
        is working. Raises :class:`RankFailed` when another rank failed."""
        import torch.distributed as dist

        device = next(self.module.parameters()).device
        states = torch.zeros(dist.get_world_size(self.group), device=device)
        states[dist.get_rank(self.group)] = state
        dist.all_reduce(states, op=dist.ReduceOp.SUM, group=self.group)
        failed = [dist.get_global_rank(self.group, r) if self.group is not None else r
                  for r in torch.nonzero(states < 0).flatten().tolist()]
        if failed and state != self.FAILED:
            raise RankFailed(failed, "inside the lockstep rollout")
        return bool((states > 0).any())

    def _before_forward(self, module, args, kwargs):
        self._between_forwards = False
        if not self._answering:
            self._exchange(self.WORKING)

    def _after_forward(self, module, args, kwargs, output):
        self._between_forwards = True

    def _answer(self) -> None:
        """One forward whose output nobody reads, so the other ranks' gathers find this rank's shards."""
        self._between_forwards = False  # the others are in this forward's gathers from here on
        device = next(self.module.parameters()).device
        self._answering = True
        try:
            with torch.no_grad():
                self.module(input_ids=torch.zeros(1, 1, dtype=torch.long, device=device), use_cache=False)
        finally:
            self._answering = False

    @contextlib.contextmanager
    def active(self, keep: bool = False) -> Iterator[torch.nn.Module]:
        hooks = [self.module.register_forward_pre_hook(self._before_forward, prepend=True, with_kwargs=True),
                 self.module.register_forward_hook(self._after_forward, with_kwargs=True)]
        _LOCKSTEP_ACTIVE.add(self.module)
        self._between_forwards = True
        try:
            yield self.module
            while self._exchange(self.DONE):
                self._answer()
        except RankFailed:
            raise  # every rank saw the failure in the same exchange: nothing left to tell
        except BaseException:
            if self._between_forwards:
                # where the others cannot take it (gone already), they learn of the error when this process ends
                with contextlib.suppress(Exception):
                    self._exchange(self.FAILED)
            raise
        finally:
            _LOCKSTEP_ACTIVE.discard(self.module)
            for hook in hooks:
                hook.remove()


#: Sharded policies inside a ``LockstepWeights.active()`` scope: the one place a rollout may decode on one.
_LOCKSTEP_ACTIVE: weakref.WeakSet[torch.nn.Module] = weakref.WeakSet()


def check_decodable(model: torch.nn.Module) -> None:
    """Raise where decoding on ``model`` could wait forever: an FSDP2-sharded model outside a lockstep scope, whose
    every forward gathers shards from the other ranks, which stop forwarding when their own rollouts end."""
    if is_fsdp_sharded(model) and model not in _LOCKSTEP_ACTIVE:
        raise ValueError(
            f"{type(model).__name__} is sharded by FSDP2: each forward gathers its layers from every rank, so ranks "
            "whose rollouts end at different steps would wait on each other forever. Decode on "
            "GatheredWeights(policy, meta_replica(policy) taken before sharding, dtype).active() (the full weights "
            "gathered once per rollout) or inside LockstepWeights(policy).active() (every rank steps until all are "
            "done); GRPOModule.rollout_weights() picks one (model.fsdp_rollout).")


def meta_replica(model: torch.nn.Module) -> torch.nn.Module:
    """A copy of ``model`` whose parameters are on the meta device (no memory) and whose buffers are copies:
    the structure a :class:`GatheredWeights` replica fills. Shared parameters stay shared."""
    memo = {id(p): torch.nn.Parameter(torch.empty_like(p, device="meta"), requires_grad=False)
            for p in model.parameters()}
    return copy.deepcopy(model, memo)


def _set_tensor(root: torch.nn.Module, name: str, tensor: torch.Tensor, parameter: bool = True) -> None:
    """Set parameter (or buffer) ``name`` of ``root`` to ``tensor`` in every module that shares it."""
    owner_name, _, leaf = name.rpartition(".")
    owner = root.get_submodule(owner_name)
    old = owner._parameters[leaf] if parameter else owner._buffers[leaf]
    new = torch.nn.Parameter(tensor, requires_grad=False) if parameter else tensor
    for module in root.modules():
        table = module._parameters if parameter else module._buffers
        for key, value in table.items():
            if value is old:
                table[key] = new
