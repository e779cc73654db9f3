"""The global python / numpy / torch random states (the CPU's, and the current CUDA device's where CUDA is in use:
a GPU update's dropout draws from it), saved as plain lists and tensors so that checkpoints load with
``torch.load(weights_only=True)``; part of ``RolloutDataModule``'s state for exact resume."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import numpy as np
import torch

from lit_grpo.runtime.validation import check_state_keys, shown_value


def get_rng_states() -> dict[str, Any]:
    name, keys, pos, has_gauss, gauss = np.random.get_state()
    return {"python": [list(x) if isinstance(x, tuple) else x for x in random.getstate()],
            "numpy": [name, keys.tolist(), int(pos), int(has_gauss), float(gauss)],
            "torch": torch.get_rng_state(),
            **({"cuda": torch.cuda.get_rng_state()} if torch.cuda.is_available() and torch.cuda.is_initialized()
               else {})}


def set_rng_states(states: Mapping[str, Any]) -> None:
    if "python" in states:
        random.setstate(_python_state(states["python"]))
    if "numpy" in states:
        np.random.set_state(_numpy_state(states["numpy"]))
    if "torch" in states:
        torch.set_rng_state(_byte_state(states["torch"]))
    if "cuda" in states and torch.cuda.is_available():  # a CPU-only resume of a GPU run has no such state to set
        torch.cuda.set_rng_state(_byte_state(states["cuda"]))


def check_rng_states(name: str, states: Any) -> None:
    """Refuse ``states`` (``get_rng_states``' of a checkpoint, ``name`` in it) unless each state is one its
    generator takes, tried on a scratch generator (the global ones are left as they are): a ValueError naming the
    bad one, with the error its generator gave. A CUDA state is checked for its form only: its size is the device's.
    """
    check_state_keys(name, states, tuple(_CHECKS), optional=tuple(_CHECKS))
    for key, state in states.items():
        what, check = _CHECKS[key]
        try:
            check(state)
        except (TypeError, ValueError, IndexError, OverflowError, RuntimeError) as error:
            raise ValueError(f"{name}[{shown_value(key)}] is not a random state of {what}: {error}") from None


def _python_state(state: Any) -> tuple:
    version, internal, gauss = state
    return version, tuple(internal), gauss


def _numpy_state(state: Any) -> tuple:
    name, keys, pos, has_gauss, gauss = state
    return name, np.asarray(keys, dtype=np.uint32), pos, has_gauss, gauss


def _byte_state(state: Any) -> torch.Tensor:
    return torch.as_tensor(state, dtype=torch.uint8)


def _check_cuda_state(state: Any) -> None:
    tensor = _byte_state(state)
    if tensor.dim() != 1 or not tensor.numel():
        raise ValueError(f"a generator's state is a non-empty list of bytes, not one shaped {list(tensor.shape)}")


#: What each saved state seeds, and its check on a scratch generator.
_CHECKS = {
    "python": ("python's random module", lambda state: random.Random().setstate(_python_state(state))),
    "numpy": ("numpy's global generator", lambda state: np.random.RandomState().set_state(_numpy_state(state))),
    "torch": ("torch's generator", lambda state: torch.Generator().set_state(_byte_state(state))),
    "cuda": ("the CUDA device's generator", _check_cuda_state),
}
