"""FLOP counting with torch.utils.flop_counter: matmuls, convolutions and attention (2 FLOPs per
multiply-add); elementwise work, norms and sampler updates count zero.

On the CPU, SDPA runs as `_scaled_dot_product_flash_attention_for_cpu`, which torch 2.13's counter has
no formula for; it is counted here with the counter's own SDPA formula, as the CUDA kernels are.
`graph_flops` counts a traced graph on fake tensors: shapes only, no arithmetic and no memory.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from torch import fx
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils.flop_counter import FlopCounterMode, sdpa_flop_count

aten = torch.ops.aten


def _cpu_sdpa_flops(query_shape, key_shape, value_shape, *args, out_shape=None, **kwargs) -> int:
    return sdpa_flop_count(query_shape, key_shape, value_shape)


def flop_counter() -> FlopCounterMode:
    """A FlopCounterMode that also counts the CPU SDPA kernel."""
    return FlopCounterMode(display=False, custom_mapping={aten._scaled_dot_product_flash_attention_for_cpu: _cpu_sdpa_flops})


def graph_flops(gm: fx.GraphModule, args: Sequence[torch.Tensor]) -> int | None:
    """FLOPs of one call of `gm` on arguments shaped as `args`, run on fake tensors; None when some
    op of the graph has no fake implementation (the count is a report, never a reason to fail)."""
    try:
        with FakeTensorMode(allow_non_fake_inputs=True) as mode, flop_counter() as counter, torch.no_grad():
            gm(*[mode.from_tensor(a) if isinstance(a, torch.Tensor) else a for a in args])
    except Exception:  # noqa: BLE001 (any op the fake mode cannot run)
        return None
    return int(counter.get_total_flops())
