"""The counter the sync and launch budgets rest on counts each kind of sync once, and nothing else."""

from __future__ import annotations

import torch

from dispatch_count import DispatchCount


def test_each_kind_of_sync_is_counted_once_and_plain_math_is_not():
    x = torch.randn(6)
    with DispatchCount() as c:
        y = x * 2 + 1  # 2 launches, no sync
    assert (c.syncs, c.launches) == (0, 2)
    for f in (lambda: int(x.max()), lambda: bool(x.sum() > 0), lambda: x.nonzero(), lambda: x[x > 0],
              lambda: x.tolist(), lambda: x.numpy(), lambda: x[0].item(),
              lambda: torch.repeat_interleave(x, torch.tensor([1, 2, 1, 1, 1, 1])), lambda: x.masked_select(x > 0)):
        with DispatchCount() as c:
            f()
        assert c.syncs == 1, c.sync_ops
    with DispatchCount() as c:
        y.view(2, 3)  # a view: no launch
        torch.repeat_interleave(x, torch.full((6,), 2), output_size=12)  # the size given: no sync
    assert c.syncs == 0 and c.ops["aten::view"] == 1 and c.ops["aten::repeat_interleave"] == 1
    assert torch.Tensor.tolist is not None and "wrapper" not in torch.Tensor.tolist.__qualname__  # restored
