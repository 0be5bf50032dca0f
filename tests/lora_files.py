"""Random LoRA files for tests, written by diffusers and peft themselves (or in the musubi-tuner key
layout, which diffusers' Wan loader converts), for a denoiser whose module names they take."""

from __future__ import annotations

from pathlib import Path

import diffusers
import torch
from diffusers.loaders.lora_base import LoraBaseMixin
from peft import LoraConfig, get_peft_model_state_dict
from safetensors.torch import save_file

from fvgraph.cards import get_card
from fvgraph.models.components import load_components

ATTENTION = ["to_q", "to_k", "to_v", "to_out.0"]


def fresh_transformer(card: str = "tiny-wan"):
    """An untouched copy of the card's seeded denoiser (what diffusers' side of a test loads into)."""
    return load_components(get_card(card), None, torch.device("cpu")).transformer


def peft_lora(folder: Path, seed: int, targets: list[str], rank: int = 4, alpha: float = 8.0, card: str = "tiny-wan",
              bias: bool = False) -> Path:  # fmt: skip
    """A random LoRA on `targets` (peft's target_modules) saved by the card's pipeline's
    `save_lora_weights` (LoraBaseMixin's, which it calls, where the pipeline has none), with its LoraConfig as the file's metadata (so lora_alpha / r applies on load)."""
    transformer = fresh_transformer(card)
    config = LoraConfig(r=rank, lora_alpha=alpha, target_modules=targets, init_lora_weights=False, lora_bias=bias)
    torch.manual_seed(seed)
    transformer.add_adapter(config, adapter_name="x")
    with torch.no_grad():  # peft's random init leaves lora_B zero-mean but large: keep the change visible, not wild
        for name, p in transformer.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn_like(p) * 0.2)
    layers = get_peft_model_state_dict(transformer, adapter_name="x")
    folder.mkdir(parents=True, exist_ok=True)
    metadata = config.to_dict()
    metadata["target_modules"] = sorted(metadata["target_modules"])
    pipeline = getattr(diffusers, get_card(card).pipeline_class)
    if hasattr(pipeline, "save_lora_weights"):
        pipeline.save_lora_weights(folder, transformer_lora_layers=layers, weight_name="lora.safetensors",
                                   transformer_lora_adapter_metadata=metadata)  # fmt: skip
    else:  # no LoRA loader for this pipeline (HunyuanVideo15Pipeline): what every pipeline's save_lora_weights writes
        LoraBaseMixin._save_lora_weights(folder, {"transformer": layers}, {"transformer": metadata}, weight_name="lora.safetensors")
    return folder / "lora.safetensors"


def musubi_lora(path: Path, seed: int, num_blocks: int, dims: dict[str, tuple[int, int]], rank: int = 4,
                alpha: float = 2.0) -> Path:  # fmt: skip
    """A random LoRA in musubi-tuner's layout (`lora_unet_blocks_{i}_self_attn_q.lora_down.weight`,
    `.lora_up.weight`, `.alpha`): every attention projection and both FFN linears of every block.
    `dims` gives (in, out) per musubi module suffix."""
    g = torch.Generator().manual_seed(seed)
    state = {}
    for i in range(num_blocks):
        for suffix, (fan_in, fan_out) in dims.items():
            key = f"lora_unet_blocks_{i}_{suffix}"
            state[f"{key}.lora_down.weight"] = torch.randn(rank, fan_in, generator=g) * 0.2
            state[f"{key}.lora_up.weight"] = torch.randn(fan_out, rank, generator=g) * 0.2
            state[f"{key}.alpha"] = torch.tensor(alpha)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path


def musubi_dims(transformer) -> dict[str, tuple[int, int]]:
    """musubi's module suffixes of one Wan block, with each linear's (in, out)."""
    block = transformer.blocks[0]
    linears = {f"{side}_{o}": getattr(attn, c) if c != "to_out.0" else attn.to_out[0]
               for side, attn in (("self_attn", block.attn1), ("cross_attn", block.attn2))
               for o, c in zip("qkvo", ATTENTION)}  # fmt: skip
    linears.update(ffn_0=block.ffn.net[0].proj, ffn_2=block.ffn.net[2])
    return {k: (m.in_features, m.out_features) for k, m in linears.items()}


def alpha_keyed_lora(path: Path, seed: int, targets: list[str], rank: int = 4, alpha: float = 2.0,
                     card: str = "tiny-flux") -> Path:  # fmt: skip
    """A random LoRA in peft's key layout with a kohya-style `.alpha` key beside each module and no
    LoraConfig metadata (as many FLUX LoRAs are published): diffusers reads the alphas as network alphas."""
    transformer = fresh_transformer(card)
    g = torch.Generator().manual_seed(seed)
    state = {}
    for name, module in transformer.named_modules():
        if type(module) is torch.nn.Linear and any(name == t or name.endswith(f".{t}") for t in targets):
            state[f"transformer.{name}.lora_A.weight"] = torch.randn(rank, module.in_features, generator=g) * 0.2
            state[f"transformer.{name}.lora_B.weight"] = torch.randn(module.out_features, rank, generator=g) * 0.2
            state[f"transformer.{name}.alpha"] = torch.tensor(alpha)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path


def kohya_flux_lora(path: Path, seed: int, transformer, rank: int = 4, alpha: float = 2.0) -> Path:
    """A random LoRA in kohya sd-scripts' FLUX layout (`lora_unet_double_blocks_{i}_img_attn_qkv`, the
    fused q/k/v that diffusers' converter splits, and the single blocks' `linear2`), each module with
    `.lora_down`, `.lora_up` and `.alpha`, for `transformer`'s sizes. Not the single blocks' fused
    `linear1`: the converter splits it at FLUX.1's own widths, which a tiny denoiser does not have."""
    dim = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    mlp = transformer.single_transformer_blocks[0].proj_mlp.out_features
    shapes = {}
    for i in range(len(transformer.transformer_blocks)):
        for stream in ("img", "txt"):
            shapes[f"double_blocks_{i}_{stream}_attn_qkv"] = (dim, 3 * dim)
            shapes[f"double_blocks_{i}_{stream}_attn_proj"] = (dim, dim)
    for i in range(len(transformer.single_transformer_blocks)):
        shapes[f"single_blocks_{i}_linear2"] = (dim + mlp, dim)
    g = torch.Generator().manual_seed(seed)
    state = {}
    for module, (fan_in, fan_out) in shapes.items():
        state[f"lora_unet_{module}.lora_down.weight"] = torch.randn(rank, fan_in, generator=g) * 0.2
        state[f"lora_unet_{module}.lora_up.weight"] = torch.randn(fan_out, rank, generator=g) * 0.2
        state[f"lora_unet_{module}.alpha"] = torch.tensor(alpha)
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path


def xlabs_flux_lora(path: Path, seed: int, transformer, rank: int = 4) -> Path:
    """A random LoRA in XLabs' FLUX layout (`double_blocks.{i}.processor.qkv_lora1.down.weight`: fused
    q/k/v per stream, whose shared down factor diffusers' converter copies to each of q, k and v, and
    `proj_lora1` / `proj_lora2`; the single blocks' `qkv_lora` and `proj_lora`), for `transformer`'s
    sizes. XLabs files carry no alpha: each module's scaling is 1."""
    dim = transformer.config.num_attention_heads * transformer.config.attention_head_dim
    mlp = transformer.single_transformer_blocks[0].proj_mlp.out_features
    shapes = {}
    for i in range(len(transformer.transformer_blocks)):
        for n in ("1", "2"):  # 1: the image stream, 2: the text stream
            shapes[f"double_blocks.{i}.processor.qkv_lora{n}"] = (dim, 3 * dim)
            shapes[f"double_blocks.{i}.processor.proj_lora{n}"] = (dim, dim)
    for i in range(len(transformer.single_transformer_blocks)):
        shapes[f"single_blocks.{i}.processor.qkv_lora"] = (dim, 3 * dim)
        shapes[f"single_blocks.{i}.processor.proj_lora"] = (dim + mlp, dim)
    g = torch.Generator().manual_seed(seed)
    state = {}
    for module, (fan_in, fan_out) in shapes.items():
        state[f"{module}.down.weight"] = torch.randn(rank, fan_in, generator=g) * 0.2
        state[f"{module}.up.weight"] = torch.randn(fan_out, rank, generator=g) * 0.2
    path.parent.mkdir(parents=True, exist_ok=True)
    save_file(state, str(path))
    return path
