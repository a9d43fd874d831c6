"""Count what a piece of code asks of the device, on a CPU: the operators that would make a GPU wait for the host
(device-to-host syncs) and the non-view operators (a proxy for kernel launches).

A sync is an operator whose result the host must read before it can go on: `_local_scalar_dense` (`item()`,
`int(t)`, `bool(t)`), `nonzero`, `masked_select`, `unique`, a boolean-mask index (`t[mask]`, a hidden
`nonzero`), `repeat_interleave` of tensor repeats without `output_size`, `equal`; and `Tensor.tolist()` /
`Tensor.numpy()`, which bypass the dispatcher and are caught by wrapping them while counting.

    with DispatchCount() as c:
        step()
    assert c.syncs == 0, c.sync_ops
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

SYNC_OPS = {"aten::_local_scalar_dense", "aten::nonzero", "aten::masked_select", "aten::equal", "aten::unique_dim",
            "aten::_unique", "aten::_unique2", "aten::unique_consecutive"}
INDEX_OPS = {"aten::index", "aten::index_put", "aten::index_put_", "aten::_index_put_impl_"}  # not index_copy_ etc.


def _is_sync(name: str, args, kwargs) -> bool:
    if name in SYNC_OPS:
        return True
    if name in INDEX_OPS and len(args) > 1:  # t[mask], t[mask] = v: the output size is the mask's count
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or ()))
    if name == "aten::repeat_interleave":
        return kwargs.get("output_size") is None
    return False


class DispatchCount(TorchDispatchMode):
    """Counts operators by name while active. `syncs`: device-to-host syncs; `launches`: non-view operators."""

    def __init__(self):
        super().__init__()
        self.ops: Counter[str] = Counter()
        self.sync_ops: Counter[str] = Counter()
        self.launches = 0

    @property
    def syncs(self) -> int:
        return sum(self.sync_ops.values())

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func._schema.name
        self.ops[name] += 1
        if not func.is_view:
            self.launches += 1
        if _is_sync(name, args, kwargs):
            self.sync_ops[name] += 1
        return func(*args, **kwargs)

    def __enter__(self):
        self._wrapped = {m: getattr(torch.Tensor, m) for m in ("tolist", "numpy")}
        for m, f in self._wrapped.items():
            setattr(torch.Tensor, m, self._counting(m, f))
        return super().__enter__()

    def __exit__(self, *exc):
        for m, f in self._wrapped.items():
            setattr(torch.Tensor, m, f)
        return super().__exit__(*exc)

    def _counting(self, name, f):
        def wrapper(t, *args, **kwargs):
            self.sync_ops[f"Tensor.{name}"] += 1
            return f(t, *args, **kwargs)
        return wrapper
