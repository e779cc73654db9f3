"""FSDP2 sharding of a transformers model and the gradient norm over shards (used by ``GRPOModule``)."""

from __future__ import annotations

from typing import Iterable

import torch


def shard_decoder_layers(model: torch.nn.Module, mesh) -> None:
    """FSDP2 (``fully_shard``) on every ``*DecoderLayer`` of ``model``, then on the whole model.

    Args:
        mesh: the strategy's ``DeviceMesh``; with named dimensions its ``"data_parallel"`` one is used.
    """
    from torch.distributed.fsdp import fully_shard

    if mesh.mesh_dim_names and "data_parallel" in mesh.mesh_dim_names:
        mesh = mesh["data_parallel"]
    layers = [m for m in model.modules() if type(m).__name__.endswith("DecoderLayer")]
    if not layers:
        raise ValueError(f"fsdp=True found no *DecoderLayer modules in {type(model).__name__} to shard")
    for layer in layers:
        fully_shard(layer, mesh=mesh)
    fully_shard(model, mesh=mesh)


def gradient_norm(parameters: Iterable[torch.nn.Parameter]) -> float:
    """The total L2 norm of the parameters' gradients (0.0 when none has one); over all shards for DTensors."""
    from torch.distributed.tensor import DTensor

    norms = [torch.linalg.vector_norm(p.grad.detach().float()) for p in parameters if p.grad is not None]
    if not norms:
        return 0.0
    # a sharded gradient's norm is a partial DTensor: full_tensor() reduces it over the mesh
    norms = [norm.full_tensor() if isinstance(norm, DTensor) else norm for norm in norms]
    return float(torch.linalg.vector_norm(torch.stack(norms)))


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
