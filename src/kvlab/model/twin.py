"""Twins: the copy of a model an engine runs, with some modules swapped for fast kernels, sharing every tensor.

Packed linears (``packed``), quantised linears (``quant``) and fused elementwise ops (``fused``) each make one.
A twin is a deep copy whose tensors (parameters, buffers, and plain tensor attributes such as packed weights)
are the original's, not copies; it is remembered per model and kind, so that engines built one after another
on the same model (the experiment builds hundreds) share it, and rebuilt when its key or a parameter changes
(torch counts every in-place write in ``_version``).
"""

from __future__ import annotations

import copy
import weakref
from collections.abc import Callable, Hashable

import torch
from torch import nn

_twins: weakref.WeakKeyDictionary[nn.Module, dict[str, tuple[tuple, nn.Module]]] = weakref.WeakKeyDictionary()


def remembered_twin(
    model: nn.Module, kind: str, key: tuple[Hashable, ...], swap: Callable[[nn.Module], None]
) -> nn.Module:
    """The ``kind`` twin of ``model`` for ``key``: a copy sharing every tensor, changed in place by ``swap``."""
    full_key = (*key, *(p._version for p in model.parameters()))
    per_model = _twins.setdefault(model, {})
    known = per_model.get(kind)
    if known is not None and known[0] == full_key:
        return known[1]
    tensors = [*model.parameters(), *model.buffers()]
    tensors += [v for m in model.modules() for v in vars(m).values() if isinstance(v, torch.Tensor)]
    twin = copy.deepcopy(model, memo={id(t): t for t in tensors})
    swap(twin)
    per_model[kind] = (full_key, twin)
    return twin
