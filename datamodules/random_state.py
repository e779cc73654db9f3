"""The global python / numpy / torch random states (the CPU's, and the current CUDA device's where CUDA is in use:
a GPU update's dropout draws from it), saved as plain lists and tensors so that checkpoints load with
``torch.load(weights_only=True)``; part of ``RolloutDataModule``'s state for exact resume."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch


def get_rng_states() -> dict[str, Any]:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": [list(x) if isinstance(x, tuple) else x for x in random.getstate()],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
            "torch": torch.get_rng_state(),
            **({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() and torch.cuda.is_initialized()
               else {})}


def set_rng_states(states: Mapping[str, Any]) -> None:
    if "python" in states:
        version, internal, gauss = states["python"]
        random.setstate((version, tuple(internal), gauss))
    if "numpy" in states:
        name, keys, pos, has_gauss, gauss = states["numpy"]
        np.random.set_state((name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss))
    if "torch" in states:
        torch.set_rng_state(torch.as_tensor(states["torch"], dtype=torch.uint8))
    if "cuda" in states and torch.cuda.is_available():  # a CPU-only resume of a GPU run has no such state to set
        torch.cuda.set_rng_state(torch.as_tensor(states["cuda"], dtype=torch.uint8))
