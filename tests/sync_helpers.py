"""What tests of host synchronisation need (not a test module): a count of lit_grpo's own reads of tensor values to
the host (``HostReads``), each a wait on the device when the tensor lives on a GPU."""

from __future__ import annotations

import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

#: What reads a value (``.item()``, ``float()``, ``bool()``) or makes a shape from values (a wait either way).
_READS = (torch.ops.aten._local_scalar_dense, torch.ops.aten.nonzero, torch.ops.aten.masked_select,
          torch.ops.aten._unique2, torch.ops.aten.unique_dim, torch.ops.aten.unique_consecutive)


def _from_lit_grpo() -> bool:
    """Whether the innermost caller outside torch (and this file) is lit_grpo's code: a read inside transformers,
    or inside torch itself (an optimizer's step counter), is theirs."""
    for frame in reversed(traceback.extract_stack()[:-2]):
        path = frame.filename.replace("\\", "/")
        if "/torch/" in path or path == __file__:
            continue
        return "/lit_grpo/" in path
    return False


class HostReads(TorchDispatchMode):
    """Counts, within the block, lit_grpo's reads of tensor values to the host: ``_READS``, indexing by a boolean
    mask (a ``nonzero`` inside) and ``Tensor.tolist``. ``sites`` names each reading line."""

    def __init__(self):
        super().__init__()
        self.sites: list[str] = []
        self._tolist = None

    @property
    def count(self) -> int:
        return len(self.sites)

    def _record(self) -> None:
        if _from_lit_grpo():
            frame = next(f for f in reversed(traceback.extract_stack()[:-2]) if "/lit_grpo/" in f.filename)
            self.sites.append(f"{frame.filename.split('/lit_grpo/')[-1]}:{frame.lineno} {frame.line}")

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        boolean_index = func is torch.ops.aten.index.Tensor and any(
            isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in args[1])
        if func.overloadpacket in _READS or boolean_index:
            self._record()
        return func(*args, **(kwargs or {}))

    def __enter__(self):
        tolist, reads = torch.Tensor.tolist, self

        def counted_tolist(tensor, *args, **kwargs):
            reads._record()
            return tolist(tensor, *args, **kwargs)

        self._tolist, torch.Tensor.tolist = tolist, counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)
