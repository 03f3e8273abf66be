"""The dropout fusion (passes/dropout.py): a native_dropout no chain took becomes dmfx::dropout."""

import torch
import torch.nn.functional as F
from conftest import count, rewrite, targets

dmfx_ops = torch.ops.dmfx


def test_standalone_dropout_becomes_philox_dropout():
    fn = lambda x: F.dropout(x, 0.2, training=True) * 3  # noqa: E731
    gm, ctx = rewrite(fn, torch.randn(8, 8))
    assert ctx.fired == {"dropout": 1}
    assert count(gm, dmfx_ops.dropout) == 1 and torch.ops.aten.native_dropout.default not in targets(gm)
