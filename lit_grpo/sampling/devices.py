"""A device as a tensor's ``.device`` reads it: the one key per-device caches (probes, measured bandwidth) use."""

from __future__ import annotations

import torch


def indexed_device(device: torch.device | str) -> torch.device:
    """``device`` with its index: bare "cuda" is the current CUDA device (``cuda:N``), as a tensor placed there
    reports it; any other device as given. A per-device cache keyed by this finds a tensor's device."""
    device = torch.device(device)
    if device.type == "cuda" and device.index is None:
        return torch.device("cuda", torch.cuda.current_device())
    return device
