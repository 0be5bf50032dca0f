"""Ulysses sequence parallelism for a diffusers denoiser, applied from outside the model code.

    apply_ulysses(transformer, mesh["ring", "ulysses"], rank, device)

This uses diffusers' own context parallelism (diffusers 0.42.1, `diffusers.hooks.context_parallel`):
the model's `_cp_plan` hooks split the rotary embedding and the first block's tokens across the
Ulysses ranks and gather the tokens again at `proj_out`, and the attention dispatcher's Ulysses path
swaps token sharding for head sharding with `all_to_all_single` (functional collectives) around each
attention. Those hooks and collectives trace into fvgraph's fullgraph step capture
(fvgraph/compile/step_capture.py; their logging calls trace as no-ops), so every collective is a
node of the compiled step graph.

What this file adds is only the setup `ModelMixin.enable_parallelism` does, for a mesh fvgraph
builds: `enable_parallelism` picks its device as `rank % torch.accelerator.device_count()`, which
raises `ZeroDivisionError: integer modulo by zero` on a machine without an accelerator (gloo on CPU),
and it builds a mesh over the whole world, whereas under CFG-parallel the Ulysses ranks are a
sub-mesh of the (cfg, ring, ulysses) grid.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh


def apply_ulysses(transformer: nn.Module, mesh: DeviceMesh, rank: int, device: torch.device) -> None:
    """Shard `transformer`'s self-attention tokens over `mesh` (dims "ring" of size 1 and "ulysses").
    The model keeps its full inputs and outputs; only the tokens between its first block and
    `proj_out` are split."""
    from diffusers.hooks.context_parallel import apply_context_parallel
    from diffusers.models._modeling_parallel import ContextParallelConfig, ParallelConfig

    plan = getattr(transformer, "_cp_plan", None)
    if plan is None:
        raise ValueError(f"{type(transformer).__name__} declares no `_cp_plan`: Ulysses cannot split it")
    if getattr(transformer, "_parallel_config", None) is not None:
        raise RuntimeError(f"{type(transformer).__name__} is already parallelized; apply_ulysses runs once per model")
    degree = mesh["ulysses"].size()
    heads = transformer.config.num_attention_heads
    if heads % degree:
        raise ValueError(f"ulysses degree {degree} must divide the attention head count {heads}")
    _trace_token_gathers()
    cp = ContextParallelConfig(ulysses_degree=degree, mesh=mesh)
    config = ParallelConfig(context_parallel_config=cp)
    config.setup(rank, torch.distributed.get_world_size(), device, mesh=mesh)
    transformer._parallel_config = config
    for module in transformer.modules():  # as enable_parallelism: the attention processors read the config
        processor = getattr(module, "processor", None)
        if processor is not None and hasattr(processor, "_parallel_config"):
            processor._parallel_config = config
    apply_context_parallel(transformer, cp, plan)


def _trace_token_gathers() -> None:
    """Let dynamo trace the token all-gather at `proj_out` on torch 2.11 (the GPU machine's torch).

    diffusers' unshard gathers the tokens on dim 1 with `funcol.all_gather_tensor`, which for a gather
    dim other than 0 calls `torch._utils._maybe_view_chunk_cat`. torch 2.11's dynamo skips that function
    ("Attempted to call function marked as skipped": a graph break, so the step does not capture);
    torch 2.13 lists it as a function to trace (torch/_dynamo/trace_rules.py). On older torch the
    functional-collectives module's reference is wrapped in `torch._dynamo.dont_skip_tracing`, once per
    process, which is what dynamo's own hint says to do."""
    import torch.distributed._functional_collectives as funcol
    from torch.torch_version import TorchVersion

    chunk_cat = getattr(funcol, "_maybe_view_chunk_cat", None)
    if TorchVersion(torch.__version__) >= "2.13" or chunk_cat is None or getattr(chunk_cat, "_fvgraph_traced", False):
        return
    traced = torch._dynamo.dont_skip_tracing(chunk_cat)
    traced._fvgraph_traced = True
    funcol._maybe_view_chunk_cat = traced
