"""The shared-prefix update: each prompt of a micro-batch goes forward (and backward) once, not once per completion.

A micro-batch's ``m`` rows hold ``u <= m`` distinct prompts (a GRPO group repeats its prompt ``G`` times). The
unshared forward runs ``m x (P + T)`` tokens; this one runs ``u x P + m x (T - 1)`` in two passes of the model:

1. the ``u`` distinct prompts (left-padded, as in ``RolloutBatch``) go forward into a ``prefix_writer`` cache,
   which keeps each layer's keys and values ``[u, kv_heads, P, head_dim]`` with their autograd graph; the last
   prompt position's state predicts each row's first completion token;
2. the completion tokens but the last go forward behind a ``prefix_reader`` cache, whose layer ``update`` returns
   ``cat(prefix[group], new)``: every row attends to its own prompt's keys (``index_select`` of the shared tensor,
   so the backward sums the group's gradients into the one prompt forward). Masks and positions are the unshared
   forward's own columns, so every real token sees exactly what it saw there.

Memory stays linear: a row's keys are ``P + T`` long, as unshared; nothing is ``[G x T, G x T]``. Rows are grouped
by prompt (``prompt_groups``), so groups split over micro-batches or several groups in one both work (a split
group's prompt goes forward once per micro-batch holding some of it).

The second pass has a cost of its own, so the prefix pays only where it spares the unshared forward enough token
positions to cover it (``shared_prefix_pays``): ``shared_prefix="auto"`` takes it there, ``True`` always.

The backward runs in two stages where one process trains alone. Every weight is used by both passes, so in one
backward the autograd engine would hold each weight's pass-2 gradient until pass 1's arrives: all the layers'
gradients at once (as much memory as the model's), on top of ``.grad``. So pass 1's outputs (the prompts' keys
and values, their last states) and pass 2's input embeddings enter pass 2 detached, through one autograd node
(``_PassOneBackward``) whose backward, once all their gradients are in, runs pass 1's backward and the embedding
lookup's. Each stage uses a weight once, so its gradient goes into ``.grad`` as the layer is done, as in the
unshared backward. Under DDP or FSDP a parameter's gradient must arrive once per backward (DDP marks it ready
once; FSDP2 reduce-scatters a module once), so there both passes share one backward.

Under mixed precision each pass would cast every weight to the autocast dtype again (Lightning's autocast keeps
no cast cache, so that an optimizer step inside one step's autocast is seen), and autograd would keep both casts
for the backward: a second low-precision copy of the model. ``casts_shared_by_passes`` lets the two passes share
one cast per weight; not without grad or where layers recompute in the backward (nothing else keeps the casts
there, a cache would), nor where FSDP2 shards the weights (a cache would keep every unit's gathered weights). One
process changes no bit by it (each backward stage upcasts its own gradients); under DDP, where both passes share
one backward, a weight's two low-precision gradients add up before the upcast, as under PyTorch's own autocast for
any weight used twice.

Gradient checkpointing: transformers' checkpointed decoder layers drop the cache unless the layer sets
``_can_checkpoint_with_cache``, because a cache that appends would grow again when the backward replays the layer.
Neither cache here appends: the writer overwrites (the replay stores equal tensors) and the reader stores nothing,
so ``caches_through_checkpoints`` sets that flag on the layers for the two calls. ``unsupported_reason`` names
what keeps a model off this path (sliding-window or hybrid caches, no cache argument, a transformers without
that flag under checkpointing, a model whose own forward drops the cache under checkpointing, as GPT-2's:
``drops_cache_under_checkpointing``); ``GRPOModule`` then warns and runs the unshared forward.
"""

from __future__ import annotations

import contextlib
import warnings
from typing import Any, Iterator

import torch
from transformers import Cache, DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.modeling_layers import GradientCheckpointingLayer

from lit_grpo.runtime.distributed import is_fsdp_sharded, is_multi_process
from lit_grpo.runtime.models import accepts, cache_keyword, checkpointed_layers


class PrefixWriteLayer(DynamicLayer):
    """Pass 1: keeps the keys/values ``[u, kv_heads, P, head_dim]`` of the last write (a replay rewrites them)."""

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
        self.keys, self.values = key_states, value_states
        return key_states, value_states


class PrefixReadLayer(DynamicLayer):
    """Pass 2: each row's prompt keys/values in front of its new ones, stored nowhere.

    Args:
        keys, values: ``[u, kv_heads, P, head_dim]`` the distinct prompts' (from a ``PrefixWriteLayer``).
        group: ``[m]`` long, the prompt of each row.
    """

    def __init__(self, keys: torch.Tensor, values: torch.Tensor, group: torch.Tensor):
        super().__init__()
        self.keys, self.values, self.group = keys, values, group
        self.dtype, self.device = keys.dtype, keys.device
        self.is_initialized = True
        self.reads = 0

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args, **kwargs):
        """``[m, kv_heads, P + q, head_dim]`` keys and values for ``q`` new tokens per row."""
        self.reads += 1
        keys = torch.cat([self.keys.index_select(0, self.group).to(key_states.dtype), key_states], dim=-2)
        values = torch.cat([self.values.index_select(0, self.group).to(value_states.dtype), value_states], dim=-2)
        return keys, values


def prefix_writer() -> Cache:
    """An empty cache for pass 1 (one ``PrefixWriteLayer`` per attention layer, added as the model writes)."""
    return Cache(layer_class_to_replicate=PrefixWriteLayer)


def prefix_reader(writer: Cache, group: torch.Tensor) -> Cache:
    """The pass-2 cache over a filled ``writer``; ``group``: ``[m]`` long, each row's index into its prompts."""
    return Cache(layers=[PrefixReadLayer(layer.keys, layer.values, group) for layer in writer.layers])


@contextlib.contextmanager
def casts_shared_by_passes(model: torch.nn.Module) -> Iterator[None]:
    """Under autocast, cast each weight once for both passes (module docstring): autocast's cast cache is on
    inside and emptied on the way out, so no cast outlives the forward that made it (the backward's references
    keep what it needs). Only where the backward holds every cast anyway: a no-op without autocast or grad, with
    checkpointed layers or an FSDP2-sharded model. Autocast caches only the casts of weights that train: frozen
    ones (LoRA's base) are cast by each pass, and held twice unless loaded in the autocast dtype."""
    device_type = next(model.parameters()).device.type
    if (not torch.is_autocast_enabled(device_type) or torch.is_autocast_cache_enabled()
            or not torch.is_grad_enabled() or checkpointed_layers(model) or is_fsdp_sharded(model)):
        yield
        return
    torch.set_autocast_cache_enabled(True)
    try:
        yield
    finally:
        torch.set_autocast_cache_enabled(False)
        torch.clear_autocast_cache()


@contextlib.contextmanager
def caches_through_checkpoints(model: torch.nn.Module) -> Iterator[None]:
    """Let checkpointed decoder layers keep the cache (safe for these caches: module docstring)."""
    layers = [m for m in checkpointed_layers(model) if "_can_checkpoint_with_cache" not in vars(m)]
    for layer in layers:
        layer._can_checkpoint_with_cache = True
    try:
        yield
    finally:
        for layer in layers:
            del layer._can_checkpoint_with_cache


def unsupported_reason(model: torch.nn.Module) -> str | None:
    """Why ``model`` cannot run the shared-prefix forward exactly, or None when it can."""
    config = getattr(model, "config", None)
    if config is None:
        return f"{type(model).__name__} has no transformers config"
    if not accepts(model, keyword := cache_keyword(model)):
        return f"{type(model).__name__}.forward takes no {keyword}"
    kinds = sorted({type(layer).__name__ for layer in DynamicCache(config=config).layers
                    if type(layer) is not DynamicLayer})
    if kinds:
        return (f"its cache layers include {', '.join(kinds)} (sliding-window, hybrid or linear attention), "
                "which a completion cannot read as a plain prefix")
    if checkpointed_layers(model):
        if not hasattr(GradientCheckpointingLayer, "_can_checkpoint_with_cache"):
            return ("this transformers version drops the cache in gradient-checkpointed layers "
                    "(no GradientCheckpointingLayer._can_checkpoint_with_cache)")
        try:
            dropped = drops_cache_under_checkpointing(model)
        except Exception as error:  # the shared forward's first pass, which it runs alike, would fail too
            return f"a one-token forward into the prefix cache failed ({type(error).__name__}: {error})"
        if dropped:
            return ("its forward hands its layers no cache under gradient checkpointing "
                    "(model.gradient_checkpointing: false keeps it)")
    return None


def drops_cache_under_checkpointing(model: torch.nn.Module) -> bool:
    """Whether ``model``'s forward, in train mode, passes its decoder layers no cache. transformers' checkpointed
    layers drop the cache themselves, which ``caches_through_checkpoints`` lifts; some models drop it above them,
    in their own forward (GPT-2's passes None while ``self.gradient_checkpointing and self.training``). Found by
    one token's forward into a ``prefix_writer``: no layer written, dropped. Without gradients, and with the layers
    let keep the cache as the shared forward lets them (``caches_through_checkpoints``: some transformers versions
    drop it in a checkpointed layer in train mode even without gradients), so only a drop above the layers shows;
    the modules' modes and the random state (dropout draws in train mode) are put back, and an FSDP2-sharded model's
    weights resharded (its root keeps them gathered after a forward, in place of its parameters). False for a model
    on the meta device, which cannot run."""
    parameter = next(model.parameters(), None)
    if parameter is None or parameter.device.type == "meta":
        return False
    device = parameter.device
    modes = [(module, module.training) for module in model.modules()]
    writer = prefix_writer()
    one = torch.ones(1, 1, dtype=torch.long, device=device)
    forked = [device.index or 0] if device.type == "cuda" else []
    try:
        with (torch.no_grad(), torch.random.fork_rng(devices=forked, device_type=device.type),
              caches_through_checkpoints(model)):
            model.train()
            model(input_ids=one * 0, attention_mask=one, position_ids=one * 0, **{cache_keyword(model): writer},
                  use_cache=False)
    finally:
        for module, training in modes:
            module.training = training
        for module in model.modules():
            if is_fsdp_sharded(module):
                module.reshard()
    return not writer.layers


#: ``GRPOModule(shared_prefix=...)``'s settings (what ``completion_logps`` takes).
SHARED_PREFIX_MODES = (True, False, "auto")

#: What the model's second pass costs per decoder layer, in token positions x that layer's parameters (the work of
#: a position, in units that hold across model sizes): ``shared_prefix: auto`` shares a micro-batch's prompts where
#: the positions it spares times a layer's parameters reach it. Measured on a CPU (docs/training.md). EXPERIMENTAL on
#: GPUs: a provisional value, a layer's launch overhead times the arithmetic rate, until ``tools.bench_update
#: --device cuda`` measures it.
PASS_COST_PER_LAYER = {"cpu": 2.5e7, "cuda": 2e10}


def saved_positions(num_rows: int, num_prompts: int, prompt_length: int) -> int:
    """The token positions the shared prefix spares an unshared micro-batch of ``m`` rows over ``u`` distinct
    prompts padded to ``P'`` tokens: ``(m - u) x P'``."""
    if not 1 <= num_prompts <= num_rows or prompt_length < 0:
        raise ValueError(f"saved_positions needs 1 <= num_prompts <= num_rows and prompt_length >= 0: got "
                         f"num_rows={num_rows}, num_prompts={num_prompts}, prompt_length={prompt_length}")
    return (num_rows - num_prompts) * prompt_length


def layer_parameters(model: torch.nn.Module) -> int:
    """The parameters of ``model``'s first decoder layer (0 where it has none that transformers knows as one)."""
    layer = next((m for m in model.modules() if isinstance(m, GradientCheckpointingLayer)), None)
    return sum(p.numel() for p in layer.parameters()) if layer is not None else 0


def shared_prefix_pays(saved: int, parameters_per_layer: int, device_type: str) -> bool:
    """``shared_prefix: auto``'s rule: whether ``saved`` positions of layers of ``parameters_per_layer`` outweigh
    the second pass on this device type (``PASS_COST_PER_LAYER``; a GPU other than CUDA takes CUDA's)."""
    cost = PASS_COST_PER_LAYER.get(device_type, PASS_COST_PER_LAYER["cuda"])
    return saved * parameters_per_layer >= cost


def prompt_groups(micro: dict[str, Any]) -> tuple[torch.Tensor, torch.Tensor]:
    """``[u]`` the row of each distinct prompt and ``[m]`` each row's index into those ``u``: the micro-batch's own
    ``prompt_groups`` where it has them (``RolloutBatch.micro_batch``: by prompt index, known on the host), else by
    prompt content, padding included (rows with equal prompt tokens and mask share one; the device is waited on)."""
    if "prompt_groups" in micro:
        return micro["prompt_groups"]
    prompt_length = micro["input_ids"].shape[1] - micro["completion_ids"].shape[1]
    key = torch.cat([micro["input_ids"][:, :prompt_length], micro["attention_mask"][:, :prompt_length]], dim=1)
    _, group = torch.unique(key, dim=0, return_inverse=True)
    first = torch.full((int(group.max()) + 1,), len(group), dtype=torch.long, device=group.device)
    first = first.scatter_reduce(0, group, torch.arange(len(group), device=group.device), "amin")
    return first, group


def shared_prefix_outputs(model: torch.nn.Module, micro: dict[str, Any], *, hidden: bool,
                          groups: tuple[torch.Tensor, torch.Tensor] | None = None) -> torch.Tensor:
    """``[m, T', H]`` final hidden states (``hidden``) or ``[m, T', V]`` logits predicting each completion token
    of a micro-batch (``RolloutBatch.micro_batch``), with each distinct prompt forwarded once.

    Equal to the unshared forward's ``[:, -(T' + 1):-1]`` up to float rounding (tests/test_shared_prefix.py).
    ``groups``: ``prompt_groups(micro)`` when the caller has it already.
    """
    num_tokens = micro["completion_ids"].shape[1]
    prompt_length = micro["input_ids"].shape[1] - num_tokens
    prompt_mask = micro["attention_mask"][:, :prompt_length]
    # a micro-batch of RolloutBatch's is left-padded: a row with a prompt token has one in the last prompt column
    shortest = micro.get("shortest_prompt")
    if prompt_length < 1 or not (shortest >= 1 if shortest is not None else bool(prompt_mask[:, -1].all())):
        raise ValueError(f"a shared prefix needs left-padded prompts of >= 1 token; got prompt_length={prompt_length} "
                         f"and last prompt column mask {prompt_mask[:, -1].tolist()}")
    first, group = groups if groups is not None else prompt_groups(micro)
    # for hidden states the model's own head runs on one position only (the caller applies it in chunks)
    outputs = dict(output_hidden_states=True, logits_to_keep=1) if hidden else {}
    last_only = dict(logits_to_keep=1) if accepts(model, "logits_to_keep") else {}
    # use_cache=False: the caches are passed explicitly (so the model makes none of its own), and transformers
    # would turn use_cache off under checkpointing anyway, with a warning
    # One embedding lookup serves both passes: a lookup per pass would give the embedding matrix a dense gradient
    # per pass ([V, H], as large as the weight) in the backward, where the unshared forward has one.
    tokens = _token_inputs(model, micro["input_ids"])
    keyword = cache_keyword(model)
    writer = prefix_writer()
    with caches_through_checkpoints(model), casts_shared_by_passes(model):
        out = model(**tokens(first, slice(0, prompt_length)), attention_mask=prompt_mask[first],
                    position_ids=micro["position_ids"][first, :prompt_length], **{keyword: writer},
                    use_cache=False, **{**outputs, **last_only})
        last = (out.hidden_states[-1] if hidden else out.logits)[:, -1:]  # [u, 1, H or V]: the last prompt token
        del out
        if not writer.layers:
            raise RuntimeError(f"{type(model).__name__} wrote no keys into the shared prefix cache; "
                               "run the update with shared_prefix=False")
        columns = slice(prompt_length, prompt_length + num_tokens - 1)
        inputs = tokens(slice(None), columns) if num_tokens > 1 else {}
        if torch.is_grad_enabled() and not is_multi_process() and not is_fsdp_sharded(model):
            last, inputs = _backward_in_two_stages(writer, last, inputs)
        parts = [last.index_select(0, group)]
        del last
        if num_tokens > 1:  # the last completion token predicts nothing: it does not go forward
            reader = prefix_reader(writer, group)
            out = model(**inputs,
                        attention_mask=micro["attention_mask"][:, :prompt_length + num_tokens - 1],
                        position_ids=micro["position_ids"][:, columns], **{keyword: reader}, use_cache=False,
                        **outputs)
            if not all(layer.reads for layer in reader.layers):
                raise RuntimeError(f"{type(model).__name__} did not read the shared prefix cache in every layer; "
                                   "run the update with shared_prefix=False")
            parts.append(out.hidden_states[-1] if hidden else out.logits)
    return torch.cat(parts, dim=1)


class _PassOneBackward(torch.autograd.Function):
    """Pass 1's outputs, detached, for pass 2; its backward (run once all their gradients are in) is pass 1's.

    The outputs come in a list, not as tensor arguments, so autograd does not link this node to pass 1's graph;
    ``anchor`` (an empty leaf) makes the node part of the loss's graph."""

    @staticmethod
    def forward(ctx, anchor: torch.Tensor, outputs: list[torch.Tensor]):
        ctx.set_materialize_grads(False)
        ctx.outputs = outputs
        return tuple(tensor.detach() for tensor in outputs)

    @staticmethod
    def backward(ctx, *grads):
        pairs = [(tensor, grad) for tensor, grad in zip(ctx.outputs, grads) if grad is not None]
        ctx.outputs = None
        if pairs:
            torch.autograd.backward([tensor for tensor, _ in pairs], [grad for _, grad in pairs])
        return None, None


def _backward_in_two_stages(writer: Cache, last: torch.Tensor, inputs: dict[str, torch.Tensor]):
    """Route pass 1's outputs (``writer``'s keys and values, ``last``) and pass 2's ``inputs`` through
    ``_PassOneBackward`` (module docstring). Returns the new ``last`` and ``inputs``; ``writer``'s layers hold the
    new keys and values."""
    slots = [(layer, name) for layer in writer.layers for name in ("keys", "values")]
    tensors = [getattr(layer, name) for layer, name in slots] + [last] + list(inputs.values())
    routed = [index for index, tensor in enumerate(tensors) if tensor.requires_grad]
    if not routed:
        return last, inputs
    anchor = torch.empty(0, device=last.device, requires_grad=True)
    for index, tensor in zip(routed, _PassOneBackward.apply(anchor, [tensors[index] for index in routed])):
        tensors[index] = tensor
    for (layer, name), tensor in zip(slots, tensors):
        setattr(layer, name, tensor)
    return tensors[len(slots)], dict(zip(inputs, tensors[len(slots) + 1:]))


def _token_inputs(model: torch.nn.Module, input_ids: torch.Tensor):
    """``(rows, columns) -> model inputs`` for part of ``input_ids`` ``[m, P + T]``: slices of one embedding lookup
    (``inputs_embeds``) where the model takes them, else the token ids themselves. An FSDP2-sharded model gets the
    ids: its weights are gathered by its own forward, so a lookup outside it would read a shard."""
    lookup = getattr(model, "get_input_embeddings", None)
    usable = callable(lookup) and accepts(model, "inputs_embeds") and not is_fsdp_sharded(model)
    embedding = lookup() if usable else None
    if not isinstance(embedding, torch.nn.Module):
        return lambda rows, columns: {"input_ids": input_ids[rows, columns]}
    embeds = embedding(input_ids)
    return lambda rows, columns: {"inputs_embeds": embeds[rows, columns]}


def shared_prefix_usable(model: torch.nn.Module, warn: bool = True) -> bool:
    """``unsupported_reason(model) is None``; otherwise warns (``warn``), naming the reason and the fallback."""
    reason = unsupported_reason(model)
    if reason is not None and warn:
        warnings.warn(f"shared_prefix=True is not exact for {type(model).__name__}: {reason}; the update runs one "
                      "forward per completion instead", stacklevel=2)
    return reason is None
