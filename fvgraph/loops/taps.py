"""Taps: named intermediate tensors of a denoise step, for parity diffs. Parity runs only.

`TapPoints(transformer)` hooks every transformer block (`blocks`, or FLUX's double- then
single-stream blocks, numbered in order of use; of a block returning (text stream, image stream) the
image stream is tapped: the last block's text stream is dead code in a traced step). In eager mode a block's output is recorded
as `tap.block.{i}.{k}` (k: the k-th call of block i in this step: 0 = cond, 1 = uncond); while
tracing, the hook wraps the output in the `fvgraph::tap` marker instead, and the tap-outputs pass
(passes/tap_outputs.py) makes each marker an extra output of the graph, named the same way. The
production step graphs never see these hooks: tap variants compile under their own signatures.

When the CFG branches are fused, a block runs once on both branches; its tap then holds both
(`2 x batch` rows, cond first) and `split_fused` names the halves as the unfused run would.
"""

from __future__ import annotations

import torch
from torch import nn


class TapPoints:
    def __init__(self, transformer: nn.Module):
        self._calls: dict[int, int] = {}
        self._recorded: dict[str, torch.Tensor] = {}
        self._handles = [block.register_forward_hook(self._hook(i)) for i, block in enumerate(_blocks(transformer))]

    def _hook(self, index: int):
        def record(module, args, output):
            k = self._calls.get(index, 0)
            self._calls[index] = k + 1
            name = f"tap.block.{index}.{k}"
            if isinstance(output, tuple):
                return (*output[:-1], self._tap(output[-1], name))
            return self._tap(output, name)

        return record

    def _tap(self, output: torch.Tensor, name: str) -> torch.Tensor:
        if torch.compiler.is_compiling():
            return torch.ops.fvgraph.tap(output, name)
        self._recorded[name] = output.detach().clone()
        return output

    def drain(self) -> dict[str, torch.Tensor]:
        """This step's recorded block outputs (eager), resetting the per-step call counts."""
        recorded, self._recorded, self._calls = self._recorded, {}, {}
        return recorded if not torch.compiler.is_compiling() else {}

    def remove(self) -> None:
        for handle in self._handles:
            handle.remove()


def _blocks(transformer: nn.Module) -> list[nn.Module]:
    if hasattr(transformer, "blocks"):
        return list(transformer.blocks)
    return [*transformer.transformer_blocks, *getattr(transformer, "single_transformer_blocks", ())]


def split_fused(taps: dict[str, torch.Tensor], batch: int = 1) -> dict[str, torch.Tensor]:
    """Name the halves of fused-branch block taps (2 x batch rows) as the unfused taps .0 and .1."""
    out = {}
    for name, value in taps.items():
        if name.startswith("tap.block.") and name.endswith(".0") and value.shape[0] == 2 * batch \
                and name[:-2] + ".1" not in taps:  # fmt: skip
            out[name], out[name[:-2] + ".1"] = value[:batch], value[batch:]
        else:
            out[name] = value
    return out
